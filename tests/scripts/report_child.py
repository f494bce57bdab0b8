"""A run the report tests kill with SIGKILL (and, in the test's own process, resume).

Usage: python report_child.py OUTPUT_DIR KILL_AT_STEP

Trains a tiny BERT classifier for 20 steps (evaluating and saving every 3, `metric_for_best_model="eval_loss"`),
resuming from the newest checkpoint in OUTPUT_DIR if there is one, and SIGKILLs itself at KILL_AT_STEP's
`on_step_end`. It prints one JSON line at `on_train_begin`, per optimizer step and per save with the seconds since
just before `train()`, so the test can bracket the time each checkpoint records.
"""

import json
import os
import signal
import sys
import time

import torch
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

from loopkit import Loop, LoopArgs
from loopkit.checkpoint import last_checkpoint


class Timeline(TrainerCallback):
    """Seconds since `start` at train begin, each step end and save; SIGKILL at step `kill_at`."""

    def __init__(self, kill_at=None):
        self.start, self.kill_at, self.events = None, kill_at, []

    def note(self, **event):
        event["t"] = time.perf_counter() - self.start
        self.events.append(event)
        print(json.dumps(event), flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        self.note(train_begin=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.note(step_end=state.global_step)
        if state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_save(self, args, state, control, **kwargs):
        self.note(saved=state.global_step)


def build_loop(out, timeline) -> Loop:
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=2))
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": i % 2} for i in range(32)]
    args = LoopArgs(output_dir=str(out), max_steps=20, per_device_train_batch_size=4, logging_steps=1,
                    save_steps=3, eval_strategy="steps", eval_steps=3, metric_for_best_model="eval_loss",
                    greater_is_better=False, disable_tqdm=True)
    return Loop(model=model, args=args, train_dataset=data, eval_dataset=data[:8], callbacks=[timeline])


def train(out, kill_at=None) -> Timeline:
    timeline = Timeline(kill_at)
    loop = build_loop(out, timeline)
    timeline.start = time.perf_counter()  # right before train(): no checkpoint can hold more time than this
    loop.train(resume_from_checkpoint=True if last_checkpoint(str(out)) else None)
    return timeline


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]))
