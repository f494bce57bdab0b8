"""Where a resumed run picks up (`DataStage.resume_point`): whole epochs done, micro-batches of the current epoch to
skip, and the batch the interrupted run had read ahead. Four cases, one function each:

| the checkpoint                                    | the case                 | where the run picks up               |
|---------------------------------------------------|--------------------------|--------------------------------------|
| none (a fresh run)                                | -                        | None                                 |
| any, with `ignore_data_skip`                      | `resume_at_epoch_start`  | the start of the current epoch       |
| HF's (no data position stored)                    | `resume_from_global_step`| derived from `global_step`, as HF    |
| loopkit's (a position in samples, maybe a batch)  | `resume_from_position`   | after the samples trained            |

loopkit checkpoints store the position in global samples, so a run resumes on another number of processes or with
another batch size (back to the last whole micro-batch, with a warning, when the samples are not a whole number of
them; the batch read ahead is then read again: same samples, other random draws).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from ..data_order import batch_from_state
from .data_plan import TrainingPlan


@dataclass
class ResumePoint:
    checkpoint: str
    epochs_trained: int
    micro_batches_to_skip: int
    dataset_state: dict | None = None  # an iterable dataset's own position (the seek protocol)
    rng: dict | None = None  # the RNG states to continue from (the checkpoint's, or later: see EvalStage)
    read_ahead: object = None  # the batch the interrupted run had read ahead (handed out first), if stored


def resume_at_epoch_start(checkpoint: str, global_step: int, plan: TrainingPlan, rng) -> ResumePoint:
    """`ignore_data_skip`: the epochs done, and the current one from its first batch (as HF)."""
    return ResumePoint(checkpoint, global_step // plan.num_update_steps_per_epoch, 0, rng=rng)


def resume_from_global_step(checkpoint: str, global_step: int, plan: TrainingPlan, accumulation: int,
                            rng) -> ResumePoint:
    """An HF checkpoint has no data position: the epoch and the micro-batches follow from `global_step`, as HF."""
    updates = plan.num_update_steps_per_epoch
    return ResumePoint(checkpoint, global_step // updates, (global_step % updates) * accumulation, rng=rng)


def resume_from_position(checkpoint: str, saved: dict, plan: TrainingPlan, samples_per_micro_batch: int,
                         processes: int, epochs_end: bool, rng) -> ResumePoint:
    """A loopkit checkpoint: `saved` is the data stage's stored state (its `position`, and the batch read ahead).
    `epochs_end`: the loader has a length, so a position at the epoch's end is the next epoch's start."""
    position = saved["position"]
    epoch, skip = position["epoch"], whole_micro_batches(position, samples_per_micro_batch)
    if plan.steps_in_epoch and skip >= plan.steps_in_epoch and epochs_end:
        epoch, skip = epoch + 1, 0  # the checkpoint closed its epoch
    stored = saved.get("read_ahead")
    # The stored batch is the next one only at the same number of processes and the same micro-batch size.
    same_batches = stored is not None and stored["processes"] == processes and position.get("micro_batches") == skip
    read_ahead = batch_from_state(stored["batch"]) if same_batches and skip else None
    return ResumePoint(checkpoint, epoch, skip, position.get("dataset_state"), rng, read_ahead)


def whole_micro_batches(position: dict, samples_per_micro_batch: int) -> int:
    """The micro-batches of this run the stored samples make, rounded down (with a warning when that re-trains some)."""
    samples = position["samples"]
    skip = samples // samples_per_micro_batch
    if samples % samples_per_micro_batch:  # another batch size: back to the last whole micro-batch
        warnings.warn(f"The checkpoint stopped after {samples} samples of epoch {position['epoch']}, not a whole "
                      f"number of this run's micro-batches of {samples_per_micro_batch} samples: resuming after "
                      f"{skip * samples_per_micro_batch} samples, so {samples - skip * samples_per_micro_batch} of "
                      f"them are trained on again.")
    return skip
