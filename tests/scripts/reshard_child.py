"""The training script of tests/test_reshard_resume.py: a tiny Llama on causal-LM samples, a global batch of 4 on
any number of processes (4 x 1, 2 x 2, 1 x 4), `DCPStorage`, a save every 2 steps.

Usage: python reshard_child.py OUTPUT_DIR NAME [CHECKPOINT]

Trains OUTPUT_DIR/NAME (from CHECKPOINT when given) and writes, per rank, OUTPUT_DIR/NAME_rank<r>.json: the sample
ids of each forward this rank ran, in order (read from the model's inputs: what trained, whatever the loader read
ahead or a checkpoint held), and the log history (each step's loss, unrounded).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import lm_data, tiny_llama  # noqa: E402

from loopkit import Loop, LoopArgs  # noqa: E402
from loopkit.storage import DCPStorage  # noqa: E402

GLOBAL_BATCH, MAX_STEPS, SAMPLES = 4, 6, 24


def train(out: str, name: str, checkpoint: str | None = None) -> None:
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    samples = lm_data(SAMPLES)
    sample_id = {tuple(s["input_ids"].tolist()): i for i, s in enumerate(samples)}
    assert len(sample_id) == SAMPLES, "lm_data drew two equal samples: ids would be ambiguous"
    forwards = []
    model = tiny_llama()
    model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append([sample_id[tuple(row.tolist())] for row in kwargs["input_ids"]]),
        with_kwargs=True)
    args = LoopArgs(output_dir=os.path.join(out, name), max_steps=MAX_STEPS,
                    per_device_train_batch_size=GLOBAL_BATCH // processes, learning_rate=3e-3, warmup_steps=2,
                    weight_decay=0.01, max_grad_norm=0.5, logging_steps=1, optim="adamw_torch", disable_tqdm=True,
                    seed=7, save_steps=2, report_to="none")
    loop = Loop(model=model, args=args, train_dataset=samples, storage=DCPStorage())
    loop.train(resume_from_checkpoint=checkpoint)
    with open(os.path.join(out, f"{name}_rank{loop.accelerator.process_index}.json"), "w") as f:
        json.dump({"num_processes": loop.accelerator.num_processes, "forwards": forwards,
                   "log_history": loop.state.log_history}, f)


if __name__ == "__main__":
    train(*sys.argv[1:])
