"""Bad input fails early and clearly, and `args` hides nothing.

Each case checks that loopkit refuses at construction (or at the first training step, when only the model's output
can tell) with a `LoopConfigError`/`ValueError` whose message names the field, the value and the fix. Then: `LoopArgs`
has `TrainingArguments`' defaults and derived values, and every `TrainingArguments` field is supported, inert or
refused when changed, so nothing is ignored silently.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re

import pytest
import torch
from helpers import regression_data, tiny_regression
from torch import nn
from torch.utils.data import IterableDataset
from transformers import TrainingArguments

from loopkit import Loop, LoopArgs, LoopConfigError
from loopkit.args import ACCELERATE_ENGINE_FIELDS, INERT_FIELDS, SUPPORTED_FIELDS, check_args
from loopkit.stages.setup import resolve_accelerator_config




def loop_args(tmp_path, **kwargs) -> LoopArgs:
    kwargs.setdefault("disable_tqdm", True)
    return LoopArgs(output_dir=str(tmp_path), **kwargs)


def hf_args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, **kwargs)


def assert_names(error, *parts):
    """The message names each part (field, value, ...) and says how to fix it."""
    message = str(error.value)
    for part in parts:
        assert part in message, f"{part!r} missing from: {message}"
    assert "Fix:" in message, f"no fix in: {message}"


# ---------------------------------------------------------------------------------------------------------------
# One test per bad input
# ---------------------------------------------------------------------------------------------------------------
def test_gradient_accumulation_steps_zero_in_training_arguments(tmp_path):
    args = hf_args(tmp_path, gradient_accumulation_steps=0)  # TrainingArguments itself accepts it
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=args, train_dataset=regression_data(8))
    assert_names(error, "gradient_accumulation_steps=0", "1 or more")


def test_gradient_accumulation_steps_zero_in_loop_args(tmp_path):
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=loop_args(tmp_path, gradient_accumulation_steps=0),
             train_dataset=regression_data(8))
    assert_names(error, "gradient_accumulation_steps=0", "1 or more")


class Stream(IterableDataset):
    """A dataset with no `__len__`: the number of steps cannot come from `num_train_epochs`."""

    def __iter__(self):
        return iter(regression_data(8))


def test_dataset_without_len_needs_max_steps(tmp_path):
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=loop_args(tmp_path), train_dataset=Stream())
    assert_names(error, "max_steps=-1", "__len__", "Stream")
    # The fix works: with max_steps the stream trains.
    loop = Loop(model=tiny_regression(), args=loop_args(tmp_path, max_steps=2, per_device_train_batch_size=4,
                                                        save_strategy="no"), train_dataset=Stream())
    loop.train()
    assert loop.state.global_step == 2


class NoLoss(nn.Module):
    """Returns logits only, whatever the batch holds."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x, labels=None):
        return {"logits": self.linear(x).squeeze(-1)}


class BareTensor(NoLoss):
    def forward(self, x, labels=None):
        return self.linear(x).squeeze(-1)


