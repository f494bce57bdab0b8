"""The three contenders: a hand-written PyTorch loop, HF Trainer and loopkit's Loop, training the same `TrainSpec`
(and, for the per-step benchmark, the peers of `benchmarks.peers`: pytorch-ignite, Lightning Fabric and Lightning's
Trainer).

Worker side. Framework imports happen inside the functions, so a loopkit process never imports
`transformers.trainer` and the time-to-first-step benchmark measures each contender's real import cost.

All three are timed by the same `StepClock` calls at the same points: the start of an optimizer step (before the
first forward of its accumulation window) and its end (after `zero_grad`, before any logging or saving).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import workloads
from .spec import PEERS, TrainSpec

NO_DECAY_NAME_PARTS = ("bias", "norm")  # HF's decay rule for these models: no decay on biases and norm weights


class StepClock:
    """Timestamps of every optimizer step's start and end, and the harness's requests: save after step k, stop
    after step k. `listeners` are called with the step number right after each end timestamp.

    On a GPU the host runs ahead of the device, so `synchronize` (e.g. `torch.cuda.synchronize`) is called before
    the end timestamps of the steps in `sync_at`: the boundaries of a timed span, never every step."""

    def __init__(self, save_at=(), stop_at: int | None = None, sync_at=(), synchronize=None):
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []  # time.process_time() at each end: the process's CPU time, all its threads
        self.first_end_wall: float | None = None  # time.time() at the end of the first step (process-start clocks)
        self.save_at, self.stop_at = set(save_at), stop_at
        self.sync_at, self.synchronize = set(sync_at), synchronize
        self.listeners = []

    def begin(self) -> None:
        self.begins.append(time.perf_counter())

    def end(self, step: int) -> tuple[bool, bool]:
        """Record the end of optimizer step `step`; return (save now, stop now)."""
        if step in self.sync_at and self.synchronize is not None:
            self.synchronize()
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        if self.first_end_wall is None:
            self.first_end_wall = time.time()
        for listener in self.listeners:
            listener(step)
        return step in self.save_at, self.stop_at is not None and step >= self.stop_at


class ClockCallback:
    """The clock as a callback (loopkit takes any object with `on_*` methods; HF gets a `TrainerCallback` subclass)."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.begin()

    def on_step_end(self, args, state, control, **kwargs):
        save, stop = self.clock.end(state.global_step)
        control.should_save = control.should_save or save
        control.should_training_stop = control.should_training_stop or stop


@dataclass
class TrainResult:
    model: torch.nn.Module
    global_step: int
    logged_losses: list = field(default_factory=list)
    started_at: float = 0.0  # perf_counter() before the contender's setup (HF/loopkit: building the trainer)
    train_called_at: float = 0.0  # perf_counter() right before the contender's train call
    train_seconds: float = 0.0  # the whole call: setup inside train(), the steps, the end-of-run summary


def seed_everything(seed: int) -> None:
    """What HF's `set_seed` does for one CPU/GPU process: python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------------
# (a) The hand-written loop: what a careful engineer writes, with the same features and no framework.
# ---------------------------------------------------------------------------------------------------------------------
class EpochShuffle(torch.utils.data.Sampler):
    """Epoch `e` visits `randperm(n, seed + e)`: the same order Accelerate's seedable sampler gives HF Trainer."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def __len__(self):
        return self.size

    def set_epoch(self, epoch: int) -> None:  # the hook Lightning's loop calls before each epoch
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


def accumulation_windows(loader, grad_accum: int):
    """One epoch's micro-batches grouped per optimizer step; the last window takes the remainder (as HF does)."""
    window = []
    for batch in loader:
        window.append(batch)
        if len(window) == grad_accum:
            yield window
            window = []
    if window:
        yield window


def linear_warmup(warmup_steps: int, total_steps: int):
    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return multiplier


def prepare_model(spec: TrainSpec, model) -> torch.device:
    """Seed as HF's `set_seed` does, move the model to the spec's device in training mode, no KV cache (HF Trainer
    and loopkit turn it off too); returns the device."""
    device = torch.device(spec.device)
    seed_everything(spec.seed)
    model.to(device).train()
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = False
    return device


