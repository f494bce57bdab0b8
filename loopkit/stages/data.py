"""Stage 2, data: dataloaders, collation, column removal, step and epoch arithmetic, and the epoch's batch order.

Contract:
* `get_train_dataloader()`, `get_eval_dataloader(eval_dataset=None)`, `get_test_dataloader(test_dataset)` build
  Accelerate-prepared loaders exactly as HF Trainer does: a `RandomSampler` that Accelerate turns into its seedable
  sampler, so epoch `e` visits `torch.randperm(n, generator=manual_seed(seed + e))` (`data_seed` if set).
* `plan(train_dataloader)` does the step and epoch arithmetic (`TrainingPlan`, HF's formulas).
* `windows(epoch, plan, resume)` yields one `Window` of micro-batches per optimizer step of the epoch, skipping the
  micro-batches a resumed run already trained without collating them.
"""

from __future__ import annotations

import inspect
import math
import random
import sys
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from ..args import config_error
from .base import Stage


def has_length(dataset) -> bool:
    try:
        return len(dataset) is not None
    except (TypeError, NotImplementedError, AttributeError):
        return False


def seed_worker(worker_id: int, num_workers: int, rank: int) -> None:
    """HF's worker seeding: each worker seeds python, numpy and torch from the loader's base seed."""
    seed = num_workers * rank + torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def find_labels(model) -> list[str]:
    """HF's default `label_names`: the forward parameters whose name contains "label" (+ QA positions)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(type(base).forward).parameters
    if "QuestionAnswering" in type(base).__name__:
        return [p for p in params if "label" in p or p in ("start_positions", "end_positions")]
    return [p for p in params if "label" in p]


class RemoveColumnsCollator:
    """Drops the keys the model's forward does not take before the user's collator sees a feature dict."""

    def __init__(self, collator, keep: set[str]):
        self.collator, self.keep = collator, keep

    def __call__(self, features):
        features = [{k: v for k, v in f.items() if k in self.keep} if isinstance(f, dict) else f for f in features]
        return self.collator(features)


@dataclass
class TrainingPlan:
    """HF's step and epoch arithmetic for one `train()` call (facts file section 4.9)."""

    num_train_epochs: int
    num_update_steps_per_epoch: int
    num_examples: int
    num_train_samples: float
    total_train_batch_size: int
    steps_in_epoch: int  # micro-batches per epoch
    max_steps: int


@dataclass
class Window:
    """The micro-batches of one optimizer step, and the index in the epoch of the first one."""

    batches: list
    first_index: int


@dataclass
class ResumePoint:
    checkpoint: str
    epochs_trained: int
    micro_batches_to_skip: int


