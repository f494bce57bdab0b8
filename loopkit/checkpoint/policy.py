"""The checkpoint POLICY of a run: one object that HOLDS the run's format (the storage the user picked,
format.py) and its four parts, each given what it needs (nothing reaches a sibling through a shared namespace):

    RunLineage(format, run, accelerator)                      lineage.py: run ids, save numbers, other runs' folders
    Resuming(format, run, node_local_disks)                    reading.py: the checkpoint to resume, its states
    Rotation(lineage, run, best_total_limit, writes_files, hub)            rotation.py: `save_total_limit`, the best
    AtomicSaves(format, lineage, rotation, run, context, options, ...)     writing.py: the atomic commit, async saves

The policy calls the format only through its documented methods (format.py's `CheckpointFormat`): a method a format
author adds, named like anything here (`write`, `save`, `start`, ...), is the format's own helper and changes
nothing in the policy. The `Loop` builds it (`CheckpointStorage.attach`) and every caller reaches checkpoints
through `context.checkpointer`, this object:

    setup      start(resume_from_checkpoint) -> the folder to resume from; load_model_before_prepare(model, folder)
    step       load_optimizer_and_scheduler(folder)      (after `accelerator.prepare`: model shards, optimizer, ...)
    data       read_rng(folder), rng_for_next_save
    loop       read_trainer_state(folder), read_stage_states(folder), save(stage_states) -> path, wait_quietly(),
               finish_uploads(), last_saved_step
    schedule   save (through the Loop), take_committed(wait), rng_for_next_save
    guards     resolve(resume_from_checkpoint), read_trainer_state(folder), last_checkpoint(), last_saved_step
    teardown   wait(), load_best_model(folder), own_checkpoints(), keep_only_best(), run_id
    API        writes_files (`save_on_each_node`), hub and upload_with (the uploads a `Loop` registers), format
"""

from __future__ import annotations

from .format import node_local_disks, writes_files
from .lineage import RunLineage
from .reading import Resuming
from .rotation import Rotation
from .writing import AtomicSaves, NoUploads


class CheckpointPolicy:
    """The run's checkpoint policy over `format` (module docstring). `options`: `async_save`, `on_save_error`,
    `best_total_limit` (the storage's)."""

    def __init__(self, format, run, context, *, async_save: bool = False, on_save_error: str = "raise",
                 best_total_limit: int | None = None):
        self.format, self.run, self.context = format, run, context
        accelerator = context.accelerator
        self.writes_files = writes_files(run.args, accelerator)
        self.async_save = async_save
        self.hub = NoUploads()
        self.lineage = RunLineage(format, run, accelerator)
        self.resuming = Resuming(format, run, node_local_disks(run.args, accelerator))
        self.rotation = Rotation(self.lineage, run, best_total_limit, self.writes_files, self.hub)
        self.saves = AtomicSaves(format, self.lineage, self.rotation, run, context, async_save=async_save,
                                 on_save_error=on_save_error, writes_files=self.writes_files,
                                 node_local_disks=node_local_disks(run.args, accelerator), hub=self.hub)

    def upload_with(self, uploads) -> None:
        """Register what uploads complete checkpoints (`begin_push()` when a save starts, on the training thread;
        `push_checkpoint(folder, push)` once it is complete; `uploading(folder)` before rotation deletes one;
        `wait()`). The `Loop` registers Trainer's `push_to_hub` (loopkit/trainer/hub.py) here."""
        self.hub = self.rotation.hub = self.saves.hub = uploads

    # -- a train()'s start, and resuming --
    def start(self, resume_from_checkpoint) -> str | None:
        """The start of a `train()`: the format's launch check (and, with `async_save`, its preparation for the
        writer thread), a killed save's leftovers removed, the checkpoint to resume from resolved, the run the
        coming saves belong to set (lineage.py, which says what it found). Returns the checkpoint path or None."""
        self.format.check_launch()
        if self.async_save:
            self.format.before_async_saves()
        if self.writes_files:
            self.lineage.remove_leftovers()
        records = self.lineage.records()
        checkpoint, skipped = self.resuming.pick(resume_from_checkpoint)
        self.lineage.start(checkpoint, resume_from_checkpoint, records, skipped)
        self.rotation.start()
        return checkpoint

    def resolve(self, resume_from_checkpoint) -> str | None:
        return self.resuming.resolve(resume_from_checkpoint)

    def checkpoint_problem(self, path: str) -> str | None:
        return self.format.checkpoint_problem(path)

    def read_trainer_state(self, checkpoint: str):
        return self.resuming.read_trainer_state(checkpoint)

    def read_stage_states(self, checkpoint: str) -> dict:
        return self.resuming.read_stage_states(checkpoint)

    def read_rng(self, checkpoint: str) -> dict | None:
        return self.resuming.read_rng(checkpoint)

    def load_model_before_prepare(self, model, checkpoint: str) -> None:
        self.format.load_model_before_prepare(model, checkpoint)

    def load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        self.format.load_optimizer_and_scheduler(checkpoint)

    def load_best_model(self, checkpoint: str) -> None:
        self.format.load_best_model(checkpoint)

    # -- saving --
    def save(self, stage_states: dict) -> str:
        return self.saves.save(stage_states)

    def take_committed(self, wait: bool) -> list:
        return self.saves.take_committed(wait)

    def wait(self) -> None:
        self.saves.wait()

    def wait_quietly(self) -> None:
        self.saves.wait_quietly()

    def async_group(self):
        return self.saves.async_group()

    @property
    def last_saved_step(self) -> int | None:
        return self.saves.last_saved_step

    @property
    def rng_for_next_save(self):
        return self.saves.rng_for_next_save

    @rng_for_next_save.setter
    def rng_for_next_save(self, rng) -> None:
        self.saves.rng_for_next_save = rng

    # -- the folders: which are this run's, rotation --
    @property
    def run_id(self) -> str | None:
        return self.lineage.run_id

    @property
    def next_save_index(self) -> int:
        return self.lineage.next_save_index

    def own_checkpoints(self) -> list[str]:
        return self.lineage.own_checkpoints()

    def last_checkpoint(self) -> str | None:
        return self.lineage.last_checkpoint()

    def rotate(self, state=None) -> None:
        self.rotation.rotate(state)

    def keep_only_best(self) -> None:
        self.rotation.keep_only_best()

    def finish_uploads(self) -> None:
        self.rotation.finish_uploads()
