"""`DPOLoop`: TRL's `DPOTrainer` on loopkit's loop (docs/trl.md). `DPOTrainer(` becomes `DPOLoop(`.

Everything TRL's trainer does is TRL's own code (loopkit/trl/base.py): the data formats and tokenisation, the
collator, the reference model (explicit, loaded from the policy's path, a PEFT adapter switched off, or log-probs
precomputed before training), every `loss_type` and every metric it logs. What DPOLoop adds:

- The loss in the step stage, `DPOStep`: TRL's `loss_type` by default; a preference loss of one's own is one small
  `DPOStep` subclass defining `preference_loss(pairs)` (the chosen/rejected log-probs of the policy and of the
  reference in, a per-pair loss out), passed as `DPOLoop(..., step=YourStep())`; TRL's forward passes and metrics
  are kept (docs/trl.md).
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
from ..trainer.overridable import HFMethods
from .base import LoopKeywords, TRLLoop, TRLStepStage
from .fused import use_fast_lm_heads


@dataclass
class PreferencePairs:
    """One micro-batch of preference pairs, as `DPOStep.preference_loss` receives it. Each tensor has one value per
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


class DPOStep(TRLStepStage):
    """DPO's step stage: the loss of each micro-batch, then loopkit's accumulation, clipping and optimizer step.

    By default the loss is TRL's (`DPOConfig.loss_type`: DPOTrainer's `compute_loss`, handed over by `DPOLoop` as
    `trl_loss`). A subclass that defines `preference_loss(self, pairs: PreferencePairs) -> Tensor` (one loss per
    pair; the stage takes their mean) trains on that loss instead, with TRL's forward passes, reference and metrics
    (`trl_pairs`, handed over by `DPOLoop`); pass it as `DPOLoop(..., step=YourStep())`."""

    preference_loss = None  # None: TRL's `loss_type`; a subclass's method: its own loss
    trl_loss = trl_pairs = None  # DPOTrainer's loss, and its forward passes and metrics (DPOLoop sets them)

    @property
    def beta(self) -> float:
        """`DPOConfig.beta`, the scale of TRL's logged `rewards/*` (beta times the log-ratios)."""
        return self.run.args.beta

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.preference_loss is None:
            return self.trl_loss(model, inputs, return_outputs, num_items_in_batch)
        result, pairs, router_loss = self.trl_pairs(model, inputs, return_outputs, num_items_in_batch)
        per_pair = self.preference_loss(pairs)
        if per_pair.shape != pairs.chosen_logps.shape:
            raise ValueError(f"{type(self).__name__}.preference_loss returned shape {tuple(per_pair.shape)}: it "
                             f"returns one loss per pair, shape {tuple(pairs.chosen_logps.shape)}")
        loss = per_pair.mean() + router_loss
        return (loss, result[1]) if return_outputs else loss


class DPOLoop(LoopKeywords, DPOTrainer, TRLLoop):
    """TRL's `DPOTrainer`: its arguments, data preparation, collator and loss; loopkit's run (loopkit/trl/base.py).

    `step=` takes a `DPOStep` (a subclass with its own `preference_loss`: it then replaces TRL's `loss_type`, and
    TRL's metrics are logged as before)."""

    args_class = DPOConfig  # the config whose fields this loop honours (loopkit/args/checks.py)
    stage_classes = {**TRLLoop.stage_classes, "step": DPOStep}
    stage_hooks = {"preference_loss": "step"}
    compute_loss = HFMethods.compute_loss  # the step stage's: TRL's loss, or the stage's own preference_loss

    def __init__(self, *args, **kwargs):
        step = kwargs.get("step")
        if getattr(step, "preference_loss", None) is not None:  # before TRL's preparation (it may precompute)
            trl_signature = inspect.signature(DPOTrainer.__init__)  # loopkit's keywords aside (LoopKeywords)
            trl_kwargs = {name: value for name, value in kwargs.items() if name in trl_signature.parameters}
            refuse_unused_loss_fields(trl_signature.bind(self, *args, **trl_kwargs).arguments.get("args"))
        super().__init__(*args, **kwargs)
        use_fast_lm_heads(self, dpo_head_outputs(self.use_weighting))  # TRL's head, less work (loopkit/trl/fused.py)
        self.step.trl_loss = DPOTrainer.compute_loss.__get__(self)
        self.step.trl_pairs = self.scored_pairs

    def scored_pairs(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's forward passes and metrics of one micro-batch, for a loss of one's own: TRL's `compute_loss` result,
        the batch's `PreferencePairs`, and the MoE router's loss term as TRL adds it (0 without a router)."""
        # The reference log-probs go in the batch as TRL's precomputed ones do, so the reference runs once; TRL's own
        # `_compute_loss` runs the policy forward and logs its metrics.
        inputs = self.with_reference_logps(inputs)
        policy = FirstForward(model)
        with self.reference_in_batch():
            result = DPOTrainer.compute_loss(self, policy, inputs, return_outputs, num_items_in_batch)
        router_loss = self.router_aux_loss_coef * policy.output.aux_loss if self.aux_loss_enabled else 0.0
        return result, preference_pairs(policy.output, inputs), router_loss

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
            raise config_error(field_name, value, "a DPOStep with its own preference_loss does not use TRL's loss "
                               "settings", f"leave {field_name} at {default!r}, or compute what it does inside "
                               "preference_loss")
