"""Benchmark 2, time to first step: from process start to the end of the first optimizer step, in a fresh process
per measurement, split into interpreter start, imports, model construction, the contender's setup (trainer, data
loader, optimizer) and the step itself. The import phase, timed at the very start of that fresh process, is the
import cost alone: torch, then the transformers model class (every contender needs it), then the framework.
"""

from __future__ import annotations

import time

from ..contenders.names import CONTENDERS
from ..reports.verdicts import check_runs, comparison_row, median, merge_checks
from ..workloads.spec import TrainSpec

MODULE = "benchmarks.suite.startup"
TITLE = "Time to first step and import cost"
PHASES = ("interpreter", "import torch", "import model library", "import framework", "build model",
          "setup until step 1", "step 1")


def spec_for(suite) -> TrainSpec:
    spec = TrainSpec(model="llama-tiny", num_train=512, seq_len=64, batch_size=8, grad_accum=2, max_steps=100,
                     warmup_steps=5, logging_steps=10)
    if suite.size == "tiny":
        spec = spec.replace(seq_len=16, model_overrides=dict(hidden_size=16, intermediate_size=32, vocab_size=64))
    return spec


# ---------------------------------------------------------------------------------------------------------------------
# Worker side (a fresh process: nothing but the standard library is imported before this runs)
# ---------------------------------------------------------------------------------------------------------------------
def first_step(contender: str, spec: dict, output_dir: str, spawned_at: float) -> dict:
    marks = {"task start": time.time()}
    import torch  # noqa: F401

    marks["torch"] = time.time()
    from transformers import LlamaForCausalLM  # noqa: F401  (the model class: every contender pays this)

    marks["model library"] = time.time()
    if contender == "hf":
        from transformers import Trainer, TrainingArguments  # noqa: F401
    elif contender == "loopkit":
        from loopkit import Loop, LoopArgs  # noqa: F401
    marks["framework"] = time.time()

    from ..contenders.clock import StepClock
    from ..contenders.run import train
    from ..workloads.checks import probe_loss
    from ..workloads.data import heldout_rows
    from ..workloads.models import build_model

    spec = TrainSpec.from_dict(spec)
    model = build_model(spec)
    marks["model"] = time.time()
    clock = StepClock(stop_at=1)
    result = train(contender, spec, clock, output_dir, model=model)
    wall_offset = clock.first_end_wall - clock.ends[0]  # perf_counter -> time.time()
    marks["step 1 begins"] = clock.begins[0] + wall_offset
    marks["step 1 ends"] = clock.first_end_wall
    times = [spawned_at, marks["task start"], marks["torch"], marks["model library"], marks["framework"],
             marks["model"], marks["step 1 begins"], marks["step 1 ends"]]
    return {
        "to_first_step": marks["step 1 ends"] - spawned_at,
        "phases": dict(zip(PHASES, (b - a for a, b in zip(times, times[1:])))),
        "global_step": result.global_step,
        "probe_loss": probe_loss(result.model, heldout_rows(spec, 32)),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    spec = spec_for(suite)
    warmup_rounds, measured_rounds = suite.pick(full=1, quick=0, tiny=0), suite.pick(full=5, quick=2, tiny=1)
    suite.say(f"startup: a fresh process per run, {warmup_rounds}+{measured_rounds} rounds")
    replies = {c: [] for c in CONTENDERS}
    for _, is_warmup in suite.rounds(warmup_rounds, measured_rounds):
        for contender in CONTENDERS:
            reply = suite.fresh(f"startup-{contender}", MODULE, "first_step", contender=contender,
                                spec=spec.to_dict(), output_dir=suite.scratch_dir(f"startup-{contender}"))
            if not is_warmup:
                replies[contender].append(reply)
    check = merge_checks(*check_runs(replies, "probe_loss", 1e-5, "probe loss after step 1"),
                         *check_runs(replies, "global_step", 0, "optimizer steps"))
    phases = {c: {p: [r["phases"][p] for r in replies[c]] for p in PHASES} for c in CONTENDERS}
    imports = {c: [sum(r["phases"][p] for p in PHASES[1:4]) for r in replies[c]] for c in CONTENDERS}
    framework = {c: [r["phases"]["import framework"] * 1e3 for r in replies[c]] for c in ("hf", "loopkit")}
    # What the contender itself adds: the common imports (torch, transformers' model class) and the model are left
    # out, so the noise of a 7-second import shared by all three does not drown the difference.
    own = {c: [sum(r["phases"][p] for p in ("import framework", "setup until step 1", "step 1"))
               for r in replies[c]] for c in CONTENDERS}
    # Setup in a fresh process: from the built model to the end of step 1: building the trainer (loopkit imports
    # Accelerate here, HF Trainer at its own import), the loader, the optimizer, and the first step. The same with
    # imports done is a row of the per-step benchmark.
    setup = {c: [r["phases"]["setup until step 1"] + r["phases"]["step 1"] for r in replies[c]] for c in CONTENDERS}
    rows = [
        comparison_row("setup in a fresh process: built model to end of step 1 (loopkit imports Accelerate here)",
                       "s", setup, check, floor="raw"),
        comparison_row("process start to end of step 1", "s",
                       {c: [r["to_first_step"] for r in replies[c]] for c in CONTENDERS}, check,
                       {"spec": spec.to_dict(), "phases": phases}, floor="raw"),
        comparison_row("the contender's own part: framework import + setup + step 1", "s", own, check, floor="raw"),
        comparison_row("imports: torch + model class + framework", "s", imports, check),
        comparison_row("framework import alone (after torch and the model class)", "ms", framework, check),
    ]
    return {"title": TITLE, "rows": rows}


def markdown(section: dict) -> str:
    from ..reports.tables import comparison_table, fmt

    lines = [comparison_table(section["rows"]),
             "\nloopkit imports Accelerate when a `Loop` is built (so it counts in its setup), HF Trainer when it is "
             "imported. Median seconds per phase (a fresh process each run):\n",
             "| phase | " + " | ".join(CONTENDERS) + " |", "|---|" + "---|" * len(CONTENDERS)]
    phases = next(row for row in section["rows"] if "phases" in row["extra"])["extra"]["phases"]
    for phase in PHASES:
        lines.append(f"| {phase} | " + " | ".join(fmt(median(phases[c][phase])) for c in CONTENDERS) + " |")
    return "\n".join(lines)
