"""TRL's fused LM head, with less work: log-probs and metrics from one pass over the logits of the scored tokens.

TRL's SFT and DPO trainers patch the model (`trl.trainer.utils.add_fused_lm_head`) so that
`model(..., labels=labels, fused_lm_head=True)` returns per-token log-probs, and the metrics TRL logs (entropy, mean
logit, whether the label is the top-1 token) instead of logits. On a CPU, TRL's head scores every position, padding
and prompt included, folds each logits tile through a dozen full-size temporaries, and recomputes the logits in the
backward. `use_fast_lm_head` wraps that forward with the same contract (`FusedCausalLMOutput`, the same numbers to
float rounding) and does less:

* only the positions whose label counts (not -100: no padding, no prompt, no packing boundary) get logits;
* one matrix product and one softmax per token give the log-prob, entropy, mean logit, log(sum p^2) and top-1
  (torch's `max` returns the first maximal index, as TRL's `is_top1` counts ties);
* the softmax is kept for the backward, which turns it into the logits' gradient in place (no second projection),
  while the scored tokens' probabilities fit in `KEEP_PROBS_BYTES`; beyond that the backward recomputes them a chunk
  of tokens at a time, as TRL's does, so memory stays bounded on long batches.

Anything else goes to TRL's own head, unchanged: a model on an accelerator (TRL's Triton kernel), weights or hidden
states not float32 or under autocast, a sharded (DTensor) head, a head that is not a plain linear layer of the last
hidden states (logit soft-capping, a logit scale or multiplier), a temperature or fp32 cast (GRPO, RLOO), an MoE
model asked for its router loss, and vision-language models.
"""

from __future__ import annotations

import functools
import types

import torch

# The scored tokens' softmax is kept for the backward up to this size (float32); beyond it, it is recomputed.
KEEP_PROBS_BYTES = 256 * 2 ** 20
# A chunk of the forward's temporaries holds at most this many logits (16 MiB in float32).
CHUNK_LOGITS = 2 ** 22
OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# Config fields of heads that are more than `hidden @ weight.T + bias` (TRL's head honours them; this one does not).
SCALED_HEAD_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                      "logits_scaling")


