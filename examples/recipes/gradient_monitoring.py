"""Recipe 1: gradient statistics of chosen layers (names containing "attention"), every N steps, in the run's logs
and in TensorBoard.

Where: loopkit's `on_gradients_ready` event fires after the last backward of an optimizer step and **before**
clipping, so the numbers are the true gradients (HF's `on_pre_optimizer_step` sees them clipped).

Cost: on a step that does not log, the listener does one integer modulo and returns. On a logging step the
statistics stay device tensors until `on_step_end`, where one `.tolist()` moves them all to the host together (one
sync, at a point where the loop's own logging syncs anyway). `loop.log(...)` then appends them to
`state.log_history` and fires `on_log`, so HF's `TensorBoardCallback` (`report_to=["tensorboard"]`) writes them as
`train/grad_norm/<layer>` and `train/grad_max/<layer>` scalars.

Two styles, same numbers:
* stage subclass: `GradientStatsStep(StepStage)` listens to the event itself (stages receive events) and logs
  through `self.context.log`: `Loop(..., step=GradientStatsStep(...))`.
* callback: `GradientStatsCallback(log=loop.log, ...)`, a plain HF-style callback: `loop.add_callback(...)`.

Run: `python examples/recipes/gradient_monitoring.py [--tiny]`, then `tensorboard --logdir <output_dir>/runs`.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from common import Size, accuracy, cli, load_classifier, loop_args, output_folder, review_datasets
from loopkit import Loop, StepStage


def layer_of(parameter_name: str, name_filter: str) -> str:
    """`bert.encoder.layer.3.attention.self.query.weight` -> `bert.encoder.layer.3.attention`."""
    parts = parameter_name.split(".")
    cut = next(i for i, part in enumerate(parts) if name_filter in part)
    return ".".join(parts[:cut + 1])


def gradient_stats(model, name_filter: str) -> tuple[list[str], torch.Tensor]:
    """Per monitored layer: the gradient's L2 norm and its largest absolute entry. Returns the log keys and one
    device tensor of values (no host sync here)."""
    grads_by_layer = defaultdict(list)
    for name, param in model.named_parameters():
        if name_filter in name and param.grad is not None:
            grads_by_layer[layer_of(name, name_filter)].append(param.grad.detach())
    keys, values = [], []
    for layer, grads in grads_by_layer.items():
        keys += [f"grad_norm/{layer}", f"grad_max/{layer}"]
        values += [torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])),
                   torch.stack([g.abs().max() for g in grads]).max()]
    return keys, torch.stack(values) if values else torch.zeros(0)


class GradientStatsMonitor:
    """The shared logic: compute on monitored steps in `on_gradients_ready`, log at `on_step_end`."""

    def __init__(self, name_filter: str = "attention", every_n_steps: int = 10):
        self.name_filter, self.every_n_steps = name_filter, every_n_steps
        self.pending = None
        self.computed_at_steps = []  # which optimizer steps paid for the statistics

    def on_gradients_ready(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1  # the optimizer step being completed (global_step counts finished ones)
        if step % self.every_n_steps:
            return
        self.pending = gradient_stats(model, self.name_filter)
        self.computed_at_steps.append(step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.pending is None:
            return
        keys, values = self.pending
        self.pending = None
        # Firing `on_log` resets `control.should_log` (HF's protocol); keep the loop's own pending train log.
        should_log = control.should_log
        self.log(dict(zip(keys, values.tolist())))  # the one host sync, on logging steps only
        control.should_log = should_log

    def log(self, logs: dict) -> None:
        raise NotImplementedError


class GradientStatsStep(GradientStatsMonitor, StepStage):
    """Stage style: the step stage monitors its own gradients and logs through the loop it belongs to."""

    def __init__(self, name_filter: str = "attention", every_n_steps: int = 10):
        StepStage.__init__(self)
        GradientStatsMonitor.__init__(self, name_filter, every_n_steps)

    def log(self, logs: dict) -> None:
        self.context.log(logs)


class GradientStatsCallback(GradientStatsMonitor):
    """Callback style: give it the loop's `log` (HF: `trainer.log`) to reach the logs and every `on_log` listener."""

    def __init__(self, log, name_filter: str = "attention", every_n_steps: int = 10):
        super().__init__(name_filter, every_n_steps)
        self.log = log


def main(tiny: bool = False, output_dir: str | None = None, style: str = "stage", every_n_steps: int | None = None,
         max_steps: int = -1, max_grad_norm: float = 1.0):
    size = Size.pick(tiny)
    train, evaluation = review_datasets(size)
    every_n_steps = every_n_steps or (3 if tiny else 10)
    args = loop_args(output_folder(output_dir, "gradients"), size, report_to=["tensorboard"], max_steps=max_steps,
                     max_grad_norm=max_grad_norm, logging_steps=every_n_steps)
    step = GradientStatsStep(every_n_steps=every_n_steps) if style == "stage" else None
    loop = Loop(model=load_classifier(size), args=args, train_dataset=train, eval_dataset=evaluation,
                compute_metrics=accuracy, step=step)
    monitor = step
    if style == "callback":
        monitor = GradientStatsCallback(loop.log, every_n_steps=every_n_steps)
        loop.add_callback(monitor)
    loop.train()
    loop.evaluate()  # printed by the loop's log printer
    print(f"gradient statistics logged at steps {monitor.computed_at_steps}; TensorBoard: {args.output_dir}/runs")
    return loop, monitor


if __name__ == "__main__":
    cli(main, __doc__)
