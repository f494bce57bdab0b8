"""Walking the batches users pass and the outputs models return, whatever container holds them.

HF's collators return `BatchEncoding`, a `Mapping` that is not a `dict`; users' collators return dicts, tuples or
lists; `datasets` rows are dicts, a tokenizer's output is a `BatchEncoding`. Every helper here accepts any `Mapping`
and any list or tuple (as HF's `trainer_pt_utils` does), so no batch is silently taken for "no tensors": a missed
batch size once made every streaming metric skip every batch (issue 10).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def has_length(obj) -> bool:
    """Whether `len(obj)` works (an `IterableDataset` may define `__len__` only to raise)."""
    try:
        return len(obj) is not None
    except (TypeError, NotImplementedError, AttributeError):
        return False


def find_batch_size(batch) -> int | None:
    """The first dimension of the first tensor or array found in a nested Mapping / list / tuple (HF's
    `find_batch_size`), or None when it holds none."""
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = find_batch_size(item)
            if found is not None:
                return found
    elif isinstance(batch, Mapping):
        for value in batch.values():
            found = find_batch_size(value)
            if found is not None:
                return found
    elif isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch.shape[0] if batch.ndim >= 1 else None
    return None


def nested_detach(tensors):
    """Detached tensors, in the same nesting (Mappings become dicts)."""
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(nested_detach(t) for t in tensors)
    if isinstance(tensors, Mapping):
        return {k: nested_detach(v) for k, v in tensors.items()}
    return tensors.detach() if isinstance(tensors, torch.Tensor) else tensors


def to_numpy(tensors):
    """Nested tensors -> numpy arrays on the host (bfloat16 as float32: numpy has none); HF's `nested_numpify`."""
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(to_numpy(t) for t in tensors)
    if isinstance(tensors, Mapping):
        return {k: to_numpy(v) for k, v in tensors.items()}
    if isinstance(tensors, torch.Tensor):
        t = tensors.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return tensors


def concat_padded(chunks: list, padding_index: int = -100):
    """Concatenate per-batch arrays along dim 0, padding dim 1 to the longest (HF's `nested_concat`)."""
    first = chunks[0]
    if isinstance(first, (list, tuple)):
        return type(first)(concat_padded([c[i] for c in chunks], padding_index) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: concat_padded([c[k] for c in chunks], padding_index) for k in first}
    arrays = [np.asarray(c) for c in chunks]
    if arrays[0].ndim < 2 or all(a.shape[1] == arrays[0].shape[1] for a in arrays):
        return np.concatenate(arrays, axis=0)
    width = max(a.shape[1] for a in arrays)
    out = np.full((sum(a.shape[0] for a in arrays), width) + arrays[0].shape[2:], padding_index,
                  dtype=arrays[0].dtype)
    row = 0
    for a in arrays:
        out[row:row + a.shape[0], :a.shape[1]] = a
        row += a.shape[0]
    return out


def plain_metrics(metrics):
    """numpy scalars and one-element tensors -> Python numbers, through lists and Mappings (HF's
    `denumpify_detensorize`)."""
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(plain_metrics(m) for m in metrics)
    if isinstance(metrics, Mapping):
        return {k: plain_metrics(v) for k, v in metrics.items()}
    if isinstance(metrics, np.generic):
        return metrics.item()
    if isinstance(metrics, torch.Tensor) and metrics.numel() == 1:
        return metrics.item()
    return metrics


def carries_labels(batch, label_names) -> bool:
    """HF's `has_labels`: every label column is in the batch and not None. A list or tuple batch has no named
    columns, so it is never taken as labelled by name (see `EvalStage.prediction_step` for how it is evaluated)."""
    return isinstance(batch, Mapping) and bool(label_names) and all(batch.get(k) is not None for k in label_names)


def shallow_copy(batch):
    """A copy of the batch's container (not its tensors), so that a `compute_loss` popping the labels leaves them
    for the streaming metrics; a tuple is immutable and stays as it is."""
    if isinstance(batch, Mapping):
        return dict(batch)
    return list(batch) if isinstance(batch, list) else batch


def without_columns(feature, keep: set[str]):
    """A feature (one dataset row: a dict, a tokenizer's `BatchEncoding`, any Mapping) with only the `keep` keys, as
    a new dict; anything else as it is. Called per row on the data path, so the common cases take a fast lane."""
    if is_batch_encoding(feature):
        feature = feature.data  # its plain dict: UserDict's items() costs a Python call per key
    if type(feature) is dict:
        # Nothing to drop (the usual row): a C-level copy. A copy either way, as HF's RemoveColumnsCollator makes
        # one: a collator that pops keys must not change the dataset's rows.
        return dict(feature) if feature.keys() <= keep else {k: v for k, v in feature.items() if k in keep}
    return {k: v for k, v in feature.items() if k in keep} if isinstance(feature, Mapping) else feature


def is_batch_encoding(value) -> bool:
    """A tokenizer's `BatchEncoding` (recognised without importing transformers): its `data` is its plain dict."""
    return type(value).__name__ == "BatchEncoding" and type(getattr(value, "data", None)) is dict


def require_named_batch(batch) -> None:
    """`model(**batch)` needs named inputs: a clear error for a tuple or list batch instead of Python's."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"The batch is a {type(batch).__name__} of {len(batch) if hasattr(batch, '__len__') else '?'} "
                        f"items, and the default compute_loss calls model(**batch), which needs a mapping of input "
                        f"names. Fix: make the collator return a dict (e.g. {{'input_ids': ..., 'labels': ...}}), or "
                        f"override compute_loss to unpack the {type(batch).__name__} yourself.")
