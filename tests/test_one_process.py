"""One process, many runs (a notebook, a hyper-parameter search, a test suite): nothing of a finished, failed or
refused `Loop` leaks into the next one (issue 34 items 1-2, issue 33 item 4; loopkit/process.py).

Every argument that sets something process-wide (Accelerate's mixed precision and engine, environment variables,
transformers' verbosity, torch's deterministic algorithms and TF32 mode), and every refusal that comes after
Accelerate was touched, is run after every other one, in both orders, with `LoopArgs` and with `TrainingArguments`.
What a `Loop` shows (its refusal, its Accelerate state, the process settings under it, its losses, the threads left
after `train()`) must be what it shows after a plain default run; a refused one leaves the process as it found it.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from helpers import free_port, hf_args, regression_data, tiny_regression
from transformers import Trainer, TrainingArguments
from transformers.utils import is_torch_tf32_available
from transformers.utils import logging as hf_logging

from loopkit import Loop, LoopArgs, LoopConfigError

# Each sets something process-wide, or is refused after Accelerate was touched (fp16 and tf32 on a machine without a
# CUDA GPU, fsdp without a launcher); "default" sets nothing.
CONFIGS = {
    "default": {},
    "bf16": {"bf16": True},
    "fp16": {"fp16": True},
    "fsdp": {"fsdp": "full_shard"},
    "full_determinism": {"full_determinism": True},
    "log_level": {"log_level": "info"},
    "tf32": {"tf32": True},
}
REFUSED_HERE = {"fsdp"} | ({"fp16"} if not torch.cuda.is_available() else set()) | (
    {"tf32"} if not is_torch_tf32_available() else set())


def build(kind: str, name: str, output_dir: str):
    # use_cpu: TrainingArguments refuses bf16 on a machine without a GPU unless it is set
    fields = dict(output_dir=output_dir, max_steps=2, save_strategy="no", report_to="none", disable_tqdm=True,
                  logging_steps=1, use_cpu=not torch.cuda.is_available(), **CONFIGS[name])
    if kind == "LoopArgs":
        return LoopArgs(**fields)
    return TrainingArguments(**fields)


# Written by `TrainingArguments` when it is built (as under Trainer): the user's arguments', not the Loop's.
WRITTEN_BY_TRAINING_ARGUMENTS = ("FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_DYNAMO_BACKEND",
                                 "ACCELERATE_DYNAMO_MODE")


def process_view(kind: str = "LoopArgs") -> dict:
    """What of the process a run leaves behind: the variables Accelerate and loopkit write, transformers'
    verbosity, torch's deterministic mode and TF32 mode."""
    prefixes = ("ACCELERATE_", "FSDP_", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG")
    ignored = WRITTEN_BY_TRAINING_ARGUMENTS if kind == "TrainingArguments" else ()
    return {"env": {k: v for k, v in os.environ.items() if k.startswith(prefixes) and k not in ignored},
            "verbosity": hf_logging.get_verbosity(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "fp32_precision": getattr(torch.backends, "fp32_precision", None)}


def run(kind: str, name: str) -> dict:
    """Build (and, if built, train) a Loop; what it showed."""
    threads = set(threading.enumerate())
    with tempfile.TemporaryDirectory() as out:
        try:  # LoopArgs refuses what TrainingArguments refuses when built (tf32 without a GPU)
            loop = Loop(model=tiny_regression(), args=build(kind, name, out), train_dataset=regression_data(16))
        except (LoopConfigError, RuntimeError, ValueError) as error:
            return {"refused": f"{type(error).__name__}: {error}", "process": process_view(kind)}
        shown = {"refused": None, "mixed_precision": loop.accelerator.mixed_precision,
                 "distributed_type": str(loop.accelerator.distributed_type), "process": process_view(kind),
                 "device": str(loop.accelerator.device)}
        loop.train()
        shown["losses"] = [entry["loss"] for entry in loop.state.log_history if "loss" in entry]
    left = [t.name for t in threading.enumerate() if t not in threads and t.is_alive()]
    shown["threads left"] = left
    return shown


@pytest.fixture(autouse=True)
def fresh_process_state():
    """Each test starts, and leaves, as a fresh process would (Accelerate's state, the verbosity conftest sets)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    hf_logging.set_verbosity_error()
    torch.use_deterministic_algorithms(False)
    for name in ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG"):
        os.environ.pop(name, None)


def refused_by_training_arguments(name: str) -> bool:
    """tf32=True: TrainingArguments itself refuses it where there is no CUDA GPU (no Loop is built)."""
    try:
        build("TrainingArguments", name, "unused")
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("kind", ["LoopArgs", "TrainingArguments"])
def test_every_run_after_every_other_shows_what_it_shows_after_a_default_run(kind):
    configs = [name for name in CONFIGS if kind == "LoopArgs" or not refused_by_training_arguments(name)]
    alone = {}
    for name in configs:
        run(kind, "default")
        alone[name] = run(kind, name)
    for name in REFUSED_HERE & set(configs):
        assert alone[name]["refused"], f"{name} was expected to be refused on this machine: {alone[name]}"
    for name in set(configs) - REFUSED_HERE:
        assert alone[name]["refused"] is None, alone[name]
        assert alone[name]["threads left"] == [], alone[name]
    assert alone["bf16"]["mixed_precision"] == "bf16" and alone["default"]["mixed_precision"] == "no"
    assert alone["log_level"]["process"]["verbosity"] == hf_logging.INFO
    assert alone["full_determinism"]["process"]["deterministic"]
    mismatches = []
    for first in configs:
        for second in configs:
            if first == second or first == "default":
                continue
            run(kind, first)
            found = process_view(kind)
            after = run(kind, second)
            # A refused Loop leaves the process as it found it (the previous Loop's settings included)
            expected = {**alone[second], "process": found} if alone[second]["refused"] else alone[second]
            if after != expected:
                mismatches.append(f"{second} after {first}: {after}\n    expected: {expected}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.parametrize("name", sorted(REFUSED_HERE))
def test_after_a_refused_loop_trainer_and_a_users_accelerator_run_as_in_a_fresh_process(tmp_path, name):
    """A refused Loop changes nothing: Trainer then trains (with bf16, which a leftover state would refuse), and a
    user's own `Accelerator(mixed_precision="bf16")` is built."""
    before = process_view()
    state_before = dict(AcceleratorState._shared_state), dict(PartialState._shared_state)
    assert run("LoopArgs", name)["refused"]
    assert process_view() == before
    assert (dict(AcceleratorState._shared_state), dict(PartialState._shared_state)) == state_before
    trainer = Trainer(model=tiny_regression(), train_dataset=regression_data(16),
                      args=hf_args(tmp_path, max_steps=2, bf16=True, save_strategy="no",
                                   use_cpu=not torch.cuda.is_available()))
    assert trainer.train().global_step == 2
    AcceleratorState._reset_state(reset_partial_state=True)
    assert run("LoopArgs", name)["refused"]
    assert Accelerator(mixed_precision="bf16").mixed_precision == "bf16"


def test_a_loop_built_again_with_the_same_training_arguments_gets_a_fresh_state(tmp_path):
    """`TrainingArguments` built once, then two Loops with it and one with other arguments built before them (a
    notebook's cells): each Loop runs as alone. (Trainer refuses the third: the state is the first Trainer's.)"""
    cpu = not torch.cuda.is_available()
    first = hf_args(tmp_path, max_steps=1, bf16=True, save_strategy="no", use_cpu=cpu)
    other = hf_args(tmp_path, max_steps=1, save_strategy="no", use_cpu=cpu)
    precisions = []
    for args in (first, first, other):
        loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(8))
        loop.train()
        precisions.append(loop.accelerator.mixed_precision)
    assert precisions == ["bf16", "bf16", "no"]


# ---------------------------------------------------------------------------------------------------------------
# use_configured_state: the state the user configured is kept, as Trainer keeps it (issue 33 item 4)
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def users_gloo_state(monkeypatch):
    """The user's own Accelerate state: one process of a gloo process group (a launcher's variables, as torchrun
    exports them), created before the training arguments. The process group is destroyed afterwards."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    yield lambda: PartialState(cpu=True, backend="gloo")
    AcceleratorState._reset_state(reset_partial_state=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def configured_state() -> tuple:
    state = PartialState()
    return state.backend, str(state.distributed_type), state.num_processes, torch.distributed.is_initialized()


@pytest.mark.parametrize("kind", ["TrainingArguments", "LoopArgs"])
def test_use_configured_state_keeps_the_users_state_as_trainer_does(tmp_path, users_gloo_state, kind):
    shown = {}
    for runner in (Trainer, Loop):
        AcceleratorState._reset_state(reset_partial_state=True)
        users_gloo_state()
        before = configured_state()
        assert before[:2] == ("gloo", "DistributedType.MULTI_CPU")
        fields = dict(max_steps=1, save_strategy="no", accelerator_config={"use_configured_state": True})
        args = hf_args(tmp_path, **fields) if kind == "TrainingArguments" or runner is Trainer else LoopArgs(
            output_dir=str(tmp_path), report_to="none", disable_tqdm=True, **fields)
        built = runner(model=tiny_regression(), args=args, train_dataset=regression_data(8))
        built.train()
        shown[runner.__name__] = (before, configured_state(), built.accelerator.state.backend)
    assert shown["Loop"] == shown["Trainer"]
    assert shown["Loop"][1] == shown["Loop"][0]  # kept


def test_use_configured_state_without_a_configured_state_is_refused_with_trainers_words(tmp_path):
    with pytest.raises(ValueError) as theirs:
        hf_args(tmp_path, accelerator_config={"use_configured_state": True})
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(LoopConfigError) as ours:
        Loop(model=tiny_regression(), train_dataset=regression_data(8),
             args=LoopArgs(output_dir=str(tmp_path), accelerator_config={"use_configured_state": True}))
    assert str(theirs.value) in str(ours.value) and "Fix:" in str(ours.value)
    assert re.search(r"accelerator_config=\{'use_configured_state': True\}", str(ours.value))


def test_a_refused_loop_leaves_the_previous_loops_settings_in_place(tmp_path):
    """Loop A is built with log_level="info" and full_determinism; Loop B is refused: A still runs under its own
    settings and Accelerate state, and the next Loop built takes A's back."""
    user_verbosity = hf_logging.get_verbosity()
    first = Loop(model=tiny_regression(), train_dataset=regression_data(16),
                 args=LoopArgs(output_dir=str(tmp_path / "a"), max_steps=2, save_strategy="no", report_to="none",
                               disable_tqdm=True, log_level="info", full_determinism=True, bf16=True,
                               use_cpu=not torch.cuda.is_available()))
    settings = process_view()
    assert run("LoopArgs", "fsdp")["refused"]
    assert process_view() == settings and settings["verbosity"] == hf_logging.INFO and settings["deterministic"]
    assert first.train().global_step == 2 and first.accelerator.mixed_precision == "bf16"
    assert run("LoopArgs", "default")["refused"] is None
    assert hf_logging.get_verbosity() == user_verbosity and not torch.are_deterministic_algorithms_enabled()
