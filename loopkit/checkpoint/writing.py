"""Writing a checkpoint atomically: a hidden temporary folder, fsynced, renamed into place, then rotation and the
push; synchronously or on a background thread, with the failure policy of `on_save_error`. What goes into the folder
is the storage's layout (`CheckpointStorage.write_files`)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from dataclasses import dataclass, field

import torch

from .. import checkpoint as files  # the file operations, looked up at call time (the kill tests wrap them there)
from .lineage import CHECKPOINT_PREFIX, LOOPKIT_STATE_NAME, RECORD_KEY, TRAINER_STATE_NAME, last_checkpoint
from .stage_tensors import split_stage_states, write_stage_tensors

SAVE_ERROR_POLICIES = ("raise", "continue", "stop")


def copy_to_cpu(obj):
    """A deep copy with every tensor moved to (new) CPU memory: what an asynchronous save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_to_cpu(v) for v in obj)
    return obj


@dataclass
class Snapshot:
    """Everything one checkpoint writes, taken at an optimizer-step boundary. `model_state` and `optimizer` are the
    layout's (the HF layout's CPU copies for an asynchronous save; None: written from the live objects)."""

    step: int
    model_state: dict | None
    optimizer: dict | None
    scheduler: dict | None
    scaler: dict | None
    rng: dict | None
    trainer_state_json: str
    stage_states_json: str
    stage_tensors: dict = field(default_factory=dict)  # this process's, with its stage entries that hold them:
    own_stage_states_json: str | None = None


