"""Stage 2, data: the training plan, the resume point, and one accumulation window of micro-batches at a time.

Contract:
* `get_train_dataloader()`, `get_eval_dataloader(eval_dataset=None)`, `get_test_dataloader(test_dataset)` build
  Accelerate-prepared loaders exactly as HF Trainer does: a `RandomSampler` that Accelerate turns into its seedable
  sampler, so epoch `e` visits `torch.randperm(n, generator=manual_seed(seed + e))` (`data_seed` if set); with
  `train_sampling_strategy="group_by_length"` HF's length-grouped order (`LengthGroupedOrder`, loopkit/data_order.py).
* `plan(train_dataloader)` does the step and epoch arithmetic (`TrainingPlan`, HF's formulas).
* `resume_point(checkpoint, global_step, plan)` says where a resumed run picks up (a `ResumePoint`).
* `windows(epoch, plan, resume)` yields one `Window` of micro-batches per optimizer step of the epoch from
  `run.train_dataloader`, read in HF Trainer's order (the whole window before its first forward, and one batch
  ahead: loopkit/data_order.py), skipping the micro-batches a resumed run already trained without collating them,
  with Accelerate's record of the loader being read kept as under Trainer.
* `state_dict()` is the data position (epoch, micro-batches, samples; an iterable dataset's own state), the batch
  read ahead (its tensors, which the checkpoint writes to safetensors, and its structure), and the state of a
  collator's own seeded generator.
* Errors at the cause, before the first batch, and `remove_unused_columns`: loopkit/columns.py (the columns
  against the model's forward and the collator; a padding collator without pad token; an unlabelled eval dataset
  while `metric_for_best_model` needs labels, at construction).

`DataStage` is this file; each of its other jobs is a file of its own, which it inherits or calls:

| file | its job |
|---|---|
| `data_loaders.py` | `DataLoaders`: collator, columns, samplers, workers, the prepared loaders, their shutdown |
| `data_plan.py` | `TrainingPlan` and `training_plan`: steps per epoch, `max_steps`, epochs, samples |
| `data_resume.py` | `ResumePoint` and its four cases: fresh, `ignore_data_skip`, an HF checkpoint, a loopkit one |
| `data_reading.py` | `EpochReading`: the epoch's `ReadAhead`, positioned for a resumed epoch (skipping, the RNG) |
| `data_end_of_loader.py` | `EndOfLoaderTracking`: Accelerate's record of the loader being read (`end_of_dataloader`) |

Reads `run.args`, `run.model`, `run.label_names`, `run.train_dataset`, `run.eval_dataset`, `run.data_collator`,
`run.processing_class`, `run.train_dataloader`; uses `context.accelerator`, `context.clock`, `context.checkpointer`;
writes no run-state field. Owns HF's overridable `get_train_dataloader`, `get_eval_dataloader`, `get_test_dataloader`,
`get_resumed_dataloader`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.utils.data import IterableDataset

from ..batches import has_length
from ..data_order import (ReadAhead, batch_state, collator_generators, generator_state, is_seekable,
                          set_generator_state)
from ..errors import config_error
from ..private_api import close_worker_queues, non_blocking_copies
from .base import Stage
from .data_end_of_loader import EndOfLoaderTracking
from .data_loaders import DataLoaders
from .data_plan import TrainingPlan, training_plan
from .data_reading import EpochReading, set_epoch
from .data_resume import ResumePoint, resume_at_epoch_start, resume_from_global_step, resume_from_position

# Importable from here as before the split (docs/stages.md: `from loopkit.stages.data import TrainingPlan, ...`).
__all__ = ["DataStage", "TrainingPlan", "Window", "ResumePoint", "set_epoch", "close_worker_queues"]


@dataclass
class Window:
    """The micro-batches of one optimizer step, and the index in the epoch of the first one."""

    batches: list
    first_index: int


class DataStage(DataLoaders, EpochReading, EndOfLoaderTracking, Stage):
    """Dataloaders and the order micro-batches reach the step stage.

    `compile_pad_to_multiple_of`: with `torch_compile`, HF's padding collators (those with a `pad_to_multiple_of`
    the user left unset) pad each batch to a multiple of this many tokens, so a run meets few distinct sequence
    lengths. None (the default: on a CPU it measured slower, docs/performance.md, "Compile") pads as the collator
    does.
    """

    def __init__(self, compile_pad_to_multiple_of: int | None = None):
        if compile_pad_to_multiple_of is not None and (not isinstance(compile_pad_to_multiple_of, int) or
                                                       compile_pad_to_multiple_of < 1):
            raise config_error("compile_pad_to_multiple_of", compile_pad_to_multiple_of, "batches are padded to a "
                               "whole, positive number of tokens", "pass e.g. 64, or None to pad as the collator "
                               "does")
        self.compile_pad_to_multiple_of = compile_pad_to_multiple_of
        self.collator = None
        self.train_source = None  # the dataset the train loader reads (after column removal)
        self.worker_seeding = None
        self.epoch, self.micro_batches_done = 0, 0
        self.reader = None  # the epoch's `ReadAhead`: its pending batch goes into checkpoints
        self.saved = None  # the state read from a checkpoint, until the resumed run reads its first window
        self.generators_after_read = None  # a seeded collator's generator state after the last window was read
        self.unstorable_batch_warned = False
        self.eval_loaders = {}  # kept only with persistent workers
        self.length_order = None  # the group_by_length sampler (LengthGroupedOrder), whose draw a resume replays
        self.saved_order_rng = None
        self.tracked_loader = None  # the train loader Accelerate's GradientState holds as active (track_end_of_loader)

    # -- step and epoch arithmetic (data_plan.py) and the resume point (data_resume.py) --
    def plan(self, dataloader) -> TrainingPlan:
        return training_plan(dataloader, self.run.args, self.train_batch_size(), self.context.accelerator.num_processes)

    def resume_point(self, checkpoint, global_step: int, plan: TrainingPlan) -> ResumePoint | None:
        """Where a resumed run picks up (None for a fresh run): one of the cases of loopkit/stages/data_resume.py."""
        if checkpoint is None:
            return None
        args, rng = self.run.args, self.context.checkpointer.read_rng(checkpoint)
        if args.ignore_data_skip:
            return resume_at_epoch_start(checkpoint, global_step, plan, rng)
        if (self.saved or {}).get("position") is None:  # an HF checkpoint: no data position stored
            return resume_from_global_step(checkpoint, global_step, plan, args.gradient_accumulation_steps, rng)
        processes = self.context.accelerator.num_processes
        return resume_from_position(checkpoint, self.saved, plan, self.train_batch_size() * processes, processes,
                                    has_length(self.run.train_dataloader), rng)

    # -- the epoch's micro-batches, grouped by optimizer step --
    def windows(self, epoch: int, plan: TrainingPlan, resume: ResumePoint | None):
        """Yield one `Window` per optimizer step, read in Trainer's order: a window's micro-batches before its first
        forward, and one batch ahead (`ReadAhead`). See `loopkit/data_order.py` for why, and for when the RNG of a
        resumed run is restored."""
        from accelerate.utils import send_to_device

        context, ga = self.context, self.run.args.gradient_accumulation_steps
        resuming = resume is not None and epoch == resume.epochs_trained
        skip = resume.micro_batches_to_skip if resuming else 0
        self.saved = None  # from here on the state is the live one
        reader, loader = self.epoch_iterator(epoch, skip, resume if resuming else None)
        self.reader = reader
        tracked = self.track_end_of_loader(loader, reader)
        generators = self.seeded_collators()
        device, non_blocking = context.accelerator.device, non_blocking_copies(loader)
        # On a CPU the collated tensors are already where training runs: Accelerate's recursive copy (a new
        # mapping, a `.to` per tensor) would change nothing but cost microseconds at every micro-batch.
        move = None if device.type == "cpu" else send_to_device
        last_window_size = plan.steps_in_epoch % ga or ga
        self.epoch, self.micro_batches_done = epoch, skip
        for update in range(skip // ga, plan.num_update_steps_per_epoch):
            size = ga if update != plan.num_update_steps_per_epoch - 1 else last_window_size
            batches = []
            with context.clock.span("data"):
                for _ in range(size):
                    try:
                        batch = next(reader)
                        batches.append(batch if move is None else move(batch, device, non_blocking=non_blocking))
                    except StopIteration:
                        break
            if not batches:
                return
            if tracked is not None and reader.ahead is ReadAhead.END:  # the epoch's last batch: data_end_of_loader.py
                tracked.end_of_dataloader = True
            if generators:  # what a checkpoint holds if an evaluation after this step is interrupted
                self.generators_after_read = [generator_state(owner) for owner in generators]
            first = self.micro_batches_done
            self.micro_batches_done += len(batches)  # counted before the step: a checkpoint after it includes them
            yield Window(batches, first)

    def yielded_nothing(self, windows: int, epoch: int, resume: ResumePoint | None) -> bool:
        """True, with a warning, when an epoch that was due batches yielded none (not one resumed at its end): an
        IterableDataset shorter than max_steps ends training there."""
        resumed_here = resume is not None and epoch == resume.epochs_trained and resume.micro_batches_to_skip
        if windows or resumed_here:
            return False
        state = self.run.state
        warnings.warn(f"Epoch {epoch} yielded no batch: stopping at step {state.global_step}. An IterableDataset "
                      f"shorter than max_steps={state.max_steps} ends training here.")
        return True

    def on_train_end(self, args, state, control, **kwargs):
        self.release_train_loader()

    def on_train_failed(self, args, state, control, **kwargs):
        self.release_train_loader()

    def seeded_collators(self) -> list:
        """The run's collators with a seeded generator of their own, when it draws in this process (no workers)."""
        return collator_generators(self.collator) if self.run.args.dataloader_num_workers == 0 else []

    # -- checkpointed state: the data position, the batch read ahead, a collator's generator --
    def state_dict(self) -> dict:
        if self.saved is not None:  # resumed, no window read yet (a pending evaluation's save): as it was loaded
            state = {key: value for key, value in self.saved.items() if key != "collator_generators"}
        else:
            state = self.position_state()
        generators = self.seeded_collators()
        if generators:
            # A checkpoint taken for an interrupted evaluation holds the RNG from before it (see Schedule), so the
            # generator from then too: after the last window was read.
            before_evaluation = self.context.checkpointer.rng_for_next_save is not None and \
                self.generators_after_read is not None
            state["collator_generators"] = self.generators_after_read if before_evaluation else \
                [generator_state(owner) for owner in generators]
        return state

    def position_state(self) -> dict:
        run, context = self.run, self.context
        samples = self.micro_batches_done * self.train_batch_size() * context.accelerator.num_processes
        position = {"epoch": self.epoch, "micro_batches": self.micro_batches_done, "samples": samples}
        if isinstance(self.train_source, IterableDataset) and is_seekable(self.train_source) and \
                run.args.dataloader_num_workers == 0:
            position["dataset_state"] = self.train_source.state_dict()  # after the batch read ahead
        state = {"position": position}
        pending = self.reader.pending if self.reader is not None else None
        if pending is not None:
            stored = batch_state(pending)
            if stored is not None:
                state["read_ahead"] = {"processes": context.accelerator.num_processes, "batch": stored}
            elif not self.unstorable_batch_warned:
                self.unstorable_batch_warned = True
                warnings.warn(f"The batch read ahead ({type(pending).__name__}) holds values a checkpoint cannot "
                              f"store without pickling (tensors, numpy arrays, dicts, lists, tuples, str, int, "
                              f"float, bool and None can be stored): a run resumed from this checkpoint reads it "
                              f"again: the same samples, but random draws made while collating it differ from the "
                              f"uninterrupted run. Return those types from the collator for an exact resume.")
        if self.length_order is not None and self.length_order.drawn_from is not None:
            state["length_order_rng"] = self.length_order.drawn_from
        return state

    def load_state_dict(self, state: dict) -> None:
        self.saved = state or None
        self.reader, self.generators_after_read = None, None
        self.saved_order_rng = state.get("length_order_rng")
        saved_generators = state.get("collator_generators")
        owners = self.seeded_collators()
        if saved_generators is not None and len(saved_generators) == len(owners):
            for owner, generator in zip(owners, saved_generators):
                set_generator_state(owner, generator)
            self.generators_after_read = saved_generators
