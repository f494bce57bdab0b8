"""Attention text by text in packed rows, with torch's `scaled_dot_product_attention`: what flash-attention's
variable-length kernels do on a GPU, for the CPU (or any device) where `sdpa` is what runs.

With `sdpa`, a packed row (position ids restarting per text, no attention mask) gets a block-diagonal causal mask
from transformers, and attention computes every query against every key of the row, then masks all but its own
text's: a row of 16 texts does about 16 times the attention it needs. `use_per_text_attention(model)` switches the
model to the attention function below, which splits the row at the position ids' restarts and runs `sdpa` on each
text alone (causal or not, as the model's attention is: an encoder's packed texts each see the whole of
themselves). The numbers are `sdpa`'s for the same texts (tests/test_per_text_attention.py).

The boundaries are read on the host, in every attention layer: free on a CPU, a wait for the device per layer on a
GPU, where `attn_implementation="flash_attention_2"` splits packed rows in its kernels instead.

    from loopkit import use_per_text_attention
    use_per_text_attention(model)          # then Loop(model, ..., data=PackingDataStage(row_tokens=...))

The contract is flash-attention's in transformers: a batch with no padding mask takes its texts' boundaries from
`position_ids`; a batch with a padding mask (evaluation's padded batches, generation) gets `sdpa` with the mask
transformers builds for `sdpa`, unchanged. Models with sliding-window or chunked attention are refused, and so is
any model on which two packed texts still see each other after the switch (`check_packing_is_exact`).
"""

from __future__ import annotations

import torch

from .errors import config_error
from .models import base_model
from .private_api import attention_implementation

NAME = "sdpa_per_text"


def per_text_mask(*, attention_mask=None, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  **kwargs):
    """No mask where the batch has no padding and no cache (the attention takes boundaries from position ids);
    otherwise the mask transformers builds for `sdpa`."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length and q_offset == kv_offset == 0:
        return None
    return sdpa_mask(attention_mask=attention_mask, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, **kwargs)


@torch.compiler.disable  # the texts' lengths are data: left uncompiled, the graphs around it keep static shapes
def per_text_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, position_ids=None, **kwargs):
    """transformers' attention-function signature; query, key, value: (batch, heads, tokens, head size). Causal
    or not as the module says (`sdpa`'s rule): an encoder's texts each attend to the whole of themselves."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    tokens = query.shape[2]
    positions = position_ids.expand(query.shape[0], tokens)
    rows = []
    for row in range(query.shape[0]):
        starts = (positions[row] == 0).nonzero().flatten().tolist()  # one int per text, not per token
        bounds = ([0] if not starts or starts[0] != 0 else []) + starts + [tokens]
        texts = [torch.nn.functional.scaled_dot_product_attention(
            query[row:row + 1, :, a:b], key[row:row + 1, :, a:b], value[row:row + 1, :, a:b], is_causal=is_causal,
            dropout_p=dropout, scale=scaling) for a, b in zip(bounds[:-1], bounds[1:])]
        rows.append(torch.cat(texts, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def use_per_text_attention(model):
    """Switch `model` (a transformers model using the attention interface) to per-text attention; returns it."""
    from transformers import AttentionInterface, AttentionMaskInterface

    from .row_packing import check_packing_is_exact

    base = base_model(model)
    config = getattr(base, "config", None)
    windowed = [field for field in ("sliding_window", "attention_chunk_size")
                if getattr(config, field, None) is not None]
    windowed += sorted({kind for kind in getattr(config, "layer_types", None) or () if kind != "full_attention"})
    if windowed or not hasattr(base, "set_attn_implementation"):
        raise config_error("model", f"{type(base).__name__} (attn_implementation="
                           f"{attention_implementation(config)})",
                           "per-text attention attends over whole texts"
                           + (f"; this model's config has {', '.join(windowed)}" if windowed else
                              "; this model has no transformers attention interface"),
                           "keep the model's own attention (attn_implementation='sdpa' packs exactly, more slowly)")
    AttentionInterface.register(NAME, per_text_attention)
    AttentionMaskInterface.register(NAME, per_text_mask)
    before = attention_implementation(config)
    base.set_attn_implementation(NAME)
    try:
        check_packing_is_exact(base)
    except Exception:
        base.set_attn_implementation(before)  # refused: the model is left as it came
        raise
    return model
