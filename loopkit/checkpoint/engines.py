"""FSDP and DeepSpeed checkpoint I/O: Accelerate's state-dict paths (HF Trainer's `_save_checkpoint` / `_load_*`),
used by the HF layout (loopkit/storage/hf.py) and the model files (model_files.py). Sharded folders are read through
loopkit/dcp_reading.py (DCP metadata through a restricted unpickler); DeepSpeed's `global_step*/` with its
`torch.load`s forced to `weights_only=True`. Moved here from loopkit/distributed.py, which keeps the launch checks."""

from __future__ import annotations

import contextlib
import os

from ..distributed import active_engine, unwrap_model
from .durable import safe_torch_load
from .lineage import OPTIMIZER_NAME, SCHEDULER_NAME

FSDP_MODEL_FOLDER, FSDP_OPTIMIZER_FOLDER = "pytorch_model_fsdp_0", "optimizer_0"  # HF Trainer's names (one model)


def full_state_dict_saved(accelerator) -> bool:
    """Whether this run's checkpoints hold the whole model as `model.safetensors` (DDP, one process, FSDP with
    FULL_STATE_DICT, DeepSpeed) rather than FSDP's sharded state-dict folders."""
    if active_engine(accelerator) != "FSDP":
        return True
    return "FULL_STATE_DICT" in str(accelerator.state.fsdp_plugin.state_dict_type)


def sharded_model_saved(checkpoint: str) -> bool:
    """The checkpoint holds the model as FSDP's sharded state dict (`pytorch_model_fsdp_0/`, torch's distributed
    checkpoint: one file per rank that wrote it)."""
    return os.path.isdir(os.path.join(checkpoint, FSDP_MODEL_FOLDER))


def model_loads_after_prepare(accelerator, checkpoint: str) -> bool:
    """The model is loaded after `prepare` (`load_engine_model`) from a sharded model folder resumed by a sharded run
    with SHARDED_STATE_DICT (each rank reads its own shards), and under DeepSpeed from the engine's checkpoint
    (`global_step*/`, model and optimizer, as HF's `deepspeed_load_checkpoint`; under ZeRO-3 it is the only copy of
    the weights). Every other combination loads the whole model before `prepare` (`load_model_weights`), which then
    shards it when FSDP or DeepSpeed is active."""
    if active_engine(accelerator) == "DeepSpeed":
        return deepspeed_checkpoint_present(checkpoint)
    return sharded_model_saved(checkpoint) and not full_state_dict_saved(accelerator)


def deepspeed_keeps_weights(accelerator, engine) -> bool:
    """DeepSpeed ZeRO-3 without `stage3_gather_16bit_weights_on_model_save` (DeepSpeed's default): the whole model
    cannot be gathered into one state dict (Accelerate's `get_state_dict` raises), and only the engine's own
    checkpoint (`global_step*/`) holds the weights. (`engine`: the prepared model; before `train()` there is none.)"""
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    return (active_engine(accelerator) == "DeepSpeed" and partitioned is not None and partitioned()
            and not engine.zero_gather_16bit_weights_on_model_save())


def deepspeed_checkpoint_present(path: str) -> bool:
    """A DeepSpeed engine checkpoint (`global_step*/`) in the folder: what HF's `deepspeed_load_checkpoint` looks
    for."""
    return any(name.startswith("global_step") and os.path.isdir(os.path.join(path, name))
               for name in os.listdir(path))


def check_deepspeed_resumable(accelerator, checkpoint: str) -> None:
    """Under DeepSpeed the optimizer state resumes only from the engine's checkpoint: a full checkpoint (it has a
    scheduler, so not `save_only_model`) without `global_step*/` would restart the optimizer silently. Refused before
    anything is loaded, with Trainer's error (its `deepspeed_load_checkpoint`) and loopkit's reason and fix."""
    from ..errors import trainer_error

    if active_engine(accelerator) != "DeepSpeed" or deepspeed_checkpoint_present(checkpoint) or \
            not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
        return
    raise trainer_error(
        f"Can't find a valid checkpoint at {checkpoint}", "resume_from_checkpoint", checkpoint,
        "it holds no DeepSpeed engine state (global_step*/: the optimizer's partitions); it was written without "
        "DeepSpeed, and resuming it under DeepSpeed would restart the optimizer",
        "resume it without DeepSpeed, or train from its weights without resume_from_checkpoint")


