"""A packing data stage, written against the stage contract only (docs/stages.md, "Stages: the contract").

Variable-length causal-LM samples are packed into rows of `row_tokens` tokens (first-fit by decreasing length; a
sample is never split), so the model computes on real tokens instead of padding:

    row:           [a1 a2 a3 a4 b1 b2 b3 c1 c2 | p  p ]      (p: the padding of a short row, a segment of its own)
    position_ids:  [ 0  1  2  3  0  1  2  0  1 |  0  1]      restart per sample
    labels:        [-100 a2 a3 a4 -100 b2 b3 -100 c2 | -100 -100]

transformers 5.x decoders see `position_ids` restart with no `attention_mask` and build the block-diagonal causal
mask themselves, so no token attends across a sample boundary; that detection is skipped when a KV cache exists, so
every packed batch carries `use_cache=False`. The first label of each sample is -100: the model shifts labels by one
inside its loss, so this is exactly "the last token of one sample does not predict the first of the next". With
`num_items_in_batch` (the window's real label tokens) the loss is the same token mean the padded run optimises.

Scope: map-style data, one process (the throughput issue extends it to iterable data and several processes).

    from packing import PackingDataStage
    Loop(model, args, train_dataset=samples, data=PackingDataStage(row_tokens=256)).train()
"""

from __future__ import annotations

import torch

from loopkit import DataStage
from loopkit.args import config_error

IGNORE = -100


def pack_samples(samples, row_tokens: int) -> list[list[int]]:
    """Indices of the samples in each row: first-fit by decreasing length (ties: dataset order)."""
    lengths = [len(sample["input_ids"]) for sample in samples]
    too_long = [i for i, n in enumerate(lengths) if n > row_tokens]
    if too_long:
        raise config_error("row_tokens", row_tokens, f"sample {too_long[0]} has {lengths[too_long[0]]} tokens and "
                           f"samples are never split", "raise row_tokens or truncate the samples")
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


def packed_row(samples, indices, row_tokens: int, pad_id: int) -> dict:
    """One row: the samples' tokens back to back, position ids restarting per sample, the first label of each sample
    ignored; a short row ends with a padding segment whose labels are all ignored."""
    ids, positions, labels = [], [], []
    for index in indices:
        sample_ids = [int(t) for t in samples[index]["input_ids"]]
        sample_labels = [int(t) for t in samples[index].get("labels", sample_ids)]
        ids += sample_ids
        positions += list(range(len(sample_ids)))
        labels += [IGNORE] + sample_labels[1:]
    pad = row_tokens - len(ids)
    ids, positions, labels = ids + [pad_id] * pad, positions + list(range(pad)), labels + [IGNORE] * pad
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions), "labels": torch.tensor(labels)}


def collate_packed_rows(rows: list[dict]) -> dict:
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    batch["use_cache"] = False  # a KV cache turns off the model's packed-row detection (module docstring)
    return batch


class PackingDataStage(DataStage):
    """`DataStage` whose training loader serves packed rows; evaluation keeps the ordinary padded batches."""

    def __init__(self, row_tokens: int = 512, pad_id: int = 0):
        super().__init__()
        self.row_tokens, self.pad_id = row_tokens, pad_id
        self.rows = None

    def get_train_dataloader(self):
        run = self.run
        if run.accelerator.num_processes > 1:
            raise config_error("data", type(self).__name__, "this minimal packing stage runs on one process",
                               "train on one process, or pad instead of packing")
        samples = run.train_dataset
        self.rows = [packed_row(samples, indices, self.row_tokens, self.pad_id)
                     for indices in pack_samples(samples, self.row_tokens)]
        return self.build_dataloader(self.rows, run.args.per_device_train_batch_size, "training", True,
                                     collator=collate_packed_rows)
