"""A preference-training step stage with a frozen reference model, written against the stage contract only.

For TRL's DPO (its data formats, loss types and metrics) use `loopkit.trl.DPOLoop` (docs/trl.md); a loss of your own
there is one small subclass of its step stage, `loopkit.trl.dpo.DPOStep`, defining `preference_loss(pairs)`, passed
as `DPOLoop(..., step=YourStep())`. This file stays as the example of a step stage written from scratch.

DPO (Rafailov et al., 2023) on batches of chosen/rejected pairs, with log-probabilities summed over the response
tokens only:

    margin = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
    loss   = mean over pairs of -log sigmoid(beta * margin) * weight

A batch holds `chosen_ids`, `chosen_attention_mask`, `chosen_response_mask` and the same for `rejected_`, plus an
optional per-pair `weight` (1 when absent). The loss is a per-micro-batch mean, so the stage declares
`loss_is_scaled_for_ga = False` and the loop divides it by the number of micro-batches of a window (docs/stages.md, "The
loss-scaling rule for overrides"). The reference model gets no gradient, is never updated, and follows the run's
device in `prepare`. Use `remove_unused_columns=False`: the pair columns are not arguments of the model's forward.

    from dpo_step import PreferenceStep
    Loop(policy, args, train_dataset=pairs, step=PreferenceStep(reference, beta=0.1)).train()
"""

from __future__ import annotations

import torch
from torch import nn

from loopkit import StepStage


def response_logprob(model, ids, attention_mask, response_mask) -> torch.Tensor:
    """Sum of log p(token | previous tokens) over each sequence's response tokens."""
    logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1].float()
    token_logprob = logits.log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(2)
    return (token_logprob * response_mask[:, 1:]).sum(1)


def pair_logprobs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected log-probabilities from one forward over both halves."""
    both = {name: torch.cat([batch[f"chosen_{name}"], batch[f"rejected_{name}"]])
            for name in ("ids", "attention_mask", "response_mask")}
    return response_logprob(model, both["ids"], both["attention_mask"], both["response_mask"]).chunk(2)


def dpo_margin(policy, reference, batch) -> torch.Tensor:
    chosen, rejected = pair_logprobs(policy, batch)
    with torch.no_grad():
        ref_chosen, ref_rejected = pair_logprobs(reference, batch)
    return (chosen - ref_chosen) - (rejected - ref_rejected)


class PreferenceStep(StepStage):
    """The step stage with DPO's loss against a frozen reference policy."""

    loss_is_scaled_for_ga = False  # a mean over the micro-batch's pairs: the loop divides by the window's size

    def __init__(self, reference, beta: float = 0.1, nonfinite: str = "ignore"):
        super().__init__(nonfinite=nonfinite)
        self.reference = reference.eval().requires_grad_(False)
        self.beta = beta
        self.history = []  # per micro-batch: (loss, mean margin), device tensors (recorded without a sync)

    def prepare(self, max_steps, checkpoint):
        super().prepare(max_steps, checkpoint)
        self.reference.to(self.context.accelerator.device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        margin = dpo_margin(model, self.reference, inputs)
        weight = inputs["weight"] if "weight" in inputs else torch.ones_like(margin)
        loss = (-nn.functional.logsigmoid(self.beta * margin) * weight).mean()
        self.history.append((loss.detach(), margin.detach().mean()))
        return (loss, {"margin": margin}) if return_outputs else loss
