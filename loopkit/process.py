"""One process, many runs (a notebook, a hyper-parameter search, a test suite): what a `Loop` changes in its process,
and how it is taken back.

Building a `Loop` changes process-wide things, as building a `Trainer` does: environment variables (Accelerate exports
`ACCELERATE_USE_FSDP` / `ACCELERATE_USE_DEEPSPEED` when it is handed a plugin, `full_determinism` sets CUDA's),
transformers' verbosity (`log_level`), torch's deterministic algorithms and TF32 mode, and Accelerate's state (one per
process: it refuses a second `Accelerator` with another mixed precision). The rules:

* A `Loop` whose construction fails (a refusal, a bad argument) leaves all of it as it found it
  (`leaves_process_as_found`, on `Loop.__init__`).
* A `Loop` that was built keeps its settings while it is the latest one (its `train()`, `evaluate()`, `save_model()`
  run under them); the next `Loop` first takes back what the previous one set, where it is still as that one set it
  (a value the user changed since is the user's, and stays).
* Accelerate's state: every `Loop` starts from one built as `TrainingArguments` builds it (`fresh_accelerate_state`):
  `LoopArgs` have it built when the `Loop` is (their equivalent of `TrainingArguments.__init__`, which resets the
  state), a `TrainingArguments` keeps the state it built unless a previous `Loop` has used it since;
  `accelerator_config={"use_configured_state": True}` keeps the state the user configured, as Trainer does.

Threads: nothing of a `Loop` keeps running once a public call returns (checkpoint writers are awaited, the memory
sampler is stopped), which tests/test_one_process.py checks with the rest.
"""

from __future__ import annotations

import contextlib
import functools
import os
from datetime import timedelta

# The key a `Loop` adds to Accelerate's shared `AcceleratorState` once its `Accelerator` exists: the state is a
# previous Loop's until something resets it (a `TrainingArguments` being built, or the next Loop).
LOOP_MARK = "_loopkit_loop_state"

# What the latest `Loop` changed, as {what: (before, after)}: taken back by the next `Loop` where still `after`.
_latest_changes: dict = {}


