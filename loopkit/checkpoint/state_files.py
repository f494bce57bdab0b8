"""The run's state files of HF Trainer's layout, which `HFStorage` and `DCPStorage` both write beside their weights:
`scheduler.pt`, `scaler.pt`, `training_args.bin`, `rng_state[_<rank>].pth`, `loopkit_tensors[_<rank>].safetensors`,
`trainer_state.json` and `loopkit_state.json` (written last). Public helpers a format may use; a format that writes
one file does not need them."""

from __future__ import annotations

import json
import os

from .. import checkpoint as files  # the file operations, looked up at call time (the kill tests wrap them there)
from .format import Checkpoint, ProcessState
from .lineage import LOOPKIT_STATE_NAME, TRAINER_STATE_NAME
from .stage_tensors import read_stage_tensors, write_stage_tensors


def write_state_files(checkpoint: Checkpoint, folder: str, args=None) -> None:
    """This process's state files of `checkpoint` into `folder` (every process calls it): the scheduler, the scaler
    and Trainer's `training_args.bin` of `args` (the writing process), this process's RNG and stage tensors, then
    the trainer state and the loopkit state (the writing process; the loopkit state last). With node-local disks
    the writing process of each node writes every process's RNG and stage tensors (`Checkpoint.process_files`)."""
    cp = checkpoint
    if cp.scheduler is not None:
        files.save_state_file(cp.scheduler, os.path.join(folder, files.SCHEDULER_NAME))
    if cp.scaler is not None and cp.writes_files:
        files.save_state_file(cp.scaler, os.path.join(folder, files.SCALER_NAME))
    if cp.writes_files and args is not None:
        files.save_training_args(args, folder)  # Trainer's pickle, for its readers (never ours)
    for process_index, rng, stage_tensors, own_stage_states in cp.process_files():
        if rng is not None:
            files.save_state_file(rng, os.path.join(folder, files.rng_file_name(cp.num_processes, process_index)))
        write_stage_tensors(stage_tensors, own_stage_states, folder, cp.num_processes, process_index)
    if cp.writes_files:
        files.write_text(os.path.join(folder, TRAINER_STATE_NAME), cp.trainer_state)
        files.write_text(os.path.join(folder, LOOPKIT_STATE_NAME), cp.loopkit_state)


def read_json_file(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"{file} is missing, corrupt or truncated ({exc}).") from exc


def read_loopkit_state_file(path: str) -> dict:
    """`loopkit_state.json` ({} when absent: HF Trainer's folder)."""
    file = os.path.join(path, LOOPKIT_STATE_NAME)
    return read_json_file(file) if os.path.isfile(file) else {}


def read_state_files(path: str) -> tuple[dict, dict]:
    """`trainer_state.json` and `loopkit_state.json` ({} when absent: HF Trainer's folder), as JSON."""
    return read_json_file(os.path.join(path, TRAINER_STATE_NAME)), read_loopkit_state_file(path)


def read_process_files(path: str, accelerator) -> ProcessState:
    """This process's RNG file (another number of processes: see `read_rng_file`) and stage tensors."""
    own, tensors = read_stage_tensors(path, accelerator.num_processes, accelerator.process_index)
    return ProcessState(rng=files.read_rng_file(path, accelerator), stage_tensors=tensors, own_stage_states=own)
