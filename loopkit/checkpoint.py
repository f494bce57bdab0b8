"""Checkpoint files in HF Trainer's layout, written atomically, and read back without unpickling code.

A checkpoint is `<output_dir>/checkpoint-<global_step>/` holding `model.safetensors` (+ `config.json` through
`save_pretrained` when the model has it), `optimizer.pt`, `scheduler.pt`, `scaler.pt` (fp16), `rng_state.pth`,
`trainer_state.json`, and loopkit's own `loopkit_state.json` (stage state, e.g. the running loss) with, when a stage's
state holds tensors (the data stage's batch read ahead), `loopkit_tensors.safetensors` (one per process:
`loopkit_tensors_<rank>.safetensors`). HF Trainer resumes from it; loopkit resumes from HF's.

Atomicity: everything is written into a hidden sibling `.tmp-checkpoint-<step>`, flushed and fsynced, marked complete
(`loopkit_state.json` is the last file written) and renamed into place. A kill mid-save leaves only the temporary
folder, which the next save removes; `resume_from_checkpoint=True` never picks it.

Reruns: every checkpoint records, in `loopkit_state.json` ("checkpoint" entry), the run that wrote it (`run_id`: new
for each fresh `train()`, inherited when resuming) and its save number in `output_dir` (`save_index`: one more than
the highest present when it is written, so it orders saves by when they happened without reading a clock or an mtime,
which a copy or a restore changes). "Most recently saved" means the highest save number; folders that record none
(HF Trainer's, or loopkit's before run ids) rank below every numbered one and among themselves by folder mtime (all
they have). Such folders count as another run: nothing in them says who wrote them, so this run never deletes them.
Rotation deletes only the current run's checkpoints; `resume_from_checkpoint=True` takes the most recently saved
complete checkpoint and names it; a fresh run into a folder holding other runs' checkpoints says what it found.

Security: weights go through safetensors, state through JSON, and every `torch.load` uses `weights_only=True`
(`rng_state.pth` needs numpy's RNG tuple, allowed by an explicit list of numpy classes). Sharded FSDP folders
(`pytorch_model_fsdp_0/`, `optimizer_0/`) are read by loopkit/dcp_reading.py (DCP metadata through a restricted
unpickler), DeepSpeed's `global_step*/` with its `torch.load`s forced to `weights_only=True` (loopkit/distributed.py).
docs/checkpoints.md lists every file read and how.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .args import trainer_error
from .distributed import (FSDP_MODEL_FOLDER, active_engine, engine_checkpoint_present, full_state_dict_saved,
                          load_engine_model, load_optimizer_state, load_sharded_model, save_engine_state,
                          sharded_model_saved)

CHECKPOINT_PREFIX = "checkpoint"
CHECKPOINT_RE = re.compile(r"^" + CHECKPOINT_PREFIX + r"-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"
LOOPKIT_STATE_NAME = "loopkit_state.json"
WEIGHTS_NAME = "model.safetensors"
OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME = "optimizer.pt", "scheduler.pt", "scaler.pt"
RECORD_KEY = "checkpoint"  # the entry of `loopkit_state.json` that says which run wrote the checkpoint, and when
TENSOR_REF = "__tensor__"  # in a stage's state: a tensor stored in the process's stage-tensor file, by name

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class CheckpointRecord:
    """Who wrote a checkpoint folder and when, as it records it (see the module docstring)."""

    path: str
    step: int
    run_id: str | None  # None: not recorded (HF Trainer's folder, or loopkit's before run ids)
    save_index: int | None
    saved_at: str | None  # UTC time of the save, for messages only
    mtime: float

    def recency(self) -> tuple:
        """Sort key, oldest first: numbered saves after unnumbered ones, which go by folder mtime, then step."""
        if self.save_index is not None:
            return (1, self.save_index, 0.0, self.step)
        return (0, 0, self.mtime, self.step)

    def describe(self) -> str:
        name = os.path.basename(self.path)
        if self.run_id is None:
            return f"{name} (no run recorded: HF Trainer's, or loopkit's before run ids)"
        return f"{name} (run {self.run_id}, save #{self.save_index}, {self.saved_at})"


def read_record(path: str) -> CheckpointRecord:
    """The record of checkpoint folder `path`; a missing or unreadable one counts as not recorded."""
    match = CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
    entry = {}
    try:
        with open(os.path.join(path, LOOPKIT_STATE_NAME), encoding="utf-8") as f:
            entry = json.load(f).get(RECORD_KEY) or {}
    except (OSError, ValueError, AttributeError):
        pass  # HF Trainer's folder, or a damaged file (resolve() names that one if it is picked)
    run_id, save_index = entry.get("run_id"), entry.get("save_index")
    recorded = isinstance(run_id, str) and isinstance(save_index, int)
    return CheckpointRecord(path=path, step=int(match.group(1)) if match else -1,
                            run_id=run_id if recorded else None, save_index=save_index if recorded else None,
                            saved_at=entry.get("saved_at") if recorded else None, mtime=os.path.getmtime(path))


def checkpoints_by_recency(output_dir: str) -> list[CheckpointRecord]:
    """The checkpoint folders under `output_dir`, least recently saved first."""
    return sorted((read_record(path) for path in checkpoint_dirs(output_dir)), key=CheckpointRecord.recency)


def last_checkpoint(output_dir: str) -> str | None:
    """The most recently saved checkpoint folder under `output_dir` (not the highest step: see the module
    docstring)."""
    records = checkpoints_by_recency(output_dir)
    return records[-1].path if records else None


def set_aside_path(record: CheckpointRecord) -> str:
    """Where another run's checkpoint goes when this run saves the same step: beside it, under a name that is no
    checkpoint's (so neither rotation nor `resume_from_checkpoint=True` sees it)."""
    base = f"{os.path.normpath(record.path)}-of-run-{record.run_id or 'unrecorded'}"
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def fsync_dir(path: str) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(root, name))
    fsync_dir(path)


