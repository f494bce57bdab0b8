"""What loopkit reads off a model itself, for every layer: the model under a PEFT wrapper.

Columns, labels, packing, the first-batch checks and the step's loss counting all decide from the model's own class
and forward signature, so they look through a PEFT wrapper first.
"""

from __future__ import annotations


def base_model(model):
    """The model under a PEFT wrapper (its forward signature and class decide columns, labels and loss counting)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
