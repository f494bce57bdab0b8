"""Checks of the first training micro-batch against the model's own loss: label dtype and label range.

They run once per `train()`, on the first micro-batch (the step stage calls `check_labels` behind a flag), so the hot
path pays one attribute test per step and the one device sync of reading the labels' range happens once. Each case
refused here is one where the model's loss would fail anyway, later and with a message about tensors (or, on a GPU,
a device-side assert that poisons the process): the check says which field is wrong and how to fix it. Nothing is
checked when a `compute_loss_func` or an overridden `compute_loss` decides what labels mean.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .errors import config_error
from .stages.base import base_model

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
