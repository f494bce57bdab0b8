"""What `TrainingArguments.__post_init__` (transformers 5.24) refuses, refused by `LoopArgs` when it is built
(`refuse_as_training_arguments`, called at the end of `LoopArgs.__post_init__`), with Trainer's exception type and
words, then loopkit's field, value and fix. `check_args` calls it again when a `Loop` is built, for any arguments:
a field changed after they were built is caught there.

`TrainingArguments.__post_init__` refuses, in its order:
- a value outside its enum: `eval_strategy`, `logging_strategy`, `save_strategy`, `hub_strategy`,
  `lr_scheduler_type`, `optim`, `debug` (here);
- `eval_strategy="steps"` with neither `eval_steps` nor `logging_steps` (`LoopArgs.__post_init__`, which derives
  `eval_steps` there);
- `torch_empty_cache_steps` not a positive integer; `logging_steps=0` with `logging_strategy="steps"`; a
  `logging_steps` / `eval_steps` / `save_steps` above 1 that is not whole (here);
- `load_best_model_at_end` with unmatched strategies or steps (`check_best_model_schedule`, loop_args.py);
- `bf16` / `bf16_full_eval` without a device that has bfloat16 and without `use_cpu`; `fp16` with `bf16`;
  `fp16_full_eval` with `bf16_full_eval`; `reduce_lr_on_plateau` / `greedy` without evaluation; `warmup_steps < 0`;
  `dataloader_prefetch_factor` without workers; `accelerator_config` given as a class; `tf32=True` without TF32
  (here);
- when it builds Accelerate's state and its plugins: `use_configured_state` without a state, DeepSpeed not active,
  and the values of `fsdp` / `fsdp_config` / `deepspeed`. `LoopArgs` builds neither (building them changes the
  environment, `FSDP_CPU_RAM_EFFICIENT_LOADING`, and Accelerate's state): the `Loop` builds them, and refuses
  these then, undoing what the building changed (loopkit/process.py, loopkit/stages/setup.py).

Building a `LoopArgs` imports transformers only for what needs it: a non-default enum value, or bf16 / tf32 asked.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from ..errors import plain, trainer_error
from ..optimizers import KNOWN_OPTIMS
from .fields import SUPPORTED_CHOICES

# The str-enums TrainingArguments turns these fields into: a value outside them is refused in the enum's words.
ENUM_OF_FIELD = {"lr_scheduler_type": ("transformers.trainer_utils", "SchedulerType"),
                 "logging_strategy": ("transformers.trainer_utils", "IntervalStrategy"),
                 "eval_strategy": ("transformers.trainer_utils", "IntervalStrategy"),
                 "save_strategy": ("transformers.trainer_utils", "SaveStrategy"),
                 "hub_strategy": ("transformers.trainer_utils", "HubStrategy"),
                 "optim": ("transformers.training_args", "OptimizerNames"),
                 "debug": ("transformers.debug_utils", "DebugOption")}


def enum_refusal(name: str, value: Any) -> str | None:
    """TrainingArguments' message for a value its enum for `name` lacks (None if the enum has it)."""
    if name not in ENUM_OF_FIELD:
        return None
    module, enum_name = ENUM_OF_FIELD[name]
    try:
        getattr(importlib.import_module(module), enum_name)(value)
    except ValueError as error:
        return str(error)
    return None


def refuse_as_training_arguments(args) -> None:
    """Raise what `TrainingArguments.__post_init__` raises for these values (the list above), in its order."""
    check_enum_values(args)
    check_training_options(args)
    check_step_values(args)
    check_bf16(args)
    check_precision_pairs(args)
    check_schedule_values(args)
    if isinstance(getattr(args, "accelerator_config", None), type):
        raise trainer_error("Tried passing in a callable to `accelerator_config`, but this is not supported. Please "
                            "pass in a fully constructed `AcceleratorConfig` object instead.", "accelerator_config",
                            args.accelerator_config, "it is a class, not a configuration",
                            "pass an instance (AcceleratorConfig(...)), a dict or a JSON file path",
                            kind=NotImplementedError)
    check_tf32(args)


def check_enum_values(args) -> None:
    """A value outside TrainingArguments' enum for its field. Defaults, the values loopkit supports
    (`SUPPORTED_CHOICES`) and an `optim` loopkit knows are in the enum, so building `LoopArgs` with them imports no
    `transformers.trainer*` module (tests/test_stand_in_callbacks.py); `debug` is checked option by option."""
    defaults = {f.name: f.default for f in dataclasses.fields(args) if f.default is not dataclasses.MISSING} \
        if dataclasses.is_dataclass(args) else {}
    for name in ENUM_OF_FIELD:
        value = getattr(args, name)
        for one in (value.split() if isinstance(value, str) else value) if name == "debug" else [value]:
            one = plain(one)
            if one == plain(defaults.get(name)) or one in SUPPORTED_CHOICES.get(name, ()) or \
                    (name == "optim" and one in KNOWN_OPTIMS):
                continue
            message = enum_refusal(name, one)
            if message is not None:
                raise trainer_error(message, name, one, "TrainingArguments accepts only the values listed",
                                    f"choose one of those for {name}")


