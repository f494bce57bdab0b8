"""Run configuration: `LoopArgs`, and the check that a `transformers.TrainingArguments` asks for nothing we ignore.

`Loop` accepts either a real `transformers.TrainingArguments` (the one-word migration from `Trainer`) or `LoopArgs`,
a light dataclass with every field of `TrainingArguments` (transformers 5.24), with the same names and defaults
(tests/test_errors.py compares them with the installed transformers). Both are read through the same attribute
names, so the rest of loopkit never asks which one it got.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import inspect
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

# LoopConfigError, MetricNotFoundError, trainer_error and plain are importable from here too (loopkit.args, as before).
from .errors import (RuntimeConfigError, LoopConfigError, MetricNotFoundError,  # noqa: F401
                     UnknownArgumentError, config_error, nearest, plain, trainer_error)
from .optimizers import check_optim


@dataclass
class LoopArgs:
    """Every `TrainingArguments` field, with transformers 5.24's names and defaults. A field loopkit does not
    implement is refused when it is changed (`check_args`), never ignored.

    After `__post_init__` the derived values match `TrainingArguments`' own `__post_init__`: `eval_steps` falls back
    to `logging_steps`, `metric_for_best_model` becomes "loss" when `load_best_model_at_end` is on (or the scheduler is
    `reduce_lr_on_plateau` / `greedy`), `greater_is_better` follows the metric's name, `report_to="none"` becomes
    `[]`, `disable_tqdm=None` follows the transformers logger's level, setting `torch_compile_mode` or
    `torch_compile_backend` turns `torch_compile` on, `use_cpu` turns `dataloader_pin_memory` off, `output_dir=None`
    becomes "trainer_output" and an `eval_strategy` turns `do_eval` on. `tf32`, `ddp_backend` and `ddp_timeout` act
    when the `Loop` is built (TrainingArguments applies them when it is built); `fsdp` / `fsdp_config` / `deepspeed`
    become the Accelerate plugins TrainingArguments builds from them (`fsdp_plugin_args`, `deepspeed_plugin`).
    """

    output_dir: str | None = None
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
    optim_args: str | None = None  # "key=value,..." for the optimizer (loopkit/optimizers.py)
    optim_target_modules: str | list | None = None  # GaLore / APOLLO: the Linear modules they project
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
    log_level: str = "passive"  # transformers' verbosity on the process(es) that log, set when the Loop is built
    log_level_replica: str = "warning"  # ... on the other processes
    log_on_each_node: bool = True  # the main process of each node logs (False: process 0 only)
    report_to: Any = "none"
    run_name: str | None = None
    disable_tqdm: bool | None = None
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
    tf32: bool | None = None  # TF32 matmuls on Ampere+ GPUs (None: torch's setting is left as it is)
    # data
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_drop_last: bool = False
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    remove_unused_columns: bool = True
    label_names: list | None = None
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"  # group_by_length: the datasets column holding each sample's length
    dataloader_multiprocessing_context: str | None = None
    dataloader_in_order: bool = True
    # Accelerate and DDP (loopkit/stages/setup.py); None: HF's rule / torch's default
    accelerator_config: Any = None  # dict, JSON file path or transformers' AcceleratorConfig
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    ddp_backend: str | None = None  # the process group's backend (None: Accelerate's choice for the device)
    ddp_timeout: int = 1800  # seconds, for the process group
    local_rank: int = -1  # read by old launch scripts (torch.distributed.launch); the launcher's LOCAL_RANK rules
    # FSDP and DeepSpeed (loopkit/distributed.py)
    fsdp: str | bool | None = None
    fsdp_config: dict | str | None = None
    deepspeed: dict | str | None = None
    auto_find_batch_size: bool = False
    # checkpoints on preemption and on multi-node runs
    save_on_each_node: bool = False
    enable_jit_checkpoint: bool = False
    # model transforms
    gradient_checkpointing: bool | None = None
    gradient_checkpointing_kwargs: dict | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_kwargs: dict | None = None
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    # Liger's Triton kernels, applied at train() as Trainer applies them (loopkit/stages/setup.py)
    use_liger_kernel: bool = False
    liger_kernel_config: dict | None = None
    # Accelerate's ParallelismConfig (data-parallel replicate / shard, tensor parallel), handed to the Accelerator
    parallelism_config: Any = None
    # training options (loopkit/stages/step.py, schedule.py, stages/setup.py, memory.py)
    label_smoothing_factor: float = 0.0
    include_num_input_tokens_seen: str | bool = "no"  # True / False become "all" / "no", as TrainingArguments does
    neftune_noise_alpha: float | None = None
    torch_empty_cache_steps: int | None = None
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    eval_use_gather_object: bool = False
    skip_memory_metrics: bool = True
    debug: str | list = ""  # "underflow_overflow" (space-separated options), a list after __post_init__
    # pushing to the Hugging Face Hub at saves (loopkit/hub.py)
    push_to_hub: bool = False
    hub_token: str | None = field(default=None, repr=False)  # a secret: never printed (to_dict masks it too)
    hub_private_repo: bool | None = None
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_always_push: bool = False
    hub_revision: str | None = None
    # read by HF's trackio integration callback (report_to="trackio")
    project: str = "huggingface"
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    trackio_static_space_id: str | None = None
    # read by scripts (examples/run_*.py), never by Trainer
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    resume_from_checkpoint: str | None = None

    def __post_init__(self):
        """The derivations of `TrainingArguments.__post_init__` (5.24), in its order."""
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        for name in DICT_FIELDS:  # a JSON string from a command line, as TrainingArguments accepts
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("{"):
                setattr(self, name, json.loads(value))
        # 5.x renamed gradient_checkpointing*; the old names stay as aliases that mirror the new ones.
        for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                         ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
            if getattr(self, new) is None and getattr(self, old) is not None:
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False
        if self.disable_tqdm is None:
            # TrainingArguments' rule: no bars when transformers' logger is quieter than WARNING. The stdlib logger
            # is read directly, so building a LoopArgs never imports transformers.
            self.disable_tqdm = logging.getLogger("transformers").getEffectiveLevel() > logging.WARNING
        for name in ("logging_strategy", "eval_strategy", "save_strategy", "lr_scheduler_type", "optim",
                     "hub_strategy"):
            setattr(self, name, plain(getattr(self, name)))
        if self.do_eval is False and self.eval_strategy != "no":
            self.do_eval = True
        if self.eval_strategy == "steps" and not self.eval_steps:
            if self.logging_steps <= 0:
                raise trainer_error(f"evaluation strategy {self.eval_strategy} requires either non-zero --eval_steps "
                                    "or --logging_steps", "eval_steps", self.eval_steps, "eval_strategy='steps' needs "
                                    "an interval, and logging_steps (its fallback) is not positive",
                                    "set eval_steps > 0")
            self.eval_steps = self.logging_steps
        if (self.load_best_model_at_end or self.lr_scheduler_type in ("reduce_lr_on_plateau", "greedy")) \
                and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        self.report_to = report_to_list(self.report_to)
        for name in ("logging_steps", "eval_steps", "save_steps"):  # whole numbers above 1 become ints
            value = getattr(self, name)
            if value is not None and value > 1 and value == int(value):
                setattr(self, name, int(value))
        check_best_model_schedule(self)
        if (self.torch_compile_mode is not None or self.torch_compile_backend is not None) and not self.torch_compile:
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"
        if self.use_cpu:
            self.dataloader_pin_memory = False
        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        if isinstance(self.debug, str):
            self.debug = self.debug.split()
        elif self.debug is None:
            self.debug = []

    # Derived values with TrainingArguments' names, so the loop reads both kinds of args the same way.
    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size

    @property
    def parallel_mode(self):
        """`TrainingArguments.parallel_mode`, which transformers' optimizer handlers read (layer-wise GaLore and
        APOLLO refuse DISTRIBUTED): DISTRIBUTED when the launcher started several processes."""
        from transformers.training_args import ParallelMode

        from .distributed import launched_world_size

        return ParallelMode.DISTRIBUTED if launched_world_size() > 1 else ParallelMode.NOT_PARALLEL

    @property
    def fsdp_plugin_args(self) -> dict | None:
        """The keywords of Accelerate's FSDP plugin, as `TrainingArguments` builds them from `fsdp` / `fsdp_config`."""
        return self.as_training_arguments().fsdp_plugin_args if self.fsdp else None

    @property
    def deepspeed_plugin(self):
        """Accelerate's `DeepSpeedPlugin`, as `TrainingArguments` builds it from `deepspeed` (None without)."""
        return self.as_training_arguments().deepspeed_plugin if self.deepspeed else None

    def as_training_arguments(self):
        """A `transformers.TrainingArguments` with these values (the one that builds the FSDP and DeepSpeed plugins),
        built without touching Accelerate's state (loopkit/process.py) or these args' own dicts."""
        from transformers import TrainingArguments

        from .process import accelerate_state_kept

        aliases = ("gradient_checkpointing", "gradient_checkpointing_kwargs")  # 5.x derives them
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in aliases}
        for name in DICT_FIELDS:  # TrainingArguments changes these in place (fsdp_config's defaults, ...)
            if name in values:
                values[name] = copy.deepcopy(values[name])
        with accelerate_state_kept():
            return TrainingArguments(**values)

    def get_warmup_steps(self, num_training_steps: int) -> int:
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_steps)

    def to_dict(self) -> dict:
        """The fields, secrets masked as `TrainingArguments.to_dict` masks them (`hub_token` -> "<HUB_TOKEN>")."""
        return {f.name: f"<{f.name.upper()}>" if f.name.endswith("_token") else getattr(self, f.name)
                for f in dataclasses.fields(self)}

    def to_sanitized_dict(self) -> dict:
        return {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in self.to_dict().items()}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def report_to_list(report_to) -> list:
    """`report_to` as TrainingArguments holds it: a list ("all": every installed integration; "none": [])."""
    if report_to in ("all", ["all"]):
        from transformers.integrations import get_available_reporting_integrations

        return get_available_reporting_integrations()
    if report_to in (None, "none", ["none"]):
        return []
    return report_to if isinstance(report_to, list) else [report_to]


