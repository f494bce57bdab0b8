"""Padding-free packing for causal LMs: rows of packed samples instead of padded batches, and the check that packing
is exact. The data stage that serves them is `PackingDataStage` (loopkit/stages/packing.py).

Variable-length samples are packed into rows of `row_tokens` tokens (a sample is never split), so the model
computes on real tokens instead of padding:

    row:           [a1 a2 a3 a4 b1 b2 b3 c1 c2 | p  p ]      (p: the padding of a short row, a segment of its own)
    position_ids:  [ 0  1  2  3  0  1  2  0  1 |  0  1]      restart per sample
    labels:        [-100 a2 a3 a4 -100 b2 b3 -100 c2 | -100 -100]

transformers 5.x decoders see `position_ids` restart with no `attention_mask` and build the block-diagonal causal
mask themselves, so no token attends across a sample boundary; that detection is skipped when a KV cache exists, so
every packed batch carries `use_cache=False`. The first label of each sample is -100: the model shifts labels by one
inside its loss, so this is exactly "the last token of one sample does not predict the first of the next". The step
stage's `num_items_in_batch` (the window's real label tokens, summed over processes) makes the loss the same token
mean the padded run optimises.

Where rows come from (`PackingDataStage(pack=...)`):
* "dataset": first-fit by decreasing length over the whole map-style dataset, once per `train()`; the rows are the
  dataset the sampler shuffles. An iterable dataset is packed as it streams (`PackedStream`: next-fit, in order).
* "batch": each batch of `per_device_train_batch_size` samples is packed on its own (`PackedBatchCollator`), so a
  packed run sees the same samples per step as the padded run (the equality tests use it).

Evaluation does not pack: it keeps the run's collator, so `compute_metrics` sees one row per sample, as with HF.
Before the first packed batch, `check_packing_is_exact` runs two packed samples against the same samples run
separately and refuses a model whose attention crosses the boundary (encoders, attention that ignores position ids).
A user's own `DataCollatorWithFlattening` gets the same check and `use_cache=False` (`exact_flattening`).
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.data import IterableDataset

from .errors import config_error
from .models import base_model
from .private_api import attention_implementation

IGNORE = -100


# ---------------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------------
def sample_tokens(sample) -> tuple[list[int], list[int]]:
    """A sample's input ids and labels as ints (labels default to the ids: causal LM)."""
    ids = [int(t) for t in sample["input_ids"]]
    labels = sample.get("labels") if hasattr(sample, "get") else None
    return ids, ([int(t) for t in labels] if labels is not None else list(ids))


def check_fits(length: int, row_tokens: int, where: str) -> None:
    if length > row_tokens:
        raise config_error("row_tokens", row_tokens, f"{where} has {length} tokens and samples are never split",
                           "raise row_tokens or truncate the samples")


def pack_samples(samples, row_tokens: int) -> list[list[int]]:
    """Indices of the samples in each row: first-fit by decreasing length (ties: dataset order)."""
    lengths = [len(sample["input_ids"]) for sample in samples]
    for i, n in enumerate(lengths):
        check_fits(n, row_tokens, f"sample {i}")
    rows, room = [], []
    for index in sorted(range(len(samples)), key=lambda i: (-lengths[i], i)):
        slot = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if slot is None:
            rows.append([])
            room.append(row_tokens)
            slot = len(rows) - 1
        rows[slot].append(index)
        room[slot] -= lengths[index]
    return rows


def row_from_tokens(tokens: list[tuple[list[int], list[int]]], row_tokens: int, pad_id: int) -> dict:
    """One row from (ids, labels) pairs: position ids restart per sample, the first label of each sample is
    ignored; a short row ends with a padding segment whose labels are all ignored."""
    ids, positions, labels = [], [], []
    for sample_ids, sample_labels in tokens:
        ids += sample_ids
        positions += list(range(len(sample_ids)))
        labels += [IGNORE] + sample_labels[1:]
    pad = row_tokens - len(ids)
    ids, positions, labels = ids + [pad_id] * pad, positions + list(range(pad)), labels + [IGNORE] * pad
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions), "labels": torch.tensor(labels)}


def packed_row(samples, indices, row_tokens: int, pad_id: int) -> dict:
    return row_from_tokens([sample_tokens(samples[i]) for i in indices], row_tokens, pad_id)


def collate_packed_rows(rows: list[dict]) -> dict:
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    batch["use_cache"] = False  # a KV cache turns off the model's packed-row detection (module docstring)
    return batch


class PackedBatchCollator:
    """Packs the samples of one batch into rows of `row_tokens` (first-fit): same samples per step as padding."""

    def __init__(self, row_tokens: int, pad_id: int = 0):
        self.row_tokens, self.pad_id = row_tokens, pad_id

    def __call__(self, features):
        rows = pack_samples(features, self.row_tokens)
        return collate_packed_rows([packed_row(features, indices, self.row_tokens, self.pad_id) for indices in rows])


