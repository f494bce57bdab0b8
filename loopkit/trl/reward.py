"""`RewardLoop`: TRL's `RewardTrainer` on loopkit's loop (docs/trl.md). `RewardTrainer(` becomes `RewardLoop(`.

TRL's are the arguments (`RewardConfig`, `processing_class`, `peft_config`, ...), the data preparation (EOS,
tokenising chosen/rejected with or without a prompt, conversational or plain, the `max_length` filter), the
collator (`DataCollatorForPreference`: chosen rows, then rejected rows), the forward pass and the logged metrics
(`num_tokens`, `min/mean/max_reward`, `accuracy`, `margin`). loopkit's are the run and what this module adds where
`Trainer`'s code would otherwise run on state a `Loop` does not keep:

- `reward_loss`: the loss from the chosen and rejected rewards, one method a subclass overrides for its own loss;
- `prediction_step`: evaluation computes the loss of label-less batches, as `Trainer` does for RewardTrainer;
- TRL's running metrics (`num_tokens` and the not-yet-logged values) are checkpointed and restored on resume;
- each checkpoint writes TRL's model card to `output_dir/README.md`, as RewardTrainer's `_save_checkpoint` does.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from torch import nn
from transformers.trainer_pt_utils import nested_detach
from trl import RewardTrainer

from .base import TRLLoop

# The key of TRL's running metrics in a checkpoint's loopkit state (loopkit_state.json).
TRL_METRICS_KEY = "trl_metrics"


class RewardLoop(RewardTrainer, TRLLoop):
    """TRL's `RewardTrainer`: its arguments, data preparation, collator and metrics; loopkit's run (module docstring).

    A reward loss of your own is one method: override `reward_loss(rewards_chosen, rewards_rejected, margin)`.
    """

    # RewardTrainer sets this (a plain attribute on Trainer) so that evaluation computes the loss of label-less
    # preference batches; loopkit's `can_return_loss` is a read-only property, so the class makes it assignable.
    can_return_loss = True

    def reward_loss(self, rewards_chosen: torch.Tensor, rewards_rejected: torch.Tensor,
                    margin: torch.Tensor | None) -> torch.Tensor:
        """The loss of one batch from its rewards (each of shape `(pairs,)`; `margin` from the dataset's `margin`
        column, else None). RewardTrainer's: the Bradley-Terry loss `-log sigmoid(chosen - rejected - margin)`
        averaged over pairs, plus `center_rewards_coefficient * mean((chosen + rejected)^2)` when that is set."""
        difference = rewards_chosen - rewards_rejected
        if margin is not None:
            difference = difference - margin
        loss = -nn.functional.logsigmoid(difference).mean()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """RewardTrainer's forward pass and metrics, with the loss from `reward_loss`."""
        _, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        rewards_chosen, rewards_rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
        loss = self.reward_loss(rewards_chosen, rewards_rejected, inputs.get("margin"))
        return (loss, outputs) if return_outputs else loss

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

    # -- TRL's running metrics across a resume, and its model card at each save ------------------------------------
    def stage_states(self) -> dict:
        """loopkit's checkpointed state plus TRL's running metrics: the token count behind `num_tokens` and the
        training values gathered since the last log (RewardTrainer keeps neither across a resume)."""
        states = super().stage_states()
        states[TRL_METRICS_KEY] = {"total_train_tokens": self._total_train_tokens,
                                   "train": {key: list(values) for key, values in self._metrics["train"].items()}}
        return states

    def start_state(self, checkpoint, plan, trial) -> None:
        super().start_state(checkpoint, plan, trial)
        saved = self.context.checkpointer.read_stage_states(checkpoint).get(TRL_METRICS_KEY) if checkpoint else None
        if saved is not None:
            self._total_train_tokens = saved["total_train_tokens"]
            self._metrics["train"] = defaultdict(list, saved["train"])

    def save_checkpoint(self) -> str:
        """As RewardTrainer's `_save_checkpoint`: the model card first (`output_dir/README.md`), then the checkpoint."""
        hub_model_id = self.args.hub_model_id
        model_name = hub_model_id.split("/")[-1] if hub_model_id else Path(self.args.output_dir).name
        self.create_model_card(model_name=model_name)
        return super().save_checkpoint()