@pytest.mark.parametrize("model_class", [NoLoss, BareTensor])
def test_model_without_loss_fails_at_first_step_naming_the_fix(tmp_path, model_class):
    failures = []

    class Watch:
        def on_train_failed(self, args, state, control, exception=None, **kwargs):
            failures.append((state.global_step, exception))

    loop = Loop(model=model_class(), args=loop_args(tmp_path, max_steps=2, save_strategy="no"),
                train_dataset=regression_data(8), callbacks=[Watch()])
    with pytest.raises(ValueError) as error:
        loop.train()
    assert_names(error, "loss", "compute_loss_func", "compute_loss")
    assert [step for step, _ in failures] == [0], "the error must come at the first step, before any update"
    assert failures[0][1] is error.value

    # The fix it names works: a compute_loss_func supplies the loss.
    def mse(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs
        return nn.functional.mse_loss(logits, labels)

    loop = Loop(model=model_class(), args=loop_args(tmp_path, max_steps=2, save_strategy="no"),
                train_dataset=regression_data(8), compute_loss_func=mse)
    assert loop.train().global_step == 2


def test_load_best_model_with_mismatched_strategies_in_loop_args(tmp_path):
    with pytest.raises(LoopConfigError) as error:
        loop_args(tmp_path, load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps")
    assert_names(error, "load_best_model_at_end=True", "eval_strategy='epoch'", "save_strategy='steps'",
                 "save_strategy='epoch'")
    # TrainingArguments refuses the same thing itself, in its own words.
    with pytest.raises(ValueError):
        hf_args(tmp_path, load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps")


def test_load_best_model_mismatch_made_after_construction(tmp_path):
    """A field changed after `LoopArgs` was built is checked again by `Loop`."""
    args = loop_args(tmp_path, load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch")
    args.save_strategy = "steps"
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=args, train_dataset=regression_data(8), eval_dataset=regression_data(4))
    assert_names(error, "load_best_model_at_end=True", "save_strategy='steps'")


def test_load_best_model_save_steps_not_a_multiple_of_eval_steps(tmp_path):
    with pytest.raises(LoopConfigError) as error:
        loop_args(tmp_path, load_best_model_at_end=True, eval_strategy="steps", eval_steps=4, save_steps=6)
    assert_names(error, "save_steps=6", "eval_steps=4", "multiple")


@pytest.mark.parametrize("field, value, hint, needs", [
    ("optim", "adamw_anyprecision", "torchdistx", {}),
    ("debug", "tpu_metrics_debug", "torch_xla is not installed", {}),
])
def test_unsupported_training_arguments_value(tmp_path, field, value, hint, needs):
    args = hf_args(tmp_path, **{field: value}, **needs)
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=args, train_dataset=regression_data(8))
    assert_names(error, f"{field}={value!r}", hint)


def test_bf16_and_fp16_together(tmp_path):
    # use_cpu: without a bf16 device TrainingArguments (and LoopArgs) refuse bf16 itself first
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=loop_args(tmp_path, bf16=True, fp16=True, use_cpu=True),
             train_dataset=regression_data(8))
    assert_names(error, "fp16=True", "bf16", "only one")


def test_eval_strategy_without_eval_dataset(tmp_path):
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=loop_args(tmp_path, eval_strategy="epoch"), train_dataset=regression_data(8))
    assert_names(error, "eval_strategy='epoch'", "eval_dataset=")


def test_batch_eval_metrics_needs_compute_result(tmp_path):
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=loop_args(tmp_path, batch_eval_metrics=True),
             train_dataset=regression_data(8), compute_metrics=lambda prediction: {})
    assert_names(error, "batch_eval_metrics=True", "compute_result")


def test_model_and_model_init_together(tmp_path):
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), model_init=tiny_regression, args=loop_args(tmp_path),
             train_dataset=regression_data(8))
    assert_names(error, "model_init=", "either model=")


@pytest.mark.parametrize("field, value", [("warmup_steps", -1), ("dataloader_prefetch_factor", 2),
                                          ("per_device_train_batch_size", 0)])
def test_out_of_range_values(tmp_path, field, value):
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=loop_args(tmp_path, **{field: value}), train_dataset=regression_data(8))
    assert_names(error, f"{field}={value!r}")


# ---------------------------------------------------------------------------------------------------------------
# LoopArgs mirrors TrainingArguments
# ---------------------------------------------------------------------------------------------------------------
def comparable(value, name=None):
    if name == "accelerator_config":  # LoopArgs keeps the value as given; the setup stage resolves it as HF does
        return resolve_accelerator_config(value)
    return getattr(value, "value", value)  # str-enums (IntervalStrategy.STEPS) compare as their string


