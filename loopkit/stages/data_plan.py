"""The data stage's step arithmetic: steps per epoch, `max_steps`, epochs and samples, with HF's formulas
(`Trainer.set_initial_training_values`). `DataStage.plan(loader)` returns `training_plan(...)`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from ..batches import has_length
from ..errors import config_error


@dataclass
class TrainingPlan:
    """HF's step and epoch arithmetic for one `train()` call (as `Trainer.set_initial_training_values`)."""

    num_train_epochs: int
    num_update_steps_per_epoch: int
    num_examples: int
    num_train_samples: float
    total_train_batch_size: int
    steps_in_epoch: int  # micro-batches per epoch
    max_steps: int


def training_plan(dataloader, args, batch_size: int, num_processes: int) -> TrainingPlan:
    """The plan for a train loader of per-device batches of `batch_size` on `num_processes` processes: from its
    length where it has one, else from `max_steps` (which must then be set)."""
    total_batch = batch_size * args.gradient_accumulation_steps * num_processes
    if has_length(dataloader):
        return plan_from_length(dataloader, args, batch_size, total_batch)
    if args.max_steps <= 0:
        raise config_error("max_steps", args.max_steps, "the train dataset has no __len__, so the number of "
                           "steps cannot be derived from num_train_epochs", "set max_steps to a positive number")
    ga = args.gradient_accumulation_steps
    return TrainingPlan(sys.maxsize, args.max_steps, total_batch * args.max_steps, args.max_steps * total_batch,
                        total_batch, args.max_steps * ga, args.max_steps)


def plan_from_length(dataloader, args, batch_size: int, total_batch: int) -> TrainingPlan:
    """A loader with a length: `max_steps` when set (the epochs follow), else `num_train_epochs` (the steps follow)."""
    micro_batches = len(dataloader)
    updates_per_epoch = max(math.ceil(micro_batches / args.gradient_accumulation_steps), 1)
    dataset = getattr(dataloader, "dataset", None)  # a custom loader may have none (HF: an estimate)
    num_examples = len(dataset) if has_length(dataset) else micro_batches * batch_size
    if args.max_steps > 0:
        max_steps = args.max_steps
        epochs = math.ceil(max_steps / updates_per_epoch)
        samples = max_steps * total_batch
    else:
        max_steps = math.ceil(args.num_train_epochs * updates_per_epoch)
        epochs = math.ceil(args.num_train_epochs)
        samples = num_examples * args.num_train_epochs
    return TrainingPlan(epochs, updates_per_epoch, num_examples, samples, total_batch, micro_batches, max_steps)
