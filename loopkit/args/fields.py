"""The fields of the installed `transformers.TrainingArguments`, read from its source, and loopkit's review of them.

`LoopArgs` is built from `training_arguments_fields()`: the names, annotations, defaults and help of the installed
release, so a field that a new transformers adds is there at once. The source is parsed (the class's fields, about
5 ms), not imported: `transformers.training_args` imports `transformers.trainer_utils`, peft, torchao and
bitsandbytes (seconds, and their warnings on a machine without their kernels), which building a `LoopArgs` must not
(tests/test_quiet_imports.py).

The review is the three tables below: the fields loopkit runs (`SUPPORTED_FIELDS`), the inert ones and the engine
ones. A field in none of them (one a transformers release added after this loopkit) is refused by name when it is
not at its default, in a `LoopArgs` and in a `TrainingArguments` alike (`check_reviewed_fields`,
loopkit/args/checks.py's `check_unsupported_fields`), never ignored.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
from typing import Any

from ..errors import LoopConfigError, config_error, plain
from ..private_api import TRAINING_ARGUMENTS_DICT_FIELDS

# The fields loopkit runs itself (where: docs/arguments.md). A `TrainingArguments` is checked against a reference
# built from their values.
SUPPORTED_FIELDS = frozenset({
    "output_dir",
    # batch, schedule, optimizer and scheduler (loopkit/optimizers.py, loopkit/schedule.py)
    "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "num_train_epochs",
    "max_steps", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "optim", "optim_args",
    "optim_target_modules", "max_grad_norm", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
    "average_tokens_across_devices",
    # logging
    "logging_strategy", "logging_steps", "logging_first_step", "logging_nan_inf_filter", "log_level",
    "log_level_replica", "log_on_each_node", "report_to", "run_name", "disable_tqdm",
    # evaluation
    "eval_strategy", "eval_steps", "eval_delay", "eval_on_start", "eval_accumulation_steps", "eval_do_concat_batches",
    "prediction_loss_only", "batch_eval_metrics", "include_for_metrics",
    # checkpoints and the best model
    "save_strategy", "save_steps", "save_total_limit", "save_only_model", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "ignore_data_skip", "restore_callback_states_from_checkpoint",
    "save_on_each_node", "enable_jit_checkpoint",
    # reproducibility and hardware
    "seed", "data_seed", "full_determinism", "bf16", "fp16", "use_cpu", "use_cache",
    # data
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_drop_last", "dataloader_persistent_workers",
    "dataloader_prefetch_factor", "remove_unused_columns", "label_names", "train_sampling_strategy",
    "length_column_name", "dataloader_multiprocessing_context", "dataloader_in_order",
    # Accelerate and DDP (loopkit/stages/setup.py), device meshes (loopkit/parallelism.py)
    "accelerator_config", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
    "ddp_static_graph", "auto_find_batch_size", "parallelism_config",
    # model transforms
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
    "activation_checkpointing_kwargs", "torch_compile", "torch_compile_backend", "torch_compile_mode",
    "use_liger_kernel", "liger_kernel_config",
    # training options (loopkit/stages/step.py, loopkit/stages/setup.py, loopkit/memory.py)
    "label_smoothing_factor", "include_num_input_tokens_seen", "neftune_noise_alpha", "torch_empty_cache_steps",
    "bf16_full_eval", "fp16_full_eval", "eval_use_gather_object", "skip_memory_metrics", "debug",
    # pushing to the Hugging Face Hub at saves (loopkit/trainer/hub.py)
    "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision",
})
# TrainingArguments fields that may take any value under loopkit, because HF Trainer does not change how it trains
# with them, or because TrainingArguments applies them itself when it is built (so they act under Loop too; with
# `LoopArgs`, the `Loop` applies them when it is built: loopkit/process.py, loopkit/stages/setup.py). A field belongs
# here only for such a reason; anything else is supported or refused when changed.
INERT_FIELDS = frozenset({
    # read by scripts (examples/run_*.py), never by Trainer
    "do_train", "do_eval", "do_predict", "resume_from_checkpoint",
    # read by HF's own integration callbacks (trackio), which loopkit builds from the same args
    "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    # applied by TrainingArguments.__post_init__ (the process group through its `device`, and TF32 backends)
    "local_rank", "ddp_timeout", "ddp_backend", "tf32",
})
# FSDP and DeepSpeed: `TrainingArguments` turns these into Accelerate plugins (`fsdp_plugin_args`, `deepspeed_plugin`),
# which the setup stage hands to the `Accelerator` and then checks are active (loopkit/distributed.py).
ACCELERATE_ENGINE_FIELDS = frozenset({"fsdp", "fsdp_config", "deepspeed"})


def is_reviewed(name: str) -> bool:
    """Whether loopkit runs the field, or knows it to be inert or an engine's (the tables above)."""
    return name in SUPPORTED_FIELDS or name in INERT_FIELDS or name in ACCELERATE_ENGINE_FIELDS