def reject_unknown_keywords(init):
    """Wrap `LoopArgs.__init__`: an unknown keyword names the nearest field (a misspelling) or, for a
    `TrainingArguments` field loopkit does not support, the way out."""

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        for name in kwargs:
            if name not in LOOP_ARGS_FIELDS:
                raise unknown_argument_error(name, kwargs[name])
        init(self, *args, **kwargs)

    return checked_init


def unknown_argument_error(name: str, value: Any) -> UnknownArgumentError:
    """LoopArgs has every `TrainingArguments` field, so an unknown name is a misspelling, a field of another
    transformers version, or a `Seq2SeqTrainingArguments` field."""
    guesses = nearest(name, LOOP_ARGS_FIELDS, n=2)
    if guesses:
        fix = f"did you mean {' or '.join(guesses)}? Write LoopArgs({guesses[0]}={value!r})"
    elif name in SEQ2SEQ_FIELDS:
        fix = (f"{name} is a Seq2SeqTrainingArguments field: pass transformers.Seq2SeqTrainingArguments("
               f"{name}=...) to loopkit.Seq2SeqLoop")
    else:
        fix = (f"use one of LoopArgs' fields, which are TrainingArguments' of the installed transformers "
               f"(dataclasses.fields(LoopArgs)); {name} is not one of them")
    return UnknownArgumentError(f"{name}={value!r}: LoopArgs has no field {name!r}. Fix: {fix}.")


