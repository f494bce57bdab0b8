"""`train`: build the model and data for a `TrainSpec` and train them with a named contender (the hand-written
loop, HF Trainer, loopkit, or a peer of the per-step benchmark). Worker side.
"""

from __future__ import annotations

import time


from ..workloads.data import train_dataset
from ..workloads.models import build_model
from ..workloads.spec import TrainSpec
from .clock import ClockCallback, StepClock
from .hf import build_trainer
from .names import PEERS
from .raw import train_raw
from .recipe import TrainResult


def train(contender: str, spec: TrainSpec, clock: StepClock, output_dir: str, resume_from: str | None = None,
          model=None, trainer_kwargs: dict | None = None) -> TrainResult:
    """Build the model and data for `spec` and train them with `contender` (`trainer_kwargs`: extra constructor
    arguments for HF Trainer or loopkit, e.g. a replaced stage)."""
    model = build_model(spec) if model is None else model
    dataset = train_dataset(spec)
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