@pytest.mark.parametrize("verbosity", [logging.WARNING, logging.ERROR])
def test_loop_args_defaults_equal_training_arguments_defaults(tmp_path, verbosity):
    """Every LoopArgs field, after both `__post_init__`s. `disable_tqdm`'s default follows transformers' log level,
    so both levels are compared."""
    logger = logging.getLogger("transformers")
    before = logger.level
    logger.setLevel(verbosity)
    try:
        ours, theirs = LoopArgs(output_dir=str(tmp_path)), TrainingArguments(output_dir=str(tmp_path))
    finally:
        logger.setLevel(before)
    for f in dataclasses.fields(LoopArgs):
        assert comparable(getattr(ours, f.name), f.name) == comparable(getattr(theirs, f.name), f.name), f.name
    assert ours.disable_tqdm == (verbosity > logging.WARNING)
    assert LoopArgs().output_dir == TrainingArguments().output_dir


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize("kwargs", [
    dict(eval_strategy="steps", logging_steps=7),
    dict(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch"),
    dict(metric_for_best_model="accuracy"),
    dict(metric_for_best_model="eval_loss", greater_is_better=True),
    dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch"),
    dict(torch_compile_mode="reduce-overhead"),
    dict(report_to="tensorboard"),
    dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}),
    dict(activation_checkpointing=True),
    dict(use_cpu=True),
    dict(save_steps=10.0, logging_steps=5.0, eval_strategy="steps", eval_steps=5.0),
    dict(lr_scheduler_kwargs='{"num_cycles": 2}'),
])
def test_loop_args_derives_what_training_arguments_derives(tmp_path, kwargs):
    ours, theirs = LoopArgs(output_dir=str(tmp_path), **kwargs), TrainingArguments(output_dir=str(tmp_path), **kwargs)
    for f in dataclasses.fields(LoopArgs):
        mine, hf = comparable(getattr(ours, f.name), f.name), comparable(getattr(theirs, f.name), f.name)
        assert mine == hf and type(mine) is type(hf), f"{f.name}: LoopArgs {mine!r} vs TrainingArguments {hf!r}"


def test_loop_args_serializes_like_training_arguments(tmp_path):
    args = LoopArgs(output_dir=str(tmp_path), learning_rate=1e-3, report_to="tensorboard")
    as_dict = args.to_dict()
    assert list(as_dict) == [f.name for f in dataclasses.fields(LoopArgs)]
    assert as_dict["learning_rate"] == 1e-3 and as_dict["report_to"] == ["tensorboard"]
    assert json.loads(args.to_json_string()) == json.loads(json.dumps(as_dict))
    assert set(args.to_sanitized_dict()) == set(as_dict)


# ---------------------------------------------------------------------------------------------------------------
# Nothing is ignored silently
# ---------------------------------------------------------------------------------------------------------------
# A plausible non-default value for every TrainingArguments field that loopkit neither supports nor deems inert.
# A transformers upgrade that adds a field fails `test_every_field_is_supported_inert_or_refused` until the new
# field is classified here or in a table of loopkit/args/fields.py (meanwhile it is refused when changed).
# (None is left today: use_liger_kernel, liger_kernel_config and parallelism_config, the last ones, are supported.)
NON_DEFAULT: dict = {}


