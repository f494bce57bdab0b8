"""Chunked cross-entropy: a step stage that trains a causal LM without materialising batch x seq x vocab logits.

The model runs with its output head skipped, so its forward returns the last hidden states; the loss is computed
from them and the head's weight a chunk of tokens at a time (`LinearCrossEntropy`, a custom autograd function that
also computes its gradients chunk by chunk, so no step of forward or backward holds more than one chunk of logits).
The loss is HF's `ForCausalLMLoss`: labels shifted by one, -100 ignored, the sum over tokens divided by
`num_items_in_batch` (the window's label tokens) or, without it, the mean over the batch's tokens.

    from loopkit import ChunkedLossStep
    Loop(model, args, train_dataset=data, step=ChunkedLossStep()).train()

Only training chunks: evaluation keeps the model's own forward, whose logits `compute_metrics` and
`prediction_step` need. Models whose head does more than a linear layer (logit soft-capping, a logit scale) are
refused with a clear error, as are models that are not causal LMs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import config_error
from ..models import base_model
from ..private_api import softmax_in_place
from .head_products import head_products
from .step import StepStage, is_causal_lm

IGNORE = -100
# A chunk holds at most this many logits unless `chunk_tokens` says otherwise. On a GPU, 32 MiB in float32: few
# kernel launches a step. On a CPU, 8 MiB: the chunk stays in the last-level cache from the matrix product that
# writes it, through the softmax, to the two products that read it back (head_products.py: how the products run).
CHUNK_LOGITS = {"cpu": 2 ** 21}
CHUNK_LOGITS_ELSEWHERE = 2 ** 23


class LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T + bias, targets), ignoring -100; returns (sum, count).

    The forward computes the gradients chunk by chunk (softmax minus the one-hot target), so the backward only
    scales them, in place (autograd then refuses a second backward through the same graph). A chunk's logits are
    the only large tensor: their row maxima and target logits are read, then torch's softmax kernel turns them into
    the softmax (in place on a CPU), whose largest value per row, 1 / sum of the exponentials, gives the
    log-sum-exp (the softmax is as accurate as F.cross_entropy's own gradient). On a CPU the ignored targets' rows
    are left out of the matrix products (there is no device to wait for to learn which they are); elsewhere they
    are zeroed through the small operands of the two products, without a host sync."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int):
        valid = targets.ne(IGNORE)
        count, all_rows = valid.sum(), hidden
        if hidden.device.type == "cpu":
            rows = valid.nonzero().squeeze(1)
            hidden, targets, valid = hidden.index_select(0, rows), targets.index_select(0, rows), None
        wanted = ctx.needs_input_grad[:3]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_bias = None
        products = head_products(hidden, weight, bias, chunk_tokens)
        for start in range(0, hidden.shape[0], chunk_tokens):
            chunk = hidden[start:start + chunk_tokens].to(weight.dtype)
            target = targets[start:start + chunk_tokens].clamp(min=0)
            logits = products.logits(chunk)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            row_max = logits.amax(dim=-1)
            probs = softmax_in_place(logits) if logits.device.type == "cpu" else torch.softmax(logits, -1)
            # log-sum-exp: the largest logit's softmax is exp(0) / sum, at least 1 / vocab (never 0)
            losses = row_max - probs.amax(dim=-1).log() - picked
            kept = None if valid is None else valid[start:start + chunk_tokens, None].to(weight.dtype)
            total += losses.sum() if kept is None else (losses * kept[:, 0]).sum()
            if not any(wanted):
                continue
            grad_logits = probs
            grad_logits[torch.arange(len(target), device=target.device), target] -= 1.0
            grad_logits = grad_logits.to(weight.dtype)
            if grad_hidden is not None:
                grad = products.hidden_grad(grad_logits)
                grad_hidden[start:start + chunk_tokens] = grad if kept is None else grad * kept
            if wanted[1]:
                products.add_weight_grad(grad_logits, chunk if kept is None else chunk * kept)
            if bias is not None and wanted[2]:
                grad = grad_logits.sum(0) if kept is None else kept[:, 0] @ grad_logits
                grad_bias = grad if grad_bias is None else grad_bias.add_(grad)
        grad_weight = products.weight_grad() if wanted[1] else None
        if grad_hidden is not None and valid is None:  # the ignored rows' gradient is zero
            grad_hidden = torch.zeros_like(all_rows).index_copy_(0, rows, grad_hidden.to(all_rows.dtype))
        zeros = lambda grad, like: torch.zeros_like(like) if grad is None and like is not None else grad  # noqa: E731
        ctx.save_for_backward(grad_hidden, zeros(grad_weight, weight if wanted[1] else None),
                              zeros(grad_bias, bias if wanted[2] else None))
        return total, count

    @staticmethod
    def backward(ctx, grad_total, grad_count):
        grads = ctx.saved_tensors
        return (*(g.mul_(grad_total.to(g.dtype)) if g is not None else None for g in grads), None, None)


def causal_lm_targets(inputs, labels) -> torch.Tensor:
    """What each position predicts: `shift_labels` if the batch has them, else the labels shifted by one (HF)."""
    if "shift_labels" in inputs:
        return inputs["shift_labels"]
    return nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE)


def chunked_causal_lm_loss(hidden, head: nn.Linear, targets, num_items_in_batch=None,
                           chunk_tokens: int | None = None) -> torch.Tensor:
    """HF's causal-LM loss from the last hidden states and the output head, one chunk of tokens at a time."""
    logits_per_chunk = CHUNK_LOGITS.get(hidden.device.type, CHUNK_LOGITS_ELSEWHERE)
    chunk_tokens = chunk_tokens or max(1, logits_per_chunk // head.weight.shape[0])
    total, count = LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias,
                                            targets.reshape(-1).to(hidden.device), chunk_tokens)
    if num_items_in_batch is None:
        return total / count  # HF's mean over the batch's label tokens
    return total / torch.as_tensor(num_items_in_batch, device=total.device)


