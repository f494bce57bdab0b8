"""Deterministic data order and randomness, so a resumed run sees exactly the batches (and random draws) an
uninterrupted run would, without re-reading the data it already trained on.

Three mechanisms, used by the data stage:

* **No read-ahead in training.** Accelerate's loader fetches one batch ahead, so a collator that draws random numbers
  in the main process (masked-LM masking) would run *before* the forward that precedes it and the RNG snapshot of a
  checkpoint would fall between the two. The data stage iterates the underlying loader itself, so the global RNG is
  consumed in program order: collate k, forward k, [checkpoint], collate k+1, ...
* **Worker randomness keyed by position.** With `num_workers > 0`, each worker is seeded from `(seed, epoch, rank,
  worker)` and, for map-style data, re-seeded before fetching each batch from `(seed, epoch, rank, batch index)`.
  A batch's random draws (augmentation in `__getitem__`, masking in the collator) then depend only on its position,
  whichever worker fetches it and wherever the run resumed.
* **Iterable datasets seek through their own state.** A dataset with `state_dict()` / `load_state_dict()` (as
  `datasets.IterableDataset` has) is asked for its state at each checkpoint and restored on resume: O(1). That needs
  `num_workers=0` (with workers the state lives in the worker processes). Otherwise the resumed epoch re-reads and
  discards the consumed batches, with a warning that states the cost.
* **Length-grouped order replayed.** `group_by_length` draws each epoch's order from the global RNG, as Trainer does;
  the RNG state it drew from is saved in checkpoints, and a run resumed mid-epoch draws the same order from it.
"""

from __future__ import annotations

import base64
import hashlib
import random
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

from .args import config_error


def derived_seed(*parts: int) -> int:
    """A well-mixed 32-bit seed from integers (stable across processes and Python versions)."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**32


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class WorkerSeeding:
    """`worker_init_fn` that seeds each worker from the run's seed and the current epoch, not from the loader's base
    seed (which is drawn from the global RNG when the iterator is created, and differs after a resume)."""

    def __init__(self, seed: int, rank: int):
        self.seed, self.rank, self.epoch = seed, rank, 0

    def __call__(self, worker_id: int) -> None:
        seed_all(derived_seed(self.seed, self.epoch, self.rank, worker_id))


class PositionSeededDataset(Dataset):
    """Wraps a map-style dataset for multi-worker loading: before a worker fetches a batch, its RNGs are seeded from
    the batch's position in the epoch. Workers receive batches round-robin (torch's in-order loading), so worker
    `w` of `W` fetches batches `first + w, first + w + W, ...` of the epoch."""

    def __init__(self, dataset, seed: int, rank: int):
        self.dataset, self.seed, self.rank = dataset, seed, rank
        self.epoch, self.first_batch, self.batches_fetched = 0, 0, 0

    def start_epoch(self, epoch: int, first_batch: int) -> None:
        """Set in the main process before the epoch's iterator (and so its workers) is created."""
        self.epoch, self.first_batch, self.batches_fetched = epoch, first_batch, 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices):
        info = get_worker_info()
        if info is not None:
            position = self.first_batch + info.id + info.num_workers * self.batches_fetched
            self.batches_fetched += 1
            seed_all(derived_seed(self.seed, self.epoch, self.rank, position))
        fetch_many = getattr(self.dataset, "__getitems__", None)
        return fetch_many(indices) if fetch_many is not None else [self.dataset[i] for i in indices]

    def __getattr__(self, name):  # column_names, features, ...: whatever the wrapped dataset offers
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def is_seekable(dataset) -> bool:
    """The iterable-dataset resume protocol: `state_dict()` and `load_state_dict(state)`."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class LengthGroupedOrder(Sampler):
    """HF's `LengthGroupedSampler` order (`train_sampling_strategy="group_by_length"`): each epoch a permutation from
    the global torch RNG, cut into megabatches sorted by length, longest batch first. Drawn from the global RNG as
    Trainer draws it, so the order equals Trainer's; the RNG state it was drawn from is kept (`drawn_from`, base64,
    saved in checkpoints) so a run resumed mid-epoch draws the same order again (`replay`) without touching the
    global RNG, which the checkpoint restores to where the interrupted run stood."""

    def __init__(self, lengths: list[int], batch_size: int):
        self.lengths, self.batch_size = lengths, batch_size
        self.drawn_from, self.replay_from = None, None

    def replay(self, drawn_from: str) -> None:
        """Draw the next epoch's order from this saved RNG state instead of the global RNG (once)."""
        self.replay_from = drawn_from

    def __len__(self):
        return len(self.lengths)

    def __iter__(self):
        from transformers.trainer_pt_utils import get_length_grouped_indices

        if self.replay_from is not None:
            state, self.replay_from = self.replay_from, None
            generator = torch.Generator().set_state(torch.frombuffer(bytearray(base64.b64decode(state)),
                                                                     dtype=torch.uint8))
        else:
            state = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
            generator = None  # the global RNG, as Trainer
        self.drawn_from = state
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


def sample_lengths(dataset, args, processing_class) -> list[int]:
    """What Trainer groups by (`group_by_length`): the `length_column_name` column of a `datasets.Dataset`, else the
    length of each sample's main input."""
    dataset = dataset.dataset if isinstance(dataset, PositionSeededDataset) else dataset
    if args.length_column_name in (getattr(dataset, "column_names", None) or []):
        return list(dataset[args.length_column_name])
    name = processing_class.model_input_names[0] if processing_class is not None else "input_ids"
    first = dataset[0]
    if not isinstance(first, Mapping) or name not in first:
        raise config_error("train_sampling_strategy", "group_by_length", f"the lengths come from a "
                           f"'{args.length_column_name}' column or each sample's '{name}', and the dataset has "
                           f"neither", f"add a '{args.length_column_name}' column (or set length_column_name) or "
                           "give each sample that key")
    return [len(sample[name]) for sample in dataset]