class LogProbsAndMetrics(torch.autograd.Function):
    """For N scored tokens: log p(target), and on request the entropy, log(sum p^2), mean logit and top-1 flag of
    `softmax(hidden @ weight.T + bias)`. Differentiable in the log-probs and the entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, outputs: tuple, keep_bytes: int, positions=None):
        ctx.set_materialize_grads(False)
        ctx.positions = positions
        count, vocab = hidden.shape[0], weight.shape[0]
        keep = count * vocab * 4 <= keep_bytes
        probs = torch.empty((count, vocab), dtype=torch.float32, device=hidden.device) if keep else None
        stats = {name: torch.empty(count, dtype=torch.float32, device=hidden.device)
                 for name in ("log_z", "target", "entropy", "sum_sq", "mean")}
        is_top1 = torch.empty(count, dtype=torch.bool, device=hidden.device)
        rows = max(1, CHUNK_LOGITS // vocab)
        if probs is not None:  # one product for the batch, as TRL's head makes it
            project(hidden, weight, bias, probs)
        for start in range(0, count, rows):
            end = min(start + rows, count)
            logits = project(hidden[start:end], weight, bias, None) if probs is None else probs[start:end]
            fold_chunk(logits, targets[start:end], outputs, {k: v[start:end] for k, v in stats.items()},
                       is_top1[start:end])
        ctx.save_for_backward(hidden, weight, bias, targets, stats["log_z"], stats["entropy"], probs)
        log_probs = stats["target"] - stats["log_z"]
        extra = {"entropy": stats["entropy"], "log_sum_sq_probs": stats["sum_sq"], "mean_logits": stats["mean"],
                 "is_top1": is_top1}
        results = [log_probs] + [extra[name] if name in outputs else None for name in OUTPUTS[1:]]
        ctx.mark_non_differentiable(*(x for x in results[2:] if x is not None))
        return tuple(results)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, *_):
        hidden, weight, bias, targets, log_z, entropy, probs = ctx.saved_tensors
        count, vocab = hidden.shape[0], weight.shape[0]
        rows = count if probs is not None and grad_entropy is None else max(1, CHUNK_LOGITS // vocab)
        grads = [torch.zeros_like(x) if x is not None and need else None
                 for x, need in zip((hidden, weight, bias), ctx.needs_input_grad[:3])]
        for start in range(0, count, rows):
            end = min(start + rows, count)
            part = slice(start, end)
            if probs is not None:
                chunk = probs[part]
            else:  # recompute this chunk's softmax from the saved log-normaliser, as TRL's backward does
                chunk = project(hidden[part], weight, bias, None).sub_(log_z[part, None]).exp_()
            grad_logits = logits_grad(chunk, hidden[part], weight, bias, targets[part], log_z[part],
                                      entropy[part], None if grad_log_probs is None else grad_log_probs[part],
                                      None if grad_entropy is None else grad_entropy[part])
            if grads[0] is not None:
                torch.mm(grad_logits, weight, out=grads[0][part])
            if grads[1] is not None:
                spread = ctx.positions if end - start == count else None  # one sum over the batch, as TRL's
                weight_grad_product(grads[1], grad_logits, hidden[part], spread)
            if grads[2] is not None:
                grads[2] += grad_logits.sum(0)
        return (*grads, None, None, None, None)


def weight_grad_product(grad_weight, grad_logits, hidden, positions) -> None:
    """grad_weight += grad_logits.T @ hidden, summed over every position of the batch as TRL's head sums it (the
    unscored ones as zero rows): the same sum in the same order, so the weights TRL's run reaches are reached to the
    bit, where a sum over the scored rows alone rounds differently (a preference metric such as `rewards/chosen`, a
    small difference of large log-probs, shows it)."""
    if positions is None:
        grad_weight.addmm_(grad_logits.T, hidden)
        return
    rows, total = positions
    spread_grad = grad_logits.new_zeros((total, grad_logits.shape[1])).index_copy_(0, rows, grad_logits)
    spread_hidden = hidden.new_zeros((total, hidden.shape[1])).index_copy_(0, rows, hidden)
    grad_weight.addmm_(spread_grad.T, spread_hidden)


def project(hidden, weight, bias, out):
    """hidden @ weight.T + bias, written into `out` when given."""
    if bias is None:
        return torch.mm(hidden, weight.T, out=out)
    return torch.addmm(bias, hidden, weight.T, out=out)


def fold_chunk(logits, targets, outputs, stats: dict, is_top1) -> None:
    """One chunk of tokens: every statistic from its logits, which become its softmax in place. The arithmetic is
    TRL's (`trl.kernels.chunked_logprob`, one tile of the whole vocabulary), so the values round as TRL's do."""
    if "mean_logits" in outputs:
        torch.mean(logits, dim=-1, out=stats["mean"])
    row_max, top = logits.max(dim=-1)  # the first maximal index: TRL's top-1 does not count a tie won earlier
    torch.eq(top, targets, out=is_top1)
    stats["target"].copy_(logits.gather(1, targets[:, None]).squeeze(1))
    exps = torch.exp(logits - row_max[:, None])
    sums = exps.sum(-1)
    torch.add(row_max, torch.log(sums), out=stats["log_z"])
    if "log_sum_sq_probs" in outputs:
        torch.sub(torch.log((exps * exps).sum(-1)), 2 * torch.log(sums), out=stats["sum_sq"])
    if "entropy" in outputs:  # H = log Z - E_p[z]
        torch.sub(stats["log_z"], exps.mul_(logits).sum(-1) / sums, out=stats["entropy"])
    logits.sub_(stats["log_z"][:, None]).exp_()


def logits_grad(probs, hidden, weight, bias, targets, log_z, entropy, grad_log_probs, grad_entropy):
    """The gradient of the chunk's logits, written over its softmax `probs`: d log p_t / dz = onehot_t - p and
    d H / dz = -p (log p + H), rounded as TRL's backward rounds them."""
    if grad_entropy is not None:  # needs log p: from the logits, recomputed (TRL's metrics detach the entropy)
        log_p = project(hidden, weight, bias, None).sub_(log_z[:, None])
        entropy_part = log_p.add_(entropy[:, None]).mul_(probs).mul_(grad_entropy[:, None])
    if grad_log_probs is None:
        probs.zero_()
    else:
        rows = torch.arange(len(targets), device=targets.device)
        at_target = grad_log_probs * (1 - probs[rows, targets])
        probs.mul_(-grad_log_probs[:, None])
        probs[rows, targets] = at_target
    if grad_entropy is not None:
        probs.sub_(entropy_part)
    return probs