def check_training_options(args) -> None:
    """`torch_empty_cache_steps` and the full-evaluation precision pair."""
    steps = args.torch_empty_cache_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise trainer_error(f"`torch_empty_cache_steps` must be an integer bigger than 0, got {steps}.",
                            "torch_empty_cache_steps", steps, "it is the interval, in optimizer steps, at which the "
                            "device cache is emptied", "set a positive integer, or None")
    if args.bf16_full_eval and args.fp16_full_eval:
        raise trainer_error("At most one of fp16 and bf16 can be True for full eval, but not both", "fp16_full_eval",
                            True, "bf16_full_eval=True is set too, and evaluation casts the model to one dtype",
                            "set only one of bf16_full_eval and fp16_full_eval")


def check_step_values(args) -> None:
    """`logging_steps=0` under 'steps', and an interval above 1 that is not a whole number of steps."""
    if plain(args.logging_strategy) == "steps" and args.logging_steps == 0:
        raise trainer_error(f"logging strategy {args.logging_strategy} requires non-zero --logging_steps",
                            "logging_steps", 0, "logging_strategy='steps' needs a positive interval",
                            "set logging_steps > 0 (or a fraction of max_steps below 1)")
    for name, strategy in (("logging_steps", "logging_strategy"), ("eval_steps", "eval_strategy"),
                           ("save_steps", "save_strategy")):
        value = getattr(args, name)
        if plain(getattr(args, strategy)) == "steps" and value is not None and value > 1 and value != int(value):
            raise trainer_error(f"--{name} must be an integer if bigger than 1: {value}", name, value,
                                "above 1 it counts steps, and a step is whole",
                                f"set {name} to a whole number, or to a fraction of max_steps below 1")


def check_precision_pairs(args) -> None:
    if args.bf16 and args.fp16:
        raise trainer_error("At most one of fp16 and bf16 can be True, but not both", "fp16", True,
                            "bf16=True is set too, and a run has one mixed-precision mode",
                            "set only one of bf16 and fp16")


def check_schedule_values(args) -> None:
    """A scheduler that steps on evaluations without any; a negative warmup; a prefetch without workers."""
    scheduler = plain(args.lr_scheduler_type)
    if scheduler in ("reduce_lr_on_plateau", "greedy") and plain(args.eval_strategy) == "no":
        raise trainer_error(f"lr_scheduler_type {scheduler} requires an eval strategy", "lr_scheduler_type",
                            scheduler, "it steps on the evaluation metric, and eval_strategy='no'",
                            "set eval_strategy='steps' or 'epoch' (and pass an eval_dataset)")
    if args.warmup_steps < 0:
        raise trainer_error(f"Got warmup_steps = {args.warmup_steps}, Expected value warmup_steps >= 0",
                            "warmup_steps", args.warmup_steps, "it cannot be negative",
                            "set warmup_steps >= 0 (a value below 1 is a fraction of max_steps)")
    if args.dataloader_prefetch_factor is not None and args.dataloader_num_workers == 0:
        raise trainer_error("--dataloader_prefetch_factor can only be set when data is loaded in a different "
                            "process, i.e. when --dataloader_num_workers > 0.", "dataloader_prefetch_factor",
                            args.dataloader_prefetch_factor, "it only applies to worker processes, and "
                            "dataloader_num_workers=0", "set dataloader_num_workers > 0 or leave "
                            "dataloader_prefetch_factor=None")


def check_bf16(args) -> None:
    """`bf16` / `bf16_full_eval` need a device with bfloat16 (a GPU that has it, a TPU), or `use_cpu=True`."""
    if not (args.bf16 or args.bf16_full_eval) or args.use_cpu:
        return
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_cuda_available, is_torch_xla_available

    if is_torch_bf16_gpu_available() or is_torch_xla_available():
        return
    message = "Your setup doesn't support bf16/gpu. You need to assign use_cpu if you want to train the model on CPU."
    field_name = "bf16" if args.bf16 else "bf16_full_eval"
    if is_torch_cuda_available():
        message += " You need Ampere+ GPU with cuda>=11.0."
    raise trainer_error(message, field_name, True, "bfloat16 needs a device that has it (an Ampere or newer GPU, a "
                        "TPU), or the CPU chosen explicitly, and this machine has no such device",
                        f"set use_cpu=True to run {field_name} on the CPU (bfloat16 autocast), or leave "
                        f"{field_name}=False")


def check_tf32(args) -> None:
    """`tf32=True` needs TF32 matmuls (an Ampere or newer CUDA GPU)."""
    if not args.tf32:
        return
    from transformers.utils import is_torch_tf32_available

    if not is_torch_tf32_available():
        raise trainer_error("--tf32 requires Ampere or a newer GPU arch, cuda>=11 and torch>=1.7", "tf32", True,
                            "TF32 is a mode of Ampere and newer CUDA GPUs, and torch sees none",
                            "leave tf32=None (or False) on this machine")
