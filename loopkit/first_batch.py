"""Checks of the first training micro-batch against the model's own loss (label dtype and label range), and the
explanation of a collator that cannot batch the examples it gets (`ExplainedCollator`).

They run once per `train()`, on the first micro-batch (the step stage calls `check_labels` behind a flag), so the hot
path pays one attribute test per step and the one device sync of reading the labels' range happens once. Each case
refused here is one where the model's loss would fail anyway, later and with a message about tensors (or, on a GPU,
a device-side assert that poisons the process): the check says which field is wrong and how to fix it. Nothing is
checked when a `compute_loss_func` or an overridden `compute_loss` decides what labels mean.

A collator handed examples of different lengths it does not pad fails inside torch ("expected sequence of length 51
at dim 1 (got 64)", under Trainer too) at the first batch: `ExplainedCollator`, the loaders' collate function, turns
that failure into an error naming the collator, the field, its lengths and the collator that pads it. It costs
nothing on a batch that collates (a `try`); the examples are looked at only after a failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from .errors import config_error
from .models import base_model

TOKEN_LABEL_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")
CLASS_LABEL_HEADS = ("ForSequenceClassification", "ForTokenClassification")


def check_labels(model, batch, causal_lm: bool) -> None:
    """Refuse labels the model's loss cannot take: floats where it wants class or token ids, and ids outside
    `config.num_labels` / `config.vocab_size` (-100, the ignore index, is always allowed)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    base = base_model(model)
    config, name = getattr(base, "config", None), type(base).__name__
    if not isinstance(labels, torch.Tensor) or config is None:
        return
    if causal_lm or name.endswith(TOKEN_LABEL_HEADS):
        size, size_field, what = getattr(config, "vocab_size", None), "config.vocab_size", "token ids"
    elif name.endswith(CLASS_LABEL_HEADS) and takes_class_ids(config, labels):
        size, size_field, what = config.num_labels, "config.num_labels", "class ids"
    else:
        return
    described = f"<{str(labels.dtype).replace('torch.', '')} tensor of shape {tuple(labels.shape)}>"
    if labels.is_floating_point():
        raise config_error("labels", described, f"{name}'s loss takes {what} (an integer tensor), and float labels "
                           f"make it fail", "make the label column integer (datasets: dataset.cast_column('label', "
                           "Value('int64')); torch: labels.long()); for regression build the model with "
                           "num_labels=1, for multi-label classification pass float labels of shape (batch, "
                           "num_labels) with problem_type='multi_label_classification'")
    if size is None:
        return
    valid = labels[labels != -100]
    if valid.numel() == 0:
        return
    low, high = int(valid.min()), int(valid.max())  # the one device sync, on the first micro-batch only
    if low < 0 or high >= size:
        fix = (f"build the model with num_labels={high + 1} (from_pretrained(..., num_labels={high + 1})), or map "
               f"the labels to 0..{size - 1}" if size_field == "config.num_labels" else
               f"tokenize with the model's own tokenizer, or call model.resize_token_embeddings(len(tokenizer))")
        raise config_error("labels", described, f"its {what} run from {low} to {high}, and {name} has "
                           f"{size_field}={size} (valid: 0..{size - 1}, and -100 to ignore a position)", fix)


def takes_class_ids(config, labels: torch.Tensor) -> bool:
    """HF's rule for a classifier's loss (`problem_type`): single-label (class ids) when set so, or when unset
    with num_labels > 1 and the labels are not one float row of num_labels per example (multi-label)."""
    problem = getattr(config, "problem_type", None)
    if problem is not None:
        return problem == "single_label_classification"
    multi_label_shape = labels.is_floating_point() and labels.ndim >= 2 and labels.shape[-1] == config.num_labels
    return config.num_labels > 1 and not multi_label_shape


# What torch, numpy and a tokenizer's `pad` say when the examples of a batch differ in length.
UNEVEN_LENGTHS = re.compile(r"expected sequence of length|Unable to create tensor|stack expects each tensor to be "
                            r"equal size|must match the size|inhomogeneous")
TOKEN_FIELDS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "special_tokens_mask")


class ExplainedCollator:
    """The loaders' collate function: `collator`, with a failure over examples of different lengths explained
    (module docstring). Picklable, for worker processes."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        try:
            return self.collator(features)
        except (ValueError, RuntimeError, TypeError) as exc:
            unpadded = unpadded_fields(user_collator(self.collator), features) if UNEVEN_LENGTHS.search(str(exc)) \
                else {}
            if not unpadded:
                raise
            raise uneven_lengths_error(user_collator(self.collator), unpadded, exc) from exc


def user_collator(collator):
    """The user's collator, under loopkit's column filter (`RemoveColumnsCollator`) if any."""
    inner = getattr(collator, "collator", None)
    return inner if inner is not None and type(collator).__name__ == "RemoveColumnsCollator" else collator


def unpadded_fields(collator, features) -> dict[str, list[int]]:
    """The fields whose values differ in length across the examples of a batch and that `collator` does not pad
    (a tokenizer's padding collator pads the tokenizer's inputs, and the token-label collators the labels too),
    each with its lengths."""
    if not isinstance(features, Sequence) or not features or not all(isinstance(f, Mapping) for f in features):
        return {}
    uneven = {}
    for name in features[0]:
        lengths = [length(f.get(name)) for f in features]
        if None not in lengths and len(set(lengths)) > 1:
            uneven[name] = lengths
    padded = set(getattr(getattr(collator, "tokenizer", None), "model_input_names", None) or ())
    if type(collator).__name__ in ("DataCollatorForTokenClassification", "DataCollatorForSeq2Seq"):
        padded.add("labels")
    return {name: lengths for name, lengths in uneven.items() if name not in padded} or uneven


def length(value) -> int | None:
    """The length of a list, tuple, array or tensor (its first dimension); None for anything else."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return shape[0] if len(shape) else None
    return len(value) if isinstance(value, Sequence) and not isinstance(value, str) else None


def uneven_lengths_error(collator, unpadded: dict[str, list[int]], exc: Exception):
    name = getattr(collator, "__name__", None) or type(collator).__name__
    fields = ", ".join(repr(field) for field in unpadded)
    if any(field in TOKEN_FIELDS for field in unpadded):
        fix = ("pad each batch: data_collator=DataCollatorWithPadding(tokenizer) (classification), "
               "DataCollatorForLanguageModeling(tokenizer, mlm=False) (causal LM: it makes the labels too), "
               "DataCollatorForTokenClassification(tokenizer) or DataCollatorForSeq2Seq(tokenizer) (labels per "
               "token, padded with -100); or pass processing_class=tokenizer (then Loop pads with "
               "DataCollatorWithPadding, as Trainer does), or tokenize with padding='max_length'")
    else:
        fix = (f"pad {fields} in the collator: DataCollatorForTokenClassification(tokenizer) or "
               f"DataCollatorForSeq2Seq(tokenizer) pad labels with -100 (DataCollatorWithPadding pads only the "
               f"tokenizer's inputs), or pad {fields} to one length when preparing the dataset")
    shown = ", ".join(str(n) for n in sorted(set(next(iter(unpadded.values()))))[:6])
    return config_error("data_collator", name, f"the examples of a batch have {fields} of different lengths "
                        f"({shown}), which {name} does not pad, so the batch cannot be stacked (the collator raised "
                        f"{type(exc).__name__}: {exc})", fix)
