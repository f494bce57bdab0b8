"""Launched by tests/test_node_local_disks.py as two one-process "nodes" (`torchrun --nnodes 2 --node_rank R`), each
node with its own output folders under OUT (standing for its local disk), `save_on_each_node=True`, DDP over gloo.

Usage: python node_local_child.py OUT first | resume

* first: an uninterrupted run into OUT/reference_node<R> (its final weights: final.safetensors there), then a run
  into OUT/node<R> that SIGKILLs itself on every node as step 7 begins (checkpoints 2, 4 and 6 written).
* resume: `resume_from_checkpoint=True` into OUT/node<R>, each node from its own folder, to the end (final weights:
  OUT/node<R>/final.safetensors).
"""

import faulthandler
import os
import signal
import sys

import torch
from safetensors.torch import save_file
from torch import nn
from transformers.trainer_callback import TrainerCallback

sys.path.insert(0, os.path.dirname(__file__))
import dist_child  # noqa: E402  (its `leave`: exit without the interpreter's teardown)

from loopkit import Loop, LoopArgs  # noqa: E402

MAX_STEPS, SAVE_STEPS, KILL_AT = 10, 2, 7


class DroppedRegression(nn.Module):
    """A dropout before the linear layer: each rank's RNG stream shapes its steps (its own RNG file must resume)."""

    def __init__(self):
        super().__init__()
        self.dropout, self.linear = nn.Dropout(0.3), nn.Linear(4, 1)

    def forward(self, x, labels=None):
        prediction = self.linear(self.dropout(x)).squeeze(-1)
        return {"loss": nn.functional.mse_loss(prediction, labels), "logits": prediction}


def regression_data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return [{"x": row, "labels": row.sum() + 1} for row in x]


class KillAt(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def train(output_dir: str, callbacks=(), resume=None) -> Loop:
    args = LoopArgs(output_dir=output_dir, max_steps=MAX_STEPS, per_device_train_batch_size=2, learning_rate=0.05,
                    save_steps=SAVE_STEPS, save_on_each_node=True, logging_steps=5, report_to="none",
                    disable_tqdm=True, seed=5)
    torch.manual_seed(0)
    loop = Loop(model=DroppedRegression(), args=args, train_dataset=regression_data(64), callbacks=list(callbacks))
    loop.train(resume_from_checkpoint=resume)
    save_file({k: v.contiguous() for k, v in loop.model.state_dict().items()},
              os.path.join(output_dir, "final.safetensors"))
    return loop


def main(out: str, mode: str) -> None:
    node = os.environ["GROUP_RANK"]
    if mode == "first":
        train(os.path.join(out, f"reference_node{node}"))
        train(os.path.join(out, f"node{node}"), callbacks=[KillAt()])
    else:
        train(os.path.join(out, f"node{node}"), resume=True)


if __name__ == "__main__":
    faulthandler.enable()
    main(sys.argv[1], sys.argv[2])
    dist_child.leave()
