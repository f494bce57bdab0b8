"""Run configuration: `LoopArgs`, and the check that a `transformers.TrainingArguments` asks for nothing we ignore.

`Loop` accepts either a real `transformers.TrainingArguments` (the one-word migration from `Trainer`) or `LoopArgs`,
a light dataclass with the same field names and defaults for every field loopkit supports. Both are read through the
same attribute names, so the rest of loopkit never asks which one it got.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any


class LoopConfigError(ValueError):
    """A configuration value loopkit cannot run with. The message names the field, the value and the fix."""


def config_error(field_name: str, value: Any, problem: str, fix: str) -> LoopConfigError:
    return LoopConfigError(f"{field_name}={value!r}: {problem}. Fix: {fix}.")


def plain(value: Any) -> Any:
    """The plain value of a str-enum (`IntervalStrategy.STEPS` -> "steps"); anything else unchanged."""
    return getattr(value, "value", value)


@dataclass
class LoopArgs:
    """The `TrainingArguments` fields loopkit supports, with transformers 5.24's names and defaults.

    After `__post_init__` the derived defaults match `TrainingArguments`: `eval_steps` falls back to `logging_steps`,
    `metric_for_best_model` becomes "loss" when `load_best_model_at_end` is on, `greater_is_better` follows the
    metric's name, and `report_to="none"` becomes `[]`.
    """

    output_dir: str = "trainer_output"
    # batch and schedule
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    num_train_epochs: float = 3.0
    max_steps: int = -1
    # optimizer and scheduler
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    optim: str = "adamw_torch_fused"
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | None = None
    warmup_steps: float = 0
    average_tokens_across_devices: bool = True
    # logging
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    logging_nan_inf_filter: bool = True
    report_to: Any = "none"
    run_name: str | None = None
    disable_tqdm: bool = False
    # evaluation
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    eval_on_start: bool = False
    eval_accumulation_steps: int | None = None
    eval_do_concat_batches: bool = True
    prediction_loss_only: bool = False
    batch_eval_metrics: bool = False
    include_for_metrics: list = field(default_factory=list)
    # checkpoints and the best model
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    ignore_data_skip: bool = False
    restore_callback_states_from_checkpoint: bool = False
    # reproducibility and hardware
    seed: int = 42
    data_seed: int | None = None
    full_determinism: bool = False
    bf16: bool = False
    fp16: bool = False
    use_cpu: bool = False
    use_cache: bool = False
    # data
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_drop_last: bool = False
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    remove_unused_columns: bool = True
    label_names: list | None = None
    train_sampling_strategy: str = "random"
    # model transforms
    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict | None = None
    activation_checkpointing: bool = False
    activation_checkpointing_kwargs: dict | None = None
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    skip_memory_metrics: bool = True

    def __post_init__(self):
        for name in ("logging_strategy", "eval_strategy", "save_strategy", "lr_scheduler_type", "optim"):
            setattr(self, name, plain(getattr(self, name)))
        if self.report_to in (None, "none"):
            self.report_to = []
        elif isinstance(self.report_to, str):
            self.report_to = [self.report_to]
        if self.gradient_checkpointing and not self.activation_checkpointing:
            # 5.x renamed it; the old name is kept as an alias, as in TrainingArguments.
            self.activation_checkpointing = True
            self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        if self.eval_strategy == "steps" and not self.eval_steps:
            self.eval_steps = self.logging_steps
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        if self.load_best_model_at_end and self.save_strategy != "best":
            if self.eval_strategy != self.save_strategy:
                raise config_error(
                    "load_best_model_at_end", True,
                    f"it needs checkpoints at the evaluations, but eval_strategy={self.eval_strategy!r} and "
                    f"save_strategy={self.save_strategy!r} differ",
                    "set save_strategy equal to eval_strategy, or save_strategy='best'",
                )
            if self.eval_strategy == "steps" and self.save_steps % self.eval_steps != 0:
                raise config_error(
                    "save_steps", self.save_steps,
                    f"load_best_model_at_end needs every save to follow an evaluation, but it is not a multiple "
                    f"of eval_steps={self.eval_steps}",
                    "make save_steps a multiple of eval_steps",
                )

    # Derived values with TrainingArguments' names, so the loop reads both kinds of args the same way.
    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size

    def get_warmup_steps(self, num_training_steps: int) -> int:
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_steps)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_sanitized_dict(self) -> dict:
        return {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in self.to_dict().items()}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


# TrainingArguments fields that HF Trainer itself does not use to train (bookkeeping for scripts, log levels,
# Hub settings that only matter with push_to_hub): a non-default value changes nothing, so it is allowed.
INERT_FIELDS = frozenset({
    "do_train", "do_eval", "do_predict", "resume_from_checkpoint", "local_rank", "log_level", "log_level_replica",
    "log_on_each_node", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision",
    "ddp_timeout", "ddp_backend", "dataloader_in_order", "length_column_name", "save_on_each_node",
    "tf32", "accelerator_config", "dataloader_multiprocessing_context", "debug", "logging_dir",
})
SUPPORTED_FIELDS = frozenset(f.name for f in dataclasses.fields(LoopArgs))
SUPPORTED_CHOICES = {
    "optim": ("adamw_torch", "adamw_torch_fused"),
    "train_sampling_strategy": ("random", "sequential"),
    "logging_strategy": ("no", "steps", "epoch"),
    "eval_strategy": ("no", "steps", "epoch"),
    "save_strategy": ("no", "steps", "epoch", "best"),
}


def check_args(args) -> None:
    """Raise `LoopConfigError` for any value loopkit would otherwise ignore or mis-run, naming the field and fix.

    For a `TrainingArguments`, every field outside the supported and inert sets must keep its default, compared
    against a default `TrainingArguments()` after its own `__post_init__` (which rewrites some defaults).
    """
    if type(args).__name__ != "LoopArgs" and dataclasses.is_dataclass(args):
        reference = type(args)(output_dir=args.output_dir)
        for f in dataclasses.fields(args):
            if f.name.startswith("_") or f.name in SUPPORTED_FIELDS or f.name in INERT_FIELDS:
                continue
            value, default = getattr(args, f.name), getattr(reference, f.name)
            if plain(value) != plain(default):
                raise config_error(
                    f.name, plain(value), "loopkit does not support this TrainingArguments field yet, and will not "
                    "ignore it silently", f"leave {f.name} at its default ({plain(default)!r}) or use HF Trainer",
                )
    positive = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
    for name in positive:
        value = getattr(args, name)
        if not isinstance(value, int) or value < 1:
            raise config_error(name, value, "must be a positive integer", f"set {name} to 1 or more")
    for name, choices in SUPPORTED_CHOICES.items():
        value = plain(getattr(args, name))
        if value not in choices:
            raise config_error(name, value, f"loopkit supports {', '.join(map(repr, choices))}",
                               f"choose one of those for {name}")
    if args.bf16 and args.fp16:
        raise config_error("fp16", True, "bf16 and fp16 are both set", "choose one mixed-precision mode")
    for name, strategy in (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy"),
                           ("eval_steps", "eval_strategy")):
        value = getattr(args, name)
        if plain(getattr(args, strategy)) == "steps" and (value is None or value <= 0):
            raise config_error(name, value, f"{strategy}='steps' needs a positive interval",
                               f"set {name} > 0 (or a fraction of max_steps below 1)")
    if args.metric_for_best_model is None and args.load_best_model_at_end:
        raise config_error("metric_for_best_model", None, "load_best_model_at_end needs a metric",
                           "set metric_for_best_model, e.g. 'loss'")
    if plain(args.save_strategy) == "best" and args.metric_for_best_model is None:
        raise config_error("save_strategy", "best", "saving the best checkpoint needs a metric to compare",
                           "set metric_for_best_model, e.g. 'loss' or 'accuracy'")
