"""Checkpoint files in HF Trainer's layout, written atomically, and read back without unpickling code.

A checkpoint is `<output_dir>/checkpoint-<global_step>/` holding `model.safetensors` (+ `config.json` through
`save_pretrained` when the model has it), `optimizer.pt`, `scheduler.pt`, `scaler.pt` (fp16), `rng_state.pth`,
`trainer_state.json`, and loopkit's own `loopkit_state.json` (stage state, e.g. the running loss). HF Trainer
resumes from it; loopkit resumes from HF's.

Atomicity: everything is written into a hidden sibling `.tmp-checkpoint-<step>`, flushed and fsynced, marked complete
(`loopkit_state.json` is the last file written) and renamed into place. A kill mid-save leaves only the temporary
folder, which the next save removes; `resume_from_checkpoint=True` never picks it.

Security: weights go through safetensors, state through JSON, and every `torch.load` uses `weights_only=True`
(`rng_state.pth` needs numpy's RNG tuple, allowed by an explicit list of numpy classes).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch

CHECKPOINT_PREFIX = "checkpoint"
CHECKPOINT_RE = re.compile(r"^" + CHECKPOINT_PREFIX + r"-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"
LOOPKIT_STATE_NAME = "loopkit_state.json"
WEIGHTS_NAME = "model.safetensors"
OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME = "optimizer.pt", "scheduler.pt", "scaler.pt"


def checkpoint_dirs(output_dir: str) -> list[str]:
    """Complete checkpoint folders under `output_dir`, in step order."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = CHECKPOINT_RE.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def last_checkpoint(output_dir: str) -> str | None:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def safe_torch_load(path: str):
    """`torch.load` that can only rebuild tensors, primitives and numpy's RNG state: never arbitrary code."""
    allowed = [np.ndarray, np.dtype, np.dtypes.UInt32DType]
    reconstruct = getattr(getattr(np, "_core", np.core).multiarray, "_reconstruct")
    allowed.append(reconstruct)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, truncated zip, ...: name the file, never fall back to full pickle
        raise RuntimeError(f"Refusing or failing to load {path}: {exc}. loopkit loads only tensors and plain "
                           f"values (weights_only=True); re-create the file or resume from another checkpoint.") from exc


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if torch.cuda.is_available() and "cuda" in state:
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            torch.cuda.random.set_rng_state(cuda)


def rng_file_name(num_processes: int, process_index: int) -> str:
    return f"rng_state_{process_index}.pth" if num_processes > 1 else "rng_state.pth"


def save_model_files(model, accelerator, output_dir: str, processing_class=None) -> None:
    """Weights (+ config) in `save_pretrained` layout when the model has it, else a bare `model.safetensors`."""
    os.makedirs(output_dir, exist_ok=True)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if hasattr(unwrapped, "save_pretrained"):
        unwrapped.save_pretrained(output_dir, is_main_process=accelerator.is_main_process)
    elif accelerator.is_main_process:
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in unwrapped.state_dict().items()}
        save_file(state, os.path.join(output_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    if processing_class is not None and accelerator.is_main_process and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)


def load_model_weights(model, checkpoint: str) -> None:
    """Load `model.safetensors` (or sharded safetensors / PEFT adapters) into `model`, non-strictly as HF does."""
    from safetensors.torch import load_file

    adapter = os.path.join(checkpoint, "adapter_model.safetensors")
    if os.path.isfile(adapter) and hasattr(model, "load_adapter"):
        model.load_adapter(checkpoint, getattr(model, "active_adapter", "default"), is_trainable=True)
        return
    single = os.path.join(checkpoint, WEIGHTS_NAME)
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(checkpoint, v) for v in json.load(f)["weight_map"].values()})
    else:
        raise FileNotFoundError(f"No {WEIGHTS_NAME} in {checkpoint}: it is not a complete checkpoint.")
    state = {}
    for path in files:
        try:
            state.update(load_file(path))
        except Exception as exc:
            raise RuntimeError(f"{path} is corrupt or truncated ({exc}).") from exc
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys and hasattr(model, "tie_weights"):
        model.tie_weights()


