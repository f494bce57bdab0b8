"""Chunked cross-entropy (`loopkit.ChunkedLossStep`, loopkit/stages/chunked_loss.py): the same loss and gradients
as the model's own loss, the same training run, and no tensor of batch x seq x vocab logits during a step. The
peak-memory ratio at vocabulary 128k is measured by `python -m benchmarks --only chunked_loss` (docs/packing.md)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from loopkit import ChunkedLossStep, Loop, LoopArgs
from loopkit.private_api import onednn_linear
from loopkit.stages.chunked_loss import (LinearCrossEntropy, causal_lm_targets, chunked_causal_lm_loss,
                                         head_skipped)
from loopkit.stages.head_products import BlasProducts, OneDnnProducts, head_products

from helpers import tiny_llama

VOCAB = 1000


def causal_batch(seed: int = 0) -> dict:
    """3 rows of 10 tokens: a right-padded row (-100 labels, attention mask 0) and a masked prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, :4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def gradients(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("num_items", [None, 40])
def test_chunked_loss_and_gradients_equal_the_model_loss(num_items):
    batch = causal_batch()
    items = torch.tensor(num_items) if num_items is not None else None
    reference = tiny_llama(vocab_size=VOCAB)
    expected = reference(**batch, num_items_in_batch=items).loss
    expected.backward()
    model = tiny_llama(vocab_size=VOCAB)
    with head_skipped(model.lm_head):
        hidden = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    assert hidden.shape[-1] == 16  # the head was skipped: hidden states, not logits
    loss = chunked_causal_lm_loss(hidden, model.lm_head, causal_lm_targets(batch, batch["labels"]), items,
                                  chunk_tokens=7)  # 30 tokens: chunks of 7 and a last one of 2
    loss.backward()
    assert "forward" not in vars(model.lm_head)  # restored
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, gradients(reference)[name], rtol=0, atol=1e-5, msg=name)


def test_a_run_with_chunked_loss_equals_the_default_run(tmp_path):
    data = [{k: v[i] for k, v in causal_batch(seed).items()} for seed in range(4) for i in range(3)]
    loops = {}
    for name, step in (("default", None), ("chunked", ChunkedLossStep(chunk_tokens=5))):
        args = LoopArgs(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        max_steps=3, learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True,
                        save_strategy="no", optim="sgd")  # Adam would magnify float noise on ~0 gradients
        loops[name] = Loop(tiny_llama(vocab_size=VOCAB), args, train_dataset=data, step=step)
        loops[name].train()
    logged = {name: [h["loss"] for h in loop.state.log_history if "loss" in h] for name, loop in loops.items()}
    assert logged["chunked"] == pytest.approx(logged["default"], rel=1e-5) and len(logged["chunked"]) == 3
    for p, q in zip(loops["default"].model.parameters(), loops["chunked"].model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation produced, forward and backward."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel] + sizes)
        return out


def test_a_chunked_step_never_holds_a_tensor_of_all_the_logits(tmp_path):
    batch = causal_batch()
    logits_size = batch["input_ids"].numel() * VOCAB
    largest = {}
    for name, step in (("default", None), ("chunked", ChunkedLossStep(chunk_tokens=8))):
        args = LoopArgs(output_dir=str(tmp_path / name), per_device_train_batch_size=3, max_steps=1,
                        report_to="none", disable_tqdm=True, save_strategy="no")
        loop = Loop(tiny_llama(vocab_size=VOCAB), args, train_dataset=[{k: v[i] for k, v in batch.items()}
                                                                      for i in range(3)], step=step)
        with LargestTensor() as mode:
            loop.train()
        largest[name] = mode.numel
    assert largest["default"] >= logits_size
    # The largest is now the head's weight (and its gradient), 16 x VOCAB, bigger than one chunk (8 x VOCAB).
    assert largest["chunked"] == 16 * VOCAB < logits_size


def test_a_model_whose_logits_are_not_a_linear_head_is_refused(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32))
    args = LoopArgs(output_dir=str(tmp_path), max_steps=1, report_to="none", disable_tqdm=True)
    data = [{"input_ids": torch.arange(5), "labels": torch.tensor(1)}]
    with pytest.raises(ValueError, match="step='ChunkedLossStep on BertForSequenceClassification'.*causal-LM loss"):
        Loop(model, args, train_dataset=data, step=ChunkedLossStep()).train()