DICT_FIELDS = ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
               "accelerator_config", "fsdp_config", "deepspeed")

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
# `Seq2SeqTrainingArguments`' own fields. The generation ones are read by the generating evaluation stage
# (`Seq2SeqLoop`'s, loopkit/stages/seq2seq.py), and any other evaluation stage refuses predict_with_generate=True
# when it is bound; `sortish_sampler` is read by no Trainer of transformers 5.24.
SEQ2SEQ_FIELDS = frozenset({"predict_with_generate", "generation_max_length", "generation_num_beams",
                            "generation_config", "sortish_sampler"})
# FSDP and DeepSpeed: `TrainingArguments` turns these into Accelerate plugins (`fsdp_plugin_args`, `deepspeed_plugin`),
# which the setup stage hands to the `Accelerator` and then checks are active (loopkit/distributed.py).
ACCELERATE_ENGINE_FIELDS = frozenset({"fsdp", "fsdp_config", "deepspeed"})
# Plumbing-like fields that do change a run (`dataloader_in_order`, `dataloader_multiprocessing_context`,
# `accelerator_config`, `debug`, `save_on_each_node`) are LoopArgs fields: supported, never inert.
LOOP_ARGS_FIELDS = frozenset(f.name for f in dataclasses.fields(LoopArgs))
LoopArgs.__init__ = reject_unknown_keywords(LoopArgs.__init__)
# `optim` is checked by loopkit/optimizers.py (refusals name the package or device the user's machine lacks).
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
# The way out, for the refused values users ask for most; otherwise the fix is "leave it at its default".
FIXES = {
    "lr_scheduler_type": "choose one of those, or build the scheduler yourself: pass optimizers=(optimizer, "
                         "scheduler) to Loop or override create_scheduler",
    "train_sampling_strategy": "use one of those, or return your sampler from a DataStage subclass's "
                               "train_sampler(dataset) and pass Loop(..., data=YourDataStage())",
}
# The fields loopkit runs itself; a `TrainingArguments` is checked against a reference built from their values.
SUPPORTED_FIELDS = LOOP_ARGS_FIELDS - INERT_FIELDS - ACCELERATE_ENGINE_FIELDS


