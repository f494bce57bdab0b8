"""Benchmark 6, a real fine-tune: the pretrained MiniLM (all-MiniLM-L6-v2) as a sentiment classifier on Rotten
Tomatoes snippets, a fixed number of steps, one run per contender. Wall time covers each contender's whole setup
and training (building the trainer, `train()`), not the common model loading; samples/s = samples trained / wall
time; accuracy is measured afterwards on held-out reviews by the same code for all three, and must be equal.
"""

from __future__ import annotations

import math

from ..contenders.names import CONTENDERS
from ..reports.verdicts import check_equal, comparison_row, merge_checks
from ..workloads.spec import TrainSpec

MODULE = "benchmarks.suite.finetune"
TITLE = "Real fine-tune: MiniLM on Rotten Tomatoes"


def plan(suite) -> tuple[TrainSpec, int]:
    # The demo's settings (examples/finetune_minilm.py): batch 16, 64 tokens, lr 5e-5, 10% warmup, decay 0.01.
    max_steps = suite.pick(full=64, quick=6, tiny=2)
    spec = TrainSpec(model="minilm", num_train=1024, seq_len=64, batch_size=16, grad_accum=1, max_steps=max_steps,
                     learning_rate=5e-5, warmup_steps=math.ceil(0.1 * max_steps), weight_decay=0.01,
                     logging_steps=suite.pick(8, 3, 1))
    if suite.size == "tiny":
        spec = spec.replace(num_train=64, seq_len=16, batch_size=4, warmup_steps=1)
    return spec, suite.pick(full=512, quick=128, tiny=16)


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def finetune(contender: str, spec: dict, num_heldout: int, output_dir: str) -> dict:
    import gc
    import time

    from ..contenders.clock import StepClock
    from ..contenders.run import train
    from ..workloads.checks import classification_accuracy
    from ..workloads.data import heldout_rows, train_dataset
    from ..workloads.models import build_model

    spec = TrainSpec.from_dict(spec)
    model = build_model(spec)  # loaded (and the data tokenized) before the clock starts
    train_dataset(spec)
    heldout = heldout_rows(spec, num_heldout)
    gc.collect()
    result = train(contender, spec, StepClock(), output_dir, model=model)
    wall = time.perf_counter() - result.started_at
    return {"wall_seconds": wall, "samples_per_second": spec.max_steps * spec.samples_per_step / wall,
            "accuracy": classification_accuracy(result.model, heldout),
            "logged_losses": result.logged_losses, "global_step": result.global_step,
            "final_logged_loss": result.logged_losses[-1] if result.logged_losses else None}


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    spec, num_heldout = plan(suite)
    replies = {}
    with suite.workers(prefix="finetune-") as workers:
        for c in CONTENDERS:
            suite.say(f"finetune: {c}, {spec.max_steps} steps of {spec.samples_per_step} reviews")
            replies[c] = workers[c].request(MODULE, "finetune", contender=c, spec=spec.to_dict(),
                                            num_heldout=num_heldout, output_dir=suite.scratch_dir(f"finetune-{c}"))
    check = merge_checks(
        check_equal({c: replies[c]["accuracy"] for c in CONTENDERS}, 0, "held-out accuracy"),
        check_equal({c: replies[c]["final_logged_loss"] for c in CONTENDERS}, 1e-4, "last logged train loss"),
        check_equal({c: replies[c]["global_step"] for c in CONTENDERS}, 0, "optimizer steps"))
    extra = {"spec": spec.to_dict(), "num_heldout": num_heldout,
             "accuracy": {c: replies[c]["accuracy"] for c in CONTENDERS},
             "samples_per_second": {c: replies[c]["samples_per_second"] for c in CONTENDERS},
             "logged_losses": {c: replies[c]["logged_losses"] for c in CONTENDERS}}
    rows = [comparison_row(f"{spec.max_steps} steps x {spec.samples_per_step} reviews, wall time", "s",
                           {c: [replies[c]["wall_seconds"]] for c in CONTENDERS}, check, extra, floor="raw")]
    return {"title": TITLE, "rows": rows}


def markdown(section: dict) -> str:
    from ..reports.tables import comparison_table, fmt

    row = section["rows"][0]
    extra = row["extra"]
    mismatched = row["check"]["mismatched"]
    lines = [comparison_table(section["rows"]), "",
             "| | " + " | ".join(CONTENDERS) + " |", "|---|" + "---|" * len(CONTENDERS),
             "| samples/s | " + " | ".join("MISMATCH" if c in mismatched else fmt(extra["samples_per_second"][c])
                                          for c in CONTENDERS) + " |",
             f"| accuracy on {extra['num_heldout']} held-out reviews | " +
             " | ".join(fmt(extra["accuracy"][c], 4) for c in CONTENDERS) + " |"]
    return "\n".join(lines)
