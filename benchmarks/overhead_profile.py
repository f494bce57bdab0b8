"""`python -m benchmarks.overhead_profile`: where loopkit's per-step microseconds go on the near-null model.

Two measurements, each contender in a fresh process (the same `TrainSpec` as the overhead benchmark's near-null row,
the same `benchmarks.contenders.train` functions):

* CPU time per optimizer step (`time.process_time`, so other processes on a busy machine do not count) of the
  hand-written loop, HF Trainer and loopkit, in alternated rounds (raw, hf, loopkit, raw, hf, loopkit, ...): medians,
  and the median of the round-by-round differences to the hand-written loop.
* A profile of loopkit's step beside the hand-written loop's: every callback event (`EventHandler.fire`, each
  callback method on its own line) and every stage of the step (data, the step stage's parts, the schedule, the
  guards, the phase clock), and the torch work both do, timed by wrappers with `perf_counter` and attributed
  exclusively (a line's time excludes the wrapped calls inside it, and the wrappers' own cost, calibrated at the
  start). Each line is the median over the timed steps of its microseconds in that step (robust to a step that the
  machine preempted); "loop, unattributed" is what the step took beyond all the lines (the loop's own code).
  Wall time, as CPU clocks cost a system call each; the medians keep other processes' interference out.

With `--before PATH`, the `loopkit` package of an earlier checkout at PATH runs as a fourth contender
("loopkit-before"), alternated with the others: the before/after figure of a change, in one run.

    python -m benchmarks.overhead_profile                     # 5 rounds, 400 timed steps, writes results
    python -m benchmarks.overhead_profile --rounds 8 --before ../loopkit-main --out /tmp/profile

Results: benchmarks/results/overhead_profile.json and .md (the committed run), unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .spec import TrainSpec

CONTENDERS = ("raw", "hf", "loopkit")
RESULTS = Path(__file__).parent / "results" / "overhead_profile"


def near_null_spec(timed_steps: int, warmup_steps: int) -> TrainSpec:
    """The overhead benchmark's near-null row (benchmarks/bench_overhead.py), at `timed_steps` timed steps."""
    return TrainSpec(model="null", num_train=4096, batch_size=8, grad_accum=2, logging_steps=50,
                     max_steps=warmup_steps + timed_steps, warmup_steps=10)


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def cpu_per_step(contender: str, spec: TrainSpec, warmup_steps: int, profiler=None) -> dict:
    """Train `spec` with `contender`; CPU and wall microseconds per optimizer step after the first `warmup_steps`."""
    import tempfile

    import torch

    from .contenders import StepClock, train

    torch.set_num_threads(1)
    cpu_ends = []
    clock = StepClock()
    clock.listeners.append(lambda step: cpu_ends.append(time.process_time()))
    if profiler is not None:
        clock.listeners.append(lambda step: profiler.active_from(step, warmup_steps, spec.max_steps))
        (instrument_raw if contender == "raw" else instrument_loopkit)(profiler, clock)
    with tempfile.TemporaryDirectory() as output_dir:
        result = train(contender, spec, clock, output_dir)
    timed = spec.max_steps - warmup_steps
    steps = [b - a for a, b in zip(cpu_ends[warmup_steps - 1:], cpu_ends[warmup_steps:])]
    return {"contender": contender, "global_step": result.global_step, "timed_steps": timed,
            "cpu_us_per_step": (cpu_ends[-1] - cpu_ends[warmup_steps - 1]) / timed * 1e6,
            # The median step: a step the machine's other processes slowed (caches, a shared core) is left out.
            "cpu_us_median_step": statistics.median(steps) * 1e6,
            "wall_us_per_step": (clock.ends[-1] - clock.ends[warmup_steps - 1]) / timed * 1e6,
            "logged_losses": result.logged_losses}


