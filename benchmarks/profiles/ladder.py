"""`python -m benchmarks.profiles.ladder`: where a ladder rung's step time goes, and how far any loop could get ahead
of HF Trainer's best configuration on the same math.

    python -m benchmarks.profiles.ladder                    # both texts: HF best, the hand-written loop, loopkit's best
    python -m benchmarks.profiles.ladder --datasets reviews --rungs hf-best,loopkit-chunked --out /tmp/profile

Each rung trains at the ladder's full size (benchmarks/suite/ladder.py: the same texts, model, rows, inductor) in a
fresh process, one torch thread, with torch's profiler recording every CPU op of the second (timed) epoch. The ops'
own CPU time is grouped per optimizer step: matrix multiplies (`aten::mm`/`addmm`/`bmm`, and oneDNN's
`mkldnn::_linear_pointwise`, which loopkit's chunked loss calls on a CPU: the output layer over the 30,522-token
vocabulary, and the layers' projections), the optimizer, attention, the loss, the embedding, the
fused kernels of compiled code, the other ops, and the time in no op at all (Python: the loop, the data, the
callbacks). The bound: a loop that did the same math in float32 with no time outside the matrix multiplies would run
HF's best step in the matrix multiplies' time; HF best's step over the smallest matrix-multiply time of the profiled
rungs is how far ahead of HF's best any loop can get here with matrix products no faster than the fastest profiled. Under the profiler a step runs a little slower; the
ladder's own tokens/s are the speeds, this says where their time goes.

Results: benchmarks/results/ladder_profile.json and .md, unless `--out` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from ..harness.runner import PUBLISHED_RESULTS
from .workers import run_worker, write_results

RESULTS = PUBLISHED_RESULTS / "ladder_profile"
RUNGS = ("hf-best", "raw", "loopkit-per-text")
# (group, substrings of the op names it takes), first match wins; ops in no group are "other ops".
GROUPS = (
    ("matrix multiplies", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
                           "mkldnn::_linear_pointwise")),
    ("optimizer", ("adam",)),
    ("attention", ("attention",)),
    ("loss (log-softmax, NLL)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("embedding", ("embedding",)),
    ("compiled code's fused kernels", ("Compiled", "compiled", "CompiledFxGraph")),
)
OUTSIDE = "in no op (Python: the loop, data, callbacks)"


def ladder_plan(dataset: str, size: str = "full") -> dict:
    """The ladder's plan for `dataset` at `size` (benchmarks.workloads.ladder.plan: full, quick or tiny)."""
    from ..workloads.ladder import plan

    def pick(full=None, quick=None, tiny=None):
        return {"full": full, "quick": quick, "tiny": tiny}[size]

    return plan(SimpleNamespace(size=size, pick=pick), dataset)


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def profiled_rung(name: str, plan: dict, output_dir: str) -> dict:
    """Train rung `name` as the ladder does, profiling the timed epoch; its op groups in ms per optimizer step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ..contenders.clock import StepClock
    from ..suite.ladder import train_by_hand, trainer_for
    from ..workloads.ladder import build_model, text_samples

    torch.set_num_threads(1)
    train, _, tokenizer = text_samples(plan)
    model = build_model(plan)
    clock, epoch_steps, profiler = StepClock(), [], profile(activities=[ProfilerActivity.CPU])

    def epoch_end(step: int) -> None:
        epoch_steps.append(step)
        if len(epoch_steps) == plan["epochs"] - 1:
            profiler.__enter__()  # the warm-up (and its compilation) is over
        elif len(epoch_steps) == plan["epochs"]:
            profiler.__exit__(None, None, None)

    if name == "raw":
        train_by_hand(plan, model, train, clock, lambda ids: None, plan["seed"], epoch_end)
    else:
        trainer_for(name, plan, model, train, tokenizer, clock, lambda ids: None, plan["seed"], output_dir,
                           epoch_end).train()
    steps = epoch_steps[-1] - epoch_steps[-2]
    seconds = clock.ends[epoch_steps[-1] - 1] - clock.ends[epoch_steps[-2] - 1]
    groups = dict.fromkeys([group for group, _ in GROUPS] + ["other ops"], 0.0)
    top = []
    for event in profiler.key_averages():
        own_ms = event.self_cpu_time_total / 1000 / steps
        group = next((g for g, parts in GROUPS if any(part in event.key for part in parts)), "other ops")
        groups[group] += own_ms
        top.append((own_ms, event.key, group))
    step_ms = seconds / steps * 1000
    groups[OUTSIDE] = max(0.0, step_ms - sum(groups.values()))
    return {"rung": name, "steps": steps, "step_ms": step_ms, "groups_ms": groups,
            "top_ops": [{"op": key, "ms_per_step": ms, "group": g} for ms, key, g in sorted(top, reverse=True)[:12]]}


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def measure(datasets: list, rungs: list, say=print) -> dict:
    results = {"datasets": {}, "load_average": [os.getloadavg()[0]], "cores": os.cpu_count(),
               "command": " ".join(["python -m benchmarks.profiles.ladder"] + sys.argv[1:])}
    for dataset in datasets:
        plan = ladder_plan(dataset)
        profiles = {}
        with tempfile.TemporaryDirectory() as scratch:
            for name in rungs:
                say(f"ladder profile ({dataset}): {name}")
                profiles[name] = run_worker("benchmarks.profiles.ladder",
                                            {"rung": name, "plan": plan, "output_dir": scratch},
                                            TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor-cache"))
                results["load_average"].append(os.getloadavg()[0])
        results["datasets"][dataset] = {"plan": plan, "profiles": profiles, "bound": bound(profiles)}
    return results


def bound(profiles: dict) -> dict | None:
    """How far ahead of HF's best step any loop can get: its step over the least matrix-multiply time profiled."""
    if "hf-best" not in profiles:
        return None
    least = min(profiles.values(), key=lambda p: p["groups_ms"]["matrix multiplies"])
    matmul_ms = least["groups_ms"]["matrix multiplies"]
    return {"hf_best_step_ms": profiles["hf-best"]["step_ms"], "least_matmul_ms": matmul_ms,
            "least_matmul_rung": least["rung"], "at_most": profiles["hf-best"]["step_ms"] / matmul_ms}


