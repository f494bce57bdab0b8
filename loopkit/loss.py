"""HF Trainer's loss semantics, for the step stage's `compute_loss` and `count_loss_items` (loopkit/stages/step.py).

* `compute_loss`: the model's own loss (`model(**inputs)["loss"]`), or `compute_loss_func`'s, or the label
  smoother's (`label_smoothing_factor`, over shifted labels for a causal-LM class, as HF decides it by the class
  name); the model gets `num_items_in_batch` when its forward takes it (`run.model_accepts_loss_kwargs`).
* `count_loss_items`: `num_items_in_batch`, the label tokens != -100 over a whole accumulation window (shifted for a
  causal LM), summed over processes with `average_tokens_across_devices`: a device tensor, no host sync.
* `loss_is_scaled`: which losses count as normalised over the accumulated batch (HF 5.x's rule,
  `loss_is_scaled_for_ga`). `None` (the default) means "scaled" when the model takes `num_items_in_batch` (its
  forward has `**kwargs` or `accepts_loss_kwargs = True`) and got it, or when a `compute_loss_func` computed the
  loss; otherwise the loss is treated as a per-micro-batch mean and divided by the number of micro-batches in the
  window. A `compute_loss` override that returns a per-batch mean on a model that takes `num_items_in_batch` must
  set `loss_is_scaled_for_ga = False` (on the stage subclass, or on a `Loop` subclass as on a `Trainer` subclass),
  or normalise by `num_items_in_batch` itself; `train()` warns when an override falls under the "scaled" rule with
  gradient accumulation (`implicit_scaling_warning`), so the choice is never silent.

Reads `run.args`, `run.model`, `run.model_accepts_loss_kwargs`, `run.compute_loss_func`, `run.label_smoother`; the
accelerator for the process count (and `gather` / `unwrap_model`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .batches import require_named_batch
from .models import base_model, is_causal_lm, is_causal_lm_class


def compute_loss(run, accelerator, model, inputs, num_items_in_batch=None):
    """HF's `compute_loss` with `return_outputs=True`: (loss, outputs)."""
    if type(inputs) is not dict:  # a dict is named; the check for anything else costs an ABC lookup per micro-batch
        require_named_batch(inputs)
    takes_labels = run.compute_loss_func is not None or run.label_smoother is not None
    labels = inputs.pop("labels") if takes_labels and "labels" in inputs else None
    if run.model_accepts_loss_kwargs and num_items_in_batch is not None:
        inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
    outputs = model(**inputs)
    if run.compute_loss_func is not None:
        loss = run.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    elif labels is not None:
        causal = is_causal_lm_class(accelerator.unwrap_model(model))
        loss = run.label_smoother(outputs, labels, shift_labels=causal, num_items_in_batch=num_items_in_batch)
    else:
        loss = model_loss(outputs, inputs)
    if (run.args.average_tokens_across_devices and num_items_in_batch is not None
            and (run.model_accepts_loss_kwargs or run.compute_loss_func is not None)):
        # The token count is global, and DDP averages gradients over processes: undo that average.
        loss = loss * accelerator.num_processes
    return loss, outputs


def count_loss_items(run, accelerator, batches, label_shift: bool | None) -> torch.Tensor | None:
    """`num_items_in_batch` for the window `batches`, or None when the loss does not take it. `label_shift`: whether
    labels are shifted (None: decide from the model)."""
    if not (run.model_accepts_loss_kwargs or run.compute_loss_func is not None):
        return None
    if not batches or not isinstance(batches[0], Mapping) or "labels" not in batches[0]:
        return None
    shift = label_shift if label_shift is not None else is_causal_lm(run.model)
    try:
        count = sum(
            (b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:] if shift
             else b["labels"]).ne(-100).sum() for b in batches)
    except (TypeError, AttributeError):
        return None
    if run.args.average_tokens_across_devices and accelerator.num_processes > 1:
        count = accelerator.gather(count.to(accelerator.device)).sum()
    return count.to(accelerator.device)


def loss_is_scaled(run, declared: bool | None, num_items_in_batch) -> bool:
    """Whether the loss is already normalised over the window (`declared`: `loss_is_scaled_for_ga`; None = HF's
    rule, module docstring)."""
    if declared is not None:
        return declared
    return (run.model_accepts_loss_kwargs and num_items_in_batch is not None) or run.compute_loss_func is not None


def implicit_scaling_warning(run) -> str | None:
    """What `train()` says when an overridden `compute_loss` falls under HF's "scaled" rule by default with
    gradient accumulation (None when the rule does not make it so)."""
    if not (run.model_accepts_loss_kwargs and run.compute_loss_func is None):
        return None
    return (f"compute_loss is overridden and {type(base_model(run.model)).__name__} takes num_items_in_batch, so "
            f"with gradient_accumulation_steps={run.args.gradient_accumulation_steps} its loss is taken as "
            f"already normalised over the whole accumulation window (HF's rule) and not divided by the number "
            f"of micro-batches. If it is a per-batch mean, set loss_is_scaled_for_ga = False on your stage or "
            f"Loop subclass (or divide a summed loss by num_items_in_batch); set it to True to silence this.")


def model_loss(outputs, inputs) -> torch.Tensor:
    """The loss a model returned, or an error that says why there is none and what to do."""
    if type(outputs) is dict or isinstance(outputs, Mapping):
        if outputs.get("loss") is None:
            raise ValueError(
                f"The model returned no loss (its outputs: {', '.join(outputs.keys())}; its inputs: "
                f"{', '.join(inputs.keys())}). Fix: pass labels in the batch (check label_names and the "
                f"collator), or give Loop a compute_loss_func, or override compute_loss.")
        return outputs["loss"]
    if isinstance(outputs, torch.Tensor):
        # HF would index it (outputs[0]) and fail far from the cause; a bare tensor is never (loss, ...).
        raise ValueError(
            f"The model returned a bare tensor of shape {tuple(outputs.shape)}, not outputs with a loss. Fix: "
            f"return a dict (or ModelOutput) with a 'loss' entry, or give Loop a compute_loss_func, or override "
            f"compute_loss.")
    return outputs[0]
