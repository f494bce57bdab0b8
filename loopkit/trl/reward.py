"""`RewardLoop`: TRL's `RewardTrainer` on loopkit's loop (docs/trl.md). `RewardTrainer(` becomes `RewardLoop(`."""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import nested_detach
from trl import RewardTrainer

from .base import TRLLoop


class RewardLoop(RewardTrainer, TRLLoop):
    """TRL's `RewardTrainer`: its arguments, data preparation, collator and loss; loopkit's run (loopkit/trl/base.py)."""

    # RewardTrainer sets this (a plain attribute on Trainer) so that evaluation computes the loss of label-less
    # preference batches; loopkit's `can_return_loss` is a read-only property, so the class makes it assignable.
    can_return_loss = True

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Trainer's `prediction_step` for a batch without labels whose loss the model can return (HF's
        `loss_without_labels`, which RewardTrainer relies on): the loss through `compute_loss`, the logits beside."""
        if ignore_keys is None:
            ignore_keys = list(getattr(self.model.config, "keys_to_ignore_at_inference", ["cache"]))
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True,
                                              num_items_in_batch=self.count_loss_items([inputs]))
        loss = loss.detach().mean()
        if prediction_loss_only:
            return loss, None, None
        logits = nested_detach(tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"]))
        return loss, logits[0] if len(logits) == 1 else logits, None
