"""A run whose callback opens, at every `on_save`, the checkpoint it is told of, as HF's callbacks find it (Ray Train's
`RayTrainReportCallback`: the newest checkpoint folder under `output_dir`, `get_last_checkpoint`), and loads it
fully. tests/test_on_save_commit.py runs it in process (`train`) and as a killed and resumed child.

Usage: python on_save_child.py OUTPUT_DIR STORAGE [KILL_STEP]

STORAGE: "hf", "hf-async", "dcp" or "dcp-async". Every `on_save` appends one JSON line to OUTPUT_DIR/on_save.jsonl
(flushed and fsynced as it happens, so a killed run's record is complete); launched on several processes (DDP, gloo),
each rank to OUTPUT_DIR/on_save_rank<r>.jsonl. KILL_STEP: a SIGKILL while checkpoint-
KILL_STEP is being written (on the writer, before its rename; with several processes on rank 0, which renames), once training has run a step past it (where an
`on_save` fired when the save began would already be recorded). The run resumes from the newest checkpoint in
OUTPUT_DIR if there is one.
"""

import json
import os
import signal
import sys
import time

import torch
from safetensors.torch import load_file
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import loopkit.checkpoint as ckpt
from loopkit import Loop, LoopArgs
from loopkit.checkpoint import safe_torch_load
from loopkit.storage import DCPStorage, HFStorage

from interrupt_child import TinyRegression, regression_data  # this folder: the script's own sys.path[0]

MAX_STEPS, SAVE_STEPS = 12, 4
KILL_WAIT_S = 60  # the writer waits at most this long for training to pass the save's step, then dies anyway


def storage_for(name: str):
    storage = DCPStorage if name.startswith("dcp") else HFStorage
    return storage(async_save=name.endswith("-async"))


def read_checkpoint(path: str, storage: str) -> tuple[dict, dict]:
    """The weights and the optimizer state of a checkpoint folder, read whole."""
    if storage.startswith("dcp"):
        from loopkit.storage.dcp import read_whole_state

        state = read_whole_state(path)
        return state["model"], state["optimizer"]
    return load_file(os.path.join(path, "model.safetensors")), safe_torch_load(os.path.join(path, "optimizer.pt"))


class OpenAtSave(TrainerCallback):
    """At each step that saves: the weights as that step left them. At each `on_save`: the newest checkpoint folder,
    opened and read whole, compared with them; one record per `on_save` (to `record_path` too, as it happens)."""

    def __init__(self, storage: str, record_path: str | None = None):
        self.storage, self.record_path = storage, record_path
        self.at_step, self.records, self.events, self.last_step_end = {}, [], [], 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.last_step_end = state.global_step
        if control.should_save:
            self.at_step[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append("summary_log" if "train_runtime" in (logs or {}) else "log")

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append("on_train_end")

    def on_save(self, args, state, control, **kwargs):
        self.events.append("on_save")
        newest = get_last_checkpoint(args.output_dir)
        record = {"step": state.global_step, "opened": os.path.basename(newest) if newest else None,
                  "late": self.last_step_end > state.global_step,
                  "logged_up_to": max((e["step"] for e in state.log_history), default=0)}
        if newest is not None:
            weights, optimizer = read_checkpoint(newest, self.storage)
            with open(os.path.join(newest, "trainer_state.json")) as f:
                record["trainer_state_step"] = json.load(f)["global_step"]
            expected = self.at_step.get(state.global_step)
            record["weights_equal"] = expected is not None and expected.keys() == weights.keys() and all(
                torch.equal(weights[k], v) for k, v in expected.items())
            record["optimizer_states"] = len(optimizer["state"])
        self.records.append(record)
        if self.record_path is not None:
            with open(self.record_path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())


def kill_while_writing(step: int, watch: OpenAtSave) -> None:
    """SIGKILL on the writer, before checkpoint-`step`'s rename, once training has finished the step after it."""
    original = ckpt.fsync_tree

    def fsync_tree(path):
        if os.path.basename(path) == f".tmp-checkpoint-{step}":
            for _ in range(KILL_WAIT_S * 20):  # polled: at most KILL_WAIT_S seconds
                if watch.last_step_end > step:
                    break
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        original(path)

    ckpt.fsync_tree = fsync_tree


def train(out: str, storage: str, watch: OpenAtSave, resume=None) -> Loop:
    args = LoopArgs(output_dir=out, max_steps=MAX_STEPS, per_device_train_batch_size=4, learning_rate=0.05,
                    logging_steps=2, save_steps=SAVE_STEPS, disable_tqdm=True, report_to="none", seed=3)
    torch.manual_seed(0)
    loop = Loop(model=TinyRegression(), args=args, train_dataset=regression_data(64), callbacks=[watch],
                storage=storage_for(storage))
    loop.train(resume_from_checkpoint=resume)
    return loop


def main():
    out, storage = sys.argv[1], sys.argv[2]
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    record = "on_save.jsonl" if ranks == 1 else f"on_save_rank{os.environ['RANK']}.jsonl"
    watch = OpenAtSave(storage, os.path.join(out, record))
    if len(sys.argv) > 3:
        kill_while_writing(int(sys.argv[3]), watch)
    resume = True if ckpt.last_checkpoint(out) else None
    train(out, storage, watch, resume)


if __name__ == "__main__":
    main()