class Profiler:
    """Exclusive time per named block, summed per optimizer step (a step ends at the phase clock's `step_done`)."""

    def __init__(self):
        self.stack = []  # [name, start, time of the timed blocks inside, how many]
        self.current = {}  # name -> seconds in this step
        self.steps = []  # one dict per step
        self.step_started = None
        self.recording = False
        self.calls = 0  # wrapped calls in this step (the profiler's own cost scales with it)
        # What one wrapped call costs its caller beyond the time the callee measures: taken off the caller's line.
        self.per_call = 0.0
        self.per_call = wrapper_cost_us(self) / 1e6

    def active_from(self, step: int, warmup_steps: int, last_step: int) -> None:
        self.recording = warmup_steps <= step < last_step

    def wrap(self, name, function):
        stack, current, now = self.stack, self.current, time.perf_counter

        def timed(*args, **kwargs):
            entry = [name, now(), 0.0, 0]
            stack.append(entry)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = now() - entry[1]
                stack.pop()
                current[name] = current.get(name, 0.0) + elapsed - entry[2] - entry[3] * self.per_call
                if stack:
                    stack[-1][2] += elapsed
                    stack[-1][3] += 1
                self.calls += 1

        timed.__wrapped__ = function
        return timed

    def patch(self, owner, attribute: str, name: str | None = None) -> None:
        """Wrap `owner.attribute`, if there is one (an earlier loopkit may lack it)."""
        if owner is not None and hasattr(owner, attribute):
            setattr(owner, attribute, self.wrap(name or f"{owner.__name__}.{attribute}", getattr(owner, attribute)))

    def step_boundary(self) -> None:
        """The end of an optimizer step (and the start of the next): store this step's lines."""
        now = time.perf_counter()
        if self.step_started is not None and self.recording:
            step = dict(self.current)
            step["step, total"] = now - self.step_started
            step["_calls"] = self.calls
            self.steps.append(step)
        self.current.clear()
        self.calls = 0
        self.step_started = now

    def table(self) -> dict:
        """Name -> median microseconds per step; 'loop, unattributed' = total - every line (per step)."""
        names = sorted({name for step in self.steps for name in step if not name.startswith("_")})
        rows = {name: statistics.median(step.get(name, 0.0) for step in self.steps) * 1e6 for name in names}
        unattributed = [step["step, total"] - step["_calls"] * self.per_call -
                        sum(v for k, v in step.items() if not k.startswith("_") and k != "step, total")
                        for step in self.steps]
        rows["loop, unattributed"] = statistics.median(unattributed) * 1e6
        rows["_wrapped calls per step"] = statistics.median(step["_calls"] for step in self.steps)
        return rows


def wrapper_cost_us(profiler: Profiler, calls: int = 20000) -> float:
    """What one wrapped call adds to its caller's line beyond what the callee's line measures (the best of five
    tries, in microseconds); the profiler takes it off the caller's line."""
    nothing = profiler.wrap("nothing", lambda: None)
    outer = profiler.wrap("outer", lambda: [nothing() for _ in range(calls)])
    costs = []
    for _ in range(5):
        outer()
        costs.append(profiler.current.pop("outer") / calls * 1e6)
        profiler.current.clear()
    profiler.calls = 0
    return min(costs)


def instrument_torch(profiler: Profiler) -> None:
    """Wrap the torch work every contender does: forward, backward, clipping, the optimizer and scheduler steps."""
    import torch

    profiler.patch(torch.Tensor, "backward", "torch: backward")
    profiler.patch(torch.nn.Module, "_call_impl", "torch: model forward")
    profiler.patch(torch.optim.AdamW, "step", "torch: AdamW.step")
    profiler.patch(torch.optim.lr_scheduler.LRScheduler, "step", "torch: scheduler.step")
    profiler.patch(torch.nn.utils, "clip_grad_norm_", "torch: clip_grad_norm_")


def instrument_raw(profiler: Profiler, clock) -> None:
    """The hand-written loop: its data (the loader's batches grouped per step) and the torch work; a step ends at
    the clock's end of step."""
    from . import contenders

    instrument_torch(profiler)
    original_windows = contenders.accumulation_windows

    def accumulation_windows(loader, grad_accum):
        iterator = original_windows(loader, grad_accum)
        fetch = profiler.wrap(DATA_LINE, lambda: next(iterator, None))
        while (window := fetch()) is not None:
            yield window

    contenders.accumulation_windows = accumulation_windows
    clock.listeners.append(lambda step: profiler.step_boundary())


DATA_LINE = "data: fetch a window (loader, collate, to device)"


