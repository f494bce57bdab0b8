"""`CheckpointStorage`: what a run needs from the storage of its checkpoints, as one object: the POLICY (written
once, loopkit/checkpoint/) on top of a FORMAT (a handful of methods each storage implements:
loopkit/checkpoint/format.py, docs/checkpoints.md "Writing another storage").

The user picks the storage: `Loop(..., storage=HFStorage(async_save=True))` (the default, `HFStorage()`: HF
Trainer's layout, loopkit/storage/hf.py) or `storage=DCPStorage(...)` (torch.distributed.checkpoint,
loopkit/storage/dcp.py). The `Loop` attaches it to the run (`attach`), and every caller reaches checkpoints through
`context.checkpointer`, this object:

    setup      start(resume_from_checkpoint) -> the folder to resume from; load_model_before_prepare(model, folder)
    step       load_optimizer_and_scheduler(folder)      (after `accelerator.prepare`: model shards, optimizer, ...)
    data       read_rng(folder)
    loop       read_trainer_state(folder), read_stage_states(folder), save(stage_states) -> path, wait_quietly(),
               finish_uploads(), last_saved_step
    schedule   save (through the Loop), rng_for_next_save
    guards     resolve(resume_from_checkpoint), read_trainer_state(folder), last_checkpoint(), last_saved_step
    teardown   wait(), load_best_model(folder), own_checkpoints(), keep_only_best()
    API        writes_files (`save_on_each_node`), hub (the uploads a `Loop` registers: `upload_with`)

The policy: the run lineage (lineage.py: run ids and save numbers, other runs' folders kept), the atomic write
(writing.py: a hidden temporary folder, fsync, rename; `async_save`; `on_save_error`), rotation (rotation.py:
`save_total_limit`, the best kept, `best_total_limit`) and resuming (reading.py). The format: `recognises`,
`read_states`, `checkpoint_problem`, `write_checkpoint`, `read_process_state`, `load_model_before_prepare`,
`load_optimizer_and_scheduler`, `load_best_model` (and optionally `states_to_save`).

Options (all storages): `async_save=True` writes on a background thread while training goes on;
`on_save_error` ("raise", "continue", "stop") is what a failed save does after its temporary folder is removed and
the previous checkpoint left as it was; `best_total_limit=k` keeps the k best checkpoints under their own limit
(see `EvalStage`, which still accepts the three and hands them to the default storage).
"""

from __future__ import annotations

from ..checkpoint.format import Checkpoint, CheckpointFormat, ProcessState  # noqa: F401 (a storage's vocabulary)
from ..checkpoint.lineage import RunLineage
from ..checkpoint.reading import Resuming
from ..checkpoint.rotation import Rotation
from ..checkpoint.writing import SAVE_ERROR_POLICIES, AtomicSaves, Snapshot  # noqa: F401 (Snapshot: earlier name)
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


def check_options(on_save_error: str, best_total_limit: int | None) -> None:
    """A clear error, naming the option, for a value no storage takes."""
    if on_save_error not in SAVE_ERROR_POLICIES:
        raise config_error("on_save_error", on_save_error, f"it must be one of {SAVE_ERROR_POLICIES}",
                           "pick one of those")
    if best_total_limit is not None and (not isinstance(best_total_limit, int) or best_total_limit < 1):
        raise config_error("best_total_limit", best_total_limit, "it is the number of best checkpoints to keep",
                           "pass a positive integer, or None for HF's single protected best")


class CheckpointStorage(RunLineage, AtomicSaves, Rotation, Resuming, CheckpointFormat):
    """Where and how a run's checkpoints are written and read (module docstring). Subclasses implement the format
    (loopkit/checkpoint/format.py's `CheckpointFormat`); the policy comes with this class."""

    run = context = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for old, new in REPLACED_METHODS.items():
            if old in vars(cls):
                raise TypeError(f"{cls.__name__}.{old}: loopkit's storage protocol no longer has {old}(); "
                                f"implement {new} instead (docs/checkpoints.md, 'Writing another storage').")

    def __init__(self, *, async_save: bool = False, on_save_error: str = "raise",
                 best_total_limit: int | None = None):
        check_options(on_save_error, best_total_limit)
        self.async_save, self.on_save_error, self.best_total_limit = async_save, on_save_error, best_total_limit

    def options(self) -> dict:
        return dict(async_save=self.async_save, on_save_error=self.on_save_error,
                    best_total_limit=self.best_total_limit)

    def attach(self, run, context) -> "CheckpointStorage":
        """Serve `run`, with the services of `context` (the `Loop` calls this once). A storage serves one run: it
        holds that run's lineage."""
        if self.run is not None and self.run is not run:
            raise config_error("storage", self, "this storage object already serves another Loop",
                               f"pass a new {type(self).__name__}(...) to each Loop")
        self.run, self.context = run, context
        check_node_local_disks(run.args, context.accelerator)
        return self


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