class AtomicSaves:
    """The part of a checkpoint storage that writes: `save` (the run's entry point), the background writer of
    `async_save`, `wait`, and the failure policy. Needs `run`, the layout's `take_snapshot` / `write_files`,
    RunLineage's `record` / `replace_existing` / `is_own`, Rotation's `rotate` and `hub`."""

    writer = None  # the background thread of an asynchronous save
    writer_error = None
    last_saved_step = None
    rng_for_next_save = None  # set when a checkpoint must hold an earlier RNG state (see Schedule)

    @property
    def writes_files(self) -> bool:
        """HF's `args.should_save`: the main process, or with `save_on_each_node` the first process of each node
        (for nodes without a shared disk)."""
        acc = self.context.accelerator
        return acc.is_local_main_process if self.run.args.save_on_each_node else acc.is_main_process

    def save(self, stage_states: dict) -> str:
        """Save a full checkpoint of the current step atomically, with `stage_states` (JSON values by stage name)
        as `loopkit_state.json`; return its final path."""
        run, context = self.run, self.context
        state = run.state
        self.wait()  # one save in flight at a time; raises a background failure first
        final = os.path.join(run.args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        if state.best_global_step is not None:
            best = os.path.join(run.args.output_dir, f"{CHECKPOINT_PREFIX}-{state.best_global_step}")
            if best == final or (os.path.isdir(best) and self.is_own(best)):  # never another run's folder
                state.best_model_checkpoint = best
        run.state.record_callback_states(context.events.callback_objects + [run.control])
        snapshot = self.take_snapshot(stage_states)
        push = self.hub.begin_push()  # on the training thread: on_push_begin, and the commit message (or None)
        self.last_saved_step, self.rng_for_next_save = state.global_step, None
        if self.async_save:
            self.writer = self.start_background_write(snapshot, push)
        else:
            self.write_handling_errors(snapshot, push)
        return final

    def common_snapshot(self, stage_states: dict, model_state=None, optimizer=None) -> Snapshot:
        """The snapshot's layout-independent parts (scheduler, scaler, RNG, trainer and stage states), copied to
        host memory for an asynchronous save; `model_state` and `optimizer` are the layout's."""
        run, acc = self.run, self.context.accelerator
        copy = copy_to_cpu if self.async_save else (lambda x: x)
        full_state = not run.args.save_only_model
        stage_states, stage_tensors, own_stage_states = split_stage_states(stage_states)
        return Snapshot(
            step=run.state.global_step, model_state=model_state, optimizer=optimizer,
            scheduler=copy(run.lr_scheduler.state_dict()) if full_state and self.writes_files else None,
            scaler=copy(acc.scaler.state_dict()) if full_state and acc.scaler is not None else None,
            rng=(self.rng_for_next_save or files.rng_state()) if full_state else None,
            trainer_state_json=run.state.to_json_string(),
            stage_states_json=json.dumps({**stage_states, RECORD_KEY: self.record()}, indent=2, sort_keys=True),
            stage_tensors=stage_tensors, own_stage_states_json=json.dumps(own_stage_states, sort_keys=True),
        )

    def write_common_files(self, snapshot: Snapshot, folder: str) -> None:
        """Scheduler, scaler, `training_args.bin`, this process's RNG states and stage tensors (every process calls
        it)."""
        acc = self.context.accelerator
        if snapshot.scheduler is not None:
            files.save_state_file(snapshot.scheduler, os.path.join(folder, files.SCHEDULER_NAME))
        if snapshot.scaler is not None and self.writes_files:
            files.save_state_file(snapshot.scaler, os.path.join(folder, files.SCALER_NAME))
        if self.writes_files:
            files.save_training_args(self.run.args, folder)  # Trainer's pickle, for its readers (never ours)
        if snapshot.rng is not None:
            files.save_state_file(snapshot.rng, os.path.join(folder, files.rng_file_name(acc.num_processes,
                                                                                      acc.process_index)))
        write_stage_tensors(snapshot.stage_tensors, snapshot.own_stage_states_json, folder, acc)

    def start_background_write(self, snapshot: Snapshot, push: str | None) -> threading.Thread:
        """`async_save`: the whole write on a thread (the snapshot holds host copies). One process only (checked
        by the storage at `start`): the write's barriers would run beside training's collectives."""
        writer = threading.Thread(target=self.write_in_background, args=(snapshot, push), daemon=False)
        writer.start()
        return writer

    def write_handling_errors(self, snapshot: Snapshot, push: str | None = None) -> None:
        try:
            self.write(snapshot, push)
        except Exception as exc:
            self.report_failure(snapshot, exc)

    def write_in_background(self, snapshot: Snapshot, push: str | None = None) -> None:
        try:
            self.write(snapshot, push)
        except Exception as exc:  # handed to the training thread at the next save or at the end
            self.writer_error = (snapshot, exc)

    def wait(self) -> None:
        """Wait for an asynchronous save to finish; then act on its failure, if any."""
        self.wait_quietly()
        if self.writer_error is not None:
            snapshot, exc = self.writer_error
            self.writer_error = None
            self.report_failure(snapshot, exc)

    def wait_quietly(self) -> None:
        """On a failing run: let an asynchronous save finish (its checkpoint stays usable), reporting nothing."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None

    def report_failure(self, snapshot: Snapshot, exc: Exception) -> None:
        previous = last_checkpoint(self.run.args.output_dir)
        message = (f"Saving checkpoint-{snapshot.step} failed ({type(exc).__name__}: {exc}). Nothing was "
                   f"half-written; the most recently saved complete checkpoint is still {previous}.")
        if self.on_save_error == "raise":
            raise RuntimeError(message + " (on_save_error='raise')") from exc
        warnings.warn(message + f" on_save_error={self.on_save_error!r}: "
                      + ("training goes on." if self.on_save_error == "continue" else "stopping training."))
        if self.on_save_error == "stop":
            self.run.control.should_training_stop = True

    def write(self, snapshot: Snapshot, push: str | None = None) -> None:
        """The atomic protocol: write into `.tmp-checkpoint-N`, fsync, rename to `checkpoint-N`, then rotate; then
        `push` (a commit message from `HubPush.begin_push`) queues the uploads of the complete folder."""
        tmp, final = self.open_folder(snapshot.step)
        try:
            self.write_files(snapshot, tmp)
            self.context.accelerator.wait_for_everyone()
            self.close_folder(snapshot, tmp, final)
        except BaseException:
            self.discard_folder(tmp)
            raise
        self.after_save(final, push)
        self.context.accelerator.wait_for_everyone()

    def open_folder(self, step: int) -> tuple[str, str]:
        """The empty temporary folder of checkpoint `step` and its final path (every process calls it)."""
        run_dir = self.run.args.output_dir
        name = f"{CHECKPOINT_PREFIX}-{step}"
        final, tmp = os.path.join(run_dir, name), os.path.join(run_dir, f".tmp-{name}")
        if self.writes_files:
            os.makedirs(run_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self.context.accelerator.wait_for_everyone()
        return tmp, final

    def close_folder(self, snapshot: Snapshot, tmp: str, final: str) -> None:
        """Once every process has written its files: the states (`loopkit_state.json` last: it marks the folder
        complete), fsync, and the rename that makes it a checkpoint. No collective: it may run on a writer thread."""
        if not self.writes_files:
            return
        files.write_text(os.path.join(tmp, TRAINER_STATE_NAME), snapshot.trainer_state_json)
        files.write_text(os.path.join(tmp, LOOPKIT_STATE_NAME), snapshot.stage_states_json)  # written last
        files.fsync_tree(tmp)
        if os.path.isdir(final):
            self.replace_existing(final, tmp)
        else:
            os.replace(tmp, final)
        files.fsync_dir(os.path.dirname(final))

    def discard_folder(self, tmp: str) -> None:
        if self.writes_files:
            shutil.rmtree(tmp, ignore_errors=True)

    def after_save(self, final: str, push: str | None) -> None:
        """Rotation, then the push of the complete folder (after rotation: no upload lists a folder being
        deleted)."""
        if self.writes_files:
            self.rotate()
            self.hub.push_checkpoint(final, push)
