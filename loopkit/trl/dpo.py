"""`DPOLoop`: TRL's `DPOTrainer` on loopkit's loop (docs/trl.md). `DPOTrainer(` becomes `DPOLoop(`.

Everything TRL's trainer does is TRL's own code (loopkit/trl/base.py): the data formats and tokenisation, the
collator, the reference model (explicit, loaded from the policy's path, a PEFT adapter switched off, or log-probs
precomputed before training), every `loss_type` and every metric it logs. What DPOLoop adds:

- A preference loss of one's own as one short method, `preference_loss(pairs)`: the chosen/rejected log-probs of the
  policy and of the reference in, a per-pair loss out; TRL's forward passes and metrics are kept (docs/trl.md).
- TRL's running metrics (`num_tokens`, and the values not yet logged) are part of loopkit's checkpoint, so a resumed
  run logs what the uninterrupted run logs (TRL's own restart counts `num_tokens` from 0 again).
- TRL's model card at each checkpoint (DPOTrainer's `_save_checkpoint`, which loopkit's saving does not call).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from trl import DPOConfig, DPOTrainer

from ..errors import config_error, plain
from .base import TRLLoop
from .fused import use_fast_lm_heads


@dataclass
class PreferencePairs:
    """One micro-batch of preference pairs, as `DPOLoop.preference_loss` receives it. Each tensor has one value per
    pair: log-probabilities are summed over the completion's tokens (the prompt is not scored)."""

    chosen_logps: torch.Tensor  # the policy's, with gradient
    rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor  # the reference's, without gradient
    ref_rejected_logps: torch.Tensor
    chosen_tokens: torch.Tensor  # completion tokens scored (float)
    rejected_tokens: torch.Tensor

    @property
    def chosen_logratios(self) -> torch.Tensor:
        """log pi(chosen) - log ref(chosen): TRL's `rewards/chosen` is `beta` times this."""
        return self.chosen_logps - self.ref_chosen_logps

    @property
    def rejected_logratios(self) -> torch.Tensor:
        return self.rejected_logps - self.ref_rejected_logps


class FirstForward:
    """The model, called as TRL calls it; keeps the output of the first call (`_compute_loss`'s policy forward)."""

    def __init__(self, model):
        self.model, self.output = model, None

    def __call__(self, *args, **kwargs):
        output = self.model(*args, **kwargs)
        if self.output is None:
            self.output = output
        return output


class DPOLoop(DPOTrainer, TRLLoop):
    """TRL's `DPOTrainer`: its arguments, data preparation, collator and loss; loopkit's run (loopkit/trl/base.py).

    A subclass may define `preference_loss(self, pairs: PreferencePairs) -> Tensor` (one loss per pair; the loop
    takes their mean): it then replaces TRL's `loss_type`, and TRL's metrics are logged as before."""

    args_class = DPOConfig  # the config whose fields this loop honours (loopkit/args/checks.py)
    preference_loss = None  # None: TRL's `loss_type`; a subclass's method: its own loss

    def __init__(self, *args, **kwargs):
        if self.preference_loss is not None:  # before TRL's preparation, which may precompute over the dataset
            config = inspect.signature(DPOTrainer.__init__).bind(self, *args, **kwargs).arguments.get("args")
            refuse_unused_loss_fields(config)
        super().__init__(*args, **kwargs)
        use_fast_lm_heads(self, dpo_head_outputs(self.use_weighting))  # TRL's head, less work (loopkit/trl/fused.py)

    __init__.__signature__ = inspect.signature(DPOTrainer.__init__)  # DPOTrainer's arguments, as help() shows them

    # -- the loss -------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.preference_loss is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL's own `_compute_loss` runs the policy forward and logs its metrics; the reference log-probs go in the
        # batch as TRL's precomputed ones do, so the reference runs once; the loss is this class's.
        inputs = self.with_reference_logps(inputs)
        policy = FirstForward(model)
        with self.reference_in_batch():
            result = super().compute_loss(policy, inputs, return_outputs, num_items_in_batch)
        pairs = preference_pairs(policy.output, inputs)
        per_pair = self.preference_loss(pairs)
        if per_pair.shape != pairs.chosen_logps.shape:
            raise ValueError(f"{type(self).__name__}.preference_loss returned shape {tuple(per_pair.shape)}: it "
                             f"returns one loss per pair, shape {tuple(pairs.chosen_logps.shape)}")
        loss = per_pair.mean()
        if self.aux_loss_enabled:  # the MoE router's loss, as TRL adds it
            loss = loss + self.router_aux_loss_coef * policy.output.aux_loss
        return (loss, result[1]) if return_outputs else loss

    def with_reference_logps(self, inputs: dict) -> dict:
        """The batch with the reference's log-probs (TRL's `compute_ref_log_probs`, as TRL's precompute calls it)."""
        if self.precompute_ref_logps:
            return inputs
        ref_chosen, ref_rejected = self.compute_ref_log_probs(self.ref_model or self.model, inputs)
        return {**inputs, "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}

    @contextlib.contextmanager
    def reference_in_batch(self):
        """TRL's `_compute_loss` reads the reference log-probs from the batch while `precompute_ref_logps` is set."""
        precompute, self.precompute_ref_logps = self.precompute_ref_logps, True
        try:
            yield
        finally:
            self.precompute_ref_logps = precompute


def dpo_head_outputs(use_weighting: bool) -> tuple:
    """The fields DPOTrainer asks its policy's fused LM head for (its __init__); the reference's: log-probs only."""
    return ("log_probs", "entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if use_weighting else ())


def preference_pairs(policy_output, inputs: dict) -> PreferencePairs:
    """The pairs of one micro-batch (chosen rows first, as TRL's collator stacks them) from the policy's fused-head
    output and the batch's reference log-probs, summed over the completion as TRL sums them."""
    scored = inputs["completion_mask"][..., 1:]  # the tokens that are predicted: TRL's shifted completion mask
    logps = policy_output.log_probs[:, -scored.size(1):].sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    chosen_tokens, rejected_tokens = scored.sum(dim=1).float().chunk(2, dim=0)
    return PreferencePairs(chosen_logps, rejected_logps, inputs["ref_chosen_logps"], inputs["ref_rejected_logps"],
                           chosen_tokens, rejected_tokens)


# DPOConfig fields that only TRL's built-in losses read: with a `preference_loss` of one's own they would do nothing.
UNUSED_WITH_OWN_LOSS = {"loss_type": ["sigmoid"], "loss_weights": None, "label_smoothing": 0.0,
                        "use_weighting": False, "ld_alpha": None, "f_divergence_type": "reverse_kl"}


def refuse_unused_loss_fields(config) -> None:
    for field_name, default in UNUSED_WITH_OWN_LOSS.items():
        value = plain(getattr(config, field_name, default))
        if value != default:
            raise config_error(field_name, value, "a DPOLoop subclass with its own preference_loss does not use "
                               "TRL's loss settings", f"leave {field_name} at {default!r}, or compute what it "
                               "does inside preference_loss")
