"""The checkpoint FORMAT: how one checkpoint is written and read, as a handful of methods (docs/checkpoints.md,
"Writing another storage"). Everything else about checkpoints (which run wrote a folder, rotation, the atomic commit
of a temporary folder, asynchronous writing, `on_save_error`, the best kept) is the POLICY, written once
(policy.py, which holds the format, and its parts: writing.py, lineage.py, rotation.py, reading.py) on top of
these methods; it calls nothing else of a format.

A format writes the whole checkpoint, the run's state included, from one `Checkpoint`, and reads it back. A folder
`checkpoint-<step>/` is the unit the policy names, renames and deletes; what is inside is the format's: HF Trainer's
files (loopkit/storage/hf.py), a DCP folder beside HF's state files (loopkit/storage/dcp.py), or one single file.

Every reader of checkpoints (resume, the run lineage and rotation, `python -m loopkit report`, the interruption
report) goes through a format. Where no storage is at hand (the command line, a folder given by path), `format_of`
finds the format that recognises the folder: the formats registered with `register_format` first, then the
built-in ones (DCP, then HF's layout).
"""

from __future__ import annotations

import abc
import importlib
import json
from dataclasses import dataclass, field

from ..distributed import unwrap_model


@dataclass
class Checkpoint:
    """Everything one checkpoint holds, taken at an optimizer-step boundary, as this process writes it.

    `trainer_state` and `loopkit_state` are JSON texts (`trainer_state.json`, and loopkit's stage states with the
    run record: the main process's). `model_state` and `optimizer_state` come from the format's own
    `states_to_save()` (host copies for an asynchronous save; None: the format reads the live objects itself).
    `scheduler` and `scaler` are state dicts (None with `save_only_model`, or on a process that does not write
    them); `rng` is this process's RNG state, `stage_tensors` and `own_stage_states` this process's tensors held by
    stage states and the entries that held them (JSON text). `writes_files`: this process writes the shared files
    (HF's `should_save`); `process_group`: the group the write's collectives must use (None: the default group;
    an asynchronous save with several processes gets a group of its own, apart from training's)."""

    step: int
    trainer_state: str
    loopkit_state: str
    model_state: dict | None = None
    optimizer_state: dict | None = None
    scheduler: dict | None = None
    scaler: dict | None = None
    rng: dict | None = None
    stage_tensors: dict = field(default_factory=dict)
    own_stage_states: str | None = None
    writes_files: bool = True
    process_index: int = 0
    num_processes: int = 1
    process_group: object = None
    # The per-process files this process writes, as (process_index, rng, stage_tensors, own_stage_states): None for
    # its own only; with node-local disks (`save_on_each_node` across nodes) each node's writing process writes
    # every process's, gathered at the save, and the others none (`process_files`).
    process_parts: list | None = None

    def process_files(self) -> list:
        if self.process_parts is not None:
            return self.process_parts
        return [(self.process_index, self.rng, self.stage_tensors, self.own_stage_states)]


@dataclass
class ProcessState:
    """What a checkpoint holds for one process, read back: the RNG state given as `Checkpoint.rng` (None if it has
    none), and the `stage_tensors` and `own_stage_states` (decoded JSON) given when it was written."""

    rng: dict | None
    stage_tensors: dict = field(default_factory=dict)
    own_stage_states: dict = field(default_factory=dict)


