"""`LoopArgs`: a light dataclass with every field of the installed `transformers.TrainingArguments`, its names,
annotations, defaults and help read from transformers' own source when this module is imported (loopkit/args/fields.py:
the source is parsed, not imported), and the derivations of `TrainingArguments.__post_init__`. A field that a newer
transformers adds is a `LoopArgs` field at once, and refused by name unless loopkit's tables list it. An unknown
keyword names the nearest field. What loopkit refuses of any args (`check_args`) is in loopkit/args/checks.py."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from ..errors import UnknownArgumentError, nearest, plain, trainer_error
from ..private_api import training_arguments_dict_fields
from .fields import check_reviewed_fields, dict_fields, training_arguments_class, training_arguments_fields, \
    training_arguments_source
from .refusals import refuse_as_training_arguments


class LoopArgsMethods:
    """Every field of the installed `TrainingArguments`, with its names and defaults (read from transformers' source:
    loopkit/args/fields.py). A field loopkit does not implement is refused when it is changed (`check_args`; a field
    its tables do not list, already when the `LoopArgs` is built), never ignored.

    After `__post_init__` the derived values match `TrainingArguments`' own `__post_init__`: `eval_steps` falls back
    to `logging_steps`, `metric_for_best_model` becomes "loss" when `load_best_model_at_end` is on (or the scheduler is
    `reduce_lr_on_plateau` / `greedy`), `greater_is_better` follows the metric's name, `report_to="none"` becomes
    `[]`, `disable_tqdm=None` follows the transformers logger's level, setting `torch_compile_mode` or
    `torch_compile_backend` turns `torch_compile` on, `use_cpu` turns `dataloader_pin_memory` off, `output_dir=None`
    becomes "trainer_output" and an `eval_strategy` turns `do_eval` on. `tf32`, `ddp_backend` and `ddp_timeout` act
    when the `Loop` is built (TrainingArguments applies them when it is built); `fsdp` / `fsdp_config` / `deepspeed`
    become the Accelerate plugins TrainingArguments builds from them (`fsdp_plugin_args`, `deepspeed_plugin`).
    """

    trainer_fields = frozenset()  # the TrainingArguments fields the class was built with (`loop_args_class`)

    def __post_init__(self):
        """The derivations of `TrainingArguments.__post_init__` (5.24), in its order, after refusing a changed field
        that loopkit's tables do not list."""
        check_reviewed_fields(self)
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


def loop_args_class(fields: list[tuple[str, str, dataclasses.Field | None]]) -> type:
    """The `LoopArgs` dataclass of these `TrainingArguments` fields (`training_arguments_fields`), with
    `LoopArgsMethods`' behaviour. A field whose source was not understood is taken from the imported class."""
    names = frozenset(name for name, _, _ in fields)
    namespace: dict[str, Any] = {"__module__": __name__, "__qualname__": "LoopArgs", "__doc__": LoopArgsMethods.__doc__,
                                 "__annotations__": {name: annotation for name, annotation, _ in fields},
                                 "trainer_fields": names}
    for name, _, declared in fields:
        namespace[name] = declared or imported_field(name)
        if name.endswith("_token"):  # a secret: never printed (to_dict masks it too)
            namespace[name].repr = False
    cls = dataclass(type("LoopArgs", (LoopArgsMethods,), namespace))
    cls.__init__ = reject_unknown_keywords(cls.__init__, names)
    return cls


def imported_field(name: str) -> dataclasses.Field:
    """The field as the imported `TrainingArguments` declares it. Only for a default that loopkit/args/fields.py cannot
    read from the source: importing `transformers.training_args` costs seconds (tests/test_args_derived.py checks that
    no field of the installed transformers needs it)."""
    from transformers import TrainingArguments

    f = TrainingArguments.__dataclass_fields__[name]
    return dataclasses.field(default=f.default, default_factory=f.default_factory, init=f.init, repr=f.repr,
                             metadata=dict(f.metadata))


def reject_unknown_keywords(init, names: frozenset[str]):
    """Wrap `LoopArgs.__init__`: an unknown keyword names the nearest field (a misspelling) or the way out."""

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        for name in kwargs:
            if name not in names:
                raise unknown_argument_error(name, kwargs[name], names)
        init(self, *args, **kwargs)

    return checked_init


def unknown_argument_error(name: str, value: Any, names: frozenset[str]) -> UnknownArgumentError:
    """LoopArgs has every field of the installed `TrainingArguments` (`names`), so an unknown name is a misspelling, a
    field of another transformers version, or a `Seq2SeqTrainingArguments` field."""
    guesses = nearest(name, names, n=2)
    if guesses:
        fix = f"did you mean {' or '.join(guesses)}? Write LoopArgs({guesses[0]}={value!r})"
    elif name in SEQ2SEQ_FIELDS:
        fix = (f"{name} is a Seq2SeqTrainingArguments field: pass transformers.Seq2SeqTrainingArguments("
               f"{name}=...) to loopkit.Seq2SeqLoop")
    else:
        fix = (f"use one of LoopArgs' fields, which are TrainingArguments' of the installed transformers "
               f"(dataclasses.fields(LoopArgs)); {name} is not one of them")
    return UnknownArgumentError(f"{name}={value!r}: LoopArgs has no field {name!r}. Fix: {fix}.")


def installed_loop_args() -> tuple[type, tuple[str, ...]]:
    """`LoopArgs` and `DICT_FIELDS` of the installed transformers: from its source, or from the imported class where
    an installation ships no source (compiled files only)."""
    try:
        declaration = training_arguments_class(training_arguments_source())
    except OSError:
        from transformers import TrainingArguments

        names = [f.name for f in dataclasses.fields(TrainingArguments) if not f.name.startswith("_")]
        return loop_args_class([(name, "Any", None) for name in names]), training_arguments_dict_fields()
    return loop_args_class(training_arguments_fields(declaration)), dict_fields(declaration)


LoopArgs, DICT_FIELDS = installed_loop_args()
# `Seq2SeqTrainingArguments`' own fields. The generation ones are read by the generating evaluation stage
# (`Seq2SeqLoop`'s, loopkit/stages/seq2seq.py), and any other evaluation stage refuses predict_with_generate=True
# when it is bound; `sortish_sampler` is read by no Trainer of transformers 5.24.
SEQ2SEQ_FIELDS = frozenset({"predict_with_generate", "generation_max_length", "generation_num_beams",
                            "generation_config", "sortish_sampler"})
LOOP_ARGS_FIELDS = frozenset(f.name for f in dataclasses.fields(LoopArgs))


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
