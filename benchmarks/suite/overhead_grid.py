"""`python -m benchmarks.suite.overhead_grid [--quick]`: loopkit's per-step overhead across the configurations users run
(issue #46), each cell measured as the issue's harness measures one.

The grid: logging every 1, 10 and 100 optimizer steps; gradient accumulation 1 and 2; loopkit given `LoopArgs` or
`transformers.TrainingArguments` (HF Trainer always gets `TrainingArguments`, the others need none); no callback, or
one user callback (`on_step_begin` and `on_step_end`). Every cell trains the near-null model (a 16x16 linear layer,
MSE loss), batch 8, AdamW (lr 1e-3, weight decay 0.01 with HF's decay groups), a linear warmup of 10 steps, clipping
at 1.0, one torch thread.

Each cell runs in a fresh process: every contender (the hand-written loop, loopkit, HF Trainer, and the peers
pytorch-ignite and Lightning Fabric where installed) trains once to warm up, then `passes` passes follow, the order
rotated by one contender each pass. Each run builds a fresh model and loader. A run's time is the process's CPU time
per optimizer step from its optimizer step `warmup` to its step `warmup + steps`, taken by a global torch
optimizer-step hook: the same boundary in every contender, with or without a callback (the hand-written loop and
the peers call their clock's `begin` / `end` either way; in the no-callback cells that clock does nothing). The
final weights of every contender are compared bit for bit with the hand-written loop's, in every pass.

Per cell: loopkit minus each contender, pass by pass (median and range), and in how many passes loopkit was below
each peer. Then two load-independent measures: Python calls per optimizer step (cProfile's call counts, builtins
included, over the same kind of span) of each contender, with the functions where loopkit's calls differ from the
hand-written loop's; and, for the LoopArgs + callback cells, where loopkit's step time goes per event and per stage
(`benchmarks.profiles.overhead`'s profiler, loopkit in lockstep with the hand-written loop).

    python -m benchmarks.suite.overhead_grid                     # the full grid: 12 passes, 50 + 1,000 steps a run
    python -m benchmarks.suite.overhead_grid --quick             # 3 passes, 20 + 200 steps
    python -m benchmarks.suite.overhead_grid --quick --logging 10 --accum 2 --methods timing,calls

Results: benchmarks/results/overhead_grid.json and .md, unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..contenders.names import LABELS, missing_peers
from ..harness.environment import cpu_model
from ..profiles.workers import run_worker
from ..reports.overhead_profile import profile_table
from ..workloads.spec import TrainSpec

RESULTS = Path(__file__).parent.parent / "results" / "overhead_grid"
SHORT_LABELS = {"hf": "HF", "ignite": "ignite", "fabric": "Fabric"}  # the summary table's column names
GRID_PEERS = ("ignite", "fabric")  # the five contenders: these two beside raw, loopkit and HF Trainer
OVERHEAD_GOAL_US = 50  # issue 46: loopkit at most the hand-written loop + 50 us of CPU per optimizer step
METHODS = ("timing", "calls", "profile")
SIZES = {"full": {"passes": 12, "warmup": 50, "steps": 1000},
         "quick": {"passes": 3, "warmup": 20, "steps": 200}}
# Calls are counted over this many optimizer steps after `CALLS_WARMUP` (a multiple of every logging interval).
CALLS_WARMUP, CALLS_STEPS = 20, 200
# The clock reads among them: each a clock_gettime, whose cost depends on the machine (vDSO or system call).
CLOCK_READS = tuple(f"~:<built-in method time.{name}>" for name in ("perf_counter", "process_time", "time",
                                                                    "monotonic", "thread_time"))


@dataclass(frozen=True)
class Cell:
    logging_steps: int
    grad_accum: int
    args_class: str  # what loopkit is given: "LoopArgs" or "TrainingArguments"
    callback: bool  # one user callback (on_step_begin, on_step_end), or none

    @property
    def name(self) -> str:
        return (f"log every {self.logging_steps}, accumulation {self.grad_accum}, {self.args_class}, "
                f"{'one callback' if self.callback else 'no callback'}")

    def spec(self, warmup: int, steps: int) -> TrainSpec:
        return TrainSpec(model="null", num_train=4096, batch_size=8, grad_accum=self.grad_accum,
                         logging_steps=self.logging_steps, max_steps=warmup + steps, warmup_steps=10)


def grid(logging=(1, 10, 100), accumulation=(1, 2), args_classes=("LoopArgs", "TrainingArguments"),
         callbacks=(False, True)) -> list[Cell]:
    return [Cell(*values) for values in itertools.product(logging, accumulation, args_classes, callbacks)]


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
class NullClock:
    """The no-callback cells' clock for the hand-written loop and the peers: they call it, it records nothing."""

    def begin(self) -> None:
        pass

    def end(self, step: int) -> tuple[bool, bool]:
        return False, False


