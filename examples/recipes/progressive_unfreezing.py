"""Recipe 6: progressive unfreezing: train only the top 2 encoder layers (and the head) at first, and unfreeze one
more layer below them at the start of every epoch. The embeddings stay frozen.

An optimizer only updates the parameters it holds, so *when* the layers were frozen decides the style:

* frozen after the optimizer was built (the usual callback way): `ProgressiveUnfreezing` callback. The optimizer was
  built while every parameter was trainable, so it holds them all; frozen ones get no gradient (`grad is None`) and
  AdamW skips them (no update, no weight decay). Unfreezing is just `requires_grad_(True)`. On resume it reapplies
  the schedule for the checkpoint's epoch at `on_train_begin`.
* frozen before the optimizer was built (e.g. frozen right after loading, to save optimizer memory): the optimizer
  does not hold them, and setting `requires_grad` alone trains nothing. `UnfreezingStep(StepStage)` adds each
  newly unfrozen layer with `StepStage.add_param_group`, which also extends the LR scheduler (a plain
  `optimizer.add_param_group` breaks the default `LambdaLR`, which keeps one lambda per group). On resume, the
  checkpoint's optimizer state has one group per layer unfrozen so far: the stage rebuilds those groups from its
  own saved state right after the scheduler is created, *before* `prepare` loads the optimizer state into them.

Run `python examples/recipes/progressive_unfreezing.py [--tiny]`: it prints which layers changed in each epoch.
"""

from __future__ import annotations

import math
import re

import torch

from common import (Size, accuracy, cli, encoder_layers, load_classifier, loop_args, output_folder,
                    parameters_snapshot, review_datasets)
from loopkit import Loop, StepStage

LAYER_INDEX = re.compile(r"\.encoder\.layer\.(\d+)\.")


def trainable_layer_count(epoch: float, top_layers: int, num_layers: int) -> int:
    """Top layers trainable during `epoch`: `top_layers` in epoch 0, one more per later epoch."""
    return min(num_layers, top_layers + math.floor(epoch + 1e-9))


def set_trainable_layers(model, count: int) -> list:
    """Make the top `count` encoder layers and the head trainable, everything else frozen. Returns the parameters
    that were frozen and are trainable now."""
    num_layers = len(encoder_layers(model))
    newly_trainable = []
    for name, param in model.named_parameters():
        match = LAYER_INDEX.search(name)
        if match is not None:
            trainable = int(match.group(1)) >= num_layers - count
        else:
            trainable = "embeddings" not in name  # the pooler and the classifier train from the start
        if trainable and not param.requires_grad:
            newly_trainable.append(param)
        param.requires_grad_(trainable)
    return newly_trainable


class ProgressiveUnfreezing:
    """Callback style, for an optimizer built while every parameter was trainable."""

    def __init__(self, top_layers: int = 2):
        self.top_layers = top_layers

    def apply(self, model, epoch: float) -> None:
        set_trainable_layers(model, trainable_layer_count(epoch, self.top_layers, len(encoder_layers(model))))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.apply(model, state.epoch)  # the checkpoint's epoch when resuming

    def on_epoch_begin(self, args, state, control, model=None, **kwargs):
        self.apply(model, state.epoch)


class UnfreezingStep(StepStage):
    """Stage style: works whether the layers were frozen before or after the optimizer was built."""

    def __init__(self, top_layers: int = 2):
        super().__init__()
        self.top_layers = top_layers
        self.trainable_layers = None
        self.resuming_from = None

    def unfreeze(self, count: int) -> None:
        model = self.run.model
        count = min(count, len(encoder_layers(model)))
        newly_trainable = set_trainable_layers(model, count)
        held = {id(p) for group in self.run.optimizer.param_groups for p in group["params"]}
        missing = [p for p in newly_trainable if id(p) not in held]
        if missing:
            self.add_param_group(missing, weight_decay=self.run.args.weight_decay)
        self.trainable_layers = count

    def prepare(self, max_steps, checkpoint):
        self.resuming_from = checkpoint
        super().prepare(max_steps, checkpoint)

    def create_scheduler(self, num_training_steps, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        # `prepare` loads a checkpoint's optimizer state right after this, and that state has one param group per
        # layer unfrozen so far: rebuild those groups first, from this stage's state saved in the checkpoint.
        saved = self.context.checkpointer.read_stage_states(self.resuming_from).get("step", {}) \
            if self.resuming_from else {}
        self.unfreeze(saved.get("trainable_layers") or self.top_layers)
        return scheduler

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.unfreeze(trainable_layer_count(state.epoch, self.top_layers, len(encoder_layers(self.run.model))))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "trainable_layers": self.trainable_layers}


class LayerChanges:
    """Records which encoder layers (and whether the embeddings) changed during each epoch."""

    def __init__(self):
        self.changed_by_epoch = []

    def on_epoch_begin(self, args, state, control, model=None, **kwargs):
        self.epoch, self.before = math.floor(state.epoch + 1e-9), parameters_snapshot(model)

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        changed = {name for name, p in model.named_parameters() if not torch.equal(p, self.before[name])}
        layers = sorted({int(m.group(1)) for m in map(LAYER_INDEX.search, changed) if m})
        self.changed_by_epoch.append({"epoch": self.epoch, "layers": layers,
                                      "embeddings": any("embeddings" in n for n in changed)})


def main(tiny: bool = False, output_dir: str | None = None, style: str = "stage", freeze_first: bool = True,
         num_train_epochs: int = 3, resume_from_checkpoint=None, save_strategy: str = "no", top_layers: int = 2):
    size = Size.pick(tiny)
    # 3 epochs: a smaller slice of the reviews keeps the default run near a minute on 2 cores.
    train, evaluation = review_datasets(size, n_train=None if tiny else 384)
    model = load_classifier(size)
    if freeze_first:  # frozen before the optimizer exists: only the stage style can train these layers later
        set_trainable_layers(model, top_layers)
    args = loop_args(output_folder(output_dir, "unfreezing"), size, num_train_epochs=num_train_epochs,
                     save_strategy=save_strategy)
    changes = LayerChanges()
    if style == "stage":
        extra = dict(step=UnfreezingStep(top_layers), callbacks=[changes])
    else:
        extra = dict(callbacks=[ProgressiveUnfreezing(top_layers), changes])
    loop = Loop(model=model, args=args, train_dataset=train, eval_dataset=evaluation, compute_metrics=accuracy,
                **extra)
    loop.train(resume_from_checkpoint=resume_from_checkpoint)
    for changed in changes.changed_by_epoch:
        print(f"epoch {changed['epoch']}: encoder layers updated {changed['layers']}, embeddings updated: "
              f"{changed['embeddings']}")
    loop.evaluate()  # printed by the loop's log printer
    return loop, changes


if __name__ == "__main__":
    cli(main, __doc__)