def chunkable_head(model) -> nn.Linear:
    """The model's output head, if the loss can be computed from it and the last hidden states alone."""
    base = base_model(model)
    name = type(base).__name__
    if not is_causal_lm(base):
        raise config_error("step", f"ChunkedLossStep on {name}", "chunked cross-entropy is the causal-LM loss",
                           "use it with a *ForCausalLM model, or the default step stage")
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    config = getattr(base, "config", None)
    extra = [a for a in ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
             if getattr(config, a, None) not in (None, 1, 1.0)]
    if not isinstance(head, nn.Linear) or extra:
        raise config_error("step", f"ChunkedLossStep on {name}", "its logits are not a plain linear layer of the "
                           f"last hidden states (head: {type(head).__name__}{', config: ' if extra else ''}"
                           f"{', '.join(extra)})", "use the default step stage for this model")
    return head


@contextlib.contextmanager
def head_skipped(head: nn.Module):
    """Within the block the head returns its input, so the model's `logits` are the last hidden states."""
    saved = vars(head).get("forward")  # a hook library may have set its own
    head.forward = lambda hidden: hidden
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


class ChunkedLossStep(StepStage):
    """`StepStage` whose training loss is chunked cross-entropy (module docstring). `chunk_tokens`: tokens per
    chunk (default: as many as keep one chunk's logits at 2**21 values on a CPU, 2**23 elsewhere)."""

    def __init__(self, chunk_tokens: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if chunk_tokens is not None and chunk_tokens < 1:
            raise config_error("chunk_tokens", chunk_tokens, "a chunk holds at least one token",
                               "pass a positive number, or None for the default")
        self.chunk_tokens, self.head = chunk_tokens, None

    def prepare_hot_path(self) -> None:
        super().prepare_hot_path()
        self.head = chunkable_head(self.run.model)

    def warn_if_override_scaling_is_implicit(self) -> None:
        pass  # the loss follows the default rule: normalised by num_items_in_batch when the model takes it

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        run, context = self.run, self.context
        chunked = (model.training and not return_outputs and run.compute_loss_func is None
                   and isinstance(inputs, Mapping) and "labels" in inputs and self.head is not None)
        if not chunked:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        forward_inputs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        with head_skipped(self.head):
            outputs = model(**forward_inputs)
        hidden = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        targets = causal_lm_targets(inputs, inputs["labels"])
        if not run.model_accepts_loss_kwargs:
            num_items_in_batch = None  # the default step's rule: a per-batch mean, divided over the window
        loss = chunked_causal_lm_loss(hidden, self.head, targets, num_items_in_batch, self.chunk_tokens)
        if run.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * context.accelerator.num_processes  # as StepStage.compute_loss: DDP averages the gradients
        return loss
