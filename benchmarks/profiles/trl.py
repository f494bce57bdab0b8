"""`python -m benchmarks.profiles.trl`: where a step's CPU time goes, TRL's trainer beside loopkit's (bench_trl's work).

Each contender trains the workload in a fresh process (the same `bench_trl.build_trainer`, one torch thread) under
Python's `cProfile`, switched on at the end of the last warm-up step and off at the end of the last step, so only
the timed steps are profiled, on the process's CPU clock (`time.process_time`, so time spent waiting for a core on
a busy machine is left out). Per run: every function's own CPU time per step (`tottime`), summed by the package its
code lives in (torch, transformers, trl, accelerate, loopkit, ...), and the functions whose own time differs most
between the two contenders. cProfile's own cost falls on Python calls (torch's kernels are one call each), so the
totals run above bench_trl's unprofiled CPU times; the comparison is between two runs profiled alike.

    python -m benchmarks.profiles.trl                        # every workload, full size
    python -m benchmarks.profiles.trl --workloads sft --size quick --out /tmp/trl-profile

Results: benchmarks/results/trl/profile.json and .md, unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..harness.runner import PUBLISHED_RESULTS, Suite
from ..suite.trl import CONTENDERS, WORKLOADS, plan
from .workers import run_worker, write_results

RESULTS = PUBLISHED_RESULTS / "trl" / "profile"
PACKAGES = ("loopkit", "trl", "transformers", "accelerate", "torch", "datasets", "tokenizers")


def package_of(filename: str) -> str:
    """The package a profiled function's code belongs to ("~" is cProfile's name for built-ins: C functions)."""
    if filename == "~":
        return "built-in (C: torch ops, ...)"
    parts = Path(filename).parts
    for name in PACKAGES:
        if name in parts:
            return name
    return "python stdlib / other"


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def profiled_run(workload: str, contender: str, settings: dict) -> dict:
    import cProfile
    import pstats
    import time

    import torch
    from transformers import TrainerCallback

    from ..suite.trl import build_trainer

    torch.set_num_threads(1)
    profiler = cProfile.Profile(time.process_time)  # CPU time: waiting for a core on a busy machine is left out
    warmup, last = settings["warmup_steps"], settings["warmup_steps"] + settings["timed_steps"]
    cpu = {}

    class Window(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == warmup:
                cpu["start"] = time.process_time()
                profiler.enable()
            elif state.global_step == last:
                profiler.disable()
                cpu["end"] = time.process_time()

    with tempfile.TemporaryDirectory() as output_dir:
        trainer = build_trainer(workload, contender, settings, output_dir, [Window()])
        trainer.train()
    steps = settings["timed_steps"]
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, tottime, cumtime, callers)
    by_package, functions = {}, []
    for (filename, line, name), (_, calls, own, _, _) in stats.items():
        package = package_of(filename)
        by_package[package] = by_package.get(package, 0.0) + own / steps * 1e3
        functions.append({"function": f"{short_path(filename)}:{line}({name})", "package": package,
                          "ms_per_step": own / steps * 1e3, "calls_per_step": calls / steps})
    functions.sort(key=lambda f: -f["ms_per_step"])
    return {"workload": workload, "contender": contender, "trainer": type(trainer).__name__,
            "cpu_ms_per_step_profiled": (cpu["end"] - cpu["start"]) / steps * 1e3,
            "by_package_ms_per_step": by_package, "functions": functions[:400]}


def short_path(filename: str) -> str:
    parts = Path(filename).parts
    for index, part in enumerate(parts):
        if part in PACKAGES:
            return "/".join(parts[index:])
    return filename if filename == "~" else "/".join(parts[-2:])


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def measure(workloads: list, size: str, say=print) -> dict:
    settings = plan(Suite(size=size, out_dir=Path(tempfile.mkdtemp(prefix="trl-profile-"))))
    runs = {}
    for workload in workloads:
        for contender in CONTENDERS:
            request = {"workload": workload, "contender": contender, "settings": settings}
            load = os.getloadavg()[0]
            reply = run_worker("benchmarks.profiles.trl", request)
            reply["load_average"] = [load, os.getloadavg()[0]]
            runs.setdefault(workload, {})[contender] = reply
            say(f"{workload} {reply['trainer']}: {reply['cpu_ms_per_step_profiled']:.1f} ms CPU/step profiled")
    return {"settings": settings, "size": size, "runs": runs, "cores": os.cpu_count(),
            "command": " ".join(["python -m benchmarks.profiles.trl"] + sys.argv[1:])}


def markdown(results: dict, top: int = 12) -> str:
    lines = [f"`{results['command']}` (size `{results['size']}`, {results['cores']} cores): each contender's timed "
             f"steps under cProfile, one fresh process each, own time per step (ms) summed by package, then the "
             f"functions whose own time differs most between the contenders.", ""]
    for workload, runs in results["runs"].items():
        trl, loopkit = runs["trl"], runs["loopkit"]
        loads = [v for r in runs.values() for v in r["load_average"]]
        lines += [f"### {WORKLOADS[workload]}", "",
                  f"Profiled CPU ms/step: {trl['trainer']} {trl['cpu_ms_per_step_profiled']:.1f}, "
                  f"{loopkit['trainer']} {loopkit['cpu_ms_per_step_profiled']:.1f} (load average "
                  f"{min(loads):.1f}-{max(loads):.1f}).", "",
                  f"| package | {trl['trainer']} ms/step | {loopkit['trainer']} ms/step | difference |",
                  "|---|---|---|---|"]
        packages = sorted(set(trl["by_package_ms_per_step"]) | set(loopkit["by_package_ms_per_step"]),
                          key=lambda p: -max(r["by_package_ms_per_step"].get(p, 0.0) for r in (trl, loopkit)))
        for package in packages:
            a, b = (r["by_package_ms_per_step"].get(package, 0.0) for r in (trl, loopkit))
            lines.append(f"| {package} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
        own = {c: {f["function"]: f for f in runs[c]["functions"]} for c in CONTENDERS}
        names = set(own["trl"]) | set(own["loopkit"])

        def difference(name):
            return own["loopkit"].get(name, {}).get("ms_per_step", 0.0) - own["trl"].get(name, {}).get(
                "ms_per_step", 0.0)

        lines += ["", f"| function (the {top} largest differences of own time) | {trl['trainer']} ms/step (calls) | "
                      f"{loopkit['trainer']} ms/step (calls) | difference |", "|---|---|---|---|"]
        for name in sorted(names, key=lambda n: -abs(difference(n)))[:top]:
            cells = [f"{own[c][name]['ms_per_step']:.3f} ({own[c][name]['calls_per_step']:.0f})" if name in own[c]
                     else "-" for c in CONTENDERS]
            lines.append(f"| `{name}` | {cells[0]} | {cells[1]} | {difference(name):+.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profiles.trl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--size", default="full", choices=("full", "quick", "tiny"))
    parser.add_argument("--out", type=Path, default=RESULTS, help="results path, without suffix (.json and .md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        request = json.loads(args.worker)
        print(json.dumps(profiled_run(request["workload"], request["contender"], request["settings"])))
        return 0
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    results = measure(workloads, args.size, lambda text: print(text, file=sys.stderr))
    write_results(args.out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
