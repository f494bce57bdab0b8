"""What loopkit reads off a model itself, for every layer: the model under a PEFT wrapper, whether it is a causal
LM (its labels are shifted inside its loss), and whether its modules' `train()` is torch's own.

Columns, labels, packing, the first-batch checks and the step's loss counting all decide from the model's own class
and forward signature, so they look through a PEFT wrapper first.
"""

from __future__ import annotations

import functools


def base_model(model):
    """The model under a PEFT wrapper (its forward signature and class decide columns, labels and loss counting)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_causal_lm(model) -> bool:
    """Causal LMs shift labels inside their loss, so their token count is `labels[..., 1:]`. Unlike HF Trainer
    (which keys this on `loss_type` and so miscounts GPT-2), loopkit counts shifted labels for every causal LM."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    if getattr(base, "loss_type", None) == "ForCausalLM":
        return True
    return is_causal_lm_class(base)


@functools.lru_cache(maxsize=1)
def causal_lm_class_names() -> frozenset:
    """transformers' causal-LM class names, built once (label smoothing asks at every micro-batch)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def is_causal_lm_class(model) -> bool:
    """HF's test for shifting labels in the label smoother: the (PEFT-unwrapped) class is a causal-LM class."""
    return type(base_model(model)).__name__ in causal_lm_class_names()


# `train()` methods that only set the `training` flags when a module is already in training mode: with these,
# calling `model.train()` on a model whose modules all train changes nothing.
PLAIN_TRAIN_METHODS = {"torch.nn.modules.module.Module.train", "transformers.modeling_utils.PreTrainedModel.train"}


def has_plain_train(module) -> bool:
    """Whether `module.train()` is torch's (or transformers') own, which only sets the `training` flags."""
    method = getattr(type(module), "train", None)
    return "train" not in vars(module) and \
        f"{getattr(method, '__module__', '')}.{getattr(method, '__qualname__', '')}" in PLAIN_TRAIN_METHODS
