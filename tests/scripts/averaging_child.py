"""Weight averaging on DDP, launched by tests/test_weight_averaging.py on 2 gloo processes: in each rank, the same
EMA run three times in one process: uninterrupted (OUT/whole), stopped after its step-4 checkpoint (OUT/resumed),
then resumed from that checkpoint by a new Loop. Each rank writes the weights its model holds when the whole and the
resumed run's train() return: OUT/{whole,resumed}_rank<r>.safetensors.

Usage: python averaging_child.py OUT
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

from loopkit import EMA, Loop, LoopArgs

from interrupt_child import TinyRegression, regression_data  # this folder: the script's own sys.path[0]

STEPS, SAVE_EVERY = 8, 4


class StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def run(out: str, callbacks=(), resume_from=None) -> Loop:
    torch.manual_seed(0)
    model = TinyRegression()
    args = LoopArgs(output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=0.1, optim="sgd",
                    save_steps=SAVE_EVERY, eval_strategy="steps", eval_steps=2, report_to="none", disable_tqdm=True,
                    log_level="error")
    loop = Loop(model, args, train_dataset=regression_data(64), eval_dataset=regression_data(16),
                callbacks=list(callbacks), averaging=EMA(decay=0.75))
    loop.train(resume_from_checkpoint=resume_from)
    return loop


def main(out: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    whole = run(os.path.join(out, "whole"))
    run(os.path.join(out, "resumed"), callbacks=[StopAt(SAVE_EVERY)])
    resumed = run(os.path.join(out, "resumed"), resume_from=os.path.join(out, "resumed", f"checkpoint-{SAVE_EVERY}"))
    for name, loop in (("whole", whole), ("resumed", resumed)):
        save_file({n: p.detach().contiguous() for n, p in loop.model.named_parameters()},
                  os.path.join(out, f"{name}_rank{rank}.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