def unsupported_field_error(name: str, value: Any, default: Any) -> LoopConfigError:
    # What a user's machine lacks is checked on it when the refusal is made (`debug` in loopkit/args/checks.py,
    # `optim` in loopkit/optimizers.py); this one is for a field loopkit does not run at all.
    return config_error(name, value, "loopkit does not support this TrainingArguments field, and will not ignore it "
                        "silently", f"leave {name} at its default ({default!r}), or train with transformers.Trainer")


def check_reviewed_fields(args) -> None:
    """A `LoopArgs`' field outside the tables (one the installed transformers added after this loopkit) must keep its
    declared default: otherwise it is refused by name. The fields a `LoopArgs` subclass adds are the subclass's
    (`args_class` declares them: loopkit/args/checks.py)."""
    for f in dataclasses.fields(args):
        if f.name in args.trainer_fields and not is_reviewed(f.name):
            value, default = plain(getattr(args, f.name)), plain(declared_default(f))
            if value != default:
                raise unsupported_field_error(f.name, value, default)


def declared_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


# ---------------------------------------------------------------------------------------------------------------
# Reading the installed `TrainingArguments` from its source
# ---------------------------------------------------------------------------------------------------------------
def training_arguments_source() -> str:
    """The installed transformers' `training_args.py`, found without importing transformers."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("loopkit needs transformers (pip install 'transformers>=5.23,<6')")
    path = os.path.join(list(spec.submodule_search_locations)[0], "training_args.py")
    with open(path, encoding="utf-8") as source:
        return source.read()


def training_arguments_class(source: str) -> ast.ClassDef:
    """`class TrainingArguments` of `source`: its fields come before its first method, so that part alone is parsed
    (a fiftieth of the time of the whole module); the whole module when that part does not parse alone."""
    start = source.find("\nclass TrainingArguments")
    end = source.find("\n    def ", start)
    try:
        return only_class(ast.parse(source[start:end if end > 0 else None]))
    except (SyntaxError, ValueError):
        return only_class(ast.parse(source))


def only_class(tree: ast.Module) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TrainingArguments":
            return node
    raise ValueError("the installed transformers' training_args.py has no class TrainingArguments")


def training_arguments_fields(declaration: ast.ClassDef) -> list[tuple[str, str, dataclasses.Field | None]]:
    """Each field of `TrainingArguments` (`training_arguments_class`), in its order: its name, its annotation (as
    written) and a `dataclasses.Field` with its default and metadata, or None where the source does not say them in
    a way this reads (`loopkit/args/loop_args.py` then takes the field from the imported class). Private (`_name`)
    fields are transformers' own state, not options, and are left out."""
    computed = computed_defaults(declaration)
    return [(node.target.id, ast.unparse(node.annotation), field_of(node.value, computed))
            for node in declaration.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and not node.target.id.startswith("_")]


def dict_fields(declaration: ast.ClassDef) -> tuple[str, ...]:
    """`TrainingArguments._VALID_DICT_FIELDS`: the fields that take a JSON string for a dict."""
    for node in declaration.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [TRAINING_ARGUMENTS_DICT_FIELDS]:
            return tuple(ast.literal_eval(node.value))
    return ()