def check_best_model_schedule(args) -> None:
    """`load_best_model_at_end` needs a checkpoint at every evaluation (TrainingArguments checks this only when it is
    built; loopkit checks again in `Loop`, so a field changed afterwards is caught too)."""
    if not args.load_best_model_at_end or plain(args.save_strategy) == "best":
        return
    eval_strategy, save_strategy = plain(args.eval_strategy), plain(args.save_strategy)
    if eval_strategy != save_strategy:
        raise trainer_error(
            '--load_best_model_at_end requires the save and eval strategy to match, except when --save_strategy='
            f'"best", but found\n- Evaluation strategy: {args.eval_strategy}\n- Save strategy: {args.save_strategy}',
            "load_best_model_at_end", True,
            f"it needs a checkpoint at every evaluation, but eval_strategy={eval_strategy!r} and "
            f"save_strategy={save_strategy!r} differ",
            f"set save_strategy={eval_strategy!r} to match eval_strategy, or save_strategy='best'",
        )
    save, every = args.save_steps, args.eval_steps
    # TrainingArguments' rule: a multiple, where fractions of max_steps only combine with fractions.
    if eval_strategy == "steps" and every and save % every != 0 and \
            not (save < 1 and every < 1 and round(save * 1_000_000) % round(every * 1_000_000) == 0):
        required = "--load_best_model_at_end requires the saving steps to be a"
        if save >= 1 and every >= 1:
            words = f"{required} round multiple of the evaluation steps, but found {save}, which is not a round " \
                    f"multiple of {every}."
        elif save < 1 and every < 1:
            words = (f"{required} multiple of the evaluation steps, but found {save}, which is not a multiple of "
                     f"{every}.")
        else:
            words = (f"{required} multiple of the evaluation steps, which cannot get guaranteed when mixing ratio and "
                     f"absolute steps for save_steps {save} and eval_steps {every}.")
        raise trainer_error(
            words, "save_steps", args.save_steps,
            f"load_best_model_at_end needs every save to follow an evaluation, but it is not a multiple "
            f"of eval_steps={args.eval_steps}",
            "make save_steps a multiple of eval_steps",
        )


