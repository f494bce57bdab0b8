"""Recipe 4: a dynamic learning rate set from a callback: cosine decay from `on_step_begin`, through
`kwargs["optimizer"]`.

    lr(step) = min_lr + (base_lr - min_lr) * (1 + cos(pi * step / max_steps)) / 2

`step` is `state.global_step` at `on_step_begin`, the number of optimizer steps already taken, so the first step uses
`base_lr`.

Two styles:
* callback: `CosineLR(base_lr, min_lr)` writes `lr` into every param group of `kwargs["optimizer"]` before each step.
  The loop's own scheduler still runs after each optimizer step; with `lr_scheduler_type="constant"` it only restores
  `base_lr`, which the callback overwrites before the next step. The LR the optimizer *uses* follows the cosine
  (`optimizer.param_groups[i]["lr"]`), but the `learning_rate` the loop logs is the scheduler's, constant here (HF
  Trainer logs it the same way): read the callback's `current_lr`, or use the stage style.
* stage subclass: `CosineScheduleStep` overrides `create_scheduler` with a `LambdaLR` of the same curve, so the
  schedule is the scheduler: it is checkpointed, resumed and logged as `learning_rate` with no extra code. Prefer
  this one when nothing but the step decides the LR; use the callback when the LR depends on what callbacks see.
"""

from __future__ import annotations

import math

import torch

from common import Size, accuracy, cli, load_classifier, loop_args, output_folder, review_datasets
from loopkit import Loop, StepStage


def cosine_lr(step: int, max_steps: int, base_lr: float, min_lr: float) -> float:
    progress = min(step / max(max_steps, 1), 1.0)
    return min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


class CosineLR:
    """Callback style."""

    def __init__(self, base_lr: float, min_lr: float = 0.0):
        self.base_lr, self.min_lr = base_lr, min_lr
        self.current_lr = base_lr

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.current_lr = cosine_lr(state.global_step, state.max_steps, self.base_lr, self.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = self.current_lr


class CosineScheduleStep(StepStage):
    """Stage style: the same curve as the loop's scheduler."""

    def __init__(self, min_lr: float = 0.0):
        super().__init__()
        self.min_lr = min_lr

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        run = self.run  # the run state (loopkit/run_state.py): this stage owns the optimizer and the scheduler
        if run.lr_scheduler is None:
            base_lr = run.args.learning_rate
            run.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer or run.optimizer,
                lambda step: cosine_lr(step, num_training_steps, base_lr, self.min_lr) / base_lr)
        return run.lr_scheduler


def main(tiny: bool = False, output_dir: str | None = None, style: str = "callback", max_steps: int = -1,
         min_lr_fraction: float = 0.1, callbacks=()):
    size = Size.pick(tiny)
    train, evaluation = review_datasets(size)
    min_lr = size.learning_rate * min_lr_fraction
    args = loop_args(output_folder(output_dir, "cosine"), size, max_steps=max_steps, lr_scheduler_type="constant")
    if style == "callback":
        extra = dict(callbacks=[CosineLR(size.learning_rate, min_lr), *callbacks])
    else:
        extra = dict(step=CosineScheduleStep(min_lr), callbacks=list(callbacks))
    loop = Loop(model=load_classifier(size), args=args, train_dataset=train, eval_dataset=evaluation,
                compute_metrics=accuracy, **extra)
    loop.train()
    loop.evaluate()  # printed by the loop's log printer
    return loop


if __name__ == "__main__":
    cli(main, __doc__)