class OptimizerSteps:
    """`time.process_time()` at every optimizer step of every torch optimizer, while entered (a global post-hook:
    the same point in every contender, whatever wraps the optimizer)."""

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.times = []
        self.handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: self.record())
        return self

    def record(self) -> None:
        self.times.append(time.process_time())

    def __exit__(self, *exc):
        self.handle.remove()
        return False


def train_once(contender: str, cell: Cell, spec: TrainSpec, output_dir: str):
    """Train `spec` with `contender` as `cell` says (a fresh model and loader); returns the trained model."""
    from ..contenders import clock as clocks, hf, peers, raw
    from ..workloads import data, models

    model, dataset = models.build_model(spec), data.train_dataset(spec)
    clock = clocks.StepClock() if cell.callback else NullClock()
    if contender == "raw":
        return raw.train_raw(spec, model, dataset, clock, output_dir).model
    if contender in peers.TRAINERS:
        return peers.TRAINERS[contender](spec, model, dataset, clock, output_dir).model
    callbacks = [clocks.ClockCallback(clock)] if cell.callback else []
    if contender == "loopkit" and cell.args_class == "TrainingArguments":
        from transformers import TrainingArguments

        from loopkit import Loop

        trainer = Loop(model=model, args=TrainingArguments(**hf.trainer_arguments(spec, output_dir)),
                       train_dataset=dataset, data_collator=data.collator_for(spec), callbacks=callbacks)
    else:
        trainer = hf.build_trainer(contender, spec, model, output_dir, dataset, callbacks=callbacks)
    trainer.train()
    return trainer.model


def timed_run(contender: str, cell: Cell, warmup: int, steps: int) -> dict:
    """One run: CPU microseconds per optimizer step over steps `warmup` to `warmup + steps`, and the final
    weights' digest."""
    import gc
    import tempfile

    from .overhead import weights_digest

    spec = cell.spec(warmup, steps)
    gc.collect()
    with tempfile.TemporaryDirectory() as output_dir, OptimizerSteps() as optimizer_steps:
        model = train_once(contender, cell, spec, output_dir)
    times = optimizer_steps.times
    if len(times) != spec.max_steps:
        raise RuntimeError(f"{contender}: {len(times)} optimizer steps seen by the hook, {spec.max_steps} expected")
    return {"cpu_us_per_step": (times[-1] - times[warmup - 1]) / steps * 1e6, "weights_sha256": weights_digest(model)}


def rotated(contenders: list, by: int) -> list:
    by %= len(contenders)
    return contenders[by:] + contenders[:by]


def time_cell(cell: Cell, contenders: list, passes: int, warmup: int, steps: int) -> dict:
    """The warm-up pass, then `passes` passes in rotated order: per contender, each measured pass's run."""
    runs = {c: [] for c in contenders}
    for index in range(passes + 1):
        for contender in rotated(contenders, index):
            run = timed_run(contender, cell, warmup, steps)
            if index > 0:  # pass 0 warms up: imports, first allocations, caches
                runs[contender].append(run)
    same = [all(runs[c][p]["weights_sha256"] == runs["raw"][p]["weights_sha256"] for c in contenders)
            for p in range(passes)]
    return {"cpu_us_per_step": {c: [r["cpu_us_per_step"] for r in runs[c]] for c in contenders},
            "bit_identical_per_pass": same, "orders": [rotated(contenders, i) for i in range(1, passes + 1)]}