def save_engine_state(run, context, folder: str, with_optimizer: bool) -> None:
    """FSDP / DeepSpeed: the model (when sharded) and the optimizer through Accelerate's functions, on every process.
    (With DDP or one process the checkpointer writes `optimizer.pt` itself.) With SHARDED_STATE_DICT each rank writes
    its own shards (`pytorch_model_fsdp_0/`, `optimizer_0/`); nothing is gathered."""
    acc, engine = context.accelerator, active_engine(context.accelerator)
    if engine == "DeepSpeed":
        # The engine writes its own sharded model + optimizer state (`global_step*/`), as HF Trainer does; where it
        # keeps the weights, the model files already had it write them (save_model_files).
        if with_optimizer and not deepspeed_keeps_weights(acc, run.model_wrapped):
            run.model_wrapped.save_checkpoint(folder)
        return
    if engine == "FSDP":
        from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

        plugin = acc.state.fsdp_plugin
        if not full_state_dict_saved(acc):
            save_fsdp_model(plugin, acc, run.model_wrapped, folder)
        if with_optimizer:
            save_fsdp_optimizer(plugin, acc, run.optimizer, run.model_wrapped, folder)


def load_engine_model(run, context, checkpoint: str) -> bool:
    """The model shards of a sharded checkpoint, after `accelerator.prepare` (`model_loads_after_prepare`), as
    Accelerate's `load_fsdp_model` reads them (its state-dict options, between two barriers) but through
    `read_dcp`: Accelerate's builds DCP's own reader, which unpickles `.metadata`. Under DeepSpeed, the engine's
    checkpoint (model and optimizer). Returns whether it loaded one."""
    acc = context.accelerator
    if not model_loads_after_prepare(acc, checkpoint):
        return False
    if active_engine(acc) == "DeepSpeed":  # the model and the optimizer (load_optimizer_state has nothing left to do)
        load_deepspeed_checkpoint(run.model_wrapped, checkpoint)
        return True
    acc.wait_for_everyone()
    load_sharded_model(run.model_wrapped, os.path.join(checkpoint, FSDP_MODEL_FOLDER),
                       sharded_state_dict_options(acc.state.fsdp_plugin))
    acc.wait_for_everyone()
    return True


def sharded_state_dict_options(plugin):
    """The state-dict options Accelerate's FSDP2 checkpoint functions use with SHARDED_STATE_DICT."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    config = plugin.state_dict_config
    return StateDictOptions(full_state_dict=False, cpu_offload=getattr(config, "offload_to_cpu", False),
                            broadcast_from_rank0=getattr(config, "rank0_only", False))


def load_sharded_model(model, folder: str, options=None) -> None:
    """A `pytorch_model_fsdp_0/` folder into `model`, sharded or not, at any number of processes (torch's distributed
    checkpoint reshards on load; without a process group it reads every shard in this process). Read by `read_dcp`:
    nothing in the folder is unpickled beyond DCP's metadata classes, tensors and plain values."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from ..dcp_reading import read_dcp

    state = {"model": get_model_state_dict(model, options=options)}
    read_dcp(state, folder)
    set_model_state_dict(model, state["model"], options=options)


def load_optimizer_state(run, context, checkpoint: str) -> bool:
    """The optimizer state, after `prepare`, from whichever layout the checkpoint holds into this run's layout:
    sharded (`optimizer_0/`, read by `read_dcp`) into a sharded run with Accelerate's options or into an unsharded
    one (torch's distributed checkpoint reshards), whole (`optimizer.pt`) into an unsharded run or, cut into this rank's
    shards, into a sharded one. Returns whether it loaded one."""
    acc, engine = context.accelerator, active_engine(context.accelerator)
    if engine == "DeepSpeed":  # loaded with the model from the engine's checkpoint (load_engine_model)
        return deepspeed_checkpoint_present(checkpoint)
    model, optimizer = unwrap_model(acc, run.model_wrapped), getattr(run.optimizer, "optimizer", run.optimizer)
    sharded, whole = os.path.join(checkpoint, FSDP_OPTIMIZER_FOLDER), os.path.join(checkpoint, OPTIMIZER_NAME)
    if os.path.isdir(sharded):
        if engine == "FSDP" and not full_state_dict_saved(acc):  # as Accelerate's load_fsdp_optimizer
            acc.wait_for_everyone()
            load_sharded_optimizer(run.model_wrapped, run.optimizer, sharded,
                                   sharded_state_dict_options(acc.state.fsdp_plugin))
            acc.wait_for_everyone()
        else:
            load_sharded_optimizer(model, optimizer, sharded)
    elif os.path.isfile(whole):
        state = safe_torch_load(whole)
        if engine == "FSDP":
            load_whole_optimizer_into_shards(model, optimizer, state)
        else:
            run.optimizer.load_state_dict(state)
    elif engine == "FSDP" and os.path.isfile(os.path.join(checkpoint, "optimizer.bin")):  # FULL_STATE_DICT layout
        from accelerate.utils import load_fsdp_optimizer

        load_fsdp_optimizer(acc.state.fsdp_plugin, acc, run.optimizer, run.model_wrapped, checkpoint)
    else:
        return False
    return True