def test_every_field_is_supported_inert_or_refused(tmp_path):
    names = {f.name for f in dataclasses.fields(TrainingArguments) if not f.name.startswith("_")}
    assert SUPPORTED_FIELDS <= names, f"LoopArgs fields TrainingArguments lacks: {SUPPORTED_FIELDS - names}"
    assert INERT_FIELDS <= names, f"inert fields TrainingArguments lacks: {INERT_FIELDS - names}"
    assert not SUPPORTED_FIELDS & INERT_FIELDS
    # FSDP / DeepSpeed fields are handed to Accelerate (tests/test_distributed.py checks that they take effect).
    assert ACCELERATE_ENGINE_FIELDS <= names
    unclassified = names - SUPPORTED_FIELDS - INERT_FIELDS - ACCELERATE_ENGINE_FIELDS
    assert unclassified == set(NON_DEFAULT), (
        f"fields with no non-default test value: {unclassified - set(NON_DEFAULT)}; "
        f"test values for fields that are no longer refused: {set(NON_DEFAULT) - unclassified}")
    check_args(hf_args(tmp_path))  # the defaults themselves pass
    for name, value in NON_DEFAULT.items():
        args = hf_args(tmp_path)
        setattr(args, name, value)  # after __post_init__, which would otherwise try to act on it (Hub, FSDP, ...)
        with pytest.raises(LoopConfigError, match=rf"^{name}=.*Fix:") as error:
            check_args(args)
        assert "loopkit does not support this TrainingArguments field" in str(error.value)


@pytest.mark.parametrize("field, value", [("do_train", True), ("trackio_space_id", "me/space"), ("log_level", "error"),
                                          ("ddp_timeout", 7200)])
def test_inert_fields_are_accepted(tmp_path, field, value):
    check_args(hf_args(tmp_path, **{field: value}))


def test_derived_values_of_supported_fields_are_not_refused(tmp_path):
    """`__post_init__` derives some fields from supported ones; comparing against a default built from the same
    supported values keeps those from counting as user changes."""
    args = hf_args(tmp_path, dataloader_num_workers=2, dataloader_prefetch_factor=2, use_cpu=True,
                   eval_strategy="steps", eval_steps=3, torch_compile_mode="default")
    check_args(args)


def test_supported_training_arguments_values_train(tmp_path):
    """A TrainingArguments with many supported fields changed trains under Loop (the checks refuse no supported
    value)."""
    args = hf_args(tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=2,
                   gradient_accumulation_steps=2, learning_rate=1e-2,
                   weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-7, optim="adamw_torch",
                   max_grad_norm=0.5, max_steps=3, lr_scheduler_type="cosine", warmup_steps=0.5,
                   logging_strategy="steps", logging_steps=1, logging_first_step=True, logging_nan_inf_filter=False,
                   eval_strategy="steps", eval_steps=2, eval_delay=1, eval_accumulation_steps=1,
                   save_strategy="steps", save_steps=2, save_total_limit=1, save_only_model=True,
                   load_best_model_at_end=True, metric_for_best_model="loss", seed=7, data_seed=3, use_cpu=True,
                   dataloader_drop_last=True, remove_unused_columns=False, label_names=["labels"],
                   run_name="errors-test", train_sampling_strategy="sequential")
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(20),
                eval_dataset=regression_data(6, seed=1))
    assert loop.train().global_step == 3
    assert loop.state.best_model_checkpoint is not None
    assert any("eval_loss" in entry for entry in loop.state.log_history)
    assert torch.isfinite(torch.tensor([e["loss"] for e in loop.state.log_history if "loss" in e])).all()


# ---------------------------------------------------------------------------------------------------------------
# Honest refusals: what loopkit does not implement, or what the user's machine lacks, checked there and then
# ---------------------------------------------------------------------------------------------------------------
class Available:
    """`importlib.util.find_spec` and `torch.cuda.is_available` as on a machine that has `packages` and, with
    `cuda`, a CUDA GPU (the refusals check both on the user's machine, when they are made)."""

    def __init__(self, monkeypatch, packages=(), cuda=False):
        import importlib.machinery
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: importlib.machinery.ModuleSpec(
            name, None) if name in packages else real(name, *a, **k))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


def refusal(args) -> str | None:
    try:
        check_args(args)
    except LoopConfigError as error:
        return str(error)
    return None