def count_calls(contender: str, cell: Cell) -> dict:
    """Python calls per optimizer step (cProfile's call counts, builtins included) over `CALLS_STEPS` steps after
    `CALLS_WARMUP`, by function. The profiler runs from the start of training, so every step is equally slowed
    (loopkit's slow-step detector then sees no slow step because of it)."""
    import cProfile
    import pstats
    import tempfile

    spec = cell.spec(CALLS_WARMUP, CALLS_STEPS)
    profiler, snapshots = cProfile.Profile(), []

    def snapshot() -> None:
        if len(steps.times) in (CALLS_WARMUP, spec.max_steps):
            profiler.disable()
            snapshots.append({key: value[1] for key, value in pstats.Stats(profiler).stats.items()})
            profiler.enable()

    with tempfile.TemporaryDirectory() as output_dir, OptimizerSteps() as steps:
        steps.record = lambda: (steps.times.append(0.0), snapshot())
        profiler.enable()
        try:
            train_once(contender, cell, spec, output_dir)
        finally:
            profiler.disable()
    before, after = snapshots
    calls = {function_name(key): (count - before.get(key, 0)) / CALLS_STEPS for key, count in after.items()}
    return {name: round(value, 3) for name, value in calls.items() if value}


def function_name(key: tuple) -> str:
    """cProfile's (file, line, name) as `package/module.py:line:name`, or `~:name` for a builtin."""
    filename, line, name = key
    if filename == "~":
        return f"~:{name}"
    for marker in ("site-packages/", "/benchmarks/", "/loopkit/"):
        if marker in filename:
            prefix = "" if marker == "site-packages/" else marker.strip("/") + "/"
            return f"{prefix}{filename.split(marker)[-1]}:{line}:{name}"
    return f"{filename}:{line}:{name}"


def calls_cell(cell: Cell, contenders: list) -> dict:
    """Calls per step of each contender, and the functions whose count differs most between loopkit and the
    hand-written loop. Each contender trains two steps first, so that every one is counted in the same process
    state."""
    import tempfile

    for contender in contenders:  # every framework imported first, as in the timed passes (torch's optimizer
        with tempfile.TemporaryDirectory() as output_dir:  # step makes more calls once some are)
            train_once(contender, cell, cell.spec(1, 1), output_dir)
    counts = {c: count_calls(c, cell) for c in contenders}
    raw, loopkit = counts["raw"], counts["loopkit"]
    differences = {name: round(loopkit.get(name, 0) - raw.get(name, 0), 3) for name in set(raw) | set(loopkit)}
    largest = sorted((item for item in differences.items() if abs(item[1]) >= 0.05), key=lambda item: -abs(item[1]))
    return {"calls_per_step": {c: round(sum(counts[c].values()), 1) for c in contenders},
            "clock_reads_per_step": {c: round(sum(counts[c].get(name, 0) for name in CLOCK_READS), 2)
                                     for c in contenders},
            "loopkit_minus_raw_by_function": dict(largest[:40])}


def profile_cell(cell: Cell, warmup: int, steps: int) -> dict:
    """loopkit's step per event and per stage beside the hand-written loop's (overhead_profile's lockstep
    profiler: LoopArgs and the clock callback, so only those cells)."""
    from ..profiles.overhead import lockstep

    reply = lockstep(cell.spec(warmup, steps), warmup, profiled=True)
    return {"raw beside loopkit": reply["profiles"]["raw"], "loopkit": reply["profiles"]["loopkit"]}