def instrument_loopkit(profiler: Profiler, clock) -> None:
    """Wrap loopkit's per-step blocks (classes, so every instance the run makes is timed)."""
    import accelerate.utils

    from loopkit import events, phases, schedule
    from loopkit.loop import Loop
    try:
        from loopkit import work
    except ImportError:  # before loopkit/work.py: the step stage counted the work itself
        work = None
    from loopkit.stages import data, step

    # Events: each fire, and each callback's method, on lines of their own.
    original_fire = events.EventHandler.fire

    def fire(handler, event, **extra):
        return profiler.wrap(f"event {event}: dispatch", original_fire)(handler, event, **extra)

    events.EventHandler.fire = fire
    original_rebuild = events.EventHandler._rebuild

    def rebuild(handler):
        original_rebuild(handler)
        for event, methods in handler.methods_by_event.items():
            handler.methods_by_event[event] = [
                profiler.wrap(f"event {event}: {type(m.__self__).__name__}", m) for m in methods]

    events.EventHandler._rebuild = rebuild
    # The data stage: fetching a window (Accelerate's loader, collation, moving to the device).
    original_windows = data.DataStage.windows

    def windows(stage, *args, **kwargs):
        iterator = original_windows(stage, *args, **kwargs)
        fetch = profiler.wrap(DATA_LINE, lambda: next(iterator, None))
        while (window := fetch()) is not None:
            yield window

    data.DataStage.windows = windows
    profiler.patch(accelerate.utils, "send_to_device", "data: send_to_device")
    # The step stage's parts, and the torch work inside them.
    for attribute in ("run_step", "count_loss_items", "training_step", "compute_loss", "optimizer_step",
                      "clip_gradients"):
        profiler.patch(step.StepStage, attribute, f"step: {attribute}")
    profiler.patch(getattr(work, "WorkCounter", None), "count", "step: work counting")
    profiler.patch(step.StepStage, "count_work", "step: work counting")
    profiler.patch(step.TrainMode, "enter", "step: TrainMode.enter")
    instrument_torch(profiler)
    # Between steps: the schedule, the guards, the phase clock.
    profiler.patch(schedule.Schedule, "record", "schedule: record")
    profiler.patch(schedule.Schedule, "after_step", "schedule: after_step (log/eval/save)")
    profiler.patch(Loop, "check_guards", "guards: check_guards")
    profiler.patch(phases.Span, "__enter__", "phase clock: spans")
    profiler.patch(phases.Span, "__exit__", "phase clock: spans")
    original_step_done = phases.PhaseClock.step_done
    timed_step_done = profiler.wrap("phase clock: step_done", original_step_done)

    def step_done(clock, step_number):
        timed_step_done(clock, step_number)
        profiler.step_boundary()

    phases.PhaseClock.step_done = step_done


def profile(contender: str, spec: TrainSpec, warmup_steps: int) -> dict:
    profiler = Profiler()
    measured = cpu_per_step(contender, spec, warmup_steps, profiler)
    return {"lines_us_per_step": profiler.table(), "wrapper_cost_us": profiler.per_call * 1e6,
            "profiled_cpu_us_per_step": measured["cpu_us_per_step"], "profiled_steps": len(profiler.steps)}


