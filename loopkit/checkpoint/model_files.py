"""The model's files in `save_pretrained` layout (or a bare `model.safetensors`), written and read back."""

from __future__ import annotations

import json
import os
import sys

from ..distributed import active_engine, unwrap_model
from .engines import (FSDP_MODEL_FOLDER, deepspeed_keeps_weights, engine_checkpoint_present, load_sharded_model,
                      sharded_model_saved)
from .lineage import WEIGHTS_NAME


def save_model_files(model, accelerator, output_dir: str, processing_class=None, state_dict=None,
                     writer: bool | None = None) -> None:
    """Weights (+ config) in `save_pretrained` layout when the model has it, else a bare `model.safetensors`.
    `state_dict` (host copies taken earlier) is written instead of the live weights when given. `writer`: whether
    this process writes (default: the main process; `save_on_each_node`: each node's first). Under DeepSpeed ZeRO-3
    without `stage3_gather_16bit_weights_on_model_save` (its default) the whole model cannot be gathered: as HF's
    `save_model`, the config is written without weights and the engine writes its own checkpoint (`global_step*/`,
    every process its partitions), which holds them."""
    writer = accelerator.is_main_process if writer is None else writer
    os.makedirs(output_dir, exist_ok=True)
    if state_dict is None and deepspeed_keeps_weights(accelerator, model):
        if writer:
            save_config_only(unwrap_model(accelerator, model), output_dir, processing_class)
        model.save_checkpoint(output_dir)
        return
    if state_dict is None and active_engine(accelerator) is not None:
        # FSDP / DeepSpeed: the whole model, gathered from the shards (a collective: every process calls this).
        state_dict = accelerator.get_state_dict(model)
        if not accelerator.is_main_process:
            return
    unwrapped = unwrap_model(accelerator, model, keep_torch_compile=False)
    if hasattr(unwrapped, "save_pretrained"):
        unwrapped.save_pretrained(output_dir, is_main_process=writer, state_dict=state_dict)
    elif writer:
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in (state_dict or unwrapped.state_dict()).items()}
        save_file(state, os.path.join(output_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    if processing_class is not None and writer and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)


TRAINING_ARGS_NAME = "training_args.bin"


def save_training_args(args, folder: str) -> None:
    """Trainer's `training_args.bin` (`torch.save` of the arguments) when they are a `TrainingArguments`, where
    Trainer writes it: tools written for Trainer read it. Secrets (`hub_token`: the fields `to_dict` masks) are left
    out, where Trainer writes them in clear into a file it uploads. loopkit never reads it (a pickle runs code when
    loaded: docs/differences.md); for `LoopArgs` none is written (no tool written for Trainer reads a `LoopArgs`)."""
    module = sys.modules.get("transformers.training_args")  # not imported: the args cannot be a TrainingArguments
    if module is None or not isinstance(args, module.TrainingArguments):
        return
    import copy

    import torch

    secrets = [name for name, value in vars(args).items() if name.endswith("_token") and value is not None]
    if secrets:
        args = copy.copy(args)
        for name in secrets:
            setattr(args, name, None)
    torch.save(args, os.path.join(folder, TRAINING_ARGS_NAME))


def save_config_only(unwrapped, output_dir: str, processing_class=None) -> None:
    """What HF's `save_model` writes when DeepSpeed keeps the weights: `save_pretrained` with an empty state dict,
    less the weights file that leaves (its `remove_dummy_checkpoint`), and the processing class."""
    if hasattr(unwrapped, "save_pretrained"):
        unwrapped.save_pretrained(output_dir, state_dict={})
        for name in (WEIGHTS_NAME, "pytorch_model.bin"):
            if os.path.isfile(os.path.join(output_dir, name)):
                os.remove(os.path.join(output_dir, name))
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
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


def holds_model_weights(path: str) -> bool:
    """Whether the folder holds a file or folder of model weights that Trainer's `_load_from_checkpoint` looks for."""
    names = (WEIGHTS_NAME, "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
             "adapter_model.safetensors", "adapter_model.bin")
    return any(os.path.isfile(os.path.join(path, name)) for name in names) or engine_checkpoint_present(path)