def _settings() -> dict:
    """The process-wide settings a `Loop` may change besides the environment: (read, write) for each."""
    import torch
    from transformers.utils import logging as hf_logging

    def read_determinism():
        return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)

    def write_determinism(value):
        torch.use_deterministic_algorithms(value[0], warn_only=value[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = value[2], value[3]

    def write_fp32_precision(value):
        torch.backends.fp32_precision = value

    settings = {"transformers verbosity": (hf_logging.get_verbosity, hf_logging.set_verbosity),
                "deterministic algorithms": (read_determinism, write_determinism)}
    if hasattr(torch.backends, "fp32_precision"):  # TF32 mode (`tf32`, torch >= 2.9)
        settings["fp32 precision"] = (lambda: torch.backends.fp32_precision, write_fp32_precision)
    return settings


def _read_all() -> dict:
    values = {("env", name): value for name, value in os.environ.items()}
    values.update({("setting", name): read() for name, (read, _) in _settings().items()})
    return values


def _write(key, value) -> None:
    kind, name = key
    if kind == "env":
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    else:
        _settings()[name][1](value)


def _changes(before: dict, after: dict) -> dict:
    return {key: (before.get(key), after.get(key)) for key in before.keys() | after.keys()
            if before.get(key) != after.get(key)}


def take_back_latest_loop() -> None:
    """Undo what the latest `Loop` set, where it is still as that Loop left it."""
    now = _read_all()
    for key, (before, after) in _latest_changes.items():
        if now.get(key) == after:
            _write(key, before)
    _latest_changes.clear()


def _accelerate_states() -> list[dict]:
    from .private_api import accelerate_shared_states

    return accelerate_shared_states()


def _restore_accelerate_states(saved: list[dict]) -> None:
    for shared, values in zip(_accelerate_states(), saved):
        shared.clear()
        shared.update(values)


@contextlib.contextmanager
def accelerate_state_kept():
    """Accelerate's state as it was, after what runs inside: building a `TrainingArguments` resets it and builds a new
    one (`_setup_devices`), which loopkit does for a reference or for the plugins it builds, never to train with. (It
    also deletes ACCELERATE_USE_DEEPSPEED after setting it for DeepSpeed, even a launcher's: kept too.)"""
    saved, flag = [dict(state) for state in _accelerate_states()], os.environ.get("ACCELERATE_USE_DEEPSPEED")
    try:
        yield
    finally:
        _restore_accelerate_states(saved)
        _write(("env", "ACCELERATE_USE_DEEPSPEED"), flag)


def leaves_process_as_found(init):
    """Wrap `Loop.__init__`: take back the previous Loop's settings first; if the construction fails, restore the
    environment, the settings and Accelerate's state as they were found (the previous Loop's included, so that Loop
    still runs as it was built); if it succeeds, remember what it changed."""

    @functools.wraps(init)
    def build(self, *args, **kwargs):
        found, previous_changes = _read_all(), dict(_latest_changes)
        states = [dict(state) for state in _accelerate_states()]
        take_back_latest_loop()
        before = _read_all()
        try:
            init(self, *args, **kwargs)
        except BaseException:
            for key, (old, _) in _changes(found, _read_all()).items():
                _write(key, old)
            _restore_accelerate_states(states)
            _latest_changes.update(previous_changes)
            raise
        _latest_changes.update(_changes(before, _read_all()))

    return build


# ---------------------------------------------------------------------------------------------------------------
# Accelerate's state
# ---------------------------------------------------------------------------------------------------------------
def fresh_accelerate_state(args, *, args_build_no_state: bool, use_configured_state: bool) -> None:
    """Before the `Loop`'s `Accelerator`: Accelerate's state as `TrainingArguments._setup_devices` builds it, so that
    nothing of a previous run's (its mixed precision, its engine, its process group settings) carries over.
    `args_build_no_state`: the arguments did not build one when they were built (`LoopArgs`; a `TrainingArguments`
    does). `use_configured_state`: the user's state is to be kept (a `TrainingArguments` acts on it itself)."""
    from accelerate.state import PartialState

    from .errors import trainer_error
    from .private_api import accelerate_shared_states, reset_accelerate_state

    partial, accelerator_state, _ = accelerate_shared_states()
    if use_configured_state:
        if partial == {}:
            raise trainer_error(
                "Passing `'use_configured_state':True` to the AcceleratorConfig requires a pre-configured "
                "`AcceleratorState` or `PartialState` to be defined before calling `TrainingArguments`. ",
                "accelerator_config", {"use_configured_state": True}, "no Accelerate state was configured before "
                "the Loop", "create it first (e.g. PartialState(backend='gloo') or Accelerator(...)), or drop "
                "use_configured_state")
        return
    if not args_build_no_state and not accelerator_state.get(LOOP_MARK):
        return  # the state this TrainingArguments built (or the user's own, made since): Trainer keeps it too
    reset_accelerate_state()
    kwargs, deepspeed = partial_state_kwargs(args)
    flag = "ACCELERATE_USE_DEEPSPEED"
    previous = os.environ.get(flag)
    if deepspeed:  # as TrainingArguments: only while the state is built, so that Accelerate detects DeepSpeed
        os.environ[flag] = "true"
    try:
        PartialState(**kwargs)
    finally:
        if deepspeed:
            _write(("env", flag), previous)


def partial_state_kwargs(args) -> tuple[dict, bool]:
    """`PartialState`'s keywords as `TrainingArguments._setup_devices` chooses them (the device, `ddp_backend`,
    `ddp_timeout`), and whether DeepSpeed is asked for."""
    use_cpu = args.use_cpu or os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes", "on")
    timeout = timedelta(seconds=args.ddp_timeout)
    if use_cpu:  # with the timeout, which TrainingArguments drops here: a hung join must end (docs/distributed.md)
        return {"cpu": True, "backend": args.ddp_backend, "timeout": timeout}, False
    if getattr(args, "deepspeed", None):
        return {"timeout": timeout}, True
    return {"backend": args.ddp_backend, "timeout": timeout}, False


def mark_loop_state() -> None:
    """Accelerate's state is now this Loop's (see LOOP_MARK)."""
    from .private_api import accelerate_shared_states

    accelerate_shared_states()[1][LOOP_MARK] = True  # AcceleratorState's
