"""Recipe 3: a composite loss (cross-entropy + L2 regularization + a confidence-margin term) whose coefficients come
from configuration, not from the code.

    loss = cross_entropy + l2 * sum(w^2 for trainable weights) + margin_weight * mean(relu(margin - (z_true - z_other)))

`z_true - z_other` is how far the true class's logit leads the best other one; the margin term pushes that lead up
to `margin` (a hinge, like an SVM's), on top of the cross-entropy. The coefficients live in a `LossConfig`
dataclass, read from a JSON file (`--loss-config file.json`) or from keyword arguments; nothing in the loss
hard-codes them.

Two styles, same number:
* stage subclass: `CompositeLossStep(config)` overrides `compute_loss`: `Loop(..., step=CompositeLossStep(cfg))`.
* function: `composite_loss_func(model, config)` gives HF's `compute_loss_func(outputs, labels, num_items_in_batch)`
  (the model is captured, since the L2 term needs its weights): `Loop(..., compute_loss_func=...)`.

The loss settings are their own object, not training arguments: the same `LossConfig` serves the stage, the
function and any evaluation script, and a JSON file of three numbers is easy to keep next to a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

import torch
from torch import nn

from common import Size, accuracy, load_classifier, loop_args, output_folder, quiet_loading, review_datasets
from loopkit import Loop, StepStage


@dataclass
class LossConfig:
    l2: float = 1e-6  # coefficient of the sum of squared trainable weights (about 8e4 for MiniLM: adds ~0.08)
    margin: float = 1.0  # the logit lead wanted for the true class
    margin_weight: float = 0.1  # coefficient of the margin hinge

    @classmethod
    def from_json(cls, path: str) -> "LossConfig":
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown loss settings {sorted(unknown)}. Fix: use only "
                             f"{[f.name for f in dataclasses.fields(cls)]}.")
        return cls(**values)


def l2_penalty(model) -> torch.Tensor:
    return sum((p.pow(2).sum() for p in model.parameters() if p.requires_grad), torch.zeros(()))


def margin_hinge(logits: torch.Tensor, labels: torch.Tensor, margin: float) -> torch.Tensor:
    true_logit = logits.gather(1, labels[:, None]).squeeze(1)
    others = logits.masked_fill(nn.functional.one_hot(labels, logits.shape[1]).bool(), float("-inf"))
    return torch.relu(margin - (true_logit - others.max(dim=1).values)).mean()


def composite_loss(model, logits, labels, config: LossConfig) -> dict:
    """The three parts and their weighted sum (the parts are returned so runs and tests can look at them)."""
    parts = {"cross_entropy": nn.functional.cross_entropy(logits, labels),
             "l2": l2_penalty(model), "margin": margin_hinge(logits, labels, config.margin)}
    parts["loss"] = parts["cross_entropy"] + config.l2 * parts["l2"] + config.margin_weight * parts["margin"]
    return parts


class CompositeLossStep(StepStage):
    """Stage style."""

    def __init__(self, config: LossConfig):
        super().__init__()
        self.config = config

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = composite_loss(self.run.model, outputs.logits, labels, self.config)["loss"]
        return (loss, outputs) if return_outputs else loss


def composite_loss_func(model, config: LossConfig):
    """Function style: HF's `compute_loss_func` signature; the loop pops `labels` and passes them here."""

    def loss_func(outputs, labels, num_items_in_batch=None):
        return composite_loss(model, outputs.logits, labels, config)["loss"]

    return loss_func


def main(tiny: bool = False, output_dir: str | None = None, config: LossConfig | None = None, style: str = "stage",
         max_steps: int = -1):
    size = Size.pick(tiny)
    config = config or LossConfig()
    train, evaluation = review_datasets(size)
    model = load_classifier(size)
    args = loop_args(output_folder(output_dir, "composite"), size, max_steps=max_steps)
    kwargs = dict(step=CompositeLossStep(config)) if style == "stage" else \
        dict(compute_loss_func=composite_loss_func(model, config))
    loop = Loop(model=model, args=args, train_dataset=train, eval_dataset=evaluation, compute_metrics=accuracy,
                **kwargs)
    loop.train()
    print(config)
    loop.evaluate()  # printed by the loop's log printer
    return loop, config


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--style", choices=("stage", "function"), default="stage")
    parser.add_argument("--loss-config", default=None, help="a JSON file with l2, margin, margin_weight")
    options = parser.parse_args()
    quiet_loading()
    main(options.tiny, options.output_dir,
         LossConfig.from_json(options.loss_config) if options.loss_config else None, options.style)