class DataStage(Stage):
    """Dataloaders and the order micro-batches reach the step stage."""

    def __init__(self):
        self.collator = None

    # -- collation and columns --
    def resolve_collator(self):
        loop = self.loop
        if loop.data_collator is not None:
            return loop.data_collator
        pc = loop.processing_class
        if pc is not None and callable(getattr(pc, "pad", None)) and hasattr(pc, "model_input_names"):
            from transformers.data.data_collator import DataCollatorWithPadding

            return DataCollatorWithPadding(pc)
        from transformers.data.data_collator import default_data_collator

        return default_data_collator

    def signature_columns(self) -> set[str]:
        model = self.loop.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        columns = set(inspect.signature(base.forward).parameters)
        return columns | {"label", "label_ids"} | set(self.loop.label_names)

    def with_model_columns(self, dataset, collator, description: str):
        """`remove_unused_columns`: drop what the forward does not take (columns of a `datasets.Dataset`, else
        the keys of each feature dict, before the collator)."""
        if not self.loop.args.remove_unused_columns:
            return dataset, collator
        keep = self.signature_columns()
        column_names = getattr(dataset, "column_names", None)
        if isinstance(column_names, list) and hasattr(dataset, "remove_columns"):
            unused = [c for c in column_names if c not in keep]
            if len(unused) == len(column_names):
                raise config_error("remove_unused_columns", True, f"no column of the {description} dataset "
                                   f"({', '.join(column_names)}) is an argument of the model's forward",
                                   "rename the columns to the model's inputs or set remove_unused_columns=False")
            return (dataset.remove_columns(unused) if unused else dataset), collator
        return dataset, RemoveColumnsCollator(collator, keep)

    # -- dataloaders (HF's get_*_dataloader; `Loop` exposes them under the same names) --
    def build_dataloader(self, dataset, batch_size: int, description: str, training: bool) -> DataLoader:
        loop, args = self.loop, self.loop.args
        if self.collator is None:
            self.collator = self.resolve_collator()
        dataset, collator = self.with_model_columns(dataset, self.collator, description)
        params = dict(batch_size=batch_size, collate_fn=collator, num_workers=args.dataloader_num_workers,
                      pin_memory=args.dataloader_pin_memory and loop.accelerator.device.type != "cpu",
                      persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
                      prefetch_factor=args.dataloader_prefetch_factor)
        if not isinstance(dataset, IterableDataset):
            params["sampler"] = self.train_sampler(dataset) if training else self.eval_sampler(dataset)
            params["drop_last"] = args.dataloader_drop_last
            if training:
                params["worker_init_fn"] = partial(seed_worker, num_workers=args.dataloader_num_workers,
                                                   rank=loop.accelerator.process_index)
        return loop.accelerator.prepare(DataLoader(dataset, **params))

    def train_sampler(self, dataset):
        if self.loop.args.train_sampling_strategy == "sequential":
            return SequentialSampler(dataset)
        return RandomSampler(dataset)  # Accelerate swaps in its seedable sampler: seed + epoch fixes the order

    def eval_sampler(self, dataset):
        return SequentialSampler(dataset) if self.loop.accelerator.num_processes == 1 else None

    def get_train_dataloader(self) -> DataLoader:
        loop = self.loop
        if loop.train_dataset is None:
            raise config_error("train_dataset", None, "training needs a train dataset", "pass train_dataset=...")
        return self.build_dataloader(loop.train_dataset, loop.args.per_device_train_batch_size, "training", True)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        loop = self.loop
        if eval_dataset is None and loop.eval_dataset is None:
            raise config_error("eval_dataset", None, "evaluation needs an eval dataset",
                               "pass eval_dataset=... to Loop or to evaluate()")
        if isinstance(eval_dataset, str):
            eval_dataset = loop.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = loop.eval_dataset
        return self.build_dataloader(eval_dataset, loop.args.per_device_eval_batch_size, "evaluation", False)

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self.build_dataloader(test_dataset, self.loop.args.per_device_eval_batch_size, "test", False)

    # -- step and epoch arithmetic --
    def plan(self, dataloader) -> TrainingPlan:
        args, acc = self.loop.args, self.loop.accelerator
        ga = args.gradient_accumulation_steps
        total_batch = args.per_device_train_batch_size * ga * acc.num_processes
        if has_length(dataloader):
            micro_batches = len(dataloader)
            updates_per_epoch = max(math.ceil(micro_batches / ga), 1)
            num_examples = len(dataloader.dataset) if has_length(dataloader.dataset) else \
                micro_batches * args.per_device_train_batch_size
            if args.max_steps > 0:
                max_steps = args.max_steps
                epochs = math.ceil(max_steps / updates_per_epoch)
                samples = max_steps * total_batch
            else:
                max_steps = math.ceil(args.num_train_epochs * updates_per_epoch)
                epochs = math.ceil(args.num_train_epochs)
                samples = num_examples * args.num_train_epochs
            return TrainingPlan(epochs, updates_per_epoch, num_examples, samples, total_batch, micro_batches,
                                max_steps)
        if args.max_steps <= 0:
            raise config_error("max_steps", args.max_steps, "the train dataset has no __len__, so the number of "
                               "steps cannot be derived from num_train_epochs", "set max_steps to a positive number")
        return TrainingPlan(sys.maxsize, args.max_steps, total_batch * args.max_steps, args.max_steps * total_batch,
                            total_batch, args.max_steps * ga, args.max_steps)

    def resume_point(self, checkpoint, global_step: int, plan: TrainingPlan) -> ResumePoint | None:
        """Where a resumed run picks up: whole epochs done, and micro-batches of the current epoch to skip."""
        if checkpoint is None:
            return None
        epochs_trained = global_step // plan.num_update_steps_per_epoch
        skip = 0 if self.loop.args.ignore_data_skip else \
            (global_step % plan.num_update_steps_per_epoch) * self.loop.args.gradient_accumulation_steps
        return ResumePoint(checkpoint, epochs_trained, skip)

    # -- the epoch's micro-batches, grouped by optimizer step --
    def windows(self, epoch: int, plan: TrainingPlan, resume: ResumePoint | None):
        from accelerate import skip_first_batches

        loop, ga = self.loop, self.loop.args.gradient_accumulation_steps
        loader, skip, restore_rng_after_first = loop.train_dataloader, 0, False
        if resume is not None and epoch == resume.epochs_trained:
            if resume.micro_batches_to_skip > 0:
                skip = resume.micro_batches_to_skip
                loader = skip_first_batches(loader, skip)  # skips in the sampler: nothing is read or collated
                restore_rng_after_first = True
            else:
                loop.checkpointer.load_rng(resume.checkpoint)
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
        iterator = iter(loader)
        last_window_size = plan.steps_in_epoch % ga or ga
        index = skip
        for update in range(skip // ga, plan.num_update_steps_per_epoch):
            size = ga if update != plan.num_update_steps_per_epoch - 1 else last_window_size
            batches = []
            for _ in range(size):
                try:
                    batches.append(next(iterator))
                except StopIteration:
                    break
            if not batches:
                return
            if restore_rng_after_first:
                # As HF: the RNG comes back after the first window is fetched, so the skip does not disturb it.
                loop.checkpointer.load_rng(resume.checkpoint)
                restore_rng_after_first = False
            yield Window(batches, index)
            index += len(batches)
