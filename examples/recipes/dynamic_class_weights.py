"""Recipe 9: class weights for an imbalanced data set, updated from each validation's per-class recall.

Data: Rotten Tomatoes reviews with most *rotten* reviews dropped (about 1 rotten for 7 fresh), so a classifier can
score well by answering "fresh". The loss is a class-weighted cross-entropy. The weights start at inverse class
frequency; after every evaluation, the classes the model recalls worst get more weight:

    target_c  = (1 - recall_c) + floor            (floor keeps a perfectly recalled class in the loss)
    weights_c = momentum * weights_c + (1 - momentum) * target_c,   then scaled to mean 1

Two styles around one `ClassWeights` object:
* stage subclass: `ClassWeightedStep(StepStage)` owns the weights, uses them in `compute_loss` and updates them in
  its own `on_evaluate` (stages receive events).
* callback: `ClassWeightUpdater(weights)` updates them in `on_evaluate`, and `weighted_loss_func(weights)` is the
  `compute_loss_func` that uses them.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from common import FRESH, ROTTEN, ReviewDataset, Size, cli, load_classifier, loop_args, output_folder, rotten_tomatoes
from loopkit import Loop, StepStage

CLASSES = (ROTTEN, FRESH)


def imbalanced_split(size: Size, keep_rotten: float = 0.2, seed: int = 0):
    rng = random.Random(seed)
    rows = [row for row in rotten_tomatoes() if row[1] == FRESH or rng.random() < keep_rotten]
    rng.shuffle(rows)
    return rows[:size.n_train], rows[size.n_train:size.n_train + size.n_eval]


def per_class_recall(eval_prediction) -> dict:
    """`compute_metrics`: accuracy, balanced accuracy and recall of each class."""
    predicted, labels = eval_prediction.predictions.argmax(-1), eval_prediction.label_ids
    recalls = {f"recall_{c}": float((predicted[labels == c] == c).mean()) if (labels == c).any() else 1.0
               for c in CLASSES}
    return {"accuracy": float((predicted == labels).mean()), "balanced_accuracy": float(np.mean(list(recalls.values()))),
            **recalls}


class ClassWeights:
    def __init__(self, train_labels: torch.Tensor, momentum: float = 0.5, floor: float = 0.1):
        counts = torch.bincount(train_labels, minlength=len(CLASSES)).float()
        self.weights = self.normalised(1.0 / counts.clamp(min=1))
        self.momentum, self.floor = momentum, floor
        self.history = [(0, self.weights.tolist())]  # (step, weights) after each update

    @staticmethod
    def normalised(weights: torch.Tensor) -> torch.Tensor:
        return weights * len(weights) / weights.sum()

    def update(self, metrics: dict, step: int) -> None:
        if not all(f"eval_recall_{c}" in metrics for c in CLASSES):
            return
        target = torch.tensor([1.0 - metrics[f"eval_recall_{c}"] + self.floor for c in CLASSES])
        self.weights = self.normalised(self.momentum * self.weights + (1 - self.momentum) * target)
        self.history.append((step, self.weights.tolist()))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, labels, weight=self.weights.to(logits.device))


class ClassWeightedStep(StepStage):
    """Stage style."""

    def __init__(self, class_weights: ClassWeights):
        super().__init__()
        self.class_weights = class_weights

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        loss = self.class_weights.loss(outputs.logits, inputs["labels"])
        return (loss, outputs) if return_outputs else loss

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.class_weights.update(metrics, state.global_step)


class ClassWeightUpdater:
    """Callback style."""

    def __init__(self, class_weights: ClassWeights):
        self.class_weights = class_weights

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.class_weights.update(metrics, state.global_step)


def weighted_loss_func(class_weights: ClassWeights):
    def loss_func(outputs, labels, num_items_in_batch=None):
        return class_weights.loss(outputs.logits, labels)

    return loss_func


def main(tiny: bool = False, output_dir: str | None = None, style: str = "stage", eval_steps: int | None = None,
         max_steps: int = -1):
    size = Size.pick(tiny)
    train_rows, eval_rows = imbalanced_split(size)
    train, evaluation = ReviewDataset(train_rows, size.max_length), ReviewDataset(eval_rows, size.max_length)
    weights = ClassWeights(train.columns["labels"])
    print(f"train: {int((train.columns['labels'] == ROTTEN).sum())} rotten of {len(train)}; "
          f"initial weights {weights.weights.tolist()}")
    if style == "stage":
        extra = dict(step=ClassWeightedStep(weights))
    else:
        extra = dict(callbacks=[ClassWeightUpdater(weights)], compute_loss_func=weighted_loss_func(weights))
    eval_steps = eval_steps or (2 if tiny else 16)
    args = loop_args(output_folder(output_dir, "class-weights"), size, eval_strategy="steps", eval_steps=eval_steps,
                     logging_steps=eval_steps, max_steps=max_steps)
    loop = Loop(model=load_classifier(size), args=args, train_dataset=train, eval_dataset=evaluation,
                compute_metrics=per_class_recall, **extra)
    loop.train()
    for step, w in weights.history:
        print(f"step {step}: class weights rotten {w[0]:.3f}, fresh {w[1]:.3f}")
    return loop, weights


if __name__ == "__main__":
    cli(main, __doc__)
