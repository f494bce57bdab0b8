"""`CheckpointStorage`: the storage of a run's checkpoints as the user picks it: a FORMAT (how one checkpoint is
written and read: a handful of methods, loopkit/checkpoint/format.py, docs/checkpoints.md "Writing another storage")
with its options. The POLICY (the run lineage, the atomic commit, `async_save`, `on_save_error`, rotation and the
best kept, resuming) is written once and HOLDS the format: `attach` builds it (loopkit/checkpoint/policy.py), and
it calls the format only through the format's documented methods. So a helper method of a format, whatever its name
(`write`, `save`, `start`, ...), never replaces a part of the policy.

The user picks the storage: `Loop(..., storage=HFStorage(async_save=True))` (the default, `HFStorage()`: HF
Trainer's layout, loopkit/storage/hf.py) or `storage=DCPStorage(...)` (torch.distributed.checkpoint,
loopkit/storage/dcp.py). The `Loop` attaches it to the run (`attach`, which returns the policy), and every caller
reaches checkpoints through `context.checkpointer`, the policy.

A format's surface: `recognises`, `read_states`, `checkpoint_problem`, `write_checkpoint`, `read_process_state`,
`load_model_before_prepare`, `load_optimizer_and_scheduler`, `load_best_model` (and optionally `states_to_save`,
`read_loopkit_state`, `check_launch`). What it reads inside a run is set by `attach`: `self.run` (model, optimizer,
scheduler, args), `self.context` (`.accelerator`), `self.writes_files`, and its options (`RESERVED`: a format may
not define these names, so that nothing it defines shadows what the policy sets).

Options (all storages): `async_save=True` writes on a background thread while training goes on;
`on_save_error` ("raise", "continue", "stop") is what a failed save does after its temporary folder is removed and
the previous checkpoint left as it was; `best_total_limit=k` keeps the k best checkpoints under their own limit
(see `EvalStage`, which still accepts the three and hands them to the default storage).
"""

from __future__ import annotations

from ..checkpoint.format import Checkpoint, CheckpointFormat, ProcessState  # noqa: F401 (a storage's vocabulary)
from ..checkpoint.format import writes_files
from ..checkpoint.policy import CheckpointPolicy
from ..checkpoint.writing import SAVE_ERROR_POLICIES, Snapshot  # noqa: F401 (Snapshot: earlier name)
from ..errors import config_error

# Methods of loopkit's earlier storage protocol, and what replaced them: a subclass that still defines one is
# refused when it is defined, with the new method named (the base class no longer calls the old ones).
REPLACED_METHODS = {
    "take_snapshot": "states_to_save() (the model's and optimizer's states; the policy collects the rest)",
    "write_files": "write_checkpoint(checkpoint, folder) (it writes the whole checkpoint, state files included)",
    "common_snapshot": "the policy's collect(stage_states), which builds the whole Checkpoint",
    "write_common_files": "write_checkpoint (HF's state files: loopkit.checkpoint.state_files.write_state_files)",
    "holds_model_weights": "recognises(path)",
}

# What `CheckpointStorage` sets and a format reads: a format that defined one would shadow it.
RESERVED = ("run", "context", "writes_files", "async_save", "on_save_error", "best_total_limit", "options",
            "attach")


def check_options(on_save_error: str, best_total_limit: int | None) -> None:
    """A clear error, naming the option, for a value no storage takes."""
    if on_save_error not in SAVE_ERROR_POLICIES:
        raise config_error("on_save_error", on_save_error, f"it must be one of {SAVE_ERROR_POLICIES}",
                           "pick one of those")
    if best_total_limit is not None and (not isinstance(best_total_limit, int) or best_total_limit < 1):
        raise config_error("best_total_limit", best_total_limit, "it is the number of best checkpoints to keep",
                           "pass a positive integer, or None for HF's single protected best")


class CheckpointStorage(CheckpointFormat):
    """Where and how a run's checkpoints are written and read (module docstring). Subclasses implement the format
    (loopkit/checkpoint/format.py's `CheckpointFormat`); the policy, which holds it, comes with `attach`."""

    run = context = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for old, new in REPLACED_METHODS.items():
            if old in vars(cls):
                raise TypeError(f"{cls.__name__}.{old}: loopkit's storage protocol no longer has {old}(); "
                                f"implement {new} instead (docs/checkpoints.md, 'Writing another storage').")
        for name, value in vars(cls).items():
            if extends_a_missing_method(cls, name, value):
                raise TypeError(f"{cls.__name__}.{name} calls super().{name}(), which no base class has: the policy is "
                                f"no longer a storage's base class but holds it, and calls only the format's methods "
                                f"(a launch check that extended start() goes into check_launch()). Implement the "
                                f"format's methods instead (docs/checkpoints.md, 'Writing another storage').")
        for name in RESERVED:
            if name in vars(cls):
                raise TypeError(f"{cls.__name__}.{name}: `{name}` is set by CheckpointStorage for the format to read "
                                f"(the run it serves, its options), so a format cannot define it: give your "
                                f"{name!r} another name (docs/checkpoints.md, 'Writing another storage').")

    def __init__(self, *, async_save: bool = False, on_save_error: str = "raise",
                 best_total_limit: int | None = None):
        check_options(on_save_error, best_total_limit)
        self.async_save, self.on_save_error, self.best_total_limit = async_save, on_save_error, best_total_limit

    def options(self) -> dict:
        return dict(async_save=self.async_save, on_save_error=self.on_save_error,
                    best_total_limit=self.best_total_limit)

    @property
    def writes_files(self) -> bool:
        """HF's `args.should_save`: this process writes the shared files (format.py's `writes_files`)."""
        return writes_files(self.run.args, self.context.accelerator)

    def attach(self, run, context) -> CheckpointPolicy:
        """Serve `run`, with the services of `context` (the `Loop` calls this once): the run's checkpoint policy,
        holding this format. A storage serves one run."""
        if self.run is not None and self.run is not run:
            raise config_error("storage", self, "this storage object already serves another Loop",
                               f"pass a new {type(self).__name__}(...) to each Loop")
        self.run, self.context = run, context
        check_node_local_disks(run.args, context.accelerator)
        return CheckpointPolicy(self, run, context, **self.options())


def extends_a_missing_method(cls, name: str, value) -> bool:
    """Whether `value`, defined as `cls.name`, calls `super().name(...)` though no base class has `name`: a method
    written to extend one of the policy's, from when the policy was the storage's base class."""
    code = getattr(value, "__code__", None)
    if code is None or "super" not in code.co_names or name not in code.co_names:
        return False
    return not any(hasattr(base, name) for base in cls.__mro__[1:])


def check_node_local_disks(args, accelerator) -> None:
    """`save_on_each_node` across nodes gives each node a checkpoint of its own, which it resumes from alone: the
    model and the optimizer must then be whole on each node's writing process (DDP, one device). FSDP's and
    DeepSpeed's saves leave shards or gathered states on some processes only: refused, with the fix."""
    import os

    from ..distributed import active_engine

    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    engine = active_engine(accelerator)
    if not args.save_on_each_node or accelerator.num_processes <= local_processes or engine is None:
        return
    raise config_error("save_on_each_node", True, f"under {engine} on several nodes each process writes its own "
                       f"shards (or only the first process holds the gathered state), so no node's own disk would "
                       f"hold a checkpoint it can resume from",
                       "save to a file system every node sees (save_on_each_node=False), or train with DDP")