def test_chunked_loss_on_packed_rows_equals_the_packed_run(tmp_path):
    """With `PackingDataStage` (position ids, `use_cache=False`, no attention mask) the chunked loss is the same."""
    from loopkit import PackingDataStage

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(1, VOCAB, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g).tolist()
             for _ in range(16))]
    logged = {}
    for name, step in (("default", None), ("chunked", ChunkedLossStep(chunk_tokens=16))):
        args = LoopArgs(output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=2,
                        learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no")
        loop = Loop(tiny_llama(vocab_size=VOCAB), args, train_dataset=data, data=PackingDataStage(row_tokens=24),
                    step=step)
        loop.train()
        logged[name] = [h["loss"] for h in loop.state.log_history if "loss" in h]
    assert logged["chunked"] == pytest.approx(logged["default"], rel=1e-5) and len(logged["chunked"]) == 2


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_linear_cross_entropy_with_a_bias_and_ignored_targets_equals_autograd(chunk_tokens):
    """The custom function's sum, count and gradients against torch's own cross-entropy of the same logits (sum over
    the kept targets), with a bias, -100 targets and chunks that do not divide the tokens (the last one shorter)."""
    torch.manual_seed(0)
    hidden, weight, bias = (torch.randn(37, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True),
                            torch.randn(50, requires_grad=True))
    targets = torch.randint(0, 50, (37,))
    targets[::5] = -100
    total, count = LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_tokens)
    (total * 0.5).backward()  # an upstream gradient other than 1: the backward scales the stored gradients
    ours = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    expected = nn.functional.cross_entropy(hidden @ weight.T + bias, targets, ignore_index=-100, reduction="sum")
    (expected * 0.5).backward()
    assert count.item() == int((targets != -100).sum())
    torch.testing.assert_close(total, expected.detach(), rtol=1e-6, atol=1e-5)
    for name, got, tensor in zip(("hidden", "weight", "bias"), ours, (hidden, weight, bias)):
        torch.testing.assert_close(got, tensor.grad, rtol=0, atol=1e-5, msg=name)
    assert ours[0][::5].abs().max() == 0  # an ignored position gets no gradient


def product_makers():
    makers = {"blas": lambda w, b, rows: BlasProducts(w, b, rows, reuse_buffer=False),
              "blas-reused-buffer": lambda w, b, rows: BlasProducts(w, b, rows, reuse_buffer=True)}
    if onednn_linear() is not None:
        makers["onednn"] = lambda w, b, rows: OneDnnProducts(w, b, rows, *onednn_linear())
    return makers


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("make", list(product_makers().values()), ids=list(product_makers()))
def test_head_products_equal_the_products_in_float64(make, with_bias):
    """Each way of computing the head's products (loopkit/stages/head_products.py), chunk by chunk with a shorter
    last chunk: the logits, the hidden states' gradient and the weight's gradient summed over the chunks, against
    the same products in float64."""
    torch.manual_seed(0)
    weight, hidden, grads = torch.randn(300, 16), torch.randn(23, 16), torch.randn(23, 300)
    bias = torch.randn(300) if with_bias else None
    products, rows = make(weight, bias, 10), 10
    for start in range(0, 23, rows):
        chunk, grad = hidden[start:start + rows], grads[start:start + rows]
        expected = chunk.double() @ weight.double().T + (0 if bias is None else bias.double())
        torch.testing.assert_close(products.logits(chunk).double(), expected, rtol=0, atol=1e-4)
        torch.testing.assert_close(products.hidden_grad(grad).double(), grad.double() @ weight.double(),
                                   rtol=0, atol=1e-4)
        products.add_weight_grad(grad, chunk)
    summed = products.weight_grad()
    assert summed.shape == weight.shape and summed.is_contiguous()
    torch.testing.assert_close(summed.double(), grads.double().T @ hidden.double(), rtol=0, atol=1e-4)