def worker(request: dict) -> dict:
    spec = TrainSpec.from_dict(request["spec"])
    if request["task"] == "profile":
        return profile(request["contender"], spec, request["warmup_steps"])
    return cpu_per_step(request["contender"], spec, request["warmup_steps"])


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def in_fresh_process(request: dict, loopkit_from: str | None = None) -> dict:
    """Run one worker request in a new process; `loopkit_from`: a folder holding a `loopkit` package to import
    instead of this checkout's (an earlier version, measured beside this one)."""
    first = [loopkit_from] if loopkit_from else []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(first + [str(Path(__file__).parent.parent)] +
                                          [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.overhead_profile", "--worker", json.dumps(request)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"worker {request} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(rounds: int, timed_steps: int, warmup_steps: int, before: str | None = None, say=print) -> dict:
    """`before`: a checkout of an earlier loopkit, measured as a fourth contender ("loopkit-before")."""
    import tempfile

    spec = near_null_spec(timed_steps, warmup_steps).to_dict()
    loads = [os.getloadavg()[0]]
    contenders = CONTENDERS[:2] + (("loopkit-before",) if before else ()) + CONTENDERS[2:]
    samples = {c: [] for c in contenders}
    median_steps = {c: [] for c in contenders}
    losses = {c: [] for c in contenders}
    shadow = tempfile.mkdtemp(prefix="loopkit-before-")  # holds only a link to the earlier `loopkit` package
    if before:
        os.symlink(os.path.join(os.path.abspath(before), "loopkit"), os.path.join(shadow, "loopkit"))
    for round_index in range(rounds):
        for contender in contenders:
            reply = in_fresh_process({"task": "cpu", "contender": contender.replace("-before", ""), "spec": spec,
                                      "warmup_steps": warmup_steps}, shadow if contender.endswith("-before") else None)
            samples[contender].append(reply["cpu_us_per_step"])
            median_steps[contender].append(reply["cpu_us_median_step"])
            losses[contender].append(reply["logged_losses"])
            say(f"round {round_index + 1}/{rounds} {contender}: {reply['cpu_us_per_step']:.0f} us CPU/step, median "
                f"step {reply['cpu_us_median_step']:.0f} ({reply['wall_us_per_step']:.0f} wall), "
                f"load {os.getloadavg()[0]:.1f}")
        loads.append(os.getloadavg()[0])
    profiles = {contender: in_fresh_process({"task": "profile", "contender": contender.replace("-before", ""),
                                             "spec": spec, "warmup_steps": warmup_steps},
                                            shadow if contender.endswith("-before") else None)
                for contender in ("raw",) + contenders[2:]}
    loads.append(os.getloadavg()[0])
    return {"spec": spec, "warmup_steps": warmup_steps, "timed_steps": timed_steps, "rounds": rounds, "before": before,
            "cpu_us_per_step": samples, "cpu_us_median_step": median_steps, "logged_losses": losses,
            "profiles": profiles,
            "load_average": {"min": min(loads), "max": max(loads)}, "cores": os.cpu_count(),
            "command": " ".join(["python -m benchmarks.overhead_profile"] + sys.argv[1:])}


def markdown(results: dict) -> str:
    lines = [f"Near-null model (16x16 linear), CPU microseconds per optimizer step, {results['rounds']} alternated "
             f"rounds of {results['timed_steps']} timed steps, each contender in a fresh process; load average "
             f"{results['load_average']['min']:.1f}-{results['load_average']['max']:.1f} on {results['cores']} "
             f"cores. Per run: the mean over its timed steps (logging steps included), and its median step (robust "
             f"to the steps other processes slowed). Then the median of the rounds (their range), and the median of "
             f"the round-by-round differences to the hand-written loop (their range).\n"]
    for key, title in (("cpu_us_per_step", "mean step"), ("cpu_us_median_step", "median step")):
        lines += [cpu_table(results[key], title), ""]
        samples = results[key]
        if "loopkit-before" in samples:
            diffs = [a - b for a, b in zip(samples["loopkit"], samples["loopkit-before"])]
            lines.append(f"{title}: loopkit minus loopkit-before ({results['before']}), per round: median "
                         f"{statistics.median(diffs):+,.0f} us/step ({min(diffs):+,.0f} to {max(diffs):+,.0f}).\n")
    lines.append(profile_table(results["profiles"]))
    return "\n".join(lines) + "\n"


def cpu_table(samples: dict, title: str) -> str:
    raw = samples["raw"]
    lines = [f"| contender | CPU us/step, {title} | minus the hand-written loop, per round |", "|---|---|---|"]
    for contender, values in samples.items():
        diffs = [v - r for v, r in zip(values, raw)]
        lines.append(f"| {contender} | {statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f}) | "
                     + ("" if contender == "raw" else
                        f"{statistics.median(diffs):+,.0f} ({min(diffs):+,.0f} to {max(diffs):+,.0f})") + " |")
    return "\n".join(lines)


def profile_table(profiles: dict) -> str:
    """One line per event / stage, one column per profiled contender: microseconds per step."""
    names = list(profiles)
    rows = {c: dict(p["lines_us_per_step"]) for c, p in profiles.items()}
    calls = {c: r.pop("_wrapped calls per step") for c, r in rows.items()}
    totals = {c: r.pop("step, total") for c, r in rows.items()}
    lines = [f"Where a step's time goes ({profiles['loopkit']['profiled_steps']} profiled steps each, one process per "
             f"column; wall microseconds per step, the median over steps of each line; each line exclusive of the "
             f"lines inside it). Profiled totals (medians): " +
             ", ".join(f"{c} {totals[c]:,.1f}" for c in names) + " us/step. The profiler's own cost (" +
             ", ".join(f"{c} {calls[c]:.0f} wrapped calls" for c in names) +
             f", {profiles['loopkit']['wrapper_cost_us']:.2f} us each) is taken off the lines that make the calls "
             f"and left out of the table.\n",
             "| event / stage | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    order = sorted(set().union(*rows.values()), key=lambda n: -max(r.get(n, 0.0) for r in rows.values()))
    for name in order:
        lines.append(f"| {name} | " + " | ".join(f"{rows[c][name]:,.1f}" if name in rows[c] else ""
                                                  for c in names) + " |")
    lines.append("| **step, total** | " + " | ".join(f"**{totals[c]:,.1f}**" for c in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=50, help="untimed optimizer steps first")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results path, without suffix (.json and .md)")
    parser.add_argument("--before", help="a checkout of an earlier loopkit to measure beside this one")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    results = measure(args.rounds, args.steps, args.warmup, args.before, say=lambda text: print(text, file=sys.stderr))
    out = args.out.with_suffix("") if args.out.suffix in (".json", ".md") else args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
