"""Tensors in a stage's checkpointed state (the data stage's batch read ahead): kept out of `loopkit_state.json` and
written, with the entries that held them, to this process's `loopkit_tensors.safetensors`
(`loopkit_tensors_<rank>.safetensors` with several processes: a batch read ahead differs by process). Safetensors and
JSON only: nothing here is unpickled."""

from __future__ import annotations

import json
import os

import torch

TENSOR_REF = "__tensor__"  # in a stage's state: a tensor stored in the process's stage-tensor file, by name


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
    """Stage states as JSON values, the tensors they held, and the entries that held some (this process's own)."""
    plain, tensors, own = {}, {}, {}
    for name, entry in stage_states.items():
        held = len(tensors)
        plain[name] = tensors_apart(entry, tensors)
        if len(tensors) > held:
            own[name] = plain[name]
    return plain, tensors, own


def write_stage_tensors(tensors: dict, own_states_json: str | None, folder: str, num_processes: int,
                        process_index: int) -> None:
    if not tensors:
        return
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, stage_tensors_name(num_processes, process_index)),
              metadata={"stage_states": own_states_json})


def read_stage_tensors(checkpoint: str, num_processes: int, process_index: int) -> tuple[dict, dict]:
    """This process's stage entries that held tensors (decoded) and the tensors, as `write_stage_tensors` wrote
    them; ({}, {}) when the checkpoint has no file for this process."""
    path = os.path.join(checkpoint, stage_tensors_name(num_processes, process_index))
    if not os.path.isfile(path):
        return {}, {}
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            own = json.loads(f.metadata()["stage_states"])
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:
        raise RuntimeError(f"{path} is corrupt or truncated ({exc}).") from exc
    return own, tensors