def log_probs_and_metrics(hidden, weight, bias, targets, outputs: tuple, keep_bytes: int = KEEP_PROBS_BYTES,
                          positions=None):
    """`LogProbsAndMetrics` over N scored tokens: the five per-token fields of `FusedCausalLMOutput` (None where
    not in `outputs`). `positions`: (the scored tokens' rows among all the batch's positions, their number), for
    the weight's gradient summed as TRL's head sums it."""
    return LogProbsAndMetrics.apply(hidden, weight, bias, targets, tuple(outputs), keep_bytes, positions)


# ---------------------------------------------------------------------------------------------------------------------
# The model's forward
# ---------------------------------------------------------------------------------------------------------------------
def covered_model(model) -> bool:
    """Whether the model's head is one this module computes (module docstring); TRL's head does the rest, also for a
    model an engine has wrapped already (DPO's reference under DeepSpeed is a `DeepSpeedEngine`)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return False
    text_config = model.config.get_text_config()
    if text_config is not model.config:  # a vision-language model
        return False
    head = model.get_output_embeddings()
    plain = isinstance(head, torch.nn.Linear) and all(getattr(text_config, field, None) in (None, 1, 1.0)
                                                      for field in SCALED_HEAD_FIELDS)
    return plain and not getattr(text_config, "output_router_logits", False)


def covered_call(head, kwargs) -> bool:
    """Whether this call is one this module computes: a float32 head on the CPU (not sharded), outside autocast,
    without the router loss."""
    weight = head.weight
    return (weight.device.type == "cpu" and type(weight.data) is torch.Tensor and weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and not kwargs.get("output_router_logits"))


def use_fast_lm_head(model, outputs: tuple) -> None:
    """Wrap the forward TRL's `add_fused_lm_head(model, outputs=outputs)` installed: calls with
    `fused_lm_head=True` that this module covers are computed here, every other call goes to TRL's forward."""
    trl_forward = model.forward
    if not covered_model(model):
        return
    from trl.trainer.utils import FusedCausalLMOutput

    @functools.wraps(type(model).forward)  # TRL's signature: `generate` validates its kwargs against it
    def fast_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                     **kwargs):
        call = dict(fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                    num_items_in_batch=num_items_in_batch)
        head = self.get_output_embeddings()
        if not fused_lm_head or not covered_call(head, kwargs):
            return trl_forward(*args, **call, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        hidden, targets = hidden.to(head.weight), targets.to(head.weight.device)  # as TRL's head: the head's device
        mask = targets != -100
        rows = mask.reshape(-1).nonzero().squeeze(1)
        scored = log_probs_and_metrics(hidden.reshape(-1, hidden.shape[-1])[rows], head.weight, head.bias,
                                       targets.reshape(-1)[rows], outputs, positions=(rows, mask.numel()))
        # `masked_scatter` keeps the output connected to the model even when no label counts (TRL's head does too)
        fields = [None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in scored]
        log_probs = fields[0]
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, **dict(zip(OUTPUTS, fields)), label_mask=mask)

    model.forward = types.MethodType(fast_forward, model)


def use_fast_lm_heads(trainer, outputs: tuple, reference_outputs: tuple = ("log_probs",)) -> None:
    """The fast head on the models a TRL trainer gave TRL's fused head: the policy (the base model under a PEFT
    adapter, as TRL patches it), computing `outputs`, and the reference model if any, computing
    `reference_outputs` (the fields TRL's trainer asked its head for)."""
    from accelerate.utils import is_peft_model

    model = trainer.model
    use_fast_lm_head(model.get_base_model() if is_peft_model(model) else model, outputs)
    if getattr(trainer, "ref_model", None) is not None:
        use_fast_lm_head(trainer.ref_model, reference_outputs)
