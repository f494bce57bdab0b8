"""Stage 2, data: dataloaders, collation, column removal, step and epoch arithmetic, and the epoch's batch order.

Contract:
* `get_train_dataloader()`, `get_eval_dataloader(eval_dataset=None)`, `get_test_dataloader(test_dataset)` build
  Accelerate-prepared loaders exactly as HF Trainer does: a `RandomSampler` that Accelerate turns into its seedable
  sampler, so epoch `e` visits `torch.randperm(n, generator=manual_seed(seed + e))` (`data_seed` if set); with
  `train_sampling_strategy="group_by_length"` HF's length-grouped order (`LengthGroupedOrder`, loopkit/data_order.py).
* `plan(train_dataloader)` does the step and epoch arithmetic (`TrainingPlan`, HF's formulas).
* `resume_point(checkpoint, global_step, plan)` says where a resumed run picks up (a `ResumePoint`).
* `windows(epoch, plan, resume)` yields one `Window` of micro-batches per optimizer step of the epoch from
  `run.train_dataloader`, read in HF Trainer's order (the whole window before its first forward, and one batch
  ahead: loopkit/data_order.py), skipping the micro-batches a resumed run already trained without collating them.
  Accelerate's record of the loader being read (its `GradientState`: the active loader, `end_of_dataloader`,
  `remainder`) is kept as the prepared loader keeps it when iterated itself (`track_end_of_loader`), so
  `accelerator.gather_for_metrics` in a `compute_loss` (TRL's metrics) drops the samples Accelerate repeated to fill
  the epoch's last batch on several processes, as under Trainer.
* `state_dict()` is the data position (epoch, micro-batches, samples; an iterable dataset's own state), the batch
  read ahead (its tensors, which the checkpoint writes to safetensors, and its structure), and the state of a
  collator's own seeded generator.
* Errors at the cause, before the first batch, and `remove_unused_columns`: loopkit/columns.py (the columns
  against the model's forward and the collator; a padding collator without pad token; an unlabelled eval dataset
  while `metric_for_best_model` needs labels, at construction).

Reads `run.args`, `run.model`, `run.label_names`, `run.train_dataset`, `run.eval_dataset`, `run.data_collator`,
`run.processing_class`, `run.train_dataloader`; uses `context.accelerator`, `context.clock`, `context.checkpointer`;
writes no run-state field. Owns HF's overridable `get_train_dataloader`, `get_eval_dataloader`, `get_test_dataloader`,
`get_resumed_dataloader`.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from ..errors import config_error
from ..batches import has_length
from ..checkpoint import restore_rng_state
from ..data_order import (LengthGroupedOrder, PositionSeededDataset, ReadAhead, WorkerSeeding, batch_from_state,
                          batch_state, collator_generators, generator_state, is_seekable, sample_lengths,
                          set_generator_state)
from ..distributed import prepare_iterable_train_loader
from ..first_batch import ExplainedCollator
from ..columns import check_eval_labels, check_padding, with_model_columns
from ..row_packing import exact_flattening
from .base import Stage


def set_epoch(loader, epoch: int) -> None:
    """Tell the loader (and Accelerate's seedable sampler inside it) which epoch starts: it fixes the order."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(inner, "set_epoch"):
        inner.set_epoch(epoch)


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
    dataset_state: dict | None = None  # an iterable dataset's own position (the seek protocol)
    rng: dict | None = None  # the RNG states to continue from (the checkpoint's, or later: see EvalStage)
    read_ahead: object = None  # the batch the interrupted run had read ahead (handed out first), if stored


class DataStage(Stage):
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

    # -- collation and columns --
    def resolve_collator(self):
        run = self.run
        if run.data_collator is not None:
            return exact_flattening(run.data_collator, run.model)  # HF's flattening collator: checked, exact
        pc = run.processing_class
        if pc is not None and callable(getattr(pc, "pad", None)) and hasattr(pc, "model_input_names"):
            from transformers.data.data_collator import DataCollatorWithPadding

            return DataCollatorWithPadding(pc)
        from transformers.data.data_collator import default_data_collator

        return default_data_collator

    def for_compiling(self, collator):
        """With `torch_compile`, a copy of HF's padding collator that pads to `compile_pad_to_multiple_of` tokens:
        each new sequence length would cost a compilation (or turn the graph dynamic). Its padding is masked
        (attention mask 0, labels -100), so the loss is the unbucketed one. The user's collator is left as it is."""
        multiple = self.compile_pad_to_multiple_of
        if not self.run.args.torch_compile or multiple is None or \
                getattr(collator, "pad_to_multiple_of", 0) is not None:  # no such option, or the user's own value
            return collator
        bucketed = copy.copy(collator)
        bucketed.pad_to_multiple_of = multiple
        return bucketed

    def check_padding(self, collator) -> None:
        check_padding(collator, self.run.processing_class)

    def check_eval_labels(self) -> None:
        """At construction: an eval dataset without labels while `metric_for_best_model` needs them
        (loopkit/columns.py)."""
        run = self.run
        check_eval_labels(run.args, run.eval_dataset, run.label_names, run.data_collator)

    def with_model_columns(self, dataset, collator, description: str):
        """`remove_unused_columns` (loopkit/columns.py)."""
        run = self.run
        if not run.args.remove_unused_columns:
            return dataset, collator
        return with_model_columns(dataset, collator, description, run.model, run.label_names,
                                  run.signature_columns)

    # -- dataloaders (HF's get_*_dataloader; `Loop` exposes them under the same names) --
    def build_dataloader(self, dataset, batch_size: int, description: str, training: bool,
                         collator=None) -> DataLoader:
        """An Accelerate-prepared loader over `dataset`, collated by `collator` (default: the run's collator, or
        HF's default for the processing class)."""
        context, args = self.context, self.run.args
        if collator is None:
            if self.collator is None:
                self.collator = self.for_compiling(self.resolve_collator())
                self.check_padding(self.collator)
            collator = self.collator
        dataset, collator = self.with_model_columns(dataset, collator, description)
        # ExplainedCollator: a collator that cannot stack uneven examples is named, with the fix (first_batch.py)
        params = dict(batch_size=batch_size, collate_fn=ExplainedCollator(collator),
                      num_workers=args.dataloader_num_workers,
                      pin_memory=args.dataloader_pin_memory and context.accelerator.device.type != "cpu",
                      persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
                      prefetch_factor=args.dataloader_prefetch_factor, in_order=args.dataloader_in_order)
        if args.dataloader_multiprocessing_context is not None:
            if args.dataloader_num_workers == 0:
                raise config_error("dataloader_multiprocessing_context", args.dataloader_multiprocessing_context,
                                   "it is how worker processes start, and dataloader_num_workers=0",
                                   "set dataloader_num_workers > 0 or leave it None")
            params["multiprocessing_context"] = args.dataloader_multiprocessing_context
        if training:
            self.train_source = dataset
            if args.dataloader_num_workers > 0:
                self.worker_seeding = WorkerSeeding(args.seed, context.accelerator.process_index)
                params["worker_init_fn"] = self.worker_seeding
                if not isinstance(dataset, IterableDataset):
                    dataset = PositionSeededDataset(dataset, args.seed, context.accelerator.process_index)
        if not isinstance(dataset, IterableDataset):
            params["sampler"] = self.train_sampler(dataset) if training else self.eval_sampler(dataset)
            params["drop_last"] = args.dataloader_drop_last
        elif training and context.accelerator.num_processes > 1:  # sharded without dispatching: see distributed.py
            return prepare_iterable_train_loader(context.accelerator, DataLoader(dataset, **params))
        return context.accelerator.prepare(DataLoader(dataset, **params))

    def train_sampler(self, dataset):
        args = self.run.args
        self.length_order = None
        if args.train_sampling_strategy == "sequential":
            return SequentialSampler(dataset)
        if args.train_sampling_strategy == "group_by_length":  # megabatches of batch x accumulation, as Trainer
            lengths = sample_lengths(dataset, args, self.run.processing_class)
            self.length_order = LengthGroupedOrder(lengths, args.per_device_train_batch_size *
                                                   args.gradient_accumulation_steps)
            return self.length_order
        return RandomSampler(dataset)  # Accelerate swaps in its seedable sampler: seed + epoch fixes the order

    def eval_sampler(self, dataset):
        args = self.run.args
        if args.train_sampling_strategy == "group_by_length":  # Trainer groups evaluation batches too, seeded
            from transformers.trainer_pt_utils import LengthGroupedSampler

            seed = args.data_seed if args.data_seed is not None else args.seed
            return LengthGroupedSampler(args.per_device_eval_batch_size, lengths=sample_lengths(
                dataset, args, self.run.processing_class), generator=torch.Generator().manual_seed(seed))
        return SequentialSampler(dataset) if self.context.accelerator.num_processes == 1 else None

    def get_train_dataloader(self) -> DataLoader:
        run = self.run
        if run.train_dataset is None:
            raise config_error("train_dataset", None, "training needs a train dataset", "pass train_dataset=...")
        return self.build_dataloader(run.train_dataset, self.train_batch_size(), "training", True)

    def train_batch_size(self) -> int:
        """The per-device train batch of this `train()` (`auto_find_batch_size` may have lowered it)."""
        return self.run.train_batch_size or self.run.args.per_device_train_batch_size

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        run = self.run
        if eval_dataset is None and run.eval_dataset is None:
            raise config_error("eval_dataset", None, "evaluation needs an eval dataset",
                               "pass eval_dataset=... to Loop or to evaluate()")
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        if isinstance(eval_dataset, str):
            eval_dataset = run.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = run.eval_dataset
        cached = self.eval_loaders.get(key)
        # As HF (keyed by the dataset's name): reuse, instead of starting new workers at every evaluation. HF also
        # returns it for another dataset passed in; loopkit only for the one it reads (docs/differences.md).
        if cached is not None and cached[0] is eval_dataset:
            return cached[1]
        loader = self.build_dataloader(eval_dataset, run.args.per_device_eval_batch_size, "evaluation", False)
        if run.args.dataloader_persistent_workers:
            self.eval_loaders[key] = (eval_dataset, loader)
        return loader

    def shut_down_workers(self) -> None:
        """Stop the persistent worker processes of the train and evaluation loaders (the teardown's release)."""
        for loader in [self.run.train_dataloader, *(loader for _, loader in self.eval_loaders.values())]:
            base = getattr(loader, "base_dataloader", loader)
            iterator = getattr(base, "_iterator", None)  # set only with persistent_workers
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
                close_worker_queues(iterator)
                base._iterator = None
        self.eval_loaders = {}
        self.reader = None  # the batch read ahead (workers' shared memory) and the epoch's iterator go with it

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self.build_dataloader(test_dataset, self.run.args.per_device_eval_batch_size, "test", False)

    # -- step and epoch arithmetic --
    def plan(self, dataloader) -> TrainingPlan:
        args, acc = self.run.args, self.context.accelerator
        ga = args.gradient_accumulation_steps
        total_batch = self.train_batch_size() * ga * acc.num_processes
        if has_length(dataloader):
            micro_batches = len(dataloader)
            updates_per_epoch = max(math.ceil(micro_batches / ga), 1)
            dataset = getattr(dataloader, "dataset", None)  # a custom loader may have none (HF: an estimate)
            num_examples = len(dataset) if has_length(dataset) else micro_batches * self.train_batch_size()
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
        """Where a resumed run picks up: whole epochs done, micro-batches of the current epoch to skip, and the batch
        the interrupted run had read ahead.

        loopkit checkpoints store the position in global samples, so a run resumes on another number of processes
        or with another batch size (back to the last whole micro-batch, with a warning, when the samples are not a
        whole number of them; the batch read ahead is then read again: same samples, other random draws). HF
        checkpoints have no position: it is derived from `global_step` as HF does.
        """
        if checkpoint is None:
            return None
        args, rng = self.run.args, self.context.checkpointer.read_rng(checkpoint)
        if args.ignore_data_skip:
            return ResumePoint(checkpoint, global_step // plan.num_update_steps_per_epoch, 0, rng=rng)
        saved = (self.saved or {}).get("position")
        if saved is None:
            return ResumePoint(checkpoint, global_step // plan.num_update_steps_per_epoch,
                               (global_step % plan.num_update_steps_per_epoch) * args.gradient_accumulation_steps,
                               rng=rng)
        samples_per_micro_batch = self.train_batch_size() * self.context.accelerator.num_processes
        epoch, skip = saved["epoch"], saved["samples"] // samples_per_micro_batch
        if saved["samples"] % samples_per_micro_batch:  # another batch size: back to the last whole micro-batch
            warnings.warn(f"The checkpoint stopped after {saved['samples']} samples of epoch {saved['epoch']}, not a "
                          f"whole number of this run's micro-batches of {samples_per_micro_batch} samples: resuming "
                          f"after {skip * samples_per_micro_batch} samples, so "
                          f"{saved['samples'] - skip * samples_per_micro_batch} of them are trained on again.")
        if plan.steps_in_epoch and skip >= plan.steps_in_epoch and has_length(self.run.train_dataloader):
            epoch, skip = epoch + 1, 0  # the checkpoint closed its epoch
        stored = self.saved.get("read_ahead")
        # The stored batch is the next one only at the same number of processes and the same micro-batch size.
        same_batches = stored is not None and stored["processes"] == self.context.accelerator.num_processes \
            and saved.get("micro_batches") == skip
        read_ahead = batch_from_state(stored["batch"]) if same_batches and skip else None
        return ResumePoint(checkpoint, epoch, skip, saved.get("dataset_state"), rng, read_ahead)

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
        device, non_blocking = context.accelerator.device, getattr(loader, "_non_blocking", False)
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
            if tracked is not None and reader.ahead is ReadAhead.END:  # the epoch's last batch is in this window
                tracked.end_of_dataloader = True
            if generators:  # what a checkpoint holds if an evaluation after this step is interrupted
                self.generators_after_read = [generator_state(owner) for owner in generators]
            first = self.micro_batches_done
            self.micro_batches_done += len(batches)  # counted before the step: a checkpoint after it includes them
            yield Window(batches, first)

    def epoch_iterator(self, epoch: int, skip: int, resume: ResumePoint | None):
        """The epoch's micro-batches (a `ReadAhead`), positioned after the first `skip` (a resumed epoch; then the
        batch the interrupted run had read ahead, if stored, comes first), and the loader it reads. The
        checkpoint's RNG is restored exactly where the uninterrupted run stood."""
        if resume is not None and skip == 0 and resume.rng is not None:
            restore_rng_state(resume.rng)  # before the iterator: creating it draws from the RNG
        primed = resume.read_ahead if resume is not None else None
        loader = self.run.train_dataloader
        set_epoch(loader, epoch)
        if self.worker_seeding is not None:
            self.worker_seeding.epoch = epoch
        if self.length_order is not None and skip and self.saved_order_rng is not None:
            self.length_order.replay(self.saved_order_rng)  # the interrupted epoch's order, drawn again
        read = skip + (primed is not None)  # batches the interrupted run had read
        overridden = bool(read) and self.resumes_through_override()
        if overridden:  # HF's hook, overridden: told every batch the interrupted run read (its read-ahead too)
            loader, discard = self.get_resumed_dataloader(loader, read), 0
        else:
            loader, discard = self.skip_batches(loader, read, resume)
        dataset = getattr(loader, "dataset", None)
        if isinstance(dataset, PositionSeededDataset):
            dataset.start_epoch(epoch, read)
        # The plain loader, which ReadAhead reads ahead as Accelerate's shard would; an override's loader as returned.
        base = loader if overridden else getattr(loader, "base_dataloader", loader)
        iterator = iter(base)
        for _ in range(discard):
            next(iterator, None)
        if resume is not None and skip and resume.rng is not None:
            restore_rng_state(resume.rng)  # the checkpoint's RNG was taken after the batch read ahead
        return ReadAhead(iterator, primed, read_ahead=base is not loader), loader

    def track_end_of_loader(self, loader, reader: ReadAhead):
        """Make `loader` Accelerate's active loader for the epoch, as a prepared loader does when iterated itself
        (`DataLoaderShard.begin`: `remainder`, the real samples of the last batch across processes); `windows` sets
        its `end_of_dataloader` once the epoch's last batch is read, before that window's first forward, as Trainer
        reads it. Returns the loader, or None where the loader keeps the record itself (iterated as it is: a plain
        `DataLoader`, or one a `get_resumed_dataloader` override returned). Flags on the host: no device sync."""
        from accelerate.data_loader import DataLoaderStateMixin

        self.release_train_loader()
        if not reader.read_ahead or not isinstance(loader, DataLoaderStateMixin):
            return None
        loader.begin()
        self.tracked_loader = loader
        return loader

    def release_train_loader(self) -> None:
        """Accelerate's record of the train loader ends with the training (Trainer's goes with its train())."""
        if self.tracked_loader is not None:
            self.tracked_loader.end()
            self.tracked_loader = None

    def on_train_end(self, args, state, control, **kwargs):
        self.release_train_loader()

    def on_train_failed(self, args, state, control, **kwargs):
        self.release_train_loader()

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """HF's hook (transformers 5.25): the train loader past its first `num_batches` batches, for a resumed epoch.
        By default loopkit skips them itself (`skip_batches`: in the sampler, by the dataset's own seek, or by reading
        and discarding them); an override, for a stateful or streaming loader, is called instead, as in Trainer."""
        loader, discard = self.skip_batches(dataloader, num_batches, None)
        if discard:
            from accelerate import skip_first_batches

            return skip_first_batches(loader, discard)  # reads and discards them, as Trainer's default does
        return loader

    def resumes_through_override(self) -> bool:
        """Whether a `Loop` subclass or a stage subclass overrides `get_resumed_dataloader`."""
        return "get_resumed_dataloader" in vars(self) or \
            type(self).get_resumed_dataloader is not DataStage.get_resumed_dataloader

    def skip_batches(self, loader, skip: int, resume: ResumePoint | None):
        """Skip the first `skip` micro-batches as cheaply as the data allows: in the sampler (map-style), by the
        dataset's own seek (an iterable with `load_state_dict`), or by reading and discarding them. Returns the
        loader to read and how many batches still have to be discarded."""
        source = self.train_source
        if not skip:
            return loader, 0
        if not isinstance(source, IterableDataset):
            from accelerate import skip_first_batches

            return skip_first_batches(loader, skip), 0  # skips indices in the sampler: nothing read or collated
        if resume is not None and resume.dataset_state is not None and is_seekable(source) and self.run.args.dataloader_num_workers == 0:
            source.load_state_dict(resume.dataset_state)
            return loader, 0
        warnings.warn(f"Resuming mid-epoch on an iterable dataset that cannot seek: re-reading and discarding "
                      f"{skip} batches, which costs as much as reading them did. For an O(1) resume give the "
                      f"dataset state_dict()/load_state_dict() (datasets.IterableDataset has them) and use "
                      f"dataloader_num_workers=0.")
        return loader, skip

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


def close_worker_queues(iterator, wait_s: float = 10.0) -> None:
    """torch's `_shutdown_workers` joins the workers but leaves their queues' pipes to others: an index queue's feeder
    thread closes its pipe a moment later, and the result queue's pipe closes when the garbage collector reaches the
    iterator, both possibly after `train()` returned, while the user's process still holds them (a fd count after a
    run once found one such pipe). Close them now that no worker is left: each feeder is awaited first (bounded: one
    stuck on a full pipe is left to torch, as torch leaves it)."""
    queues = [*getattr(iterator, "_index_queues", ()), getattr(iterator, "_worker_result_queue", None)]
    for queue in filter(None, queues):
        feeder = getattr(queue, "_thread", None)  # multiprocessing.Queue's feeder, started by the first put
        if feeder is not None:
            feeder.join(wait_s)
            if feeder.is_alive():
                continue
        for end in (getattr(queue, "_reader", None), getattr(queue, "_writer", None)):
            if end is not None and not end.closed:
                end.close()