# DeepSpeed's own objects in its checkpoints, besides tensors and plain values: the ZeRO stage of the optimizer state,
# fp16 loss scalers, the fragment addresses of `param_slice_mappings` (deepspeed/runtime/zero/stage_1_and_2.py,
# stage3.py, bf16_optimizer.py, fp16/loss_scaler.py, utils/tensor_fragment.py).
DEEPSPEED_STATE_CLASSES = ("deepspeed.runtime.zero.config.ZeroStageEnum",
                           "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                           "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                           "deepspeed.utils.tensor_fragment.fragment_address")


def deepspeed_state_classes() -> list:
    """The classes of `DEEPSPEED_STATE_CLASSES` that this DeepSpeed has (another version: what it does not have, it
    does not save)."""
    import importlib

    allowed = []
    for path in DEEPSPEED_STATE_CLASSES:
        module, name = path.rsplit(".", 1)
        try:
            allowed.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return allowed


def load_deepspeed_checkpoint(engine, checkpoint: str) -> None:
    """The engine's `load_checkpoint` (model and optimizer from `global_step*/`, as HF Trainer resumes), with every
    `torch.load` it makes forced to `weights_only=True`: DeepSpeed's checkpoint engine passes `weights_only=False`.
    Its own state classes (`DEEPSPEED_STATE_CLASSES`, those this DeepSpeed has) are admitted besides tensors and
    plain values; anything else is refused, naming the folder."""
    import pickle

    from ..dcp_reading import UnsafeCheckpointError

    try:
        with weights_only_loads(deepspeed_state_classes()):
            engine.load_checkpoint(checkpoint, load_module_strict=False)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"Refusing to load the DeepSpeed checkpoint in {checkpoint}: {exc}") from exc


@contextlib.contextmanager
def weights_only_loads(allowed: list):
    """Every `torch.load` inside runs with `weights_only=True`, even one that passes `weights_only=False` (torch's
    TORCH_FORCE_WEIGHTS_ONLY_LOAD), admitting the `allowed` classes besides tensors and plain values."""
    import torch

    saved = {name: os.environ.pop(name, None) for name in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD",
                                                            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def load_sharded_optimizer(model, optimizer, folder: str, options=None) -> None:
    """An `optimizer_0/` folder (keyed by parameter names) into an optimizer over `model`, sharded or not, read by
    `read_dcp` as `load_sharded_model` reads a model folder."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from ..dcp_reading import read_dcp

    state = {"optimizer": get_optimizer_state_dict(model, optimizer, options=options)}  # the layout to fill
    read_dcp(state, folder)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)


def load_whole_optimizer_into_shards(model, optimizer, state: dict) -> None:
    """A whole `optimizer.pt` (torch's layout: parameters by position in the param groups) into a sharded optimizer:
    the positions are named after the parameters they hold here (the optimizer was built over the same model, in the
    same order, before `prepare`), and torch's `set_optimizer_state_dict` keeps this rank's part of each tensor."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): name for name, p in model.named_parameters()}
    fqns = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    named = {"state": {fqns[i]: value for i, value in state["state"].items()},
             "param_groups": [{**group, "params": [fqns[i] for i in group["params"]]}
                              for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def engine_checkpoint_present(path: str) -> bool:
    """A sharded FSDP model folder or a DeepSpeed `global_step*` folder: a checkpoint without `model.safetensors`."""
    return any(name.startswith(("pytorch_model_fsdp_", "global_step")) and os.path.isdir(os.path.join(path, name))
               for name in os.listdir(path))
