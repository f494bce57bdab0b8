"""What every contender's training is made of, written once: the seeds, the data order (HF's seedable sampler
order), the accumulation windows, AdamW with HF's decay groups, the linear warm-up and the result of a run.

Worker side (imports torch). The hand-written loop (raw.py) and the peers (peers.py) build on it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from ..workloads.data import collator_for
from ..workloads.spec import TrainSpec

NO_DECAY_NAME_PARTS = ("bias", "norm")  # HF's decay rule for these models: no decay on biases and norm weights


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
                                         collate_fn=collator_for(spec),
                                         pin_memory=torch.device(spec.device).type == "cuda")
    return sampler, loader