def worker(request: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    cell = Cell(**request["cell"])
    if request["task"] == "profile":
        return profile_cell(cell, request["warmup"], request["steps"])
    result = {}
    if "timing" in request["methods"]:
        result["timing"] = time_cell(cell, request["contenders"], request["passes"], request["warmup"],
                                     request["steps"])
    if "calls" in request["methods"]:  # after the timing: the profiler never runs beside a timed run
        result["calls"] = calls_cell(cell, request["contenders"])
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def measure(cells: list, methods: tuple, passes: int, warmup: int, steps: int, say=print, chosen=None,
            after_cell=None) -> dict:
    """Every cell in a fresh process (and its profile in another); `chosen`: only these contenders (the
    hand-written loop and loopkit always run); `after_cell(results)` after each cell (partial results)."""
    missing = missing_peers()
    contenders = [c for c in ["raw", "loopkit", "hf"] + [p for p in GRID_PEERS if p not in missing]
                  if chosen is None or c in chosen or c in ("raw", "loopkit")]
    results = {"contenders": contenders, "peers_missing": {p: missing[p] for p in GRID_PEERS if p in missing},
               "passes": passes, "warmup_steps": warmup, "timed_steps": steps, "calls_steps": CALLS_STEPS,
               "cores": os.cpu_count(), "cpu_model": cpu_model(), "cells": []}
    for number, cell in enumerate(cells, 1):
        load_before = os.getloadavg()[0]
        entry = {"cell": asdict(cell), "name": cell.name}
        request = {"cell": asdict(cell), "contenders": contenders, "passes": passes, "warmup": warmup,
                   "steps": steps, "methods": [m for m in methods if m != "profile"]}
        if request["methods"]:
            entry.update(run_worker("benchmarks.suite.overhead_grid", {"task": "cell", **request}))
        if "profile" in methods and cell.args_class == "LoopArgs" and cell.callback:
            entry["profile"] = run_worker("benchmarks.suite.overhead_grid", {"task": "profile", **request})
        entry["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        results["cells"].append(entry)
        say(f"[{number}/{len(cells)}] {cell.name}: {cell_summary(entry)}, load {entry['load_average']}")
        if after_cell is not None:
            after_cell(results)
    return results


def differences(timing: dict, contender: str, other: str) -> list:
    """`contender`'s run minus `other`'s run of the same pass, pass by pass (us per step)."""
    samples = timing["cpu_us_per_step"]
    return [a - b for a, b in zip(samples[contender], samples[other])]


def spread(values: list) -> str:
    return f"{statistics.median(values):+,.1f} ({min(values):+,.1f} to {max(values):+,.1f})"


def cell_summary(entry: dict) -> str:
    parts = []
    if "timing" in entry:
        parts.append(f"loopkit - raw {spread(differences(entry['timing'], 'loopkit', 'raw'))} us/step")
    if "calls" in entry:
        calls = entry["calls"]["calls_per_step"]
        parts.append(f"calls/step raw {calls['raw']:.0f}, loopkit {calls['loopkit']:.0f}")
    return "; ".join(parts) or "profiled"


def below_count(timing: dict, other: str) -> str:
    """In how many passes loopkit's run was below `other`'s run of the same pass."""
    below = [d < 0 for d in differences(timing, "loopkit", other)]
    return f"{sum(below)}/{len(below)}"


def summary_table(results: dict) -> str:
    peers = [c for c in results["contenders"] if c not in ("raw", "loopkit")]
    lines = ["| cell | hand-written, us/step | loopkit - hand-written, per pass | all <= +"
             f"{OVERHEAD_GOAL_US} | " + " | ".join(f"below {SHORT_LABELS.get(p, p)}" for p in peers) +
             " | same weights | calls/step (hand-written, loopkit) | clock reads | load |",
             "|---|---|---|---|" + "---|" * len(peers) + "---|---|---|---|"]
    for entry in results["cells"]:
        timing, calls = entry.get("timing"), entry.get("calls")
        row = [entry["name"]]
        if timing:
            over = differences(timing, "loopkit", "raw")
            same = timing["bit_identical_per_pass"]
            row += [f"{statistics.median(timing['cpu_us_per_step']['raw']):,.0f}", spread(over),
                    "yes" if max(over) <= OVERHEAD_GOAL_US else "no"]
            row += [below_count(timing, p) for p in peers] + [f"{sum(same)}/{len(same)}"]
        else:
            row += [""] * (4 + len(peers))
        if calls:
            per_step = calls["calls_per_step"]
            row.append(f"{per_step['raw']:.0f}, {per_step['loopkit']:.0f} "
                       f"({per_step['loopkit'] - per_step['raw']:+.0f})")
            clocks = calls.get("clock_reads_per_step")
            row.append(f"{clocks['raw']:.1f}, {clocks['loopkit']:.1f}" if clocks else "")
        else:
            row += ["", ""]
        row.append(f"{entry['load_average'][0]:.1f}-{entry['load_average'][1]:.1f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def cell_table(results: dict, entry: dict) -> str:
    """One cell: each contender's runs, its difference to the hand-written loop's and loopkit's to it, per pass."""
    timing = entry["timing"]
    lines = [f"**{entry['name']}** (load average {entry['load_average'][0]:.1f}-{entry['load_average'][1]:.1f})\n",
             "| contender | CPU us/step, median (range) | minus the hand-written loop, per pass | loopkit minus it, "
             "per pass | passes loopkit below it |", "|---|---|---|---|---|"]
    for contender in results["contenders"]:
        values = timing["cpu_us_per_step"][contender]
        other = contender not in ("raw", "loopkit")
        lines.append(f"| {LABELS[contender]} | {statistics.median(values):,.0f} ({min(values):,.0f}-"
                     f"{max(values):,.0f}) | {'' if contender == 'raw' else spread(differences(timing, contender, 'raw'))}"
                     f" | {spread(differences(timing, 'loopkit', contender)) if other else ''}"
                     f" | {below_count(timing, contender) if other else ''} |")
    return "\n".join(lines)


def within_goal(timing: dict) -> bool:
    return max(differences(timing, "loopkit", "raw")) <= OVERHEAD_GOAL_US


def below_in_every_pass(timing: dict, other: str) -> bool:
    return max(differences(timing, "loopkit", other)) < 0


def identical_in_every_pass(timing: dict) -> bool:
    return all(timing["bit_identical_per_pass"])


def verdicts(results: dict) -> list[str]:
    timed = [e for e in results["cells"] if "timing" in e]
    if not timed:
        return []
    over = [e["name"] for e in timed if not within_goal(e["timing"])]
    peers = [c for c in results["contenders"] if c not in ("raw", "loopkit")]
    behind = [f"{e['name']} ({LABELS[p]})" for e in timed for p in peers if not below_in_every_pass(e["timing"], p)]
    unequal = [e["name"] for e in timed if not identical_in_every_pass(e["timing"])]
    return [f"- loopkit within {OVERHEAD_GOAL_US} us of the hand-written loop in every pass of every cell: " +
            ("yes" if not over else "no: " + "; ".join(over)),
            f"- loopkit below every peer ({', '.join(LABELS[p] for p in peers)}) in every pass of every cell: " +
            ("yes" if not behind else "no: " + "; ".join(behind)),
            "- final weights bit-identical across the contenders in every pass of every cell: " +
            ("yes" if not unequal else "no: " + "; ".join(unequal))]


def calls_lines(entry: dict, top: int = 15) -> str:
    """Where loopkit's calls per step differ from the hand-written loop's (positive: loopkit makes more)."""
    largest = list(entry["calls"]["loopkit_minus_raw_by_function"].items())[:top]
    return "\n".join([f"**{entry['name']}**: loopkit minus the hand-written loop, calls per step, the {top} largest\n",
                      "| function | calls per step |", "|---|---|"] +
                     [f"| `{name}` | {value:+.2f} |" for name, value in largest])


def measured_by(results: dict) -> str:
    """The command, the machine and the method, in one paragraph."""
    loads = [x for e in results["cells"] for x in e["load_average"]]
    missing = ", ".join(f"{LABELS[p]} ({why})" for p, why in results["peers_missing"].items()) or "none"
    # Microseconds of Python scale with the CPU: a grid is read against its own hand-written loop, on its machine.
    machine = f"{results['cores']} cores" + (f" of an {results['cpu_model']}" if results.get("cpu_model") else "")
    return (f"Measured by `{results['command']}` on {machine}, load average {min(loads):.1f}-"
            f"{max(loads):.1f}. Each cell in a fresh process: every contender trains once to warm up, then "
            f"{results['passes']} passes, the order rotated each pass, each run a fresh model and loader, "
            f"{results['warmup_steps']} + {results['timed_steps']} optimizer steps, CPU us per optimizer step over "
            f"the last {results['timed_steps']}. Peers not installed: {missing}. Calls per step: cProfile's call "
            f"counts (builtins included) over {results['calls_steps']} steps, load-independent.")


def verdict_counts(results: dict) -> list[str]:
    """`verdicts` as counts of cells, not their names (docs/performance.md's summary)."""
    timed = [e["timing"] for e in results["cells"] if "timing" in e]
    peers = [c for c in results["contenders"] if c not in ("raw", "loopkit")]

    def cells_where(holds) -> str:
        return f"{sum(1 for timing in timed if holds(timing))} of {len(timed)} cells"

    lines = [f"- loopkit within +{OVERHEAD_GOAL_US} us of the hand-written loop in every pass: "
             f"{cells_where(within_goal)}."]
    lines += [f"- loopkit below {LABELS[p]} in every pass: "
              f"{cells_where(lambda t, p=p: below_in_every_pass(t, p))}." for p in peers]
    return lines + [f"- final weights bit-identical across the contenders in every pass: "
                    f"{cells_where(identical_in_every_pass)}."]


def markdown(results: dict) -> str:
    lines = [measured_by(results) + "\n", summary_table(results), ""] + verdicts(results)
    for entry in results["cells"]:
        if "timing" in entry:
            lines += ["", cell_table(results, entry)]
    for entry in results["cells"]:
        if "calls" in entry and entry["cell"]["args_class"] == "LoopArgs" and entry["cell"]["callback"]:
            lines += ["", calls_lines(entry)]
    for entry in results["cells"]:
        if "profile" in entry:
            lines += ["", f"**{entry['name']}**, per event and per stage:\n", profile_table(entry["profile"])]
    return "\n".join(lines) + "\n"


def parse_list(text: str, kind) -> tuple:
    return tuple(kind(value) for value in text.split(",") if value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite.overhead_grid", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 passes of 20 + 200 steps (default: 12 of 50 + 1,000)")
    parser.add_argument("--passes", type=int, help="measured passes per cell, after the warm-up pass")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, help="untimed optimizer steps first")
    parser.add_argument("--logging", default="1,10,100", help="logging_steps values (comma-separated)")
    parser.add_argument("--accum", default="1,2", help="gradient_accumulation_steps values")
    parser.add_argument("--args", default="LoopArgs,TrainingArguments", help="what loopkit is given")
    parser.add_argument("--callbacks", default="0,1", help="user callbacks: 0 (none), 1 (one)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--contenders", help="only these (comma-separated; raw and loopkit always run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results path, without suffix (.json and .md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    size = dict(SIZES["quick" if args.quick else "full"])
    size.update({key: getattr(args, key) for key in size if getattr(args, key) is not None})
    methods = parse_list(args.methods, str)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    classes = parse_list(args.args, str)
    if set(classes) - {"LoopArgs", "TrainingArguments"}:
        parser.error(f"--args {args.args!r}: choose from LoopArgs, TrainingArguments")
    cells = grid(parse_list(args.logging, int), parse_list(args.accum, int), classes,
                 tuple(bool(int(n)) for n in parse_list(args.callbacks, int)))
    command = " ".join(["python -m benchmarks.suite.overhead_grid"] + sys.argv[1:])

    def write(results: dict) -> None:  # after every cell: a run cut short still leaves its cells
        results["command"] = command
        out = args.out.with_suffix("") if args.out.suffix in (".json", ".md") else args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(results))

    results = measure(cells, methods, size["passes"], size["warmup"], size["steps"],
                      lambda text: print(text, file=sys.stderr, flush=True),
                      parse_list(args.contenders, str) if args.contenders else None, write)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
