"""A short training run that the interruption tests signal (tests/test_interrupt.py).

Usage: python interrupt_child.py OUTPUT_DIR [MODE]

It trains a tiny regression model for 8 optimizer steps, saving every 2, and resumes from the newest checkpoint in
OUTPUT_DIR if there is one. MODE:
* "sigint" / "sigterm": that signal to itself at the start of step 3 (as a Ctrl-C or a scheduler would);
* "sigint-twice": SIGINT at the start of step 3, and a second SIGINT while checkpoint-3 is being written;
* "catch": as "sigint", with `train()` in a `try` that catches `TrainingInterrupted` and goes on after it.
Without MODE it runs (or resumes) to the end. After `train()` it prints "after train(): ..." (what a script's code
after `train()` sees).
"""

import os
import signal
import sys

import torch
from torch import nn

import loopkit.checkpoint as ckpt
from loopkit import Loop, LoopArgs, TrainingInterrupted


class TinyRegression(nn.Module):
    """y = a.x + b with an MSE loss (tests/helpers.py has the same; importing it would import HF Trainer, which
    takes seconds: this child starts often)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x, labels=None):
        prediction = self.linear(x).squeeze(-1)
        return {"loss": nn.functional.mse_loss(prediction, labels), "logits": prediction}


def regression_data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    return [{"x": row, "labels": 3 * row[0] - 2 * row[1] + 1} for row in x]


class SignalAtStep:
    """A callback (HF's protocol: a method per event) that sends `signum` to this process as step `step` begins."""

    def __init__(self, signum, step):
        self.signum, self.step = signum, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            self.step = None
            os.kill(os.getpid(), self.signum)


def second_sigint_during_save(step: int) -> None:
    """The second Ctrl-C arrives while checkpoint-`step` writes its trainer_state.json (mid-save)."""
    original = ckpt.write_text

    def write_text(path, text):
        original(path, text)
        if f".tmp-checkpoint-{step}" in path and path.endswith("trainer_state.json"):
            os.kill(os.getpid(), signal.SIGINT)

    ckpt.write_text = write_text


def main():
    out, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    callbacks = []
    if mode:
        callbacks.append(SignalAtStep(signal.SIGTERM if mode == "sigterm" else signal.SIGINT, 3))
    if mode == "sigint-twice":
        second_sigint_during_save(3)
    args = LoopArgs(output_dir=out, max_steps=8, per_device_train_batch_size=4, learning_rate=0.05, logging_steps=1,
                    save_steps=2, disable_tqdm=True, report_to="none", seed=3)
    torch.manual_seed(0)
    loop = Loop(model=TinyRegression(), args=args, train_dataset=regression_data(32), callbacks=callbacks)
    resume = True if ckpt.last_checkpoint(out) else None
    try:
        loop.train(resume_from_checkpoint=resume)
    except TrainingInterrupted as interrupted:
        if mode != "catch":
            raise
        print(f"after train(): interrupted, checkpoint={interrupted.checkpoint} saved={interrupted.saved}")
        return
    print(f"after train(): completed at step {loop.state.global_step}")


if __name__ == "__main__":
    main()
