"""`python -m benchmarks.profiles.overhead`: where loopkit's per-step microseconds go on the near-null model.

Each contender in a fresh process (the same `TrainSpec` as the overhead benchmark's near-null row,
the same `benchmarks.contenders.run.train`):

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

    python -m benchmarks.profiles.overhead                     # 5 rounds, 400 timed steps, writes results
    python -m benchmarks.profiles.overhead --rounds 8 --before ../loopkit-main --out /tmp/profile
    python -m benchmarks.profiles.overhead --methods interleaved --rounds 8 --passes 3   # one method only

Results: benchmarks/results/overhead_profile.json and .md (the committed run), unless `--out` says otherwise.

The wrappers that time the profile's lines: profiles/instrument.py; the tables: reports/overhead_profile.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from ..harness.runner import PUBLISHED_RESULTS
from ..reports.overhead_profile import markdown
from ..workloads.spec import TrainSpec
from .instrument import Profiler, instrument, profile_result, profile_steps
from .workers import run_worker, write_results

CONTENDERS = ("raw", "hf", "loopkit")


RESULTS = PUBLISHED_RESULTS / "overhead_profile"


def near_null_spec(timed_steps: int, warmup_steps: int) -> TrainSpec:
    """The overhead benchmark's near-null row (benchmarks/suite/overhead.py), at `timed_steps` timed steps."""
    return TrainSpec(model="null", num_train=4096, batch_size=8, grad_accum=2, logging_steps=50,
                     max_steps=warmup_steps + timed_steps, warmup_steps=10)


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def cpu_per_step(contender: str, spec: TrainSpec, warmup_steps: int, profiler=None) -> dict:
    """Train `spec` with `contender`; CPU and wall microseconds per optimizer step after the first `warmup_steps`."""
    import tempfile

    import torch

    from ..contenders.clock import StepClock
    from ..contenders.run import train

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


def profile(contender: str, spec: TrainSpec, warmup_steps: int) -> dict:
    profiler = Profiler()
    cpu_per_step(contender, spec, warmup_steps, profiler)
    return profile_result(profiler)


def in_fresh_process(request: dict, loopkit_from: str | None = None) -> dict:
    """Run one worker request in a new process; `loopkit_from`: a folder holding a `loopkit` package to import
    instead of this checkout's (an earlier version, measured beside this one)."""
    return run_worker("benchmarks.profiles.overhead", request, path_first=[loopkit_from] if loopkit_from else [])


class Turns:
    """Threads taking turns by index: `wait(i)` blocks until it is i's turn; `pass_on(i)` gives the turn to the next
    index that has not finished (`finished=True`: i has)."""

    def __init__(self, count: int):
        self.count, self.current, self.finished = count, 0, set()
        self.condition = threading.Condition()

    def wait(self, index: int) -> None:
        with self.condition:
            self.condition.wait_for(lambda: self.current == index)

    def pass_on(self, index: int, finished: bool = False) -> None:
        with self.condition:
            if finished:
                self.finished.add(index)
            waiting = [i for i in range(1, self.count + 1) if (index + i) % self.count not in self.finished]
            self.current = (index + waiting[0]) % self.count if waiting else index
            self.condition.notify_all()


def lockstep(spec: TrainSpec, warmup_steps: int, contenders=("raw", "loopkit"), profiled: bool = False) -> dict:
    """The contenders in one process, one thread each, taking turns step by step (a step of one, then a step of
    the next, ...): each step's CPU time (`time.thread_time`) sits beside the others' under the same machine
    conditions, a millisecond apart. Returns the median over steps of the contenders' step-by-step differences to
    the first contender, and each contender's median step; `profiled`: and each one's profile (the lines of a step,
    `Profiler`), measured side by side."""
    import tempfile

    import torch

    from ..contenders.clock import StepClock
    from ..contenders.run import train

    torch.set_num_threads(1)
    turns = Turns(len(contenders))
    ends = {c: [] for c in contenders}
    profilers = {}
    if profiled:
        for contender in contenders:
            instrument(contender)

    def run(index: int, contender: str) -> None:
        clock = StepClock()

        def step_ended(step):
            ends[contender].append(time.thread_time())
            paused = time.perf_counter()
            turns.pass_on(index)
            turns.wait(index)
            if profiled:  # the other contender's turn is no part of this one's step
                profilers[contender].pause(time.perf_counter() - paused)

        turns.wait(index)
        if profiled:
            profilers[contender] = Profiler()
            profile_steps(profilers[contender], contender, clock, spec, warmup_steps)
        clock.listeners.append(step_ended)
        try:
            with tempfile.TemporaryDirectory() as output_dir:
                train(contender, spec, clock, output_dir)
        finally:
            turns.pass_on(index, finished=True)

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
            "command": " ".join(["python -m benchmarks.profiles.overhead"] + sys.argv[1:])}


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
    from ..contenders.names import PEERS, missing_peers

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profiles.overhead", description=__doc__,
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


if __name__ == "__main__":
    sys.exit(main())
