"""The chunked loss's three matrix products with the output head's weight W (vocab x hidden), chunk by chunk:
the logits `chunk @ W.T (+ bias)`, the hidden states' gradient `grad_logits @ W`, and the weight's gradient, the sum
over chunks of `grad_logits.T @ chunk`. They are most of a step's time on a language model's training step with a
large vocabulary.

Two ways to compute them, the same float32 math:
* `BlasProducts`: torch's `mm` / `addmm_` (the BLAS torch is built with), on every device;
* `OneDnnProducts`: on an x86 CPU where torch has oneDNN, float32 without autocast and W a plain tensor (not
  sharded): oneDNN's linear kernel, with W laid out for it once per step (W does not change within a step). The
  ladder's profile (docs/performance.md) shows the time it saves on the machine it ran on: there torch's BLAS (MKL)
  ran these products at about half oneDNN's speed. It holds up to two more tensors of W's size while the loss runs
  (the laid-out W, and a chunk's part of the weight's gradient beside the sum).
"""

from __future__ import annotations

import platform

import torch
from torch import nn

from ..private_api import onednn_linear

ON_X86 = platform.machine().lower() in ("x86_64", "amd64")  # where oneDNN's products were measured


class BlasProducts:
    """torch.mm / addmm_. `reuse_buffer`: the chunks' logits go into one buffer (on a CPU, where a fresh block each
    chunk cost its page faults; float32 without autocast, where the product writes float32)."""

    def __init__(self, weight, bias, chunk_rows: int, reuse_buffer: bool):
        self.weight, self.bias, self.summed = weight, bias, None
        self.buffer = torch.empty(chunk_rows, weight.shape[0], dtype=torch.float32) if reuse_buffer else None

    def logits(self, chunk):
        """The chunk's logits, in float32."""
        weight, bias = self.weight, self.bias
        if self.buffer is None:
            return (chunk @ weight.T if bias is None else torch.addmm(bias, chunk, weight.T)).float()
        out = self.buffer[:chunk.shape[0]]
        return torch.mm(chunk, weight.T, out=out) if bias is None else torch.addmm(bias, chunk, weight.T, out=out)

    def hidden_grad(self, grad_logits):
        return grad_logits @ self.weight

    def add_weight_grad(self, grad_logits, rows):
        self.summed = grad_logits.T @ rows if self.summed is None else self.summed.addmm_(grad_logits.T, rows)

    def weight_grad(self):
        return self.summed


class OneDnnProducts:
    """oneDNN's linear kernel (private_api.onednn_linear), always on chunks of `chunk_rows` rows: a shorter chunk
    (the step's last) is padded with zero rows, whose logits are computed and left out. oneDNN keeps what it builds
    for each shape it meets (tens of MB for the ladder's head: RSS grew without bound when the last chunk's rows
    changed from step to step).
    The logits' product takes W laid out for it (a copy of W, once per step); the hidden states' gradient takes W.T
    as it is (oneDNN's fast layout for that product already); the weight's gradient is summed transposed (hidden x
    vocab, its fast layout) and transposed once at the end."""

    def __init__(self, weight, bias, chunk_rows: int, linear, layout):
        self.linear, self.layout, self.weight, self.bias = linear, layout, weight, bias
        self.rows, self.for_logits, self.summed_t = chunk_rows, None, None
        self.padded = None  # a short chunk's logits with its padding rows (the returned logits are its first rows)

    def full_rows(self, rows):
        """`rows` with zero rows after them up to the chunk's size."""
        if rows.shape[0] == self.rows:
            return rows
        return torch.cat([rows, rows.new_zeros(self.rows - rows.shape[0], rows.shape[1])])

    def logits(self, chunk):
        if self.for_logits is None:
            self.for_logits = self.layout(self.weight, self.rows)
        logits = self.linear(self.full_rows(chunk), self.for_logits, self.bias)
        self.padded = logits if chunk.shape[0] != self.rows else None
        return logits[:chunk.shape[0]]

    def full_logit_rows(self, grad_logits):
        """`grad_logits` with padding rows: a short chunk's padded logits when `grad_logits` is what `logits()`
        returned, turned into the gradient in place (the loss does that), else a padded copy."""
        if grad_logits.shape[0] == self.rows:
            return grad_logits
        if self.padded is not None and grad_logits.data_ptr() == self.padded.data_ptr():
            return self.padded
        return self.full_rows(grad_logits)

    def hidden_grad(self, grad_logits):
        return self.linear(self.full_logit_rows(grad_logits), self.weight.T)[:grad_logits.shape[0]]

    def add_weight_grad(self, grad_logits, rows):
        # (grad_logits.T @ rows).T; the padding rows of `rows` are zero: they add nothing
        part = self.linear(self.full_rows(rows).T.contiguous(), self.full_logit_rows(grad_logits).T)
        self.summed_t = part if self.summed_t is None else self.summed_t.add_(part)

    def weight_grad(self):
        self.for_logits = self.padded = None  # the chunks are done: one copy of W fewer during the transpose
        return None if self.summed_t is None else self.summed_t.T.contiguous()


def head_products(hidden, weight, bias, chunk_rows: int):
    """The products for this step's chunks: oneDNN's where it serves (module docstring), else BLAS's."""
    rows = min(chunk_rows, hidden.shape[0])
    plain_float32_on_cpu = (
        hidden.device.type == "cpu" and all(type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.float32
                                            for t in (weight, bias) if t is not None)
        and not torch.is_autocast_enabled("cpu"))
    onednn = onednn_linear() if plain_float32_on_cpu and ON_X86 else None
    if onednn is None:
        return BlasProducts(weight, bias, rows, reuse_buffer=plain_float32_on_cpu)
    # a step with fewer rows than a chunk pads them to a multiple of 64 only: few shapes, little padding
    padded_rows = chunk_rows if hidden.shape[0] >= chunk_rows else min(chunk_rows, -(-hidden.shape[0] // 64) * 64)
    return OneDnnProducts(weight, bias, padded_rows, *onednn)
