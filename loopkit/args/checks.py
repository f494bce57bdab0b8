"""What loopkit refuses of the arguments, at construction, naming the field, the value and the fix: `check_args`
(any args: values loopkit would otherwise ignore or mis-run, and a `TrainingArguments` field it does not run that
is changed), `check_inputs` (what `Trainer.__init__` rejects about the arguments next to them), and the tables they
read: the fields loopkit supports, the inert ones, the engine ones, the choices it runs and the fixes it names."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
from typing import Any

from ..errors import LoopConfigError, RuntimeConfigError, config_error, plain, trainer_error
from ..optimizers import check_optim
from .fields import (ACCELERATE_ENGINE_FIELDS, INERT_FIELDS, SUPPORTED_CHOICES, SUPPORTED_FIELDS,
                     check_reviewed_fields, unsupported_field_error)
from .loop_args import LOOP_ARGS_FIELDS, SEQ2SEQ_FIELDS, LoopArgs, check_best_model_schedule
from .refusals import enum_refusal, refuse_as_training_arguments

# The tables of the fields loopkit supports, the inert ones and the engine ones: loopkit/args/fields.py.
# Plumbing-like fields that do change a run (`dataloader_in_order`, `dataloader_multiprocessing_context`,
# `accelerator_config`, `debug`, `save_on_each_node`) are supported, never inert.

# `optim` is checked by loopkit/optimizers.py (refusals name the package or device the user's machine lacks); the
# other fields that take one of a few values: SUPPORTED_CHOICES, in loopkit/args/fields.py.
# The way out, for the refused values users ask for most; otherwise the fix is "leave it at its default".
FIXES = {
    "lr_scheduler_type": "choose one of those, or build the scheduler yourself: pass optimizers=(optimizer, "
                         "scheduler) to Loop or override create_scheduler",
    "train_sampling_strategy": "use one of those, or return your sampler from a DataStage subclass's "
                               "train_sampler(dataset) and pass Loop(..., data=YourDataStage())",
}


# A config subclass's own fields that its `__post_init__` derives from another one when left None, and refuses
# when both are given: TRL's GRPOConfig / RLOOConfig derive `generation_batch_size` from `steps_per_generation`.
DERIVED_OWN_FIELDS = {"generation_batch_size"}


def check_unsupported_fields(args) -> None:
    """Every `TrainingArguments` field outside the supported and inert sets must have the value a `TrainingArguments`
    built with the same supported values has (so values `__post_init__` derives from supported fields count as
    defaults). A script's subclass may add fields of its own (`@dataclass class ScriptArgs(TrainingArguments)`):
    Trainer never reads them, and neither does this check; the reference keeps their values. A `LoopArgs`' field
    outside those sets (one a newer transformers added) must keep its declared default (`check_reviewed_fields`).

    The reference is built without touching Accelerate's state: building a `TrainingArguments` resets it, which would
    throw away a state the user configured (`use_configured_state`)."""
    from ..process import accelerate_state_kept

    if isinstance(args, LoopArgs):
        check_reviewed_fields(args)  # its __post_init__ checked them too; a field may have changed since
        return
    fields = [f for f in dataclasses.fields(args) if not f.name.startswith("_")]
    own = {f.name for f in fields} - trainer_field_names(args)
    same = {f.name: getattr(args, f.name) for f in fields if f.init and (f.name in SUPPORTED_FIELDS or f.name in own)}
    for name in DERIVED_OWN_FIELDS & own:  # left for the reference's __post_init__ to derive again
        same[name] = None
    with accelerate_state_kept(), transformers_quiet():  # the user's own args printed its notes already
        reference = type(args)(**same)
    for f in fields:
        if f.name in SUPPORTED_FIELDS or f.name in INERT_FIELDS or f.name in ACCELERATE_ENGINE_FIELDS \
                or f.name in SEQ2SEQ_FIELDS or f.name in own:
            continue
        value, default = plain(getattr(args, f.name)), plain(getattr(reference, f.name))
        if value != default:
            raise unsupported_field_error(f.name, value, default)


# TRL's configs and loopkit's loops that read them (loopkit/trl/): a field of one of these configs, on a `Loop` that
# does not declare it, names the loop to use.
TRL_LOOPS = {"SFTConfig": "SFTLoop", "DPOConfig": "DPOLoop", "RewardConfig": "RewardLoop", "GRPOConfig": "GRPOLoop"}


class ArgsClassDeclaration:
    """`Loop`'s `args_class`: the config class whose fields the loop reads beyond `TrainingArguments`' (None:
    none; `SFTLoop.args_class = SFTConfig`; a subclass that reads options of its own, `args_class = MyArgs`). A
    field nothing reads is refused when the loop is created, before any `__init__` runs: a subclass's (a TRL
    trainer's loads the model and tokenises the datasets) runs before `Loop.__init__`, which checks again
    (`check_args`: the args of a subclass's `__init__(*args, **kwargs)`, or args it built)."""

    args_class = None

    def __new__(cls, *args, **kwargs):
        check_declared_fields(cls, named_argument(cls.__init__, args, kwargs, "args"))
        return super().__new__(cls)


def named_argument(function, args: tuple, kwargs: dict, name: str):
    """The value a call `function(self, *args, **kwargs)` gives its parameter `name` (None when the call does not
    bind, or `name` is no named parameter: a `*args` catch-all)."""
    try:
        signature = inspect.signature(function)
        parameter = signature.parameters.get(name)
        if parameter is None or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            return kwargs.get(name)
        return signature.bind(None, *args, **kwargs).arguments.get(name)
    except (TypeError, ValueError):
        return None


def check_declared_fields(loop_class, args) -> None:
    """Refuse, by name, each field of `args` that no part of the run reads. loopkit reads the fields of
    `TrainingArguments` (or `LoopArgs`) and `Seq2SeqTrainingArguments` (each runs, is inert, or is refused when it
    is changed: `check_unsupported_fields`); any other field (a TRL config's `packing`, a script's own option) is
    read only by a `Loop` class that declares its config class, `args_class` (`SFTLoop.args_class = SFTConfig`; a
    user's `class MyLoop(Loop): args_class = MyArgs`). Private (`_name`) fields and those `__init__` does not take
    (derived ones) are not options, and are not checked."""
    if args is None or isinstance(args, type) or not dataclasses.is_dataclass(args):
        return
    declared = loop_class.args_class
    if declared is not None and not (isinstance(declared, type) and dataclasses.is_dataclass(declared)):
        raise config_error(f"{loop_class.__name__}.args_class", declared, "it is the config class whose fields "
                           "the loop reads, and this is no dataclass", "set args_class to that class (a "
                           "TrainingArguments subclass), or leave it None")
    read = loopkit_field_names(args) | SEQ2SEQ_FIELDS
    if declared is not None:
        read |= {f.name for f in dataclasses.fields(declared)}
    unread = [f.name for f in dataclasses.fields(args) if f.init and not f.name.startswith("_") and f.name not in read]
    if unread:
        raise unread_fields_error(loop_class, args, unread)


def loopkit_field_names(args) -> set[str]:
    """The fields loopkit itself reads: `LoopArgs`' for a `LoopArgs`, else `TrainingArguments`' (of the installed
    transformers: one it adds is then run, inert or refused when changed, `check_unsupported_fields`)."""
    if isinstance(args, LoopArgs):
        return set(LOOP_ARGS_FIELDS)
    from transformers import TrainingArguments  # transformers.training_args: not a `transformers.trainer*` module

    return {f.name for f in dataclasses.fields(TrainingArguments)} | LOOP_ARGS_FIELDS


def unread_fields_error(loop_class, args, unread: list[str]) -> LoopConfigError:
    """One sentence per class that declares unread fields (a TRL config's, a user's), each with its fix."""
    by_owner: dict[type, list[str]] = {}
    for name in unread:
        by_owner.setdefault(field_owner(type(args), name), []).append(name)
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None
                for f in dataclasses.fields(args)}
    parts = []
    for owner, names in by_owner.items():
        changed = [n for n in names if plain(getattr(args, n)) != plain(defaults[n])]
        shown = ", ".join(f"{n}={plain(getattr(args, n))!r}" for n in (changed or names[:3]))
        rest = len(names) - len(changed or names[:3])
        listing = shown + (f" (and {rest} more field{'s' if rest > 1 else ''} of it"
                           f"{', at their defaults' if changed else ''})" if rest else "")
        parts.append(f"{listing}: {owner_fields_problem(owner, loop_class)}. Fix: "
                     f"{owner_fields_fix(owner, type(args), loop_class)}.")
    return LoopConfigError(" Also: ".join(parts))


