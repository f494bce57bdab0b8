"""What one benchmark run trains: a `TrainSpec` every contender receives unchanged.

This module is imported by the parent process too, so it must stay free of torch and transformers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TrainSpec:
    """Model, data, optimizer, schedule and step count of one training run.

    `model` names a preset in `benchmarks.workloads.models.LLAMA_PRESETS`; `model_overrides` changes preset fields (the
    smoke test uses it to shrink models). Every contender trains with AdamW (HF's decay groups), a linear warmup
    schedule, gradient clipping and gradient accumulation, and reads the device only at logging points.
    """

    model: str = "null"
    model_overrides: dict = field(default_factory=dict)
    num_train: int = 512
    seq_len: int = 64
    # "map" (shuffled each epoch), "iterable" (a stream, read in order) or "iterable-seekable" (a stream with
    # state_dict/load_state_dict, as datasets.IterableDataset has)
    data: str = "map"
    batch_size: int = 8
    grad_accum: int = 2
    max_steps: int = 100
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    logging_steps: int = 50
    seed: int = 42
    device: str = "cpu"
    bf16: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainSpec":
        return cls(**values)

    def replace(self, **changes) -> "TrainSpec":
        return dataclasses.replace(self, **changes)

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.grad_accum