def adamw_with_decay_groups(model, spec: TrainSpec) -> torch.optim.AdamW:
    """AdamW over HF's two parameter groups: weight decay on everything but biases and norm weights."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [p for n, p in named if any(part in n.lower() for part in NO_DECAY_NAME_PARTS)]
    decay = [p for n, p in named if not any(part in n.lower() for part in NO_DECAY_NAME_PARTS)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=spec.learning_rate, betas=(0.9, 0.999), eps=1e-8, fused=True)


def warmup_schedule(optimizer, spec: TrainSpec) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup(spec.warmup_steps, spec.max_steps))


def epoch_loader(spec: TrainSpec, dataset) -> tuple[EpochShuffle, torch.utils.data.DataLoader]:
    """HF's data order (`EpochShuffle`: set its `epoch` before each epoch) and the spec's collator."""
    sampler = EpochShuffle(len(dataset), spec.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=spec.batch_size, sampler=sampler,
                                         collate_fn=workloads.collator_for(spec),
                                         pin_memory=torch.device(spec.device).type == "cuda")
    return sampler, loader


def train_raw(spec: TrainSpec, model, dataset, clock: StepClock, output_dir: str | None = None) -> TrainResult:
    if spec.data != "map":
        raise ValueError("the hand-written loop trains map-style data only (it is not a resume contender)")
    called_at = time.perf_counter()
    device = prepare_model(spec, model)
    optimizer = adamw_with_decay_groups(model, spec)
    schedule = warmup_schedule(optimizer, spec)
    sampler, loader = epoch_loader(spec, dataset)
    # Token-weighted accumulation exactly where HF does it: the model takes the window's label-token count.
    weigh_by_tokens = workloads.accepts_token_count(model)
    shift = workloads.is_causal_lm(model)

    running_loss = torch.zeros((), device=device)  # summed on the device; read only at logging points
    logged_losses, last_logged, step, epoch, stopped = [], 0, 0, 0, False
    while step < spec.max_steps and not stopped:
        sampler.epoch = epoch
        for window in accumulation_windows(loader, spec.grad_accum):
            window = [{k: v.to(device, non_blocking=True) for k, v in batch.items()} for batch in window]
            clock.begin()
            extra = {}
            if weigh_by_tokens:
                extra["num_items_in_batch"] = sum(workloads.count_label_tokens(b, shift) for b in window)
            for batch in window:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.bf16):
                    loss = model(**batch, **extra)["loss"]
                if not weigh_by_tokens:
                    loss = loss / len(window)
                loss.backward()
                running_loss += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
            optimizer.step()
            learning_rate = schedule.get_last_lr()[0]
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            save, stop = clock.end(step)
            if step % spec.logging_steps == 0:  # the loop's only host reads
                logs = {"loss": running_loss.item() / (step - last_logged), "grad_norm": grad_norm.item(),
                        "learning_rate": learning_rate}
                running_loss.zero_()
                last_logged = step
                logged_losses.append(logs["loss"])
                print(logs)
            if save:
                save_raw_checkpoint(model, optimizer, schedule, f"{output_dir}/checkpoint-{step}")
            stopped = stop or step >= spec.max_steps
            if stopped:
                break
        epoch += 1
    return TrainResult(model, step, logged_losses, called_at, called_at, time.perf_counter() - called_at)


def save_raw_checkpoint(model, optimizer, schedule, path: str) -> None:
    """A careful engineer's checkpoint: weights (safetensors via save_pretrained), optimizer and scheduler state."""
    import os

    os.makedirs(path, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))
    torch.save(optimizer.state_dict(), os.path.join(path, "optimizer.pt"))
    torch.save(schedule.state_dict(), os.path.join(path, "scheduler.pt"))


# ---------------------------------------------------------------------------------------------------------------------
# (b) HF Trainer and (c) loopkit: the same arguments, the same collator, progress bars off.
# ---------------------------------------------------------------------------------------------------------------------
def trainer_arguments(spec: TrainSpec, output_dir: str, **overrides) -> dict:
    """`TrainingArguments` / `LoopArgs` fields for `spec` (identical names in both)."""
    values = dict(
        output_dir=output_dir, per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.grad_accum, max_steps=spec.max_steps, learning_rate=spec.learning_rate,
        warmup_steps=spec.warmup_steps, weight_decay=spec.weight_decay, max_grad_norm=spec.max_grad_norm,
        logging_steps=spec.logging_steps, save_strategy="no", report_to="none", disable_tqdm=True, seed=spec.seed,
        bf16=spec.bf16, use_cpu=spec.device == "cpu",
    )
    values.update(overrides)
    return values


def build_trainer(contender: str, spec: TrainSpec, model, output_dir: str, train_dataset=None, callbacks=(),
                  args_overrides=None, **trainer_kwargs):
    """An HF `Trainer` or a loopkit `Loop` with identical arguments; `trainer_kwargs` go to the constructor."""
    arguments = trainer_arguments(spec, output_dir, **(args_overrides or {}))
    if contender == "hf":
        from transformers import Trainer, TrainingArguments

        return Trainer(model=model, args=TrainingArguments(**arguments), train_dataset=train_dataset,
                       data_collator=workloads.collator_for(spec), callbacks=[as_hf_callback(cb) for cb in callbacks],
                       **trainer_kwargs)
    if contender == "loopkit":
        from loopkit import Loop, LoopArgs

        return Loop(model=model, args=LoopArgs(**arguments), train_dataset=train_dataset,
                    data_collator=workloads.collator_for(spec), callbacks=list(callbacks), **trainer_kwargs)
    raise ValueError(f"contender={contender!r} has no trainer; choose 'hf' or 'loopkit'")


def as_hf_callback(callback):
    """HF calls every event on every callback: give a duck-typed callback `TrainerCallback`'s no-op defaults."""
    from transformers import TrainerCallback

    hf_class = type(f"HF{type(callback).__name__}", (type(callback), TrainerCallback), {})
    adapted = object.__new__(hf_class)
    adapted.__dict__.update(vars(callback))
    return adapted


def train(contender: str, spec: TrainSpec, clock: StepClock, output_dir: str, resume_from: str | None = None,
          model=None, trainer_kwargs: dict | None = None) -> TrainResult:
    """Build the model and data for `spec` and train them with `contender` (`trainer_kwargs`: extra constructor
    arguments for HF Trainer or loopkit, e.g. a replaced stage)."""
    model = workloads.build_model(spec) if model is None else model
    dataset = workloads.train_dataset(spec)
    if contender == "raw":
        if resume_from is not None:
            raise ValueError("the hand-written loop does not resume")
        return train_raw(spec, model, dataset, clock, output_dir)
    if contender in PEERS:
        if resume_from is not None or trainer_kwargs:
            raise ValueError(f"{contender} runs the per-step benchmark only: no resume, no replaced stages")
        from . import peers

        return peers.TRAINERS[contender](spec, model, dataset, clock, output_dir)
    started_at = time.perf_counter()
    trainer = build_trainer(contender, spec, model, output_dir, dataset, callbacks=[ClockCallback(clock)],
                            **(trainer_kwargs or {}))
    called_at = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_from)
    seconds = time.perf_counter() - called_at
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return TrainResult(trainer.model, trainer.state.global_step, losses, started_at, called_at, seconds)