def unsupported_field_error(name: str, value: Any, default: Any) -> LoopConfigError:
    fix = FIXES.get(name, f"leave {name} at its default ({default!r}), or train with transformers.Trainer")
    # A field a later transformers adds, until it is reviewed. (What a user's machine lacks is checked on it when
    # the refusal is made, as for `debug` below and `optim` in loopkit/optimizers.py.)
    return config_error(name, value, "loopkit does not support this TrainingArguments field, and will not ignore it "
                        "silently", fix)


def check_unsupported_fields(args) -> None:
    """Every `TrainingArguments` field outside the supported and inert sets must have the value a `TrainingArguments`
    built with the same supported values has (so values `__post_init__` derives from supported fields count as
    defaults). A script's subclass may add fields of its own (`@dataclass class ScriptArgs(TrainingArguments)`):
    Trainer never reads them, and neither does this check; the reference keeps their values. A `LoopArgs`
    has only fields loopkit runs or that are inert.

    The reference is built without touching Accelerate's state: building a `TrainingArguments` resets it, which would
    throw away a state the user configured (`use_configured_state`)."""
    from .process import accelerate_state_kept

    if isinstance(args, LoopArgs):  # every field of its own is run or inert
        return
    fields = [f for f in dataclasses.fields(args) if not f.name.startswith("_")]
    own = {f.name for f in fields} - trainer_field_names(args)
    same = {f.name: getattr(args, f.name) for f in fields if f.init and (f.name in SUPPORTED_FIELDS or f.name in own)}
    with accelerate_state_kept(), transformers_quiet():  # the user's own args printed its notes already
        reference = type(args)(**same)
    for f in fields:
        if f.name in SUPPORTED_FIELDS or f.name in INERT_FIELDS or f.name in ACCELERATE_ENGINE_FIELDS \
                or f.name in SEQ2SEQ_FIELDS or f.name in own:
            continue
        value, default = plain(getattr(args, f.name)), plain(getattr(reference, f.name))
        if value != default:
            raise unsupported_field_error(f.name, value, default)


