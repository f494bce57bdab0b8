"""Deterministic data order and randomness: batches are read in HF Trainer's order, so random draws (a masking
collator's, dropout's) match Trainer's, and a resumed run sees exactly the batches and draws an uninterrupted run
would, without re-reading the data it already trained on.

The mechanisms, used by the data stage:

* **Trainer's read order.** Trainer takes an optimizer step's whole accumulation window before its first forward
  (`get_batch_samples`), and Accelerate's loader reads one batch ahead of the one it hands out. So the collator of
  micro-batch k+1 runs before the forward of micro-batch k, and the first micro-batch of window w+1 is collated before
  window w's forwards (and before the evaluation and the save after step w). `ReadAhead` reads in that order. A
  collator that draws from the global RNG in the main process (`DataCollatorForLanguageModeling`'s masking) and a
  model with dropout then consume the RNG as under Trainer, draw for draw.
* **The pre-read batch is checkpointed.** At a checkpoint mid-epoch the next micro-batch has already been collated
  (its random draws came before the last step's dropout), so the RNG state alone cannot reproduce it. The data
  stage's state holds that batch as it was collated (`batch_state`: tensors, which the checkpoint writes to
  safetensors, and JSON structure); a resumed run skips the sampler past it and hands it out first
  (`ReadAhead(primed=...)`). Anything read after it is read after the restored RNG, as in the uninterrupted run.
* **Collators with their own generator.** A collator with a seeded generator (`DataCollatorForLanguageModeling(
  seed=...)`) draws from it instead of the global RNG; its state is checkpointed (`collator_generators`).
* **Worker randomness keyed by position.** With `num_workers > 0`, each worker is seeded from `(seed, epoch, rank,
  worker)` and, for map-style data, re-seeded before fetching each batch from `(seed, epoch, rank, batch index)`.
  A batch's random draws (augmentation in `__getitem__`, masking in the collator) then depend only on its position,
  whichever worker fetches it and wherever the run resumed. (Trainer seeds workers otherwise, so with workers the
  collator's draws are not Trainer's; dropout's, in the main process, still are.)
* **Iterable datasets seek through their own state.** A dataset with `state_dict()` / `load_state_dict()` (as
  `datasets.IterableDataset` has) is asked for its state at each checkpoint, after the pre-read batch was read (the
  position the resumed run continues from, once the stored batch is handed out), and restored on resume: O(1). That
  needs `num_workers=0` (with workers the state lives in the worker processes). Otherwise the resumed epoch re-reads
  and discards the consumed batches, with a warning that states the cost.
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

from .errors import config_error


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


class ReadAhead:
    """An epoch's micro-batches in Accelerate's order: each `next()` reads the batch after the one it returns, so
    the batch after the last one handed out (`pending`) is already collated, as under Trainer. `primed`: the
    pre-read batch a checkpoint stored, handed out first (the loader is then positioned after it). With
    `read_ahead=False` (a loader of the user's own that Accelerate does not wrap: Trainer reads it as it is) nothing
    is read before it is handed out, and nothing past the epoch's last batch."""

    NOT_READ, END = object(), object()

    def __init__(self, iterator, primed=None, read_ahead: bool = True):
        self.iterator, self.read_ahead = iterator, read_ahead
        self.ahead = self.NOT_READ if primed is None else primed

    def __iter__(self):
        return self

    def __next__(self):
        if self.ahead is self.END:
            raise StopIteration
        current = next(self.iterator) if self.ahead is self.NOT_READ else self.ahead
        self.ahead = next(self.iterator, self.END) if self.read_ahead else self.NOT_READ
        return current

    @property
    def pending(self):
        """The batch read ahead and not handed out yet; None if there is none."""
        return None if self.ahead is self.NOT_READ or self.ahead is self.END else self.ahead


def batch_state(batch):
    """`batch` as JSON values with its tensors in place (a checkpoint writes them to safetensors), or None for a
    batch holding something else (an object of the user's class, a numpy scalar): such a batch cannot be stored
    without pickling. Tensors, numpy arrays, dicts with string keys, `BatchEncoding`, lists, tuples, str, int, float,
    bool and None are kept with their types."""
    from transformers import BatchEncoding

    if isinstance(batch, torch.Tensor):
        return {"tensor": batch}
    if isinstance(batch, np.ndarray) and batch.dtype != object:
        return {"ndarray": torch.from_numpy(batch)}
    if batch is None or type(batch) in (str, int, float, bool):
        return {"value": batch}
    if type(batch) in (list, tuple):
        items = [batch_state(item) for item in batch]
        return None if any(item is None for item in items) else {type(batch).__name__: items}
    if type(batch) in (dict, BatchEncoding) and all(isinstance(key, str) for key in batch):
        items = {key: batch_state(value) for key, value in batch.items()}
        kind = "dict" if type(batch) is dict else "batch_encoding"
        return None if any(item is None for item in items.values()) else {kind: items}
    return None


def batch_from_state(state):
    """The batch `batch_state` described."""
    from transformers import BatchEncoding

    (kind, value), = state.items()
    if kind in ("tensor", "value"):
        return value
    if kind == "ndarray":
        return value.numpy()
    if kind in ("list", "tuple"):
        items = [batch_from_state(item) for item in value]
        return items if kind == "list" else tuple(items)
    items = {key: batch_from_state(item) for key, item in value.items()}
    return items if kind == "dict" else BatchEncoding(items)


def collator_generators(collator) -> list:
    """The collators, in `collator` and the wrappers around it (`.collator`), that draw from a seeded generator of
    their own (`DataCollatorForLanguageModeling(seed=...)`: `seed` and `generator`)."""
    owners = []
    while collator is not None:
        if getattr(collator, "seed", None) is not None and hasattr(collator, "generator"):
            owners.append(collator)
        collator = getattr(collator, "collator", None)
    return owners


def generator_state(owner):
    """A collator's generator state: a uint8 tensor (torch), a dict (numpy), or None before its first batch."""
    generator = owner.generator
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    return None


def set_generator_state(owner, state) -> None:
    """Restore what `generator_state` returned, creating the generator as the collator would at its first batch."""
    if state is None:
        return
    kind = "pt" if isinstance(state, torch.Tensor) else "np"
    if not isinstance(owner.generator, torch.Generator if kind == "pt" else np.random.Generator):
        create = getattr(owner, "create_rng", None)  # HF's: also records the process that owns the generator
        if create is not None:
            create(kind)
        else:
            owner.generator = torch.Generator() if kind == "pt" else np.random.default_rng()
    if kind == "pt":
        owner.generator.set_state(state)
    else:
        owner.generator.bit_generator.state = state
