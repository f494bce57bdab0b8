"""`LoopArgs`: a light dataclass with every field of `transformers.TrainingArguments` (transformers 5.24), with the
same names and defaults (tests/test_errors.py compares them with the installed transformers), and the derivations
of `TrainingArguments.__post_init__`. An unknown keyword names the nearest field. What loopkit refuses of any args
(`check_args`, the tables of supported and inert fields) is in loopkit/args/checks.py."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnknownArgumentError, nearest, plain, trainer_error
from .refusals import refuse_as_training_arguments


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
    # pushing to the Hugging Face Hub at saves (loopkit/trainer/hub.py)
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
        refuse_as_training_arguments(self)  # what TrainingArguments refuses when it is built (refusals.py)

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

        from ..distributed import launched_world_size

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

        from ..process import accelerate_state_kept

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
    if name in installed_trainer_field_names():  # a field of a newer transformers than LoopArgs declares
        fix = (f"{name} is a field of the installed transformers' TrainingArguments that LoopArgs does not declare "
               f"(loopkit does not run it yet, and will not ignore it): leave it out, or pass "
               f"transformers.TrainingArguments to Loop, which refuses {name} by name when it is changed")
    elif guesses:
        fix = f"did you mean {' or '.join(guesses)}? Write LoopArgs({guesses[0]}={value!r})"
    elif name in SEQ2SEQ_FIELDS:
        fix = (f"{name} is a Seq2SeqTrainingArguments field: pass transformers.Seq2SeqTrainingArguments("
               f"{name}=...) to loopkit.Seq2SeqLoop")
    else:
        fix = (f"use one of LoopArgs' fields, which are TrainingArguments' of the installed transformers "
               f"(dataclasses.fields(LoopArgs)); {name} is not one of them")
    return UnknownArgumentError(f"{name}={value!r}: LoopArgs has no field {name!r}. Fix: {fix}.")


def installed_trainer_field_names() -> set[str]:
    """The fields of the installed transformers' `TrainingArguments` (imported here, on an error's path only:
    building a `LoopArgs` imports no transformers)."""
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


DICT_FIELDS = ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
               "accelerator_config", "fsdp_config", "deepspeed")

# `Seq2SeqTrainingArguments`' own fields. The generation ones are read by the generating evaluation stage
# (`Seq2SeqLoop`'s, loopkit/stages/seq2seq.py), and any other evaluation stage refuses predict_with_generate=True
# when it is bound; `sortish_sampler` is read by no Trainer of transformers 5.24.
SEQ2SEQ_FIELDS = frozenset({"predict_with_generate", "generation_max_length", "generation_num_beams",
                            "generation_config", "sortish_sampler"})
LOOP_ARGS_FIELDS = frozenset(f.name for f in dataclasses.fields(LoopArgs))
LoopArgs.__init__ = reject_unknown_keywords(LoopArgs.__init__)


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