class PackedStream(IterableDataset):
    """An iterable dataset packed as it streams: samples fill a row in arrival order until the next does not fit.

    Resumable when the source is (`state_dict()`/`load_state_dict()`, as `datasets.IterableDataset`): the state is
    the source's position plus the sample read but not yet placed, so a resumed run reads the same rows."""

    def __init__(self, source, row_tokens: int, pad_id: int = 0):
        self.source, self.row_tokens, self.pad_id = source, row_tokens, pad_id
        self.pending, self.restored = None, None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def __iter__(self):
        self.pending, self.restored = self.restored, None
        row, used = [], 0
        samples = iter(self.source)
        while True:
            if self.pending is None:
                sample = next(samples, None)
                if sample is None:
                    break
                self.pending = sample_tokens(sample)
            length = len(self.pending[0])
            check_fits(length, self.row_tokens, "a streamed sample")
            if used + length > self.row_tokens:
                yield row_from_tokens(row, self.row_tokens, self.pad_id)  # `pending` waits for the next row
                row, used = [], 0
            row.append(self.pending)
            used += length
            self.pending = None
        if row:
            yield row_from_tokens(row, self.row_tokens, self.pad_id)

    def state_dict(self):
        """None when the source cannot seek: the data stage then re-reads and discards (still exact)."""
        if not callable(getattr(self.source, "state_dict", None)):
            return None
        return {"source": self.source.state_dict(), "pending": self.pending}

    def load_state_dict(self, state) -> None:
        self.source.load_state_dict(state["source"])
        self.restored = tuple(state["pending"]) if state["pending"] is not None else None


# ---------------------------------------------------------------------------------------------------------------
# The exactness check, and a user's own flattening collator
# ---------------------------------------------------------------------------------------------------------------
def packed_logits_error(model) -> float:
    """Max abs difference between two samples packed in one row and the same samples run separately."""
    base = base_model(model)
    params = inspect.signature(base.forward).parameters
    name = type(base).__name__
    if "position_ids" not in params:
        raise config_error("model", name, "its forward takes no position_ids, so packed samples cannot restart their "
                           "positions", "pad instead of packing (train_sampling_strategy='group_by_length' keeps the "
                           "padding low)")
    vocab = getattr(getattr(base, "config", None), "vocab_size", None) or 2
    generator = torch.Generator().manual_seed(0)  # the global RNG is left alone: runs stay reproducible
    first, second = (torch.randint(1, vocab, (n,), generator=generator) for n in (5, 7))
    device = next(base.parameters()).device
    extra = {"use_cache": False} if "use_cache" in params else {}

    def logits(ids, positions):
        inputs = dict(input_ids=ids[None].to(device), position_ids=positions[None].to(device), **extra)
        return base(**inputs).logits[0].float()

    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            packed = logits(torch.cat([first, second]), torch.cat([torch.arange(5), torch.arange(7)]))
            alone = torch.cat([logits(first, torch.arange(5)), logits(second, torch.arange(7))])
    finally:
        base.train(was_training)
    return (packed - alone).abs().max().item()


def check_packing_is_exact(model, tolerance: float = 1e-5) -> None:
    """Refuse a model on which packed samples see each other (a clear error naming the model and the fix)."""
    error = packed_logits_error(model)
    if not error <= tolerance:
        base = base_model(model)
        attention = attention_implementation(getattr(base, "config", None))
        raise config_error("model", f"{type(base).__name__} (attn_implementation={attention})",
                           f"two packed samples give logits up to {error:.3g} away from the same samples run "
                           f"separately (tolerance {tolerance}): its attention crosses sample boundaries (an "
                           f"encoder-only model, or an attention implementation that ignores position_ids)",
                           "pad instead of packing (train_sampling_strategy='group_by_length' keeps the padding "
                           "low), or use a decoder "
                           "with attn_implementation='sdpa', 'eager' or 'flash_attention_2'")


class ExactFlattening:
    """A user's `DataCollatorWithFlattening`, with `use_cache=False` in each batch (module docstring)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        batch["use_cache"] = False
        return batch


def exact_flattening(collator, model):
    """`collator` itself, or, for HF's `DataCollatorWithFlattening`, the same collator made exact: the model is
    checked (`check_packing_is_exact`) and each batch carries `use_cache=False`."""
    from transformers.data.data_collator import DataCollatorWithFlattening

    if not isinstance(collator, DataCollatorWithFlattening):
        return collator
    check_packing_is_exact(model)
    if "use_cache" not in inspect.signature(base_model(model).forward).parameters:
        return collator  # no cache to turn off, and the check passed
    return ExactFlattening(collator)