def field_owner(args_class: type, name: str) -> type:
    """The class whose fields `name` counts among: the most derived of TRL's configs (`TRL_LOOPS`) that has it,
    else the class that first declared it."""
    with_field = [c for c in args_class.__mro__ if name in getattr(c, "__dataclass_fields__", {})]
    for cls in with_field:
        if is_trl_config(cls) and cls.__name__ in TRL_LOOPS:
            return cls
    return with_field[-1]


def is_trl_config(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "trl"


def owner_fields_problem(owner: type, loop_class: type) -> str:
    reader = f"TRL's {owner.__name__.removesuffix('Config')}Trainer" if is_trl_config(owner) else "your own code"
    return (f"{owner.__name__}'s fields are read by {reader}, and {loop_class.__name__} does not read them (its "
            f"args_class is {getattr(loop_class.args_class, '__name__', None)}); it will not ignore them silently")


def owner_fields_fix(owner: type, args_class: type, loop_class: type) -> str:
    if is_trl_config(owner):
        loop_name = TRL_LOOPS.get(owner.__name__)
        trainer = f"{owner.__name__.removesuffix('Config')}Trainer"
        if trainer in {cls.__name__ for cls in loop_class.__mro__}:  # TRL's trainer on loopkit, undeclared
            return (f"{loop_class.__name__} runs TRL's {trainer}, which reads them: declare its config, "
                    f"`args_class = {owner.__name__}` in class {loop_class.__name__}")
        if loop_name is None:
            return f"loopkit has no loop for TRL's {trainer}: train with trl.{trainer} itself"
        return (f"they are {owner.__name__}'s: use loopkit.trl.{loop_name} ({trainer}( becomes {loop_name}(: "
                f"TRL's preparation, collator and loss on loopkit's loop), or pass transformers.TrainingArguments "
                f"to {loop_class.__name__} for a plain run")
    name = loop_class.__name__
    if loop_class.__module__.split(".")[0] == "loopkit":  # loopkit's own loop: a subclass of it declares them
        declare = (f"`class MyLoop({name}): args_class = {args_class.__name__}`, then MyLoop(...) in place of "
                   f"{name}(...)")
    else:
        declare = f"`args_class = {args_class.__name__}` in class {name}"
    return (f"if your code reads them (your script, or your Loop subclass's methods), declare the class they belong "
            f"to on the loop that runs them: {declare}; otherwise keep them out of the training arguments (a "
            "dataclass of their own, parsed beside TrainingArguments: HfArgumentParser((TrainingArguments, "
            "ScriptArguments)))")


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


def check_args(args, loop_class=None) -> None:
    """Raise `LoopConfigError` for any value loopkit would otherwise ignore or mis-run, naming the field and fix;
    first, with the `Loop` class, any field that neither loopkit nor the class reads (`check_declared_fields`).

    For a `TrainingArguments` (or any args dataclass other than `LoopArgs`), a field outside the supported and inert
    sets that does not keep its default is refused. That check comes last: it builds a `TrainingArguments` from the
    supported values, whose own validation would otherwise preempt the clearer messages below.
    """
    if loop_class is not None:
        check_declared_fields(loop_class, args)
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
    refuse_as_training_arguments(args)  # what TrainingArguments refuses, also for a field changed after it was built
    check_intervals(args)
    check_debug_options(args)
    if args.metric_for_best_model is None and (args.load_best_model_at_end or plain(args.save_strategy) == "best"):
        field_name, value = (("load_best_model_at_end", True) if args.load_best_model_at_end else
                             ("save_strategy", "best"))
        raise trainer_error("`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
                            "`args.load_best_model_at_end` is set to `True`.", field_name, value,
                            "choosing the best checkpoint needs a metric to compare",
                            "set metric_for_best_model, e.g. 'loss' or 'accuracy'")
    check_best_model_schedule(args)
    check_optim(args)
    if dataclasses.is_dataclass(args):
        check_unsupported_fields(args)


def check_intervals(args) -> None:
    """A 'steps' strategy needs a positive interval (TrainingArguments refuses only logging_steps=0, which
    `refuse_as_training_arguments` has refused in its words before this runs)."""
    for name, strategy in (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy"),
                           ("eval_steps", "eval_strategy")):
        value = getattr(args, name)
        if plain(getattr(args, strategy)) == "steps" and (value is None or value <= 0):
            raise config_error(name, value, f"{strategy}='steps' needs a positive interval",
                               f"set {name} > 0 (or a fraction of max_steps below 1)")


def refusal(trainer_message: str | None, field_name: str, value: Any, problem: str, fix: str) -> LoopConfigError:
    """`trainer_error` where TrainingArguments / Trainer refuse the same value (their words first), else
    `config_error`."""
    if trainer_message is None:
        return config_error(field_name, value, problem, fix)
    return trainer_error(trainer_message, field_name, value, problem, fix)


def check_debug_options(args) -> None:
    """The debug option loopkit does not run (an unknown one is refused as TrainingArguments refuses it:
    loopkit/args/refusals.py)."""
    for option in (plain(o) for o in args.debug):
        if option == "tpu_metrics_debug":
            # Checked on the user's machine now: without torch_xla there are no XLA metrics to print at all.
            problem = ("it prints torch_xla's metrics, and torch_xla is not installed"
                       if importlib.util.find_spec("torch_xla") is None else
                       "loopkit does not print torch_xla's metrics (not implemented)")
            raise config_error("debug", option, problem, "use debug='underflow_overflow' or leave debug empty")


def check_inputs(args, *, model, model_init, train_dataset, eval_dataset, compute_metrics, optimizers,
                 optimizer_cls_and_kwargs=None) -> None:
    """What `Trainer.__init__` rejects about the arguments next to `args`, rejected at construction as there."""
    from ..batches import has_length

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