def markdown(results: dict) -> str:
    from ..workloads.ladder import DATASETS, RUNGS as LABELS

    loads = results["load_average"]
    lines = [f"Measured by `{results['command']}` on {results['cores']} cores, load average {min(loads):.1f}-"
             f"{max(loads):.1f}. Own CPU time of the ops per optimizer step of the timed epoch, in ms (torch's "
             f"profiler, one thread).\n"]
    for dataset, part in results["datasets"].items():
        profiles = part["profiles"]
        names = list(profiles)
        lines += [f"**{DATASETS[dataset]['label']}** (one {part['plan']['row_tokens']}-token packed row or a "
                  f"flattened batch of {part['plan']['batch_size']} texts a step):\n",
                  "| ms per step | " + " | ".join(LABELS[n][0] for n in names) + " |", "|---|" + "---|" * len(names)]
        for group in profiles[names[0]]["groups_ms"]:
            lines.append(f"| {group} | " + " | ".join(f"{profiles[n]['groups_ms'][group]:,.1f}" for n in names) + " |")
        lines.append("| **step** | " + " | ".join(f"**{profiles[n]['step_ms']:,.1f}**" for n in names) + " |")
        if part["bound"] is not None:
            b = part["bound"]
            lines += ["", f"The bound: HF best's step ({b['hf_best_step_ms']:,.1f} ms) over the least matrix-multiply "
                          f"time profiled ({b['least_matmul_ms']:,.1f} ms, {LABELS[b['least_matmul_rung']][0]}): no "
                          f"loop doing this math in float32 here, with matrix products no faster than those, gets "
                          f"more than {b['at_most']:.2f}x ahead of HF's best."]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profiles.ladder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="reviews,debates,hamlet",
                        help="comma-separated: reviews, debates, hamlet")
    parser.add_argument("--rungs", default=",".join(RUNGS), help="comma-separated ladder rungs (RUNGS)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results path, without suffix (.json and .md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        request = json.loads(args.worker)
        print(json.dumps(profiled_rung(request["rung"], request["plan"], request["output_dir"])))
        return 0
    results = measure(args.datasets.split(","), args.rungs.split(","), lambda text: print(text, file=sys.stderr))
    write_results(args.out, results, markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