def test_head_products_take_onednn_only_for_plain_float32_on_a_cpu_without_autocast():
    """oneDNN where it serves (an x86 CPU with torch's oneDNN: this machine), torch's BLAS elsewhere: under
    autocast (the product's dtype is autocast's), for a bfloat16 head."""
    import platform

    hidden, weight = torch.randn(4, 8), torch.randn(30, 8)
    on_x86 = platform.machine().lower() in ("x86_64", "amd64") and onednn_linear() is not None
    assert isinstance(head_products(hidden, weight, None, 2), OneDnnProducts if on_x86 else BlasProducts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = head_products(hidden, weight, None, 2)
    assert isinstance(under_autocast, BlasProducts) and under_autocast.buffer is None
    assert isinstance(head_products(hidden, weight.bfloat16(), None, 2), BlasProducts)


def test_linear_cross_entropy_under_autocast_and_with_extreme_logits_equals_autograd():
    """Under CPU bfloat16 autocast the products are autocast's (as the model's own head would compute them); with
    logits hundreds apart (targets far below the row's maximum: softmax values that underflow float32) the loss
    is still the exact log-sum-exp minus the target's logit."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(12, 8), torch.randn(40, 8) * 60
    targets = torch.randint(0, 40, (12,))
    logits = hidden @ weight.T
    assert float((logits.amax(-1) - logits.gather(1, targets[:, None]).squeeze(1)).max()) > 200
    total, _ = LinearCrossEntropy.apply(hidden, weight, None, targets, 5)
    expected = nn.functional.cross_entropy(logits.double(), targets, reduction="sum")
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = LinearCrossEntropy.apply(hidden, weight / 60, None, targets, 5)
        expected = nn.functional.cross_entropy((hidden @ (weight / 60).T).float(), targets, reduction="sum")
    torch.testing.assert_close(total, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(onednn_linear() is None, reason="torch without oneDNN")
def test_onednn_products_meet_one_shape_whatever_the_last_chunk():
    """oneDNN keeps what it builds for each shape it meets (the process grew by ~15 MB a step when the last chunk's
    rows changed from step to step), so every product it runs has the chunk's full rows: a short chunk is padded,
    and its logits and gradients are still the unpadded products."""
    linear, layout = onednn_linear()
    shapes = set()

    def recorded(x, weight, bias=None):
        shapes.add((tuple(x.shape), tuple(weight.shape)))
        return linear(x, weight, bias)

    torch.manual_seed(0)
    weight = torch.randn(300, 16)
    for rows_in_step in (23, 27, 21):  # chunks of 10: the last has 3, 7 and 1 rows
        hidden = torch.randn(rows_in_step, 16)
        products = OneDnnProducts(weight, None, 10, recorded, layout)
        for start in range(0, rows_in_step, 10):
            chunk = hidden[start:start + 10]
            grad = products.logits(chunk)
            torch.testing.assert_close(grad, chunk @ weight.T, rtol=0, atol=1e-4)
            expected_hidden_grad = grad @ weight  # the logits stand in for their gradient here
            torch.testing.assert_close(products.hidden_grad(grad), expected_hidden_grad, rtol=1e-5, atol=1e-4)
            products.add_weight_grad(grad, chunk)
        expected = sum(hidden[s:s + 10].T @ (hidden[s:s + 10] @ weight.T) for s in range(0, rows_in_step, 10)).T
        torch.testing.assert_close(products.weight_grad(), expected, rtol=1e-5, atol=1e-3)
    assert len(shapes) == 3, shapes  # the logits', the hidden gradient's and the weight gradient's: one shape each
