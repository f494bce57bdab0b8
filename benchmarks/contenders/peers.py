"""The peers of the per-step benchmark: pytorch-ignite, Lightning Fabric and Lightning's Trainer, each training the
same `TrainSpec` as the hand-written loop, written as each framework's documentation shows.

Worker side. Installed for the benchmarks only (loopkit's `bench` extra, never a dependency of loopkit); each
framework is imported inside its function, so a missing one costs only its own rows (`spec.missing_peers`).

Same work as the hand-written loop: the same model and data order (`EpochShuffle`, HF's seedable order, epoch by
epoch), AdamW over HF's decay groups (fused), the same linear warmup stepped once per optimizer step, gradient
clipping at `max_grad_norm` (each framework's own clipping), accumulation over `grad_accum` micro-batches, and the
device read only at logging points (every `logging_steps` optimizer steps). The harness checks the result: every
contender's final model must give the same held-out loss as the hand-written loop's.

- ignite and Fabric take each accumulation window whole, as the hand-written loop does, so a causal LM weighs its
  loss by the window's label tokens exactly as HF does (`num_items_in_batch`).
- Lightning's Trainer takes one micro-batch per `training_step` and divides each loss by `accumulate_grad_batches`
  (its only accumulation): the same gradient when every micro-batch of a window holds as many label tokens, as the
  benchmark's causal-LM batches do (equal-length rows, no -100 labels); a rounding apart, not bit for bit.

Each is timed by the same `StepClock` calls: the start of an optimizer step and its end (after `zero_grad`).
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from ..workloads.models import accepts_token_count, count_label_tokens, is_causal_lm
from ..workloads.spec import TrainSpec
from .recipe import (TrainResult, accumulation_windows, adamw_with_decay_groups, epoch_loader, prepare_model,
                     warmup_schedule)


def require_map_data(spec: TrainSpec, peer: str) -> None:
    if spec.data != "map":
        raise ValueError(f"{peer} trains map-style data only here (it runs the per-step benchmark)")


class Windows:
    """The loader's micro-batches grouped per optimizer step: a re-iterable with a length, so one ignite iteration
    is one optimizer step and one pass is one epoch (the last window takes the remainder, as HF does)."""

    def __init__(self, loader, grad_accum: int):
        self.loader, self.grad_accum = loader, grad_accum

    def __len__(self):
        return math.ceil(len(self.loader) / self.grad_accum)

    def __iter__(self):
        return accumulation_windows(self.loader, self.grad_accum)


class LossLog:
    """The logging point the hand-written loop has: the mean loss since the last log (summed on the device, read
    here only), the gradient norm and the learning rate, printed."""

    def __init__(self, device):
        self.running = torch.zeros((), device=device)
        self.last_logged = 0
        self.losses: list[float] = []

    def write(self, step: int, grad_norm, learning_rate: float) -> None:
        logs = {"loss": self.running.item() / (step - self.last_logged), "grad_norm": float(grad_norm),
                "learning_rate": learning_rate}
        self.running.zero_()
        self.last_logged = step
        self.losses.append(logs["loss"])
        print(logs)


def window_loss(model, window: list, spec: TrainSpec, backward, running: torch.Tensor,
                autocast_device: str | None = None, unwrapped=None) -> None:
    """Forward and backward over one accumulation window, as the hand-written loop does them, each micro-batch's
    (scaled) loss added to `running` on the device. `backward(loss, is_last)` is the framework's backward;
    `autocast_device`: the device type to autocast the forward on under `spec.bf16` (None where the framework
    autocasts itself); `unwrapped`: the user's model inside a framework's wrapper (whose forward takes anything)."""
    weigh_by_tokens = accepts_token_count(unwrapped or model)
    extra = {}
    if weigh_by_tokens:
        shift = is_causal_lm(unwrapped or model)
        extra["num_items_in_batch"] = sum(count_label_tokens(b, shift) for b in window)
    for index, batch in enumerate(window):
        with (torch.autocast(autocast_device, dtype=torch.bfloat16, enabled=spec.bf16) if autocast_device else
              contextlib.nullcontext()):
            loss = model(**batch, **extra)["loss"]
        if not weigh_by_tokens:
            loss = loss / len(window)
        backward(loss, index == len(window) - 1)
        running += loss.detach()


# ---------------------------------------------------------------------------------------------------------------------
# pytorch-ignite: an `Engine` whose process function runs one optimizer step; ignite's handlers for the schedule
# (`LRScheduler`, at ITERATION_STARTED as its documentation says), the epoch's data order and the logging point.
# ---------------------------------------------------------------------------------------------------------------------
def train_ignite(spec: TrainSpec, model, dataset, clock, output_dir: str | None = None) -> TrainResult:
    from ignite.engine import Engine, Events
    from ignite.handlers import LRScheduler

    require_map_data(spec, "pytorch-ignite")
    called_at = time.perf_counter()
    device = prepare_model(spec, model)
    optimizer = adamw_with_decay_groups(model, spec)
    sampler, loader = epoch_loader(spec, dataset)
    log = LossLog(device)

    def optimizer_step(engine, window):
        window = [{k: v.to(device, non_blocking=True) for k, v in batch.items()} for batch in window]
        clock.begin()
        window_loss(model, window, spec, lambda loss, is_last: loss.backward(), log.running, device.type)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.end(engine.state.iteration)
        return grad_norm

    trainer = Engine(optimizer_step)
    trainer.add_event_handler(Events.ITERATION_STARTED, LRScheduler(warmup_schedule(optimizer, spec)))
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda engine: sampler.set_epoch(engine.state.epoch - 1))

    @trainer.on(Events.ITERATION_COMPLETED(every=spec.logging_steps))
    def write_log(engine):
        log.write(engine.state.iteration, engine.state.output, optimizer.param_groups[0]["lr"])

    trainer.run(Windows(loader, spec.grad_accum), max_iters=spec.max_steps)
    return TrainResult(model, trainer.state.iteration, log.losses, called_at, called_at,
                       time.perf_counter() - called_at)


# ---------------------------------------------------------------------------------------------------------------------
# Lightning Fabric: the hand-written loop with Fabric's setup, data loader, backward (no gradient sync before a
# window's last micro-batch) and clipping, as Fabric's gradient-accumulation guide writes it.
# ---------------------------------------------------------------------------------------------------------------------
def train_fabric(spec: TrainSpec, model, dataset, clock, output_dir: str | None = None) -> TrainResult:
    from lightning.fabric import Fabric

    require_map_data(spec, "Lightning Fabric")
    called_at = time.perf_counter()
    device = prepare_model(spec, model)
    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=1,
                    precision="bf16-mixed" if spec.bf16 else "32-true")
    optimizer = adamw_with_decay_groups(model, spec)
    schedule = warmup_schedule(optimizer, spec)
    model, optimizer = fabric.setup(model, optimizer)
    sampler, loader = epoch_loader(spec, dataset)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)  # moves each batch to the device
    log = LossLog(fabric.device)

    def backward(loss, is_last):
        with fabric.no_backward_sync(model, enabled=not is_last):
            fabric.backward(loss)

    step, epoch = 0, 0
    while step < spec.max_steps:
        sampler.set_epoch(epoch)
        for window in accumulation_windows(loader, spec.grad_accum):
            clock.begin()
            # Fabric's precision plugin autocasts the forward itself
            window_loss(model, window, spec, backward, log.running, unwrapped=model.module)
            grad_norm = fabric.clip_gradients(model, optimizer, max_norm=spec.max_grad_norm)
            optimizer.step()
            learning_rate = schedule.get_last_lr()[0]
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            clock.end(step)
            if step % spec.logging_steps == 0:
                log.write(step, grad_norm, learning_rate)
            if step >= spec.max_steps:
                break
        epoch += 1
    return TrainResult(model.module, step, log.losses, called_at, called_at, time.perf_counter() - called_at)


# ---------------------------------------------------------------------------------------------------------------------
# Lightning's Trainer: a LightningModule around the model; the Trainer's own accumulation, clipping, step-interval
# schedule and logging (`self.log` every step, written to a logger every `log_every_n_steps`, with the learning rate
# from `LearningRateMonitor`). Progress bar, model summary, checkpointing and validation off, as in the others.
# ---------------------------------------------------------------------------------------------------------------------
def train_lightning(spec: TrainSpec, model, dataset, clock, output_dir: str | None = None) -> TrainResult:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import LearningRateMonitor

    require_map_data(spec, "Lightning's Trainer")
    called_at = time.perf_counter()
    device = prepare_model(spec, model)
    _, loader = epoch_loader(spec, dataset)  # Lightning sets the sampler's epoch (`set_epoch`) before each epoch
    module, logger, step_clock = lightning_parts(spec, model, clock)
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
        precision="bf16-mixed" if spec.bf16 else "32-true", max_steps=spec.max_steps, max_epochs=-1,
        accumulate_grad_batches=spec.grad_accum, gradient_clip_val=spec.max_grad_norm, gradient_clip_algorithm="norm",
        log_every_n_steps=spec.logging_steps, logger=logger,
        callbacks=[LearningRateMonitor(logging_interval="step"), step_clock],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, default_root_dir=output_dir)
    trainer.fit(module, train_dataloaders=loader)
    return TrainResult(module.model, trainer.global_step, logger.losses, called_at, called_at,
                       time.perf_counter() - called_at)


def lightning_parts(spec: TrainSpec, model, clock) -> tuple:
    """Lightning's pieces around `model`: the LightningModule (loss logged every step, AdamW with HF's decay groups
    and a step-interval schedule), a logger that prints at the logging points, and the callback timing each step."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger

    class WrappedModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch)["loss"]
            self.log("loss", loss, batch_size=spec.batch_size)
            return loss

        def configure_optimizers(self):
            optimizer = adamw_with_decay_groups(self.model, spec)
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": warmup_schedule(optimizer, spec), "interval": "step"}}

    class PrintLogger(Logger):
        """Prints what Lightning logs at its logging points (the others print their logs too)."""

        def __init__(self):
            super().__init__()
            self.losses = []

        @property
        def name(self):
            return "print"

        @property
        def version(self):
            return 0

        def log_metrics(self, metrics, step=None):
            if "loss" in metrics:
                self.losses.append(float(metrics["loss"]))
            print({"step": step, **metrics})

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    class StepClockCallback(pl.Callback):
        """`clock.begin()` at a window's first micro-batch, `clock.end()` once the optimizer has stepped."""

        def __init__(self):
            self.in_step, self.steps = False, 0

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if not self.in_step:
                self.in_step = True
                clock.begin()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step != self.steps:
                self.in_step, self.steps = False, trainer.global_step
                clock.end(self.steps)

    return WrappedModel(), PrintLogger(), StepClockCallback()


TRAINERS = {"ignite": train_ignite, "fabric": train_fabric, "lightning": train_lightning}