class CheckpointFormat(abc.ABC):
    """How one checkpoint is written and read (module docstring). `recognises`, `read_states` and
    `checkpoint_problem` work on any folder, without a run (the command line uses them); the others run inside a
    run, where `self.run` (model, optimizer, scheduler, args) and `self.context.accelerator` are set."""

    # -- any folder, without a run --
    @abc.abstractmethod
    def recognises(self, path: str) -> bool:
        """Whether `path` looks like a checkpoint of this format (a quick look; `checkpoint_problem` checks it)."""

    @abc.abstractmethod
    def read_states(self, path: str) -> tuple[dict, dict]:
        """The checkpoint's trainer state (`trainer_state.json`'s dict) and loopkit state (the dict given as
        `Checkpoint.loopkit_state`; {} for a checkpoint without one, e.g. HF Trainer's). Raises `RuntimeError`
        naming the file when one is damaged."""

    @abc.abstractmethod
    def checkpoint_problem(self, path: str) -> str | None:
        """Why `path` cannot be resumed from (a damaged or missing file, named), or None."""

    # -- inside a run --
    @abc.abstractmethod
    def write_checkpoint(self, checkpoint: Checkpoint, folder: str) -> None:
        """Every process: write `checkpoint` into the empty temporary `folder`. The policy then renames the folder
        into place once every process has returned (nothing half-written is ever named like a checkpoint)."""

    @abc.abstractmethod
    def read_process_state(self, path: str) -> ProcessState:
        """Every process, resuming: this process's RNG and stage tensors, as given in `Checkpoint`."""

    @abc.abstractmethod
    def load_model_before_prepare(self, model, path: str) -> None:
        """Resuming: the weights a model needs before `accelerator.prepare` (nothing, if loaded after)."""

    @abc.abstractmethod
    def load_optimizer_and_scheduler(self, path: str) -> None:
        """Resuming, after `accelerator.prepare`, on every process: what loads into prepared objects (sharded
        weights, the optimizer, the scheduler, the scaler)."""

    @abc.abstractmethod
    def load_best_model(self, path: str) -> None:
        """`load_best_model_at_end`: the weights of checkpoint `path` into the run's model (every process)."""

    def check_launch(self) -> None:
        """Optional: at each `train()`'s start, raise a `config_error` (loopkit.errors) for a launch this format
        cannot serve (e.g. `DCPStorage` under DeepSpeed). Default: every launch."""

    def before_async_saves(self) -> None:
        """Optional: at each `train()`'s start with `async_save`, on the training thread: what the writer thread's
        first write would otherwise do while training runs beside it and that holds the GIL all along (an import),
        so that the steps after that save do not wait for it. Default: nothing."""

    def read_loopkit_state(self, path: str) -> dict:
        """The loopkit state alone (what the run lineage reads of every folder, so that a damaged trainer state
        leaves the folder's place in the save order known). Default: from `read_states`."""
        return self.read_states(path)[1]

    def states_to_save(self) -> tuple[dict | None, dict | None]:
        """At the step boundary, on the training thread: the model's and the optimizer's states a save writes, as
        `Checkpoint.model_state` / `optimizer_state` (the policy stages host copies of them for an asynchronous
        save). Default: the unwrapped model's `state_dict()` and the optimizer's (none with `save_only_model`, or
        on a process that does not write)."""
        run, acc = self.run, self.context.accelerator
        model = unwrap_model(acc, run.model_wrapped, keep_torch_compile=False).state_dict()
        with_optimizer = not run.args.save_only_model and self.writes_files and run.optimizer is not None
        return model, run.optimizer.state_dict() if with_optimizer else None


def writes_files(args, accelerator) -> bool:
    """HF's `args.should_save`: the main process, or with `save_on_each_node` the first process of each node (for
    nodes without a shared disk)."""
    return accelerator.is_local_main_process if args.save_on_each_node else accelerator.is_main_process


def node_local_disks(args, accelerator) -> bool:
    """`save_on_each_node` with several processes: each node writes a whole checkpoint of its own (each process's
    RNG and stage tensors included), which it resumes from alone."""
    return bool(args.save_on_each_node) and accelerator.num_processes > 1


# -------------------------------------------------------------------------------------------------------------
# Finding the format of a folder
# -------------------------------------------------------------------------------------------------------------
BUILT_IN_FORMATS = ("loopkit.storage.dcp:DCPStorage", "loopkit.storage.hf:HFStorage")  # tried in this order
registered_formats: list = []  # formats registered by the user (register_format), tried first


def format_class(name: str) -> type:
    """A format named "package.module:Class" (as the command line takes it)."""
    module, _, attribute = name.partition(":")
    if not attribute:
        raise ValueError(f"{name!r}: name a format as 'package.module:Class'")
    return getattr(importlib.import_module(module), attribute)


def register_format(storage) -> None:
    """Make `format_of` try `storage` (a `CheckpointFormat` class, an instance, or "package.module:Class") before
    the built-in formats, e.g. so that `python -m loopkit report` reads folders written by your storage."""
    if isinstance(storage, str):
        storage = format_class(storage)
    instance = storage() if isinstance(storage, type) else storage
    if not any(type(known) is type(instance) for known in registered_formats):
        registered_formats.insert(0, instance)


def known_formats() -> list:
    return registered_formats + [format_class(name)() for name in BUILT_IN_FORMATS]


def format_of(path: str, preferred=None):
    """The format that recognises checkpoint folder `path` (`preferred` first: the run's own storage), or None."""
    for candidate in ([preferred] if preferred is not None else []) + known_formats():
        try:
            if candidate.recognises(path):
                return candidate
        except OSError:
            continue
    return None


def read_states(path: str, preferred=None) -> tuple[dict, dict]:
    """`read_states` of the format that recognises `path` (`RuntimeError` naming the folder when none does)."""
    found = format_of(path, preferred)
    if found is None:
        raise RuntimeError(f"{path} is not a checkpoint any known format recognises (built-in: "
                           f"{', '.join(BUILT_IN_FORMATS)}; register yours with loopkit.checkpoint.register_format).")
    return found.read_states(path)


def json_text(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True)
