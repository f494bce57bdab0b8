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

* Interleaved in one process: each round a fresh process where every contender (the hand-written loop, loopkit,
  HF Trainer, and the peers where installed: pytorch-ignite, Lightning Fabric, Lightning's Trainer) trains once to
  warm up, then `--passes` times in turn (raw, loopkit, hf, ignite, ...). Each run's mean CPU time per step; per
  round, the median over the passes of each contender's difference to the hand-written loop's run of the same pass.
  Between processes the same code runs faster or slower by up to a third (where its memory lands, the caches it
  finds); within one process, warm, the differences hold to a few microseconds, which is what resolves tens of them.

With `--before PATH`, the `loopkit` package of an earlier checkout at PATH runs as a further contender
("loopkit-before"), alternated with the others (interleaved: in processes of its own, beside the hand-written loop):
the before/after figure of a change, in one run.

    python -m benchmarks.overhead_profile                     # 5 rounds, 400 timed steps, writes results
    python -m benchmarks.overhead_profile --rounds 8 --before ../loopkit-main --out /tmp/profile
    python -m benchmarks.overhead_profile --methods interleaved --rounds 8 --passes 3   # one method only

Results: benchmarks/results/overhead_profile.json and .md (the committed run), unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
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
        profile_steps(profiler, contender, clock, spec, warmup_steps)
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


# Thread -> the Profiler timing its calls: two contenders in one process (lockstep) each get their own lines, and a
# call in a thread without one runs untimed.
ROUTES = {}


def current_profiler():
    return ROUTES.get(threading.get_ident())


class Profiler:
    """Exclusive time per named block, summed per optimizer step, for the thread that makes it (a step ends at the
    contender's end of step: `step_boundary`)."""

    def __init__(self):
        self.stack = []  # [name, start, time of the timed blocks inside, how many]
        self.current = {}  # name -> seconds in this step
        self.steps = []  # one dict per step
        self.step_started = None
        self.recording = False
        self.calls = 0  # wrapped calls in this step (the profiler's own cost scales with it)
        # What one wrapped call costs its caller beyond the time the callee measures: taken off the caller's line.
        self.per_call = 0.0
        ROUTES[threading.get_ident()] = self
        self.per_call = wrapper_cost_us(self) / 1e6

    def active_from(self, step: int, warmup_steps: int, last_step: int) -> None:
        self.recording = warmup_steps <= step < last_step

    @staticmethod
    def wrap(name, function):
        """`function`, timed on the calling thread's profiler under `name`."""
        routes, thread, now = ROUTES, threading.get_ident, time.perf_counter

        def timed(*args, **kwargs):
            profiler = routes.get(thread())
            if profiler is None:
                return function(*args, **kwargs)
            stack, entry = profiler.stack, [name, now(), 0.0, 0]
            stack.append(entry)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = now() - entry[1]
                stack.pop()
                current = profiler.current
                current[name] = current.get(name, 0.0) + elapsed - entry[2] - entry[3] * profiler.per_call
                if stack:
                    stack[-1][2] += elapsed
                    stack[-1][3] += 1
                profiler.calls += 1

        timed.__wrapped__ = function
        return timed

    @staticmethod
    def patch(owner, attribute: str, name: str) -> None:
        """Wrap `owner.attribute`, if there is one (an earlier loopkit may lack it)."""
        if owner is not None and hasattr(owner, attribute):
            setattr(owner, attribute, Profiler.wrap(name, getattr(owner, attribute)))

    def pause(self, seconds: float) -> None:
        """`seconds` just passed outside the contender (another's turn in lockstep): leave them out."""
        for entry in self.stack:
            entry[1] += seconds
        if self.step_started is not None:
            self.step_started += seconds

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


INSTRUMENTED = set()


def instrument(contender: str) -> None:
    """Wrap the per-step blocks of `contender` ("raw" or "loopkit") and the torch work, once per process."""
    for part in ("torch", contender):
        if part not in INSTRUMENTED:
            INSTRUMENTED.add(part)
            {"torch": instrument_torch, "raw": instrument_raw, "loopkit": instrument_loopkit}[part](Profiler)


def instrument_torch(profiler) -> None:
    """Wrap the torch work every contender does: forward, backward, clipping, the optimizer and scheduler steps."""
    import torch

    profiler.patch(torch.Tensor, "backward", "torch: backward")
    profiler.patch(torch.nn.Module, "_call_impl", "torch: model forward")
    profiler.patch(torch.optim.AdamW, "step", "torch: AdamW.step")
    profiler.patch(torch.optim.lr_scheduler.LRScheduler, "step", "torch: scheduler.step")
    profiler.patch(torch.nn.utils, "clip_grad_norm_", "torch: clip_grad_norm_")


def instrument_raw(profiler) -> None:
    """The hand-written loop: its data (the loader's batches grouped per step); a step ends at the clock's end of
    step (`cpu_per_step` / `lockstep` add the listener)."""
    from . import contenders

    original_windows = contenders.accumulation_windows

    def accumulation_windows(loader, grad_accum):
        iterator = original_windows(loader, grad_accum)
        fetch = profiler.wrap(DATA_LINE, lambda: next(iterator, None))
        while (window := fetch()) is not None:
            yield window

    contenders.accumulation_windows = accumulation_windows


DATA_LINE = "data: fetch a window (loader, collate, to device)"


def instrument_loopkit(profiler) -> None:
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
        if current_profiler() is not None:
            current_profiler().step_boundary()

    phases.PhaseClock.step_done = step_done


def profile_steps(profiler: Profiler, contender: str, clock, spec: TrainSpec, warmup_steps: int) -> None:
    """Time `contender`'s steps after the first `warmup_steps` on `profiler` (this thread's)."""
    instrument(contender)
    clock.listeners.append(lambda step: profiler.active_from(step, warmup_steps, spec.max_steps))
    if contender == "raw":  # loopkit's steps end at its phase clock's step_done (instrument_loopkit)
        clock.listeners.append(lambda step: profiler.step_boundary())


def profile_result(profiler: Profiler) -> dict:
    return {"lines_us_per_step": profiler.table(), "wrapper_cost_us": profiler.per_call * 1e6,
            "profiled_steps": len(profiler.steps)}


def profile(contender: str, spec: TrainSpec, warmup_steps: int) -> dict:
    profiler = Profiler()
    cpu_per_step(contender, spec, warmup_steps, profiler)
    return profile_result(profiler)


def lockstep(spec: TrainSpec, warmup_steps: int, contenders=("raw", "loopkit"), profiled: bool = False) -> dict:
    """The contenders in one process, one thread each, taking turns step by step (a step of one, then a step of
    the next, ...): each step's CPU time (`time.thread_time`) sits beside the others' under the same machine
    conditions, a millisecond apart. Returns the median over steps of the contenders' step-by-step differences to
    the first contender, and each contender's median step; `profiled`: and each one's profile (the lines of a step,
    `Profiler`), measured side by side."""
    import tempfile

    import torch

    from .contenders import StepClock, train

    torch.set_num_threads(1)
    turn = threading.Condition()
    state = {"turn": 0, "done": set()}
    ends = {c: [] for c in contenders}
    profilers = {}
    if profiled:
        for contender in contenders:
            instrument(contender)

    def wait_for_turn(index: int) -> None:
        turn.wait_for(lambda: state["turn"] == index)

    def pass_turn(index: int) -> None:
        waiting = [i for i in range(1, len(contenders) + 1)
                   if (index + i) % len(contenders) not in state["done"]]
        state["turn"] = (index + waiting[0]) % len(contenders) if waiting else index
        turn.notify_all()

    def run(index: int, contender: str) -> None:
        clock = StepClock()

        def step_ended(step):
            ends[contender].append(time.thread_time())
            paused = time.perf_counter()
            with turn:
                pass_turn(index)
                wait_for_turn(index)
            if profiled:  # the other contender's turn is no part of this one's step
                profilers[contender].pause(time.perf_counter() - paused)

        with turn:
            wait_for_turn(index)
        if profiled:
            profilers[contender] = Profiler()
            profile_steps(profilers[contender], contender, clock, spec, warmup_steps)
        clock.listeners.append(step_ended)
        try:
            with tempfile.TemporaryDirectory() as output_dir:
                train(contender, spec, clock, output_dir)
        finally:
            with turn:
                state["done"].add(index)
                pass_turn(index)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    steps = {c: [b - a for a, b in zip(ends[c][warmup_steps - 1:], ends[c][warmup_steps:])] for c in contenders}
    first = contenders[0]
    return {"median_step_us": {c: statistics.median(steps[c]) * 1e6 for c in contenders},
            "median_difference_us": {c: statistics.median(b - a for a, b in zip(steps[first], steps[c])) * 1e6
                                     for c in contenders[1:]},
            "steps": len(steps[first]), "profiles": {c: profile_result(p) for c, p in profilers.items()}}


def interleaved(spec: TrainSpec, warmup_steps: int, contenders: list, passes: int) -> dict:
    """Every contender in this process: one run each to warm up, then `passes` passes in turn; each run's mean
    CPU microseconds per step (and its median step), and its logged losses."""
    runs = {c: [] for c in contenders}
    for _ in range(passes + 1):
        for contender in contenders:
            runs[contender].append(cpu_per_step(contender, spec, warmup_steps))
    return {c: [{key: run[key] for key in ("cpu_us_per_step", "cpu_us_median_step", "logged_losses")}
                for run in measured[1:]] for c, measured in runs.items()}


def worker(request: dict) -> dict:
    spec = TrainSpec.from_dict(request["spec"])
    if request["task"] == "interleaved":
        return interleaved(spec, request["warmup_steps"], request["contenders"], request["passes"])
    if request["task"] == "profile":
        return profile(request["contender"], spec, request["warmup_steps"])
    if request["task"] == "lockstep":
        return lockstep(spec, request["warmup_steps"], profiled=request.get("profiled", False))
    return cpu_per_step(request["contender"], spec, request["warmup_steps"])


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def in_fresh_process(request: dict, loopkit_from: str | None = None) -> dict:
    """Run one worker request in a new process; `loopkit_from`: a folder holding a `loopkit` package to import
    instead of this checkout's (an earlier version, measured beside this one)."""
    return run_worker("benchmarks.overhead_profile", request, path_first=[loopkit_from] if loopkit_from else [])


def run_worker(module: str, request: dict, path_first=(), **env_vars) -> dict:
    """`python -m MODULE --worker REQUEST` in a new process (one thread, offline, this checkout's `benchmarks`
    importable after `path_first`, `env_vars` added): the JSON its last line prints."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1", **env_vars,
               PYTHONPATH=os.pathsep.join(list(path_first) + [str(Path(__file__).parent.parent)] +
                                          [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-m", module, "--worker", json.dumps(request)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{module} worker {request} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


METHODS = ("fresh", "lockstep", "profile", "interleaved")


def measure(rounds: int, timed_steps: int, warmup_steps: int, before: str | None = None, say=print,
            methods=METHODS, passes: int = 3) -> dict:
    """`before`: a checkout of an earlier loopkit, measured as a further contender ("loopkit-before")."""
    import tempfile

    spec = near_null_spec(timed_steps, warmup_steps).to_dict()
    loads = [os.getloadavg()[0]]
    contenders = CONTENDERS[:2] + (("loopkit-before",) if before else ()) + CONTENDERS[2:]
    shadow = tempfile.mkdtemp(prefix="loopkit-before-")  # holds only a link to the earlier `loopkit` package
    if before:
        os.symlink(os.path.join(os.path.abspath(before), "loopkit"), os.path.join(shadow, "loopkit"))

    def run(request: dict, contender: str) -> dict:
        request = {"spec": spec, "warmup_steps": warmup_steps, **request}
        reply = in_fresh_process(request, shadow if contender.endswith("-before") else None)
        loads.append(os.getloadavg()[0])
        return reply

    results = {"spec": spec, "warmup_steps": warmup_steps, "timed_steps": timed_steps, "rounds": rounds,
               "before": before, "methods": list(methods), "profiles": {}}
    if "fresh" in methods:
        results.update(fresh_rounds(run, rounds, contenders, say))
    if "lockstep" in methods:  # the hand-written loop and loopkit in one process, step by step
        results["lockstep"] = lockstep_rounds(run, rounds, contenders[2:], say)
    if "profile" in methods:  # each loopkit profiled in lockstep with the hand-written loop, in a process of its own
        for contender in contenders[2:]:
            reply = run({"task": "lockstep", "profiled": True}, contender)
            results["profiles"][f"raw beside {contender}"] = reply["profiles"]["raw"]
            results["profiles"][contender] = reply["profiles"]["loopkit"]
    if "interleaved" in methods:
        results["interleaved"] = interleaved_rounds(run, rounds, passes, bool(before), say)
    return {**results, "load_average": {"min": min(loads), "max": max(loads)}, "cores": os.cpu_count(),
            "command": " ".join(["python -m benchmarks.overhead_profile"] + sys.argv[1:])}


def fresh_rounds(run, rounds: int, contenders: tuple, say) -> dict:
    """Each contender in a fresh process, alternated round by round."""
    samples, median_steps, losses = ({c: [] for c in contenders} for _ in range(3))
    for round_index in range(rounds):
        for contender in contenders:
            reply = run({"task": "cpu", "contender": contender.replace("-before", "")}, contender)
            samples[contender].append(reply["cpu_us_per_step"])
            median_steps[contender].append(reply["cpu_us_median_step"])
            losses[contender].append(reply["logged_losses"])
            say(f"round {round_index + 1}/{rounds} {contender}: {reply['cpu_us_per_step']:.0f} us CPU/step, median "
                f"step {reply['cpu_us_median_step']:.0f} ({reply['wall_us_per_step']:.0f} wall), "
                f"load {os.getloadavg()[0]:.1f}")
    return {"cpu_us_per_step": samples, "cpu_us_median_step": median_steps, "logged_losses": losses}


def lockstep_rounds(run, rounds: int, loopkits: tuple, say) -> dict:
    paired = {c: [] for c in loopkits}
    for round_index in range(rounds):
        for contender in paired:
            reply = run({"task": "lockstep"}, contender)
            paired[contender].append(reply)
            say(f"lockstep round {round_index + 1}/{rounds} raw vs {contender}: median steps "
                f"{reply['median_step_us']['raw']:.0f} and {reply['median_step_us']['loopkit']:.0f} us CPU, "
                f"median difference {reply['median_difference_us']['loopkit']:+.1f} us, load {os.getloadavg()[0]:.1f}")
    return paired


def interleaved_rounds(run, rounds: int, passes: int, before: bool, say) -> dict:
    """Per round, a fresh process running every contender in turn (`interleaved`); with `before`, a second process
    running the earlier loopkit beside the hand-written loop the same way."""
    from .spec import PEERS, missing_peers

    missing = missing_peers()
    contenders = ["raw", "loopkit", "hf"] + [peer for peer in PEERS if peer not in missing]
    replies = []
    for round_index in range(rounds):
        reply = run({"task": "interleaved", "contenders": contenders, "passes": passes}, "loopkit")
        if before:
            earlier = run({"task": "interleaved", "contenders": ["raw", "loopkit"], "passes": passes},
                          "loopkit-before")
            reply["raw beside loopkit-before"], reply["loopkit-before"] = earlier["raw"], earlier["loopkit"]
        replies.append(reply)
        say(f"interleaved round {round_index + 1}/{rounds}: " + ", ".join(
            f"{c} {statistics.median(r['cpu_us_per_step'] for r in runs):.0f}" for c, runs in reply.items()) +
            f" us CPU/step (median of {passes} passes), load {os.getloadavg()[0]:.1f}")
    return {"contenders": contenders, "passes": passes, "peers_missing": missing, "rounds": replies}


def markdown(results: dict) -> str:
    lines = []
    if "cpu_us_per_step" in results:
        lines += [f"Near-null model (16x16 linear), CPU microseconds per optimizer step, {results['rounds']} "
                  f"alternated rounds of {results['timed_steps']} timed steps, each contender in a fresh process; "
                  f"load average {results['load_average']['min']:.1f}-{results['load_average']['max']:.1f} on "
                  f"{results['cores']} cores. Per run: the mean over its timed steps (logging steps included), and "
                  f"its median step (robust to the steps other processes slowed). Then the median of the rounds "
                  f"(their range), and the median of the round-by-round differences to the hand-written loop (their "
                  f"range).\n"]
        for key, title in (("cpu_us_per_step", "mean step"), ("cpu_us_median_step", "median step")):
            lines += [cpu_table(results[key], title), ""]
            samples = results[key]
            if "loopkit-before" in samples:
                diffs = [a - b for a, b in zip(samples["loopkit"], samples["loopkit-before"])]
                lines.append(f"{title}: loopkit minus loopkit-before ({results['before']}), per round: median "
                             f"{statistics.median(diffs):+,.0f} us/step ({min(diffs):+,.0f} to {max(diffs):+,.0f}).\n")
    if "interleaved" in results:
        lines += [interleaved_table(results), ""]
    if "lockstep" in results:
        lines += [lockstep_table(results), ""]
    if results.get("profiles"):
        lines.append(profile_table(results["profiles"]))
    return "\n".join(lines) + "\n"


OVERHEAD_GOAL_US = 50  # issue 37: loopkit at most the hand-written loop + 50 us of CPU per step


def interleaved_differences(rounds: list, contender: str, baseline: str) -> list:
    """Per round, the median over its passes of `contender`'s run minus `baseline`'s run of the same pass."""
    return [statistics.median(c["cpu_us_per_step"] - b["cpu_us_per_step"]
                              for c, b in zip(reply[contender], reply[baseline])) for reply in rounds]


def interleaved_table(results: dict) -> str:
    """The interleaved method's table and verdicts (`interleaved`, `interleaved_rounds`)."""
    part = results["interleaved"]
    rounds, names = part["rounds"], list(part["rounds"][0])
    contenders = [c for c in names if not c.startswith("raw beside")]
    lines = [f"Interleaved in one process ({len(rounds)} rounds, each a fresh process; in it every contender trains "
             f"once to warm up, then {part['passes']} passes in turn, {results['timed_steps']} timed steps a run): "
             f"each run's mean CPU us per step; per round the median over the passes of each contender's run minus "
             f"the hand-written loop's run of the same pass (loopkit-before: its own process, beside its own "
             f"hand-written loop runs), and of loopkit's run minus each other contender's. Then the median of the "
             f"rounds (their range). Peers not installed: " + (", ".join(part["peers_missing"]) or "none") + ".\n",
             "| contender | CPU us/step | minus the hand-written loop, per round | loopkit minus it, per round | "
             "logged losses = the hand-written loop's |", "|---|---|---|---|---|"]
    verdicts = []
    for contender in contenders:
        baseline = "raw beside loopkit-before" if contender == "loopkit-before" else "raw"
        values = [statistics.median(run["cpu_us_per_step"] for run in reply[contender]) for reply in rounds]
        over_raw = interleaved_differences(rounds, contender, baseline)
        same = all(run["logged_losses"] == raw["logged_losses"] for reply in rounds
                   for run, raw in zip(reply[contender], reply[baseline]))
        ahead_by = None if contender in ("raw", "loopkit", "loopkit-before") else \
            interleaved_differences(rounds, "loopkit", contender)
        versus = spread(ahead_by) if ahead_by else ""
        lines.append(f"| {contender} | {statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f}) | "
                     + ("" if contender == "raw" else spread(over_raw)) + f" | {versus} | "
                     + ("yes" if same else "no") + " |")
        if contender == "loopkit":
            verdicts.append(f"- loopkit within {OVERHEAD_GOAL_US} us of the hand-written loop in every round: "
                            + ("yes" if max(over_raw) <= OVERHEAD_GOAL_US else "no") + f" ({spread(over_raw)} us)")
        elif ahead_by:
            verdicts.append(f"- loopkit below {contender} in every round: " + ("yes" if max(ahead_by) < 0 else "no"))
    return "\n".join(lines + [""] + verdicts)


def spread(values: list) -> str:
    return f"{statistics.median(values):+,.1f} ({min(values):+,.1f} to {max(values):+,.1f})"


def lockstep_table(results: dict) -> str:
    """Per round, loopkit's step minus the hand-written loop's, the two taking turns step by step in one process."""
    lines = [f"Lockstep ({results['rounds']} rounds; each a fresh process where the hand-written loop and loopkit "
             f"take turns, one optimizer step each, in two threads, so both see the machine alike): per round the "
             f"median over {results['timed_steps']} steps of loopkit's step CPU time minus the hand-written "
             f"loop's step just before it; then the median of the rounds (their range).\n",
             "| loopkit | hand-written loop, median step | loopkit, median step | loopkit minus hand-written |",
             "|---|---|---|---|"]
    for contender, replies in results["lockstep"].items():
        raw = [r["median_step_us"]["raw"] for r in replies]
        own = [r["median_step_us"]["loopkit"] for r in replies]
        diffs = [r["median_difference_us"]["loopkit"] for r in replies]
        lines.append(f"| {contender} | {statistics.median(raw):,.0f} ({min(raw):,.0f}-{max(raw):,.0f}) | "
                     f"{statistics.median(own):,.0f} ({min(own):,.0f}-{max(own):,.0f}) | "
                     f"{statistics.median(diffs):+,.1f} ({min(diffs):+,.1f} to {max(diffs):+,.1f}) |")
    return "\n".join(lines)


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
    lines = [f"Where a step's time goes ({profiles['loopkit']['profiled_steps']} profiled steps each; each loopkit "
             f"in lockstep with the hand-written loop in a process of their own; wall microseconds per step, the "
             f"median over steps of each line, the other contender's turn left out; each line exclusive of the lines "
             f"inside it). Profiled totals (medians): " +
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
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated, of {', '.join(METHODS)} (default: all)")
    parser.add_argument("--passes", type=int, default=3, help="interleaved: passes per process after the warm-up")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    methods = tuple(m for m in args.methods.split(",") if m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    results = measure(args.rounds, args.steps, args.warmup, args.before, lambda text: print(text, file=sys.stderr),
                      methods, args.passes)
    write_results(args.out, results, markdown(results))
    return 0


def write_results(out: Path, results: dict, text: str) -> None:
    """`results` to OUT.json and `text` to OUT.md (`out` with or without either suffix); `text` printed too."""
    out = out.with_suffix("") if out.suffix in (".json", ".md") else out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
