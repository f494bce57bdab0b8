"""`RewardLoop`: TRL's `RewardTrainer` on loopkit's loop (docs/trl.md). `RewardTrainer(` becomes `RewardLoop(`.

TRL's are the arguments (`RewardConfig`, `processing_class`, `peft_config`, ...), the data preparation (EOS,
tokenising chosen/rejected with or without a prompt, conversational or plain, the `max_length` filter), the
collator (`DataCollatorForPreference`: chosen rows, then rejected rows), the forward pass and the logged metrics
(`num_tokens`, `min/mean/max_reward`, `accuracy`, `margin`). loopkit's are the run and what this module adds where
`Trainer`'s code would otherwise run on state a `Loop` does not keep:

- the loss in the step stage, `RewardStep`: `reward_loss` makes it from the chosen and rejected rewards (RewardTrainer's
  by default); a loss of one's own is one small `RewardStep` subclass, passed as `RewardLoop(..., step=YourStep())`;
- `prediction_step`: evaluation computes the loss of label-less batches, as `Trainer` does for RewardTrainer;
- TRL's running metrics (`num_tokens` and the not-yet-logged values) are checkpointed and restored on resume;
- each checkpoint writes TRL's model card to `output_dir/README.md`, as RewardTrainer's `_save_checkpoint` does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.trainer_pt_utils import nested_detach
from trl import RewardConfig, RewardTrainer

from ..trainer.overridable import HFMethods
from .base import LoopKeywords, TRLLoop, TRLStepStage


class RewardStep(TRLStepStage):
    """The reward model's step stage: RewardTrainer's forward pass and metrics (`trl_loss`, its `compute_loss`, handed
    over by `RewardLoop`), the loss from `reward_loss`, then loopkit's accumulation, clipping and optimizer step.
    A reward loss of one's own is a subclass overriding `reward_loss`, passed as `RewardLoop(..., step=YourStep())`;
    evaluation computes its `eval_loss` with the same loss."""

    trl_loss = None  # RewardTrainer's compute_loss, bound to the loop (RewardLoop sets it)

    def reward_loss(self, rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor,
                    margin: torch.Tensor | None) -> torch.Tensor:
        """The loss of one batch from its rewards (each of shape `(pairs,)`; `margin` from the dataset's `margin`
        column, else None). RewardTrainer's: the Bradley-Terry loss `-log sigmoid(chosen - rejected - margin)`
        averaged over pairs, plus `center_rewards_coefficient * mean((chosen + rejected)^2)` when that is set."""
        difference = rewards_chosen - rewards_rejected
        if margin is not None:
            difference = difference - margin
        loss = -nn.functional.logsigmoid(difference).mean()
        coefficient = self.run.args.center_rewards_coefficient
        if coefficient is not None:
            loss = loss + coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """RewardTrainer's forward pass and metrics, with the loss from `reward_loss`."""
        _, outputs = self.trl_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        rewards_chosen, rewards_rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
        loss = self.reward_loss(rewards_chosen, rewards_rejected, inputs.get("margin"))
        return (loss, outputs) if return_outputs else loss


class RewardLoop(LoopKeywords, RewardTrainer, TRLLoop):
    """TRL's `RewardTrainer`: its arguments, data preparation, collator and metrics; loopkit's run (module docstring).
    `step=` takes a `RewardStep` (a subclass with its own `reward_loss`)."""

    # RewardTrainer sets this (a plain attribute on Trainer) so that evaluation computes the loss of label-less
    # preference batches; loopkit's `can_return_loss` is a read-only property, so the class makes it assignable.
    can_return_loss = True
    args_class = RewardConfig  # the config whose fields this loop honours (loopkit/args/checks.py)
    stage_classes = {**TRLLoop.stage_classes, "step": RewardStep}
    stage_hooks = {"reward_loss": "step"}
    compute_loss = HFMethods.compute_loss  # the step stage's: RewardTrainer's forward, the stage's reward_loss

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step.trl_loss = RewardTrainer.compute_loss.__get__(self)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Trainer's `prediction_step` for a batch whose loss the model returns without labels (HF's
        `loss_without_labels`, which RewardTrainer switches on): the loss through `compute_loss`, the logits beside
        and, as in Trainer, the label columns named in `label_names` (RewardTrainer names none: an empty tuple)."""
        if ignore_keys is None:
            ignore_keys = list(getattr(self.model.config, "keys_to_ignore_at_inference", ["cache"]))
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True,
                                              num_items_in_batch=self.count_loss_items([inputs]))
        loss = loss.detach().mean()
        if prediction_loss_only:
            return loss, None, None
        logits = nested_detach(tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"]))
        labels = nested_detach(tuple(inputs.get(name) for name in self.label_names))
        return loss, logits[0] if len(logits) == 1 else logits, labels[0] if len(labels) == 1 else labels