class EarlyFlush:
    """Flushes a checkpoint's finished files to disk on a helper thread while the next ones are serialised, so the
    disk's write-back overlaps the CPU work instead of following it. `fsync_tree` still runs before the rename (then
    cheap: nothing left to write), so what makes a checkpoint durable and complete is unchanged."""

    def __init__(self, folder: str):
        self.folder, self.started, self.thread = folder, set(), None

    def flush_new_files(self) -> None:
        """Start flushing the files written into the folder since the last call (after the earlier ones)."""
        paths = [os.path.join(root, name) for root, _, files in os.walk(self.folder) for name in sorted(files)]
        new = [path for path in paths if path not in self.started]
        if not new:
            return
        self.started.update(new)
        previous = self.thread
        self.thread = threading.Thread(target=self.flush, args=(previous, new), daemon=True)
        self.thread.start()

    @staticmethod
    def flush(previous, paths) -> None:
        if previous is not None:
            previous.join()
        for path in paths:
            try:
                fsync_file(path)
            except OSError:  # the final fsync_tree reports what matters
                return

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()


class FlushWhileWriting:
    """Flushes a file to disk on a helper thread while it is being written (every `every` seconds), so the fsync
    before the rename waits for the last part only instead of the whole file: for the optimizer state, the largest
    file, written last. The helper waits in the kernel, not for the GIL."""

    def __init__(self, path: str, every: float = 0.03):
        self.path, self.every = path, every
        self.done = threading.Event()

    def __enter__(self):
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)  # no truncation: torch.save reopens it
        self.thread = threading.Thread(target=self.flush, daemon=True)
        self.thread.start()
        return self

    def flush(self) -> None:
        sync = getattr(os, "fdatasync", os.fsync)
        while not self.done.wait(self.every):
            try:
                sync(self.fd)
            except OSError:  # the final fsync_tree reports what matters
                return

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        os.close(self.fd)
        return False


def save_state_file(obj, path: str) -> None:
    """`torch.save` of optimizer, scheduler, scaler or RNG state without the zip records' CRC32s: `torch.load` never
    checks them (a corrupted payload loads silently either way), and computing them takes about a third of the time
    of saving an optimizer state. (The switch is torch's global one: set for this call, then restored.)"""
    set_crc = getattr(torch.serialization, "set_crc32_options", None)
    computed = torch.serialization.get_crc32_options() if set_crc is not None else None
    try:
        if set_crc is not None:
            set_crc(False)
        torch.save(obj, path)
    finally:
        if set_crc is not None:
            set_crc(computed)


def safe_torch_load(path: str):
    """`torch.load` that can only rebuild tensors, primitives and numpy's RNG state: never arbitrary code."""
    allowed = [np.ndarray, np.dtype, np.dtypes.UInt32DType]
    reconstruct = getattr(getattr(np, "_core", np.core).multiarray, "_reconstruct")
    allowed.append(reconstruct)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, truncated zip, ...: name the file, never fall back to full pickle
        raise RuntimeError(f"Refusing or failing to load {path}: {exc}. loopkit loads only tensors and plain values "
                           f"(weights_only=True); re-create the file or resume from another checkpoint.") from exc


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


def stage_tensors_name(num_processes: int, process_index: int) -> str:
    return f"loopkit_tensors_{process_index}.safetensors" if num_processes > 1 else "loopkit_tensors.safetensors"