class Checkpointer:
    """Writes, finds, rotates and reads checkpoints of one run. Owned by the evaluation-and-checkpoint stage."""

    def __init__(self, loop):
        self.loop = loop

    # -- writing --
    def save(self) -> str:
        """Save a full checkpoint of the current step atomically; return its final path."""
        loop = self.loop
        acc, args, state = loop.accelerator, loop.args, loop.state
        run_dir = args.output_dir
        name = f"{CHECKPOINT_PREFIX}-{state.global_step}"
        final = os.path.join(run_dir, name)
        tmp = os.path.join(run_dir, f".tmp-{name}")
        if acc.is_main_process:
            os.makedirs(run_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        save_model_files(loop.model_wrapped, acc, tmp, loop.processing_class)
        if state.best_global_step is not None:
            best = os.path.join(run_dir, f"{CHECKPOINT_PREFIX}-{state.best_global_step}")
            if os.path.isdir(best) or best == final:
                state.best_model_checkpoint = best
        if not args.save_only_model:
            if acc.is_main_process:
                torch.save(loop.optimizer.state_dict(), os.path.join(tmp, OPTIMIZER_NAME))
                torch.save(loop.lr_scheduler.state_dict(), os.path.join(tmp, SCHEDULER_NAME))
                if acc.scaler is not None:
                    torch.save(acc.scaler.state_dict(), os.path.join(tmp, SCALER_NAME))
            torch.save(rng_state(), os.path.join(tmp, rng_file_name(acc.num_processes, acc.process_index)))
        acc.wait_for_everyone()
        if acc.is_main_process:
            state.record_callback_states(loop.callback_handler.callbacks + [loop.control])
            state.save_to_json(os.path.join(tmp, TRAINER_STATE_NAME))
            with open(os.path.join(tmp, LOOPKIT_STATE_NAME), "w") as f:
                json.dump(loop.stage_states(), f, indent=2, sort_keys=True)
            fsync_tree(tmp)
            if os.path.isdir(final):  # a re-save of the same step (e.g. after resume): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            self.rotate()
        acc.wait_for_everyone()
        return final

    def rotate(self) -> None:
        """HF's `save_total_limit` rule: keep the newest and the best, delete the oldest others beyond the limit.

        Ordering is by step number (HF uses mtimes, which a copy or a restore can reorder).
        """
        limit = self.loop.args.save_total_limit
        if limit is None or limit <= 0:
            return
        dirs = checkpoint_dirs(self.loop.args.output_dir)
        best = self.loop.state.best_model_checkpoint
        protected = {dirs[-1]} if dirs else set()
        if best is not None and os.path.isdir(best):
            protected.add(os.path.join(self.loop.args.output_dir, os.path.basename(best)))
        keep = max(limit, len(protected))
        deletable = [d for d in dirs if d not in protected]
        excess = len(dirs) - keep
        for path in deletable[:max(0, excess)]:
            shutil.rmtree(path, ignore_errors=True)

    def keep_only_best(self) -> None:
        """End of training with `save_total_limit == 1`: only the best checkpoint survives (HF)."""
        best = self.loop.state.best_model_checkpoint
        if self.loop.args.save_total_limit != 1 or best is None or not self.loop.accelerator.is_main_process:
            return
        for path in checkpoint_dirs(self.loop.args.output_dir):
            if os.path.basename(path) != os.path.basename(best):
                shutil.rmtree(path, ignore_errors=True)

    # -- reading --
    def resolve(self, resume_from_checkpoint) -> str | None:
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        if resume_from_checkpoint is True:
            path = last_checkpoint(self.loop.args.output_dir)
            if path is None:
                raise ValueError(f"resume_from_checkpoint=True but no checkpoint-<step> folder exists in "
                                 f"output_dir={self.loop.args.output_dir!r}. Train without resuming first.")
            return path
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r} is not a folder.")
        return resume_from_checkpoint

    @staticmethod
    def read_trainer_state(checkpoint: str):
        from .state import LoopState

        path = os.path.join(checkpoint, TRAINER_STATE_NAME)
        try:
            return LoopState.load_from_json(path)
        except (OSError, ValueError, TypeError) as exc:
            raise RuntimeError(f"{path} is missing, corrupt or truncated ({exc}).") from exc

    @staticmethod
    def read_stage_states(checkpoint: str) -> dict:
        path = os.path.join(checkpoint, LOOPKIT_STATE_NAME)
        if not os.path.isfile(path):
            return {}  # a checkpoint written by HF Trainer
        with open(path) as f:
            return json.load(f)

    def load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        loop = self.loop
        opt_path, sched_path = os.path.join(checkpoint, OPTIMIZER_NAME), os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(opt_path) and os.path.isfile(sched_path):
            loop.optimizer.load_state_dict(safe_torch_load(opt_path))
            loop.lr_scheduler.load_state_dict(safe_torch_load(sched_path))
        scaler_path = os.path.join(checkpoint, SCALER_NAME)
        if os.path.isfile(scaler_path) and loop.accelerator.scaler is not None:
            loop.accelerator.scaler.load_state_dict(safe_torch_load(scaler_path))

    def load_rng(self, checkpoint: str) -> None:
        acc = self.loop.accelerator
        path = os.path.join(checkpoint, rng_file_name(acc.num_processes, acc.process_index))
        if os.path.isfile(path):
            restore_rng_state(safe_torch_load(path))
