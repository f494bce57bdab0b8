"""Launched by tests/test_run_fields.py as two one-process "nodes" (`torchrun --nnodes 2 --node_rank R`), each node
with its own output folder OUT/node<R> as on machines without a shared disk:

* trains a tiny model for 2 steps with every `ddp_*` field set away from torch's default and `save_on_each_node`,
  then writes what the DDP wrapper got to OUT/ddp_rank<r>.json;
* trains again with `save_on_each_node=False` into OUT/main_only_node<R>.

It leaves with `os._exit(0)` once everything it reports is written: see `dist_child.leave`.
"""

import faulthandler
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import dist_child  # noqa: E402  (its `leave`: exit without the interpreter's teardown)

from loopkit import Loop, LoopArgs  # noqa: E402


class TwoHeads(nn.Module):
    """`unused` takes no part in the loss: DDP needs find_unused_parameters=True to train it without an error."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(2, 1), nn.Linear(2, 1)

    def forward(self, x, labels=None):
        prediction = self.used(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(prediction, labels), "logits": prediction}


def train(output_dir: str, **fields) -> Loop:
    torch.manual_seed(0)
    data = [{"x": torch.randn(2), "labels": torch.randn(())} for _ in range(8)]
    args = LoopArgs(output_dir=output_dir, max_steps=2, per_device_train_batch_size=2, save_steps=2,
                    report_to="none", disable_tqdm=True, **fields)
    loop = Loop(model=TwoHeads(), args=args, train_dataset=data)
    loop.train()
    return loop


def main(out: str) -> None:
    node = os.environ["GROUP_RANK"]
    loop = train(os.path.join(out, f"node{node}"), save_on_each_node=True, ddp_find_unused_parameters=True,
                 ddp_bucket_cap_mb=7, ddp_broadcast_buffers=False, ddp_static_graph=True)
    ddp, rank = loop.model_wrapped, loop.accelerator.process_index
    seen = dict(wrapper=type(ddp).__name__, find_unused_parameters=ddp.find_unused_parameters,
                bucket_bytes_cap=ddp.bucket_bytes_cap, broadcast_buffers=ddp.broadcast_buffers,
                static_graph=ddp.static_graph, global_step=loop.state.global_step)
    with open(os.path.join(out, f"ddp_rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    train(os.path.join(out, f"main_only_node{node}"))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    faulthandler.enable()  # an abort before `leave` prints every thread's Python stack into the launch's log
    main(sys.argv[1])
    dist_child.leave()
