"""Whether a checkpoint folder can be resumed from, read without trusting it, and what it says about the run."""

from __future__ import annotations

import json
import os
import warnings

from .engines import engine_checkpoint_present
from .lineage import LOOPKIT_STATE_NAME, TRAINER_STATE_NAME, WEIGHTS_NAME


def json_problem(path: str) -> str | None:
    """What is wrong with the JSON file `path` (missing, or not JSON: named with its size), or None."""
    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except OSError as exc:
        return f"{name}: cannot be read ({exc.strerror or exc})"
    except ValueError as exc:
        return f"{name}: {os.path.getsize(path):,} bytes, not valid JSON ({exc})"
    return None


def safetensors_problem(path: str) -> str | None:
    """What is wrong with the safetensors file `path`, from its header alone (e.g. "model.safetensors: 20,480 bytes,
    its header promises 1,234,567"), or None."""
    name, size = os.path.basename(path), os.path.getsize(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if size >= 8 else None
        if length is None or 8 + length > size:
            promised = f"its header alone promises {8 + length:,}" if length is not None else "no header"
            return f"{name}: {size:,} bytes, {promised}"
        try:
            header = json.loads(f.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            return f"{name}: its header is not a safetensors header ({exc})"
    if size < 8 + length + end:
        return f"{name}: {size:,} bytes, its header promises {8 + length + end:,}"
    return None


def weights_problem(path: str) -> str | None:
    """What is wrong with a weights file: its size against its header, then whether safetensors opens it."""
    from safetensors import safe_open

    problem = safetensors_problem(path)
    if problem is not None:
        return problem
    try:
        with safe_open(path, framework="pt"):
            pass
    except Exception as exc:
        return f"{os.path.basename(path)}: safetensors cannot open it ({exc})"
    return None


def checkpoint_problem(path: str) -> str | None:
    """Why `path` cannot be resumed from (which file, what is wrong), or None. A loopkit folder is complete by
    construction (it only gets its name once fully written); an HF Trainer folder has no such guarantee, and a disk
    or a copy may damage either later, so both are checked the same way: the states parse and every weights file is
    as long as its header says."""
    for name in (TRAINER_STATE_NAME, LOOPKIT_STATE_NAME):
        file = os.path.join(path, name)
        problem = json_problem(file) if name == TRAINER_STATE_NAME or os.path.isfile(file) else None
        if problem is not None:
            return problem
    candidates = [os.path.join(path, n) for n in (WEIGHTS_NAME, "adapter_model.safetensors") if
                  os.path.isfile(os.path.join(path, n))]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                candidates += sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
        except (OSError, ValueError, KeyError) as exc:
            return f"{os.path.basename(index)}: corrupt ({exc})"
    if not candidates and not engine_checkpoint_present(path):  # a sharded FSDP checkpoint has no single file
        return f"it has no {WEIGHTS_NAME}"
    for weights in candidates:
        problem = weights_problem(weights) if os.path.isfile(weights) else f"{os.path.basename(weights)}: missing"
        if problem is not None:
            return problem
    if not os.path.isfile(os.path.join(path, LOOPKIT_STATE_NAME)):
        warnings.warn(f"{path} was not written by loopkit (no {LOOPKIT_STATE_NAME}, e.g. HF Trainer's): accepted "
                      f"because its trainer state parses and its weights open; its data position is derived from "
                      f"global_step.")
    return None


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


def read_trainer_state(checkpoint: str):
    from ..state import LoopState

    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    try:
        return LoopState.load_from_json(path)
    except (OSError, ValueError, TypeError) as exc:
        raise RuntimeError(f"{path} is missing, corrupt or truncated ({exc}).") from exc


def read_stage_states(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, LOOPKIT_STATE_NAME)
    if not os.path.isfile(path):
        return {}  # a checkpoint written by HF Trainer
    with open(path) as f:
        return json.load(f)