# TrainingArguments' class body computes one default, `optim`'s, from torch's version. loopkit applies its copy of
# that rule while the code that computes it reads as below (transformers 5.23 to 5.25); changed, the field is taken
# from the imported class (tests/test_args_derived.py compares both ways with the imported class).
DEFAULT_OPTIM_CODE = ("default_optim = 'adamw_torch'\n"
                      "if is_torch_available():\n"
                      "    from .pytorch_utils import is_torch_greater_or_equal_than_2_8\n"
                      "    if is_torch_greater_or_equal_than_2_8:\n"
                      "        default_optim = 'adamw_torch_fused'")
FACTORIES = {"list": list, "dict": dict}
NOT_GIVEN = object()


def computed_defaults(declaration: ast.ClassDef) -> dict[str, Any]:
    """The names the class body computes that loopkit knows the rule of, with their values here."""
    code = "\n".join(ast.unparse(node) for node in declaration.body
                     if not isinstance(node, ast.AnnAssign) and "default_optim" in ast.unparse(node))
    return {"default_optim": default_optim()} if code == DEFAULT_OPTIM_CODE else {}


def default_optim() -> str:
    """transformers' rule: "adamw_torch_fused" with torch 2.8 or newer, else "adamw_torch"."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return "adamw_torch_fused" if (major, minor) >= (2, 8) else "adamw_torch"


def field_of(value: ast.expr | None, computed: dict[str, Any]) -> dataclasses.Field | None:
    """The `dataclasses.Field` that `name: type = value` declares (a default may name one of the `computed` values),
    or None if `value` is not understood here."""
    if value is None:
        return None
    if not (isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field")):
        default = literal(value)
        return None if default is NOT_GIVEN else dataclasses.field(default=default)
    keywords = {k.arg: k.value for k in value.keywords}
    if value.args or set(keywords) - {"default", "default_factory", "metadata", "repr", "init"}:
        return None
    options: dict[str, Any] = {"metadata": literal_metadata(keywords.get("metadata"))}
    for name in ("repr", "init"):
        if name in keywords:
            options[name] = literal(keywords[name])
    if "default_factory" in keywords:
        options["default_factory"] = FACTORIES.get(ast.unparse(keywords["default_factory"]), NOT_GIVEN)
    elif "default" in keywords:
        options["default"] = literal(keywords["default"])
        if options["default"] is NOT_GIVEN:
            options["default"] = computed.get(ast.unparse(keywords["default"]), NOT_GIVEN)
    if NOT_GIVEN in options.values() or "default" not in options and "default_factory" not in options:
        return None
    return dataclasses.field(**options)


def literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return NOT_GIVEN


def literal_metadata(metadata: ast.expr | None) -> dict:
    """The literal entries of a field's metadata (its "help"; `choices` computed from other names are left out)."""
    if not isinstance(metadata, ast.Dict):
        return {}
    entries = {literal(k): literal(v) for k, v in zip(metadata.keys, metadata.values) if k is not None}
    return {k: v for k, v in entries.items() if k is not NOT_GIVEN and v is not NOT_GIVEN}


# The values loopkit supports of the fields that take one of a few (the rest are refused by name: checks.py).
SUPPORTED_CHOICES = {
    # transformers' schedulers (reduce_lr_on_plateau and greedy step on eval metrics); a scheduler type added later
    # is refused until it is reviewed.
    "lr_scheduler_type": ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                          "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau", "greedy",
                          "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"),
    "train_sampling_strategy": ("random", "sequential", "group_by_length"),
    "include_num_input_tokens_seen": ("no", "all", "non_padding"),
    "logging_strategy": ("no", "steps", "epoch"),
    "eval_strategy": ("no", "steps", "epoch"),
    "save_strategy": ("no", "steps", "epoch", "best"),
    "hub_strategy": ("end", "every_save", "checkpoint", "all_checkpoints"),
}
