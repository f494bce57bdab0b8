"""Benchmark 4, resume latency: the time from `train(resume_from_checkpoint=...)` to the end of the first new
optimizer step, resuming at a point near the start and one far into the epoch, loopkit vs HF Trainer, with
* map-style data: both skip indices in the sampler, nothing is read;
* an iterable stream: what was trained must be read again and thrown away;
* an iterable stream with `state_dict()`/`load_state_dict()` (as `datasets.IterableDataset` has): a loop that uses
  them can start reading at the saved position.

For each kind of data, each contender trains the near-null model once and saves checkpoints at both points (its own
checkpoints, in HF's layout); every resume starts from them. The model is near-null, so the latency is the
framework's resume work (loading the checkpoint, positioning the data) rather than compute. The check: after its
first new step, loopkit's model equals HF's.
"""

from __future__ import annotations

from ..reports.verdicts import check_runs, comparison_row, merge_checks
from ..workloads.spec import TrainSpec

MODULE = "benchmarks.suite.resume"
TITLE = "Resume latency"
CONTENDERS = ("hf", "loopkit")  # the hand-written loop does not resume
DATA_KINDS = ("map", "iterable", "iterable-seekable")


def plan(suite) -> tuple[TrainSpec, list[int]]:
    far = suite.pick(full=2000, quick=400, tiny=6)
    points = [10, far] if suite.size != "tiny" else [far]  # tiny: one point keeps the smoke test short
    # One epoch is longer than the run, so both points are mid-epoch: the data must be positioned, not restarted.
    spec = TrainSpec(model="null", batch_size=8, grad_accum=2, max_steps=far + 100, num_train=16 * (far + 200),
                     warmup_steps=10, logging_steps=suite.pick(100, 100, 2))
    return spec, points


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def make_checkpoints(contender: str, spec: dict, points: list, output_dir: str) -> dict:
    from ..contenders.clock import StepClock
    from ..contenders.run import train

    spec = TrainSpec.from_dict(spec)
    result = train(contender, spec, StepClock(save_at=points, stop_at=max(points)), output_dir)
    return {"checkpoints": {str(p): f"{output_dir}/checkpoint-{p}" for p in points},
            "global_step": result.global_step, "train_seconds": result.train_seconds}


def resume_once(contender: str, spec: dict, checkpoint: str, resumed_step: int, output_dir: str) -> dict:
    import gc

    from ..contenders.clock import StepClock
    from ..contenders.run import train
    from ..workloads.checks import probe_loss
    from ..workloads.data import heldout_rows

    spec = TrainSpec.from_dict(spec)
    clock = StepClock(stop_at=resumed_step + 1)
    gc.collect()
    result = train(contender, spec, clock, output_dir, resume_from=checkpoint)
    return {"latency": clock.ends[0] - result.train_called_at, "global_step": result.global_step,
            "probe_loss": probe_loss(result.model, heldout_rows(spec, 32))}


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    spec, points = plan(suite)
    warmup_rounds, measured_rounds = suite.pick(full=1, quick=0, tiny=0), suite.pick(full=4, quick=2, tiny=1)
    rows, checkpointing_seconds = [], {}
    with suite.workers(CONTENDERS, prefix="resume-") as workers:
        for kind in DATA_KINDS:
            suite.say(f"resume: {kind} data, training to step {max(points)} with checkpoints at {points}")
            checkpoints = {c: workers[c].request(MODULE, "make_checkpoints", contender=c,
                                                 spec=spec.replace(data=kind).to_dict(), points=points,
                                                 output_dir=suite.scratch_dir(f"resume-{c}-{kind}"))
                           for c in CONTENDERS}
            checkpointing_seconds[kind] = {c: checkpoints[c]["train_seconds"] for c in CONTENDERS}
            for point in points:
                suite.say(f"resume: {kind} data at step {point}, {warmup_rounds}+{measured_rounds} rounds")
                replies = {c: [] for c in CONTENDERS}
                for _, is_warmup in suite.rounds(warmup_rounds, measured_rounds):
                    for c in CONTENDERS:
                        reply = workers[c].request(MODULE, "resume_once", contender=c,
                                                   spec=spec.replace(data=kind).to_dict(),
                                                   checkpoint=checkpoints[c]["checkpoints"][str(point)],
                                                   resumed_step=point, output_dir=suite.scratch_dir(f"resumed-{c}"))
                        if not is_warmup:
                            replies[c].append(reply)
                check = merge_checks(*check_runs(replies, "probe_loss", 1e-5, "probe loss after the resumed step"),
                                     *check_runs(replies, "global_step", 0, "optimizer steps"))
                rows.append(comparison_row(
                    f"{kind} data, resume at step {point}", "s",
                    {c: [r["latency"] for r in replies[c]] for c in CONTENDERS}, check,
                    {"data": kind, "resume_step": point,
                     "micro_batches_skipped": point * spec.grad_accum}))
    return {"title": TITLE, "rows": rows, "spec": spec.to_dict(), "points": points,
            "checkpointing_seconds": checkpointing_seconds}


def markdown(section: dict) -> str:
    from ..reports.tables import comparison_table

    spec = section["spec"]
    return (f"Near-null model, batch {spec['batch_size']} x accumulation {spec['grad_accum']}; the far point skips "
            f"{section['points'][-1] * spec['grad_accum']:,} micro-batches. Seconds from the `train()` call to the "
            f"end of the first new step.\n\n" + comparison_table(section["rows"], CONTENDERS))
