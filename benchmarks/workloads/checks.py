"""The checks every contender's trained model goes through (the same code for all): the loss on held-out rows and
a classifier's accuracy. A contender that ends elsewhere is reported as MISMATCH instead of a number.
"""

from __future__ import annotations

import torch

from .data import TensorRows, batches


@torch.no_grad()
def probe_loss(model, rows: TensorRows, device="cpu") -> float:
    """Mean loss of the trained model on held-out rows: equal final weights give equal values."""
    was_training = model.training
    model.eval()
    total = 0.0
    for batch in batches(rows, 64, device):
        total += float(model(**batch)["loss"]) * len(batch["labels"])
    model.train(was_training)
    return total / len(rows)


@torch.no_grad()
def classification_accuracy(model, rows: TensorRows, device="cpu") -> float:
    was_training = model.training
    model.eval()
    correct = 0
    for batch in batches(rows, 64, device):
        labels = batch.pop("labels")
        correct += int((model(**batch)["logits"].argmax(-1) == labels).sum())
    model.train(was_training)
    return correct / len(rows)
