"""`async_save` in Accelerate's FSDP2 checkpoint layout (`HFStorage` under FSDP2): the files the synchronous save
writes (engines.py's `save_engine_state` and model_files.py's `save_model_files`), made from host copies of each
process's own shards, with every collective on the writer thread's group.

On the training thread, at the step boundary: `local_states` takes the model's and the optimizer's states as torch's
`get_model_state_dict` / `get_optimizer_state_dict` give them without gathering (each process its DTensor shards:
no collective); the policy stages host copies of them while the next step runs (staging.py). On the writer thread,
`write_staged_shards` writes the copies on the checkpoint's group (writing.py's `async_group()`, a gloo group apart
from the default one, which training uses at the same time):

* SHARDED_STATE_DICT: `pytorch_model_fsdp_0/` and `optimizer_0/`, torch's distributed checkpoint as Accelerate's
  `save_fsdp_model` / `save_fsdp_optimizer` write them (`dcp.save` of {"model": ...} and {"optimizer": ...}: every
  process its own shards, rank 0 the metadata);
* FULL_STATE_DICT: every shard gathered to rank 0 (`gather_to_rank_zero`: the DTensors rebuilt on a device mesh over
  that group, then `full_tensor()`), which writes `model.safetensors` (`save_pretrained`, as HF's `save_model`) and
  `optimizer.bin` (the whole optimizer state, as Accelerate's `save_fsdp_optimizer` writes it).

The gather needs FSDP2's one-dimensional mesh (plain sharding over all processes); a run whose parameters live on a
mesh of more dimensions (HSDP, tensor parallelism) is refused at its first save with the fix named.
"""

from __future__ import annotations

import os

from .. import checkpoint as files  # the file operations, looked up at call time (the kill tests wrap them there)
from ..errors import config_error
from .engines import FSDP_MODEL_FOLDER, FSDP_OPTIMIZER_FOLDER, full_state_dict_saved

WHOLE_OPTIMIZER_NAME = "optimizer.bin"  # Accelerate's `save_fsdp_optimizer` with FULL_STATE_DICT


def local_states(model, optimizer, with_optimizer: bool) -> tuple[dict, dict | None]:
    """This process's shards of the model's and (`with_optimizer`) the optimizer's states, keyed as torch's
    distributed state-dict functions key them (parameter names): nothing gathered, no collective."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=False)
    model_state = get_model_state_dict(model, options=options)
    check_one_dimensional(model_state)
    if not with_optimizer:
        return model_state, None
    return model_state, get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=options)


def check_one_dimensional(state: dict) -> None:
    """FULL_STATE_DICT's gather rebuilds each DTensor on a one-dimensional mesh over the writer's group (FSDP2's plain
    sharding); a model on a mesh of more dimensions is refused (under either state-dict type: only this is tested)."""
    from torch.distributed.tensor import DTensor

    for name, value in state.items():
        if isinstance(value, DTensor) and value.device_mesh.ndim != 1:
            raise config_error("async_save", True, f"HFStorage's asynchronous save under FSDP2 gathers over one "
                               f"mesh dimension, and {name} is laid out on a {value.device_mesh.ndim}-dimensional "
                               f"mesh (HSDP or tensor parallelism)",
                               "use DCPStorage(async_save=True), or HFStorage(async_save=False)")


def write_staged_shards(checkpoint, folder: str, accelerator, model, processing_class) -> None:
    """Every process, on the writer thread: the staged shards of `checkpoint` into `folder` in the layout of the
    plugin's `state_dict_type` (module docstring), every collective on `checkpoint.process_group` (in one process,
    which has none, the default group: there is no other process to wait for)."""
    import torch.distributed as dist

    group = checkpoint.process_group or dist.group.WORLD
    if not full_state_dict_saved(accelerator):
        save_on_group({"model": checkpoint.model_state}, os.path.join(folder, FSDP_MODEL_FOLDER), group)
        if checkpoint.optimizer_state is not None:
            save_on_group({"optimizer": checkpoint.optimizer_state},
                          os.path.join(folder, FSDP_OPTIMIZER_FOLDER), group)
        return
    model_state = gather_to_rank_zero(checkpoint.model_state, group)
    optimizer_state = gather_to_rank_zero(checkpoint.optimizer_state, group)
    if accelerator.process_index != 0:  # as the synchronous save: the main process writes the whole state
        return
    files.save_model_files(model, accelerator, folder, processing_class, state_dict=model_state, writer=True)
    if optimizer_state is not None:
        files.save_state_file(optimizer_state, os.path.join(folder, WHOLE_OPTIMIZER_NAME))


def save_on_group(state: dict, folder: str, group) -> None:
    """torch's distributed checkpoint of `state` into `folder` (Accelerate's writer and planner: the same files),
    its collectives on `group`."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), process_group=group)


def gather_to_rank_zero(state, group):
    """The whole of `state` (nested dicts and lists of tensors, DTensor shards among them) on rank 0 of `group`, None
    on the others: each DTensor gathered on a device mesh over `group`, one at a time."""
    import torch.distributed as dist

    if state is None:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    keep = dist.get_rank(group) == 0
    whole = gather_nested(state, DeviceMesh.from_group(group, "cpu"), keep)
    return whole if keep else None


def gather_nested(value, mesh, keep: bool):
    """`value` with each DTensor replaced by its whole tensor (`keep`), or dropped once gathered (the other ranks)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        if value.device_mesh.mesh.tolist() != mesh.mesh.tolist():  # a shard's place is its rank's place in the mesh
            raise RuntimeError(f"a DTensor laid out over ranks {value.device_mesh.mesh.tolist()} cannot be gathered "
                               f"on the writer's group (ranks {mesh.mesh.tolist()})")
        moved = DTensor.from_local(value.to_local(), mesh, value.placements, run_check=False, shape=value.shape,
                                   stride=value.stride())
        whole = moved.full_tensor()
        return whole if keep else None
    if isinstance(value, dict):
        return {key: gather_nested(item, mesh, keep) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(gather_nested(item, mesh, keep) for item in value)
    return value
