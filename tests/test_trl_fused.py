"""loopkit's fused LM head for TRL's loops (loopkit/trl/fused.py) against TRL's own (`trl.kernels`), live: every
per-token field and every gradient, on the scored tokens only; and which models and calls it leaves to TRL's head.
The runs of SFTLoop and DPOLoop against TRL's trainers are tests/test_trl_sft.py and tests/test_trl_dpo.py."""

from __future__ import annotations

import pytest
import torch

trl_kernels = pytest.importorskip("trl.kernels")

from loopkit.trl import fused  # noqa: E402

ALL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def problem(bias: bool, tokens: int = 40, vocab: int = 3000, width: int = 16):
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = (torch.randn(vocab, width) * 0.3).requires_grad_()
    bias_tensor = (torch.randn(vocab) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (tokens,))
    with torch.no_grad():  # a tie for the top logit, won by an earlier token than the target: not top-1
        hidden[0] = 0.0
        if bias_tensor is not None:
            bias_tensor[:] = 0.0
    targets[1] = (hidden[1].detach() @ weight.detach().T + (0 if bias_tensor is None else bias_tensor.detach())
                  ).argmax()  # the top-1 token
    return hidden, weight, bias_tensor, targets


def forward_backward(function, hidden, weight, bias, targets, entropy_grad: bool):
    outputs = function(hidden, weight, bias, targets)
    torch.manual_seed(1)
    loss = (outputs[0] * torch.randn(len(targets))).sum()
    if entropy_grad:
        loss = loss + (outputs[1] * torch.randn(len(targets))).sum()
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    grads = torch.autograd.grad(loss, leaves)
    return [x.detach() for x in outputs], list(grads)


@pytest.mark.parametrize("keep_bytes", [fused.KEEP_PROBS_BYTES, 0], ids=["softmax-kept", "softmax-recomputed"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["log-prob-grad", "entropy-grad-too"])
def test_every_field_and_gradient_equals_trls_head(keep_bytes, bias, entropy_grad):
    hidden, weight, bias_tensor, targets = problem(bias)

    def trls(h, w, b, t):
        return trl_kernels.ChunkedLogProbFunction.apply(h, w, b, t, 1.0, 32768, None, 1.0, ALL)

    def loopkits(h, w, b, t):
        return fused.log_probs_and_metrics(h, w, b, t, ALL, keep_bytes)

    theirs, their_grads = forward_backward(trls, hidden, weight, bias_tensor, targets, entropy_grad)
    ours, our_grads = forward_backward(loopkits, hidden, weight, bias_tensor, targets, entropy_grad)
    assert not theirs[4][0] and theirs[4][1]  # the tie and the top-1 token are both there
    for name, mine, expected in zip(ALL, ours, theirs):
        if name == "is_top1":
            assert torch.equal(mine, expected)
        else:
            torch.testing.assert_close(mine, expected, rtol=1e-6, atol=1e-6, msg=name)
    for mine, expected in zip(our_grads, their_grads):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)


def test_only_the_requested_fields_are_returned():
    hidden, weight, _, targets = problem(False)
    outputs = fused.log_probs_and_metrics(hidden, weight, None, targets, ("log_probs",))
    assert outputs[0].shape == (len(targets),) and all(x is None for x in outputs[1:])


def tiny_llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, **config))


def test_model_forward_scores_label_tokens_only_and_keeps_trls_contract(monkeypatch):
    """The wrapped forward returns TRL's `FusedCausalLMOutput` with TRL's numbers (every field zero where the label
    is -100), and the head computes logits for the tokens whose label counts, not for every position."""
    from trl.trainer.utils import add_fused_lm_head

    ours, theirs = tiny_llama(), tiny_llama()
    for model in (ours, theirs):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    fused.use_fast_lm_head(ours, ("log_probs", "entropy", "is_top1"))
    scored = []
    original = fused.log_probs_and_metrics
    monkeypatch.setattr(fused, "log_probs_and_metrics",
                        lambda hidden, *rest, **options: scored.append(hidden.shape[0])
                        or original(hidden, *rest, **options))
    ids = torch.randint(0, 500, (3, 9))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    labels[2, 6:] = -100  # padding
    mine = ours(input_ids=ids, labels=labels, fused_lm_head=True)
    expected = theirs(input_ids=ids, labels=labels, fused_lm_head=True)
    assert scored == [int((labels[:, 1:] != -100).sum())] and scored[0] < 3 * 8
    for name in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(mine, name), getattr(expected, name), rtol=1e-6, atol=1e-6)
    assert torch.equal(mine.is_top1, expected.is_top1) and torch.equal(mine.label_mask, expected.label_mask)
    assert mine.mean_logits is None and expected.mean_logits is None
    assert ours(input_ids=ids).logits.shape == (3, 9, 500)  # without fused_lm_head: the model's own forward


def test_uncovered_models_and_calls_go_to_trls_head(monkeypatch):
    from trl.trainer.utils import add_fused_lm_head

    calls = []
    monkeypatch.setattr(fused, "log_probs_and_metrics", lambda *args, **options: calls.append(1))
    capped = tiny_llama()
    capped.config.final_logit_softcapping = 30.0  # a head that is more than a linear layer: left as TRL set it
    add_fused_lm_head(capped)
    trl_forward = capped.forward
    fused.use_fast_lm_head(capped, ("log_probs",))
    assert capped.forward == trl_forward
    model = tiny_llama()
    add_fused_lm_head(model)
    fused.use_fast_lm_head(model, ("log_probs",))
    ids = torch.randint(0, 500, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: TRL's head (it rounds in bf16)
        output = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert calls == [] and output.log_probs.shape == (2, 5)