def tensors_apart(value, tensors: dict):
    """`value` (a stage's state) with each tensor replaced by {"__tensor__": name}; the tensors, as CPU copies (an
    asynchronous save writes them later), go into `tensors` under those names."""
    if isinstance(value, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
        return {TENSOR_REF: name}
    if isinstance(value, dict):
        return {key: tensors_apart(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [tensors_apart(item, tensors) for item in value]
    return value


def tensors_back(value, tensors: dict):
    """Undo `tensors_apart`. A reference to a tensor `tensors` lacks (no file for this process: another number of
    processes wrote the checkpoint) becomes None."""
    if isinstance(value, dict):
        if value.keys() == {TENSOR_REF}:
            return tensors.get(value[TENSOR_REF])
        return {key: tensors_back(item, tensors) for key, item in value.items()}
    if isinstance(value, list):
        return [tensors_back(item, tensors) for item in value]
    return value


def split_stage_states(stage_states: dict) -> tuple[dict, dict, dict]:
    """Stage states as JSON values, the tensors they held, and the entries that held some. Those entries are this
    process's own (a batch read ahead differs by process): they are written with the tensors, per process."""
    plain, tensors, own = {}, {}, {}
    for name, entry in stage_states.items():
        held = len(tensors)
        plain[name] = tensors_apart(entry, tensors)
        if len(tensors) > held:
            own[name] = plain[name]
    return plain, tensors, own


def saved_world_size(checkpoint: str) -> int | None:
    """How many processes wrote `checkpoint`, from its RNG files (one per rank); None if it has none."""
    ranks = [name for name in os.listdir(checkpoint) if re.fullmatch(r"rng_state_\d+\.pth", name)]
    if ranks:
        return len(ranks)
    return 1 if os.path.isfile(os.path.join(checkpoint, "rng_state.pth")) else None


def save_model_files(model, accelerator, output_dir: str, processing_class=None, state_dict=None,
                     writer: bool | None = None) -> None:
    """Weights (+ config) in `save_pretrained` layout when the model has it, else a bare `model.safetensors`.
    `state_dict` (host copies taken earlier) is written instead of the live weights when given. `writer`: whether
    this process writes (default: the main process; `save_on_each_node`: each node's first)."""
    writer = accelerator.is_main_process if writer is None else writer
    os.makedirs(output_dir, exist_ok=True)
    if state_dict is None and active_engine(accelerator) is not None:
        # FSDP / DeepSpeed: the whole model, gathered from the shards (a collective: every process calls this).
        state_dict = accelerator.get_state_dict(model)
        if not accelerator.is_main_process:
            return
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    if hasattr(unwrapped, "save_pretrained"):
        unwrapped.save_pretrained(output_dir, is_main_process=writer, state_dict=state_dict)
    elif writer:
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in (state_dict or unwrapped.state_dict()).items()}
        save_file(state, os.path.join(output_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    if processing_class is not None and writer and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)


def load_model_weights(model, checkpoint: str) -> None:
    """Load `model.safetensors` (or sharded safetensors / PEFT adapters) into `model`, non-strictly as HF does; from
    a sharded FSDP checkpoint (no `model.safetensors`), its `pytorch_model_fsdp_0/` folder."""
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
    elif sharded_model_saved(checkpoint):
        return load_sharded_model(model, os.path.join(checkpoint, FSDP_MODEL_FOLDER))
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


def warn_if_checkpoint_args_differ(args, state) -> None:
    """Trainer's `compare_trainer_and_checkpoint_args`, in its words and under its logger: a warning naming each of
    the logging, evaluation and save intervals and the per-device batch size that differs from the checkpoint's
    `trainer_state.json` (whose intervals the resumed run keeps, as Trainer's does)."""
    from transformers.utils import logging as hf_logging

    differences = [(name, getattr(args, name), getattr(state, name, None))
                   for name in ("logging_steps", "eval_steps", "save_steps")]
    if state.train_batch_size is not None:  # loopkit's state holds the per-device batch (Trainer's: x n_gpu)
        differences.append(("per_device_train_batch_size", args.per_device_train_batch_size, state.train_batch_size))
    differences = [d for d in differences if d[1] is not None and d[2] is not None and d[1] != d[2]]
    if differences:
        hf_logging.get_logger("transformers.trainer_utils").warning_once(
            "Warning: The following arguments do not match the ones in the `trainer_state.json` within the "
            "checkpoint directory: " + "".join(f"\n\t{name}: {ours} (from args) != {saved} (from trainer_state.json)"
                                               for name, ours, saved in differences))


def holds_model_weights(path: str) -> bool:
    """Whether the folder holds a file or folder of model weights that Trainer's `_load_from_checkpoint` looks for."""
    names = (WEIGHTS_NAME, "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
             "adapter_model.safetensors", "adapter_model.bin")
    return any(os.path.isfile(os.path.join(path, name)) for name in names) or engine_checkpoint_present(path)


def checkpoint_problem(path: str) -> str | None:
    """Why `path` cannot be resumed from, or None. A loopkit folder is complete by construction (it only gets its
    name once fully written); an HF Trainer folder has no such guarantee, so both are checked the same way: the
    state parses and every weights file opens."""
    from safetensors import safe_open

    state_path = os.path.join(path, TRAINER_STATE_NAME)
    try:
        with open(state_path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as exc:
        return f"{state_path} is missing, corrupt or truncated ({exc})"
    candidates = [os.path.join(path, n) for n in (WEIGHTS_NAME, "adapter_model.safetensors") if
                  os.path.isfile(os.path.join(path, n))]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                candidates += sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
        except (OSError, ValueError, KeyError) as exc:
            return f"{index} is corrupt ({exc})"
    if not candidates and not engine_checkpoint_present(path):  # a sharded FSDP checkpoint has no single file
        return f"it has no {WEIGHTS_NAME}"
    for weights in candidates:
        try:
            with safe_open(weights, framework="pt"):  # checks the header and that the data covers the file
                pass
        except Exception as exc:
            return f"{weights} is corrupt or truncated ({exc})"
    if not os.path.isfile(os.path.join(path, LOOPKIT_STATE_NAME)):
        warnings.warn(f"{path} was not written by loopkit (no {LOOPKIT_STATE_NAME}, e.g. HF Trainer's): accepted "
                      f"because its trainer state parses and its weights open; its data position is derived from "
                      f"global_step.")
    return None


def copy_to_cpu(obj):
    """A deep copy with every tensor moved to (new) CPU memory: what an asynchronous save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_to_cpu(v) for v in obj)
    return obj


@dataclass
class Snapshot:
    """Everything one checkpoint writes, taken at an optimizer-step boundary."""

    step: int
    model_state: dict | None  # CPU copies for an asynchronous save; None: write the live model
    optimizer: dict | None
    scheduler: dict | None
    scaler: dict | None
    rng: dict | None
    trainer_state_json: str
    stage_states_json: str
    stage_tensors: dict = field(default_factory=dict)  # this process's, with its stage entries that hold them:
    own_stage_states_json: str | None = None


LEFTOVER_PREFIXES = (".tmp-", ".old-", ".deleting-")
SAVE_ERROR_POLICIES = ("raise", "continue", "stop")


class Checkpointer:
    """Writes, finds, rotates and reads the checkpoints of one run: a run-level component the `Loop` builds (from
    the evaluation stage's `checkpoint_options()`) and hands to the stages through the run state.

    `async_save=True`: the state is copied to host memory at the step boundary and written by a background thread
    while training goes on (same atomic protocol; one save in flight at a time; single process only).
    `on_save_error`: what a failed save (a full disk, say) does after the temporary folder is removed and the
    previous checkpoint left as it was: "raise" (default), "continue" (warn and train on) or "stop" (warn and stop
    training cleanly). `best_total_limit`: see `EvalStage`.

    Reads `run.args`, `run.accelerator`, `run.state`, `run.model_wrapped`, `run.optimizer`, `run.lr_scheduler`,
    `run.processing_class`, `run.events`; writes `state.best_model_checkpoint` and `state.stateful_callbacks`.
    """

    def __init__(self, run, async_save: bool = False, on_save_error: str = "raise",
                 best_total_limit: int | None = None):
        from .args import config_error

        if on_save_error not in SAVE_ERROR_POLICIES:
            raise config_error("on_save_error", on_save_error, f"it must be one of {SAVE_ERROR_POLICIES}",
                               "pick one of those")
        self.run, self.async_save, self.on_save_error = run, async_save, on_save_error
        self.best_total_limit = best_total_limit
        self.writer = None  # the background thread of an asynchronous save
        self.writer_error = None
        self.last_saved_step = None
        self.rng_for_next_save = None  # set when a checkpoint must hold an earlier RNG state (see Schedule)
        # The run the checkpoints belong to (module docstring): set by `start()` at each train(); a save before any
        # train() starts a run of its own.
        self.run_id: str | None = None
        self.next_save_index = 1
        from .hub import HubPush  # it imports this module

        self.hub = HubPush(run)  # push_to_hub: the uploads of complete checkpoints (loopkit/hub.py)
        self.rotation_deferred = False  # a folder rotation left because it was uploading

    # -- the run --
    def start(self, resume_from_checkpoint) -> str | None:
        """The start of a `train()`: remove a killed save's leftovers, resolve the checkpoint to resume from, and
        set the run the coming saves belong to (the checkpoint's when resuming, else a new one). Says what it found:
        a fresh run next to other runs' checkpoints warns; `resume_from_checkpoint=True` names its pick. Returns
        the checkpoint path or None."""
        self.remove_leftovers()
        records = checkpoints_by_recency(self.run.args.output_dir)
        checkpoint = self.resolve(resume_from_checkpoint)
        previous_run = self.run_id
        resumed = read_record(checkpoint) if checkpoint is not None else None
        self.begin_run((resumed.run_id if resumed is not None else None) or new_run_id(), records)
        if self.run.accelerator.is_main_process:
            if checkpoint is None:
                self.report_other_runs(records)
            elif resume_from_checkpoint is True:
                self.report_resume_pick(resumed, records, previous_run)
        return checkpoint

    def begin_run(self, run_id: str, records: list[CheckpointRecord]) -> None:
        """Saves from now on belong to `run_id` and are numbered after every checkpoint in `records`. With several
        processes the main process's id is taken by all (a fresh id differs by rank; `save` compares it on each)."""
        if self.run.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            run_id = broadcast_object_list([run_id], from_process=0)[0]
        self.run_id = run_id
        self.next_save_index = 1 + max((r.save_index for r in records if r.save_index is not None), default=0)

    def report_other_runs(self, records: list[CheckpointRecord]) -> None:
        """A fresh run into an `output_dir` that holds checkpoints: say whose they are and what happens to them."""
        if not records:
            return
        found = ", ".join(r.describe() for r in records)
        warnings.warn(
            f"output_dir={self.run.args.output_dir!r} already holds checkpoints of another run: {found}. This fresh "
            f"run (run {self.run_id}) keeps them: rotation (save_total_limit) deletes only this run's checkpoints, "
            f"and a save at the same step renames the other one to <name>-of-run-<id>. resume_from_checkpoint=True "
            f"takes the most recently saved checkpoint, whichever run wrote it. Use a new output_dir to keep runs "
            f"apart, or resume_from_checkpoint=True to continue the other run.")

    def report_resume_pick(self, picked: CheckpointRecord, records: list[CheckpointRecord],
                           previous_run: str | None) -> None:
        """`resume_from_checkpoint=True`: name the checkpoint; warn when another run's is picked or passed over."""
        others = [r for r in records if r.run_id != picked.run_id]  # unrecorded ones: only next to recorded ones
        message = (f"resume_from_checkpoint=True: resuming from {picked.describe()}, the most recently saved "
                   f"complete checkpoint in output_dir={self.run.args.output_dir!r}.")
        if previous_run is not None and picked.run_id != previous_run:
            message += f" It belongs to another run than this Loop's previous train() (run {previous_run})."
        elif not others:
            logger.info(message)
            return
        if others:
            message += (f" Not picked, from other runs: {', '.join(r.describe() for r in others)}. Pass "
                        f"resume_from_checkpoint=<folder> to resume one of those.")
        warnings.warn(message)

    def record(self) -> dict:
        """The next save's entry in `loopkit_state.json`: its run and save number."""
        if self.run_id is None:  # a save outside train(): a run of its own
            self.begin_run(new_run_id(), checkpoints_by_recency(self.run.args.output_dir))
        entry = {"run_id": self.run_id, "save_index": self.next_save_index,
                 "saved_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        self.next_save_index += 1
        return entry

    # -- writing --
    @property
    def writes_files(self) -> bool:
        """HF's `args.should_save`: the main process, or with `save_on_each_node` the first process of each node
        (for nodes without a shared disk)."""
        acc = self.run.accelerator
        return acc.is_local_main_process if self.run.args.save_on_each_node else acc.is_main_process

    def save(self, stage_states: dict) -> str:
        """Save a full checkpoint of the current step atomically, with `stage_states` (JSON values by stage name)
        as `loopkit_state.json`; return its final path."""
        run = self.run
        acc, state = run.accelerator, run.state
        if self.async_save and acc.num_processes > 1:
            from .args import config_error

            raise config_error("async_save", True, "asynchronous saving supports one process only",
                               "use async_save=False under a distributed launch")
        self.wait()  # one save in flight at a time; raises a background failure first
        final = os.path.join(run.args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        if state.best_global_step is not None:
            best = os.path.join(run.args.output_dir, f"{CHECKPOINT_PREFIX}-{state.best_global_step}")
            if best == final or (os.path.isdir(best) and self.is_own(best)):  # never another run's folder
                state.best_model_checkpoint = best
        snapshot = self.snapshot(stage_states)
        push = self.hub.begin_push()  # on the training thread: on_push_begin, and the commit message (or None)
        self.last_saved_step, self.rng_for_next_save = state.global_step, None
        if self.async_save:
            self.writer = threading.Thread(target=self.write_in_background, args=(snapshot, push), daemon=False)
            self.writer.start()
        else:
            self.write_handling_errors(snapshot, push)
        return final

    def snapshot(self, stage_states: dict) -> Snapshot:
        run, acc, args = self.run, self.run.accelerator, self.run.args
        copy = copy_to_cpu if self.async_save else (lambda x: x)
        unwrapped = acc.unwrap_model(run.model_wrapped, keep_torch_compile=False)
        full_state = not args.save_only_model
        sharded = active_engine(acc) is not None  # FSDP / DeepSpeed: the optimizer is written by their own path
        run.state.record_callback_states(run.events.callbacks + [run.control])
        stage_states, stage_tensors, own_stage_states = split_stage_states(stage_states)
        return Snapshot(
            step=run.state.global_step,
            model_state=copy(unwrapped.state_dict()) if self.async_save else None,
            optimizer=copy(run.optimizer.state_dict()) if full_state and self.writes_files and not sharded
            else None,
            scheduler=copy(run.lr_scheduler.state_dict()) if full_state and self.writes_files else None,
            scaler=copy(acc.scaler.state_dict()) if full_state and acc.scaler is not None else None,
            rng=(self.rng_for_next_save or rng_state()) if full_state else None,
            trainer_state_json=run.state.to_json_string(),
            stage_states_json=json.dumps({**stage_states, RECORD_KEY: self.record()}, indent=2, sort_keys=True),
            stage_tensors=stage_tensors, own_stage_states_json=json.dumps(own_stage_states, sort_keys=True),
        )

    def write_handling_errors(self, snapshot: Snapshot, push: str | None = None) -> None:
        try:
            self.write(snapshot, push)
        except Exception as exc:
            self.report_failure(snapshot, exc)

    def write_in_background(self, snapshot: Snapshot, push: str | None = None) -> None:
        try:
            self.write(snapshot, push)
        except Exception as exc:  # handed to the training thread at the next save or at the end
            self.writer_error = (snapshot, exc)

    def wait(self) -> None:
        """Wait for an asynchronous save to finish; then act on its failure, if any."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None
        if self.writer_error is not None:
            snapshot, exc = self.writer_error
            self.writer_error = None
            self.report_failure(snapshot, exc)

    def wait_quietly(self) -> None:
        """On a failing run: let an asynchronous save finish (its checkpoint stays usable), reporting nothing."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None

    def report_failure(self, snapshot: Snapshot, exc: Exception) -> None:
        previous = last_checkpoint(self.run.args.output_dir)
        message = (f"Saving checkpoint-{snapshot.step} failed ({type(exc).__name__}: {exc}). Nothing was "
                   f"half-written; the most recently saved complete checkpoint is still {previous}.")
        if self.on_save_error == "raise":
            raise RuntimeError(message + " (on_save_error='raise')") from exc
        warnings.warn(message + f" on_save_error={self.on_save_error!r}: "
                      + ("training goes on." if self.on_save_error == "continue" else "stopping training."))
        if self.on_save_error == "stop":
            self.run.control.should_training_stop = True

    def write(self, snapshot: Snapshot, push: str | None = None) -> None:
        """The atomic protocol: write into `.tmp-checkpoint-N`, fsync, rename to `checkpoint-N`, then rotate; then
        `push` (a commit message from `HubPush.begin_push`) queues the uploads of the complete folder."""
        run, acc = self.run, self.run.accelerator
        run_dir = run.args.output_dir
        name = f"{CHECKPOINT_PREFIX}-{snapshot.step}"
        final, tmp = os.path.join(run_dir, name), os.path.join(run_dir, f".tmp-{name}")
        if self.writes_files:
            os.makedirs(run_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        early = EarlyFlush(tmp)
        try:
            if full_state_dict_saved(acc):  # all but FSDP's SHARDED_STATE_DICT: one model.safetensors
                save_model_files(run.model_wrapped, acc, tmp, run.processing_class, state_dict=snapshot.model_state,
                                 writer=self.writes_files)
            if active_engine(acc) is not None:  # FSDP / DeepSpeed: Accelerate's paths, on every process
                save_engine_state(run, tmp, with_optimizer=not run.args.save_only_model)
            early.flush_new_files()  # the weights reach the disk while the optimizer state is serialised
            if snapshot.optimizer is not None:
                path = os.path.join(tmp, OPTIMIZER_NAME)
                with FlushWhileWriting(path):
                    save_state_file(snapshot.optimizer, path)
            if snapshot.scheduler is not None:
                save_state_file(snapshot.scheduler, os.path.join(tmp, SCHEDULER_NAME))
            if snapshot.scaler is not None and self.writes_files:
                save_state_file(snapshot.scaler, os.path.join(tmp, SCALER_NAME))
            if snapshot.rng is not None:
                save_state_file(snapshot.rng, os.path.join(tmp, rng_file_name(acc.num_processes,
                                                                             acc.process_index)))
            if snapshot.stage_tensors:
                from safetensors.torch import save_file

                os.makedirs(tmp, exist_ok=True)
                save_file(snapshot.stage_tensors, os.path.join(tmp, stage_tensors_name(acc.num_processes,
                                                                                       acc.process_index)),
                          metadata={"stage_states": snapshot.own_stage_states_json})
            acc.wait_for_everyone()
            if self.writes_files:
                write_text(os.path.join(tmp, TRAINER_STATE_NAME), snapshot.trainer_state_json)
                write_text(os.path.join(tmp, LOOPKIT_STATE_NAME), snapshot.stage_states_json)  # written last
                early.wait()
                fsync_tree(tmp)
                if os.path.isdir(final):
                    self.replace_existing(final, tmp)
                else:
                    os.replace(tmp, final)
                fsync_dir(run_dir)
        except BaseException:
            early.wait()
            if self.writes_files:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.writes_files:
            self.rotate()
            self.hub.push_checkpoint(final, push)  # after rotation: no upload lists a folder being deleted
        acc.wait_for_everyone()

    def remove_leftovers(self) -> None:
        """Folders a killed save or rotation left behind (never complete checkpoints): removed at train start."""
        run_dir = self.run.args.output_dir
        if not self.writes_files or not os.path.isdir(run_dir):
            return
        for entry in os.listdir(run_dir):
            if entry.startswith(LEFTOVER_PREFIXES) and CHECKPOINT_RE.match(entry.split("-", 1)[1]):
                shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)

    def own_checkpoints(self) -> list[str]:
        """This run's checkpoint folders in `output_dir`, least recently saved first."""
        records = checkpoints_by_recency(self.run.args.output_dir)
        return [r.path for r in records if r.run_id is not None and r.run_id == self.run_id]

    def is_own(self, path: str) -> bool:
        return self.run_id is not None and read_record(path).run_id == self.run_id

    def replace_existing(self, final: str, tmp: str) -> None:
        """A save at a step whose folder exists. This run's own (a re-save after a resume) is swapped and dropped;
        another run's, or an unrecorded one, is renamed to a name that is not a checkpoint's, never deleted."""
        record = read_record(final)
        own = record.run_id is not None and record.run_id == self.run_id
        name = os.path.basename(final)
        aside = os.path.join(os.path.dirname(final), f".old-{name}") if own else set_aside_path(record)
        os.replace(final, aside)
        os.replace(tmp, final)
        if own:
            shutil.rmtree(aside, ignore_errors=True)
        else:
            warnings.warn(f"This run (run {self.run_id}) saved {name}, where {record.describe()} "
                          f"was: that one is kept as {aside} (pass it to resume_from_checkpoint to resume it).")

    def delete(self, path: str) -> None:
        """Rename first, so a kill mid-delete never leaves a half-deleted folder named like a checkpoint."""
        doomed = os.path.join(os.path.dirname(path), ".deleting-" + os.path.basename(path))
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def checkpoint_scores(self, dirs: list[str]) -> dict[str, float]:
        """`metric_for_best_model` of each checkpoint folder in `dirs` whose step was evaluated (from `log_history`,
        which resumes with the run); non-finite values are left out."""
        from .schedule import best_metric_key

        args = self.run.args
        if args.metric_for_best_model is None:
            return {}
        key = best_metric_key(args)
        by_step = {entry["step"]: entry[key] for entry in self.run.state.log_history if key in entry}
        scores = {}
        for path in dirs:
            step = int(CHECKPOINT_RE.match(os.path.basename(path)).group(1))
            if step in by_step and math.isfinite(by_step[step]):
                scores[path] = by_step[step]
        return scores

    def best_checkpoints(self, dirs: list[str]) -> set[str]:
        """The folders among `dirs` that rotation must keep as best: `state.best_model_checkpoint` (HF), plus, with
        `best_total_limit=k`, the k best scored checkpoints (ties: the earlier step, as a strict improvement
        decides the best)."""
        recorded = self.run.state.best_model_checkpoint
        # Compared as real paths: `output_dir` may be relative, and a resumed run's best may lie in another folder.
        best = {d for d in dirs if recorded is not None and os.path.realpath(d) == os.path.realpath(recorded)}
        if self.best_total_limit is not None:
            scores = self.checkpoint_scores(dirs)
            sign = -1 if self.run.args.greater_is_better else 1
            ranked = sorted(scores, key=lambda path: (sign * scores[path], dirs.index(path)))
            best.update(ranked[:self.best_total_limit])
        return best

    def rotate(self) -> None:
        """HF's `save_total_limit` rule: keep the newest and the best, delete the oldest others beyond the limit.
        With `EvalStage(best_total_limit=k)` the limits are separate: the `save_total_limit` newest checkpoints and
        the k best (by `metric_for_best_model`) are kept.

        Only this run's checkpoints are counted and deleted (another run's are never this run's to delete), in the
        order they were saved (their save numbers; HF uses mtimes, which a copy or a restore can reorder).
        """
        limit = self.run.args.save_total_limit
        if limit is None or limit <= 0:
            return
        dirs = self.own_checkpoints()
        if not dirs:
            return
        best = self.best_checkpoints(dirs)
        if self.best_total_limit is not None:
            keep = set(dirs[-limit:]) | best
        else:
            protected = {dirs[-1]} | best
            others = [d for d in dirs if d not in protected]
            room = max(limit, len(protected)) - len(protected)  # for the newest unprotected checkpoints
            keep = protected | set(others[len(others) - room:] if room else [])
        for path in dirs:
            if path in keep:
                continue
            if self.hub.uploading(path):  # deleted by a later rotation, once uploaded (finish_uploads at the latest)
                self.rotation_deferred = True
            else:
                self.delete(path)

    def finish_uploads(self) -> None:
        """The end of `train()`: wait for the push in progress (Trainer's `_finish_current_push`), then delete what
        rotation left because it was uploading."""
        self.hub.wait()
        if self.rotation_deferred and self.writes_files:
            self.rotation_deferred = False
            self.rotate()

    def keep_only_best(self) -> None:
        """End of training with `save_total_limit == 1`: only the best checkpoint survives (HF). Nothing is deleted
        when the best is not one of this run's checkpoints (else "all but the best" would be everything: transformers
        PR 25136, and HF 5.24 still does it after resuming into a new output_dir) or when best and regular checkpoints
        have separate limits (`EvalStage(best_total_limit=...)`)."""
        best = self.run.state.best_model_checkpoint
        if self.run.args.save_total_limit != 1 or best is None or not self.writes_files:
            return
        if self.best_total_limit is not None:
            return
        dirs = self.own_checkpoints()
        if os.path.realpath(best) not in {os.path.realpath(d) for d in dirs}:
            return  # e.g. a run resumed into a new output_dir: its best lies elsewhere (HF deletes the whole run here)
        self.hub.wait()  # no folder is deleted while it uploads
        for path in dirs:
            if os.path.realpath(path) != os.path.realpath(best):
                self.delete(path)

    # -- reading --
    def resolve(self, resume_from_checkpoint) -> str | None:
        """The checkpoint folder to resume from. `True`: the most recently saved usable one in `output_dir` (module
        docstring), falling back (with a warning) past any that is corrupt; a path: that folder, or a clear error
        naming the bad file."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        output_dir = self.run.args.output_dir
        if resume_from_checkpoint is True:
            for path in reversed([r.path for r in checkpoints_by_recency(output_dir)]):
                problem = checkpoint_problem(path)
                if problem is None:
                    return path
                warnings.warn(f"Not resuming from {path}: {problem}. Falling back to the previous checkpoint.")
            raise trainer_error(f"No valid checkpoint found in output directory ({output_dir})",
                                "resume_from_checkpoint", True, f"output_dir={output_dir!r} holds no usable "
                                f"checkpoint-<step> folder", "train without resuming first, or pass the path of a "
                                "checkpoint folder")
        if not os.path.isdir(resume_from_checkpoint) or not holds_model_weights(resume_from_checkpoint):
            raise trainer_error(f"Can't find a valid checkpoint at {resume_from_checkpoint}",
                                "resume_from_checkpoint", resume_from_checkpoint,
                                "it is not a folder" if not os.path.isdir(resume_from_checkpoint) else
                                f"the folder holds no model weights ({WEIGHTS_NAME}, an index or an adapter)",
                                "pass a checkpoint-<step> folder, or resume_from_checkpoint=True for the latest one")
        problem = checkpoint_problem(resume_from_checkpoint)
        if problem is not None:
            raise ValueError(f"Cannot resume from {resume_from_checkpoint}: {problem}.")
        return resume_from_checkpoint

    @staticmethod
    def read_trainer_state(checkpoint: str):
        from .state import LoopState

        path = os.path.join(checkpoint, TRAINER_STATE_NAME)
        try:
            return LoopState.load_from_json(path)
        except (OSError, ValueError, TypeError) as exc:
            raise RuntimeError(f"{path} is missing, corrupt or truncated ({exc}).") from exc

    def read_stage_states(self, checkpoint: str) -> dict:
        """`loopkit_state.json` (the main process's), with the entries that held tensors taken from this process's
        stage-tensor file, tensors put back."""
        path = os.path.join(checkpoint, LOOPKIT_STATE_NAME)
        if not os.path.isfile(path):
            return {}  # a checkpoint written by HF Trainer
        with open(path) as f:
            states = json.load(f)
        acc = self.run.accelerator
        tensor_path = os.path.join(checkpoint, stage_tensors_name(acc.num_processes, acc.process_index))
        if not os.path.isfile(tensor_path):
            return tensors_back(states, {})
        from safetensors import safe_open

        try:
            with safe_open(tensor_path, framework="pt") as f:
                own = json.loads(f.metadata()["stage_states"])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:
            raise RuntimeError(f"{tensor_path} is corrupt or truncated ({exc}).") from exc
        return tensors_back({**states, **own}, tensors)

    def load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        """After `prepare`, on every process: a sharded model's shards, then (as HF: when the checkpoint has a
        scheduler, i.e. not `save_only_model`) the optimizer in whichever layout it was saved, and the scheduler."""
        run = self.run
        sched_path = os.path.join(checkpoint, SCHEDULER_NAME)
        load_engine_model(run, checkpoint)
        if os.path.isfile(sched_path) and load_optimizer_state(run, checkpoint):
            run.lr_scheduler.load_state_dict(safe_torch_load(sched_path))
        scaler_path = os.path.join(checkpoint, SCALER_NAME)
        if os.path.isfile(scaler_path) and run.accelerator.scaler is not None:
            run.accelerator.scaler.load_state_dict(safe_torch_load(scaler_path))

    def read_rng(self, checkpoint: str) -> dict | None:
        """This process's RNG states saved in `checkpoint` (None if it has none, e.g. `save_only_model`)."""
        acc = self.run.accelerator
        saved_by = saved_world_size(checkpoint)
        if saved_by is None:
            return None
        if saved_by == acc.num_processes:
            path = os.path.join(checkpoint, rng_file_name(acc.num_processes, acc.process_index))
            return safe_torch_load(path) if os.path.isfile(path) else None
        # Another number of processes: the data position is kept (it is stored in global samples), but the RNG
        # streams of the ranks cannot be: each rank continues from the saved rank of its own index, if any.
        if acc.is_main_process:
            warnings.warn(f"{checkpoint} was saved by {saved_by} process(es) and is resumed by {acc.num_processes}: "
                          f"the data order continues exactly (same global batch), but random draws (dropout, "
                          f"random collators) will differ from an uninterrupted run.")
        rank = acc.process_index if acc.process_index < saved_by else 0
        return safe_torch_load(os.path.join(checkpoint, rng_file_name(saved_by, rank)))
