"""The random number generators' states: taken, restored, and the per-process file names they are saved under."""

from __future__ import annotations

import os
import random
import re
import warnings

import numpy as np
import torch

from .durable import safe_torch_load


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


def saved_world_size(checkpoint: str) -> int | None:
    """How many processes wrote `checkpoint`, from its RNG files (one per rank); None if it has none."""
    ranks = [name for name in os.listdir(checkpoint) if re.fullmatch(r"rng_state_\d+\.pth", name)]
    if ranks:
        return len(ranks)
    return 1 if os.path.isfile(os.path.join(checkpoint, "rng_state.pth")) else None


def read_rng_file(checkpoint: str, accelerator) -> dict | None:
    """This process's RNG states saved in `checkpoint` (None if it has none, e.g. `save_only_model`)."""
    acc = accelerator
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
