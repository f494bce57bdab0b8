"""A user's distributed training script, written as users write them for Trainer with `Trainer` replaced by `Loop`:
the training arguments from the command line, evaluation and prediction with `compute_metrics`, training, and then
the script simply ends. Nothing here destroys the process group, waits for the other rank or leaves early:
whatever must happen at the end of the process is loopkit's job (tests/test_process_exit.py launches it with
`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2`, as docs/distributed.md's launch commands do).

Usage: torchrun --nproc_per_node 2 user_script.py --output_dir OUT [any TrainingArguments flag]

Exits 1 (as the user's own check) when a gathered prediction is out of order or missing; rank 0 writes
OUT/result.json with the metrics once everything ran.
"""

import json
import os

import torch
from torch import nn
from transformers import HfArgumentParser, TrainingArguments

from loopkit import Loop


class Indices(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)]), "labels": torch.tensor(float(i))}


class Echo(nn.Module):
    """Predicts its input through one trainable scale, so a gathered prediction shows which sample it came from."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x, labels=None):
        prediction = (x * self.scale).squeeze(-1)
        loss = nn.functional.mse_loss(prediction, labels) if labels is not None else None
        return {"loss": loss, "logits": prediction}


def in_order(prediction) -> dict:
    expected = list(range(len(prediction.label_ids)))
    return {"in_order": prediction.label_ids.tolist() == expected}


def main() -> None:
    args = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()[0]
    metrics = {}
    for n in (13, 7):  # neither divides into whole global batches
        loop = Loop(model=Echo(), args=args, eval_dataset=Indices(n), compute_metrics=in_order)
        metrics[f"eval_{n}"] = loop.evaluate()
        metrics[f"predict_{n}"] = loop.predict(Indices(n)).metrics
        if not (metrics[f"eval_{n}"]["eval_in_order"] and metrics[f"predict_{n}"]["test_in_order"]):
            raise SystemExit(1)
    args.max_steps = 2
    loop = Loop(model=Echo(), args=args, train_dataset=Indices(16))
    metrics["train"] = loop.train().metrics
    if loop.is_world_process_zero():
        with open(os.path.join(args.output_dir, "result.json"), "w") as f:
            json.dump(metrics, f)


if __name__ == "__main__":
    main()
