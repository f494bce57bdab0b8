"""`CheckpointStorage`: what a run needs from the storage of its checkpoints, as one interface.

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
    guards     resolve(resume_from_checkpoint), read_trainer_state(folder), last_saved_step
    teardown   wait(), load_best_model(folder), own_checkpoints(), keep_only_best()
    API        writes_files (`save_on_each_node`), hub (push_to_hub)

What every storage shares (the checkpoint-<step> folders and their guarantees) is implemented here once, from
loopkit/checkpoint/: the run lineage (lineage.py: run ids and save numbers, other runs' folders kept), the atomic
write (writing.py: a hidden temporary folder, fsync, rename; `async_save`; `on_save_error`), rotation
(rotation.py: `save_total_limit`, the best kept, `best_total_limit`), resuming (reading.py) and the RNG files
(rng.py). A storage decides the layout of the weights and the optimizer inside the folder: the abstract methods
below. The FSDP and DeepSpeed paths are the HF layout's (they write Accelerate's folders); DCP handles plain, DDP
and FSDP2 models itself.

Options (all storages): `async_save=True` writes on a background thread while training goes on;
`on_save_error` ("raise", "continue", "stop") is what a failed save does after its temporary folder is removed and
the previous checkpoint left as it was; `best_total_limit=k` keeps the k best checkpoints under their own limit
(see `EvalStage`, which still accepts the three and hands them to the default storage).
"""

from __future__ import annotations

import abc

from ..checkpoint.lineage import RunLineage
from ..checkpoint.reading import Resuming
from ..checkpoint.rotation import Rotation
from ..checkpoint.writing import SAVE_ERROR_POLICIES, AtomicSaves, Snapshot


def check_options(on_save_error: str, best_total_limit: int | None) -> None:
    """A clear error, naming the option, for a value no storage takes."""
    from ..args import config_error

    if on_save_error not in SAVE_ERROR_POLICIES:
        raise config_error("on_save_error", on_save_error, f"it must be one of {SAVE_ERROR_POLICIES}",
                           "pick one of those")
    if best_total_limit is not None and (not isinstance(best_total_limit, int) or best_total_limit < 1):
        raise config_error("best_total_limit", best_total_limit, "it is the number of best checkpoints to keep",
                           "pass a positive integer, or None for HF's single protected best")


class CheckpointStorage(RunLineage, AtomicSaves, Rotation, Resuming, abc.ABC):
    """Where and how a run's checkpoints are written and read (module docstring). Subclasses implement the layout:
    `take_snapshot`, `write_files`, `load_model_before_prepare`, `load_optimizer_and_scheduler`, `load_best_model`,
    `holds_model_weights` and `checkpoint_problem`."""

    run = context = None

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
        from ..args import config_error

        if self.run is not None and self.run is not run:
            raise config_error("storage", self, "this storage object already serves another Loop",
                               f"pass a new {type(self).__name__}(...) to each Loop")
        from ..trainer.hub import HubPush

        self.run, self.context = run, context
        self.hub = HubPush(run, context)  # push_to_hub: the uploads of complete checkpoints (loopkit/trainer/hub.py)
        return self

    # -- the layout: what a storage implements --
    @abc.abstractmethod
    def take_snapshot(self, stage_states: dict) -> Snapshot:
        """At the step boundary, on the training thread: what the save writes (`common_snapshot` plus the
        layout's model and optimizer state; host copies when `async_save`)."""

    @abc.abstractmethod
    def write_files(self, snapshot: Snapshot, folder: str) -> None:
        """Every process: write the snapshot's files into the temporary `folder` (the common ones through
        `write_common_files`). The states, fsync and rename follow (`close_folder`)."""

    @abc.abstractmethod
    def load_model_before_prepare(self, model, checkpoint: str) -> None:
        """Resuming: the weights a model needs before `accelerator.prepare` (nothing, if loaded after)."""

    @abc.abstractmethod
    def load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        """Resuming, after `accelerator.prepare`, on every process: what loads into prepared objects (sharded
        weights, the optimizer, the scheduler, the scaler)."""

    @abc.abstractmethod
    def load_best_model(self, checkpoint: str) -> None:
        """`load_best_model_at_end`: the weights of `checkpoint` into the run's model (every process)."""

    @abc.abstractmethod
    def holds_model_weights(self, path: str) -> bool:
        """Whether folder `path` holds weights this storage can load (a quick look, before `checkpoint_problem`)."""

    @abc.abstractmethod
    def checkpoint_problem(self, path: str) -> str | None:
        """Why `path` cannot be resumed from (a damaged or missing file, named), or None."""