@contextlib.contextmanager
def transformers_quiet():
    """transformers' logger at ERROR while a reference `TrainingArguments` is built."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def trainer_field_names(args) -> set[str]:
    """The fields `TrainingArguments` itself declares, for an instance of it or of a subclass; for another args
    dataclass, all of its fields."""
    from transformers import TrainingArguments  # not a `transformers.trainer*` module

    if isinstance(args, TrainingArguments):
        return {f.name for f in dataclasses.fields(TrainingArguments)}
    return {f.name for f in dataclasses.fields(args)}


def check_args(args) -> None:
    """Raise `LoopConfigError` for any value loopkit would otherwise ignore or mis-run, naming the field and fix.

    For a `TrainingArguments` (or any args dataclass other than `LoopArgs`), a field outside the supported and inert
    sets that does not keep its default is refused. That check comes last: it builds a `TrainingArguments` from the
    supported values, whose own validation would otherwise preempt the clearer messages below.
    """
    positive = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
    for name in positive:
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise config_error(name, value, "must be a positive integer", f"set {name} to 1 or more")
    for name, choices in SUPPORTED_CHOICES.items():
        value = plain(getattr(args, name))
        if value not in choices:
            fix = FIXES.get(name, f"choose one of those for {name}")
            raise refusal(enum_refusal(name, value), name, value, f"loopkit supports {', '.join(map(repr, choices))}",
                          fix)
    if args.bf16 and args.fp16:
        raise trainer_error("At most one of fp16 and bf16 can be True, but not both", "fp16", True,
                            "bf16=True is set too, and a run has one mixed-precision mode",
                            "set only one of bf16 and fp16")
    check_intervals(args)
    check_training_options(args)
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
    scheduler = plain(args.lr_scheduler_type)
    if scheduler in ("reduce_lr_on_plateau", "greedy") and plain(args.eval_strategy) == "no":
        raise trainer_error(f"lr_scheduler_type {scheduler} requires an eval strategy", "lr_scheduler_type",
                            scheduler, "it steps on the evaluation metric, and eval_strategy='no'",
                            "set eval_strategy='steps' or 'epoch' (and pass an eval_dataset)")
    if args.metric_for_best_model is None and (args.load_best_model_at_end or plain(args.save_strategy) == "best"):
        field_name, value = (("load_best_model_at_end", True) if args.load_best_model_at_end else
                             ("save_strategy", "best"))
        raise trainer_error("`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
                            "`args.load_best_model_at_end` is set to `True`.", field_name, value,
                            "choosing the best checkpoint needs a metric to compare",
                            "set metric_for_best_model, e.g. 'loss' or 'accuracy'")
    check_tf32(args)
    check_best_model_schedule(args)
    check_optim(args)
    if dataclasses.is_dataclass(args):
        check_unsupported_fields(args)


def check_intervals(args) -> None:
    """A 'steps' strategy needs a positive interval (TrainingArguments refuses 0 for logging, with its words)."""
    for name, strategy in (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy"),
                           ("eval_steps", "eval_strategy")):
        value = getattr(args, name)
        if plain(getattr(args, strategy)) == "steps" and (value is None or value <= 0):
            trainer_message = (f"logging strategy {args.logging_strategy} requires non-zero --logging_steps"
                               if name == "logging_steps" and value == 0 else None)
            raise refusal(trainer_message, name, value, f"{strategy}='steps' needs a positive interval",
                          f"set {name} > 0 (or a fraction of max_steps below 1)")


def refusal(trainer_message: str | None, field_name: str, value: Any, problem: str, fix: str) -> LoopConfigError:
    """`trainer_error` where TrainingArguments / Trainer refuse the same value (their words first), else
    `config_error`."""
    if trainer_message is None:
        return config_error(field_name, value, problem, fix)
    return trainer_error(trainer_message, field_name, value, problem, fix)


# The str-enums TrainingArguments turns these fields into: a value outside them is refused in the enum's words.
ENUM_OF_FIELD = {"lr_scheduler_type": ("transformers.trainer_utils", "SchedulerType"),
                 "logging_strategy": ("transformers.trainer_utils", "IntervalStrategy"),
                 "eval_strategy": ("transformers.trainer_utils", "IntervalStrategy"),
                 "save_strategy": ("transformers.trainer_utils", "SaveStrategy"),
                 "hub_strategy": ("transformers.trainer_utils", "HubStrategy"),
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


def check_tf32(args) -> None:
    """`tf32=True` needs TF32 matmuls (an Ampere or newer CUDA GPU), as `TrainingArguments` checks when it is built."""
    if not args.tf32:
        return
    from transformers.utils import is_torch_tf32_available

    if not is_torch_tf32_available():
        raise trainer_error("--tf32 requires Ampere or a newer GPU arch, cuda>=11 and torch>=1.7", "tf32", True,
                            "TF32 is a mode of Ampere and newer CUDA GPUs, and torch sees none",
                            "leave tf32=None (or False) on this machine")


def check_training_options(args) -> None:
    """The values of the training options TrainingArguments validates when it is built (checked again here, for
    `LoopArgs` and for fields changed afterwards), and the debug options loopkit does not run."""
    steps = args.torch_empty_cache_steps
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise trainer_error(f"`torch_empty_cache_steps` must be an integer bigger than 0, got {steps}.",
                            "torch_empty_cache_steps", steps, "it is the interval, in optimizer steps, at which the "
                            "device cache is emptied", "set a positive integer, or None")
    if args.bf16_full_eval and args.fp16_full_eval:
        raise trainer_error("At most one of fp16 and bf16 can be True for full eval, but not both", "fp16_full_eval",
                            True, "bf16_full_eval=True is set too, and evaluation casts the model to one dtype",
                            "set only one of bf16_full_eval and fp16_full_eval")
    for option in (plain(o) for o in args.debug):
        if option == "tpu_metrics_debug":
            # Checked on the user's machine now: without torch_xla there are no XLA metrics to print at all.
            problem = ("it prints torch_xla's metrics, and torch_xla is not installed"
                       if importlib.util.find_spec("torch_xla") is None else
                       "loopkit does not print torch_xla's metrics (not implemented)")
            raise config_error("debug", option, problem, "use debug='underflow_overflow' or leave debug empty")
        if option != "underflow_overflow":
            raise refusal(enum_refusal("debug", option), "debug", option, "it is not a debug option",
                          "use debug='underflow_overflow' or leave debug empty")


def check_inputs(args, *, model, model_init, train_dataset, eval_dataset, compute_metrics, optimizers,
                 optimizer_cls_and_kwargs=None) -> None:
    """What `Trainer.__init__` rejects about the arguments next to `args`, rejected at construction as there."""
    from .batches import has_length

    if optimizers[0] is not None and optimizer_cls_and_kwargs is not None:
        raise trainer_error("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible.",
                            "optimizer_cls_and_kwargs", optimizer_cls_and_kwargs, "an optimizer was passed too",
                            "pass either optimizers=(opt, sched) or optimizer_cls_and_kwargs", kind=RuntimeConfigError)

    if model is not None and model_init is not None:
        raise trainer_error("`Trainer` requires either a `model` or `model_init` argument, but not both.",
                            "model_init", model_init, "a model was passed too, and train() would replace it with "
                            "model_init()", "pass either model=... or model_init=...")
    if model_init is not None and any(o is not None for o in optimizers):
        passed = tuple(None if o is None else type(o).__name__ for o in optimizers)
        raise trainer_error("Passing a `model_init` is incompatible with providing the `optimizers` argument. You "
                            "should subclass `Trainer` and override the `create_optimizer_and_scheduler` method.",
                            "optimizers", passed, "model_init builds a new model at each train(), which an "
                            "optimizer built beforehand would not hold", "drop optimizers=... and override "
                            "create_optimizer / create_scheduler in a Loop subclass instead",
                            kind=RuntimeConfigError)
    for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        for key, part in (dataset.items() if isinstance(dataset, dict) else [(None, dataset)]):
            if part is not None and has_length(part) and len(part) == 0:
                where = f"{name}[{key!r}]" if key is not None else name
                raise config_error(where, f"<empty {type(part).__name__}>", "it has no example", "pass a dataset with "
                                   "at least one example (check the split, filter or file that built it)")
    if train_dataset is not None and not has_length(train_dataset) and args.max_steps <= 0:
        raise trainer_error("The train_dataset does not implement __len__, so the number of training steps cannot be "
                            "inferred; max_steps has to be specified. The total number of steps must be known in "
                            "advance to bound the training loop and to configure the learning rate scheduler.",
                            "max_steps", args.max_steps, f"the train dataset "
                            f"({type(train_dataset).__name__}) has no __len__, so the number of steps cannot be "
                            "derived from num_train_epochs", "set max_steps to the number of optimizer steps to train")
    # Trainer's order: batch_eval_metrics, then the eval dataset (Trainer._validate_args).
    if args.batch_eval_metrics and compute_metrics is not None:
        if "compute_result" not in inspect.signature(compute_metrics).parameters:
            raise trainer_error("When using `batch_eval_metrics`, your `compute_metrics` function must take a "
                                "`compute_result` boolean argument which will be triggered after the last batch of "
                                "the eval set to signal that the summary statistics should be returned by the "
                                "function.", "batch_eval_metrics", True, "compute_metrics is then called after every "
                                "batch and must know when the last one came", "give compute_metrics a "
                                "compute_result argument (True on the last batch: return the metrics then), or set "
                                "batch_eval_metrics=False")
    if plain(args.eval_strategy) != "no" and eval_dataset is None:
        raise trainer_error(f"You have set `args.eval_strategy` to {args.eval_strategy} but you didn't pass an "
                            "`eval_dataset` to `Trainer`. Either set `args.eval_strategy` to `no` or pass an "
                            "`eval_dataset`. ", "eval_strategy", plain(args.eval_strategy), "evaluating during "
                            "training needs an eval dataset, and none was passed", "pass eval_dataset=... to Loop, or "
                            "set eval_strategy='no'")