def test_tpu_metrics_debug_refusal_follows_the_users_machine(tmp_path, monkeypatch):
    args = loop_args(tmp_path, debug="tpu_metrics_debug")
    Available(monkeypatch, packages=())
    without = refusal(args)
    assert "torch_xla is not installed" in without and "not implemented" not in without
    Available(monkeypatch, packages=("torch_xla",))
    with_xla = refusal(args)
    assert "loopkit does not print torch_xla's metrics (not implemented)" in with_xla
    assert "not installed" not in with_xla


@pytest.mark.parametrize("optim, needs", [("adalomo", "cuda"), ("galore_adamw_8bit", "cuda"),
                                          ("adamw_torch_xla", "torch_xla"), ("adamw_torch_npu_fused", "torch_npu"),
                                          ("adamw_anyprecision", "torchdistx")])
def test_optim_refusals_follow_the_users_machine(tmp_path, monkeypatch, optim, needs):
    """Refused while the machine lacks the device or package, with that reason; accepted once it has it."""
    extra = {"optim_target_modules": ["linear"]} if optim.startswith("galore") else {}
    args = loop_args(tmp_path, optim=optim, **extra)
    Available(monkeypatch, packages=("galore_torch", "lomo_optim"), cuda=False)
    lacking = refusal(args)
    assert lacking is not None and f"optim={optim!r}" in lacking and "this machine" not in lacking
    assert ("torch sees none (torch.cuda.is_available() is False)" if needs == "cuda"
            else f"{needs} is not installed") in lacking
    Available(monkeypatch, packages=("galore_torch", "lomo_optim", needs), cuda=needs == "cuda")
    assert refusal(args) is None



# ---------------------------------------------------------------------------------------------------------------
# LoopArgs has every TrainingArguments field of the installed transformers (issue 34 item 4)
# ---------------------------------------------------------------------------------------------------------------
# (The fields and declared defaults themselves: tests/test_args_derived.py, which reads them from the source.)
@pytest.mark.parametrize("fsdp, fsdp_config", [
    ("full_shard", None),
    (True, {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "state_dict_type": "SHARDED_STATE_DICT"}),
    ("shard_grad_op offload", '{"fsdp_reshard_after_forward": false, "cpu_ram_efficient_loading": true}'),
])
def test_loop_args_build_the_fsdp_plugin_that_training_arguments_build(tmp_path, fsdp, fsdp_config):
    """`fsdp` / `fsdp_config` in LoopArgs become the same plugin keywords as in TrainingArguments, without changing
    the LoopArgs' own dict or Accelerate's state."""
    from accelerate.state import PartialState

    given = dict(fsdp_config) if isinstance(fsdp_config, dict) else fsdp_config
    ours = LoopArgs(output_dir=str(tmp_path), fsdp=fsdp, fsdp_config=fsdp_config)
    state_before = dict(PartialState._shared_state)
    plugin_args = ours.fsdp_plugin_args
    assert dict(PartialState._shared_state) == state_before
    theirs = TrainingArguments(output_dir=str(tmp_path), fsdp=fsdp, fsdp_config=copy.deepcopy(fsdp_config))
    assert plugin_args == theirs.fsdp_plugin_args and plugin_args is not None
    assert ours.fsdp_config == (json.loads(given) if isinstance(given, str) else given)  # not changed in place
    assert LoopArgs(output_dir=str(tmp_path)).fsdp_plugin_args is None


def test_unknown_loop_args_field_names_no_trainer_to_switch_to(tmp_path):
    """Every TrainingArguments field is a LoopArgs field, so the error for an unknown one no longer sends the user
    to Trainer for it."""
    with pytest.raises(TypeError) as error:
        LoopArgs(output_dir=str(tmp_path), zzz_not_a_field=1)
    assert "Trainer" not in str(error.value).replace("TrainingArguments", "") and "Fix:" in str(error.value)
    with pytest.raises(TypeError) as error:
        LoopArgs(output_dir=str(tmp_path), predict_with_generate=True)
    assert "Seq2SeqTrainingArguments" in str(error.value) and "Seq2SeqLoop" in str(error.value)
