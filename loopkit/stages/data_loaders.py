"""The data stage's loaders (HF's `get_train_dataloader`, `get_eval_dataloader`, `get_test_dataloader`): the
collator, column removal, the samplers, workers and their seeding, an Accelerate-prepared `DataLoader`; and the
persistent workers' shutdown. `DataStage` inherits these methods: override any of them on a `DataStage` subclass.

Reads `run.args`, `run.model`, `run.label_names`, `run.signature_columns`, `run.train_dataset`, `run.eval_dataset`,
`run.data_collator`, `run.processing_class`, `run.train_batch_size`, `run.train_dataloader`; uses
`context.accelerator`. Keeps on the stage: `collator` (the run's, made once), `train_source` (the dataset the train
loader reads, after column removal), `worker_seeding`, `length_order` (the group_by_length sampler), `eval_loaders`
(kept only with persistent workers).
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from ..columns import check_eval_labels, check_padding, with_model_columns
from ..data_order import LengthGroupedOrder, PositionSeededDataset, WorkerSeeding, sample_lengths
from ..distributed import prepare_iterable_train_loader
from ..errors import config_error
from ..first_batch import ExplainedCollator
from ..private_api import shut_down_persistent_workers
from ..row_packing import exact_flattening


class DataLoaders:
    """The loader-building part of `DataStage` (a mixin: the stage's `__init__` sets the attributes it keeps)."""

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
        params = self.loader_options(collator, batch_size)
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

    def loader_options(self, collator, batch_size: int) -> dict:
        """The `DataLoader` keywords every loader shares, from the arguments (workers, pinning, prefetching, ...)."""
        context, args = self.context, self.run.args
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
        return params

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
            shut_down_persistent_workers(loader)
        self.eval_loaders = {}
        self.reader = None  # the batch read ahead (workers' shared memory) and the epoch's iterator go with it

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self.build_dataloader(test_dataset, self.run.args.per_device_eval_batch_size, "test", False)
