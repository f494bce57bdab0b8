"""Writing a checkpoint atomically: a hidden temporary folder, fsynced, renamed into place, then rotation and the
push; synchronously or on a background thread, with the failure policy of `on_save_error`. What goes into the folder
is the format's (`CheckpointFormat.write_checkpoint`, format.py)."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import shutil
import threading
import warnings
from dataclasses import dataclass

import torch

from .. import checkpoint as files  # the file operations, looked up at call time (the kill tests wrap them there)
from ..distributed import unwrap_model
from .format import Checkpoint
from .lineage import CHECKPOINT_PREFIX, RECORD_KEY
from .stage_tensors import split_stage_states
from .staging import Staging, WeightsHold, copy_to_cpu  # noqa: F401 (copy_to_cpu: public here too)

SAVE_ERROR_POLICIES = ("raise", "continue", "stop")


Snapshot = Checkpoint  # loopkit's earlier name (the fields were renamed: see `Checkpoint`)


@dataclass
class CommittedSave:
    """A checkpoint that is complete (written, fsynced, renamed into place, rotation done) and not yet announced
    (`on_save`). `state`: the trainer state it holds, for an asynchronous save (its `on_save` fires after later
    steps ran); None for a synchronous one (the run's live state is still that state)."""

    path: str
    step: int
    state: object = None
    best_model_checkpoint: str | None = None


@contextlib.contextmanager
def heap_left_to_training():
    """While the writer thread writes: the objects that exist when it starts are left out of the garbage
    collector's full collections (`gc.freeze`), and put back after (`gc.unfreeze`: collected as before).

    Why: a write allocates thousands of objects (DCP's plans and metadata), which sets off a full collection on the
    writer thread; that one scans every object of the process holding the GIL (hundreds of thousands once
    transformers is imported: tenths of a second), and training stops for all of it. A program that froze its heap
    itself (`gc.get_freeze_count()`) is left as it is: unfreezing would undo its own freeze."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class NoUploads:
    """The uploads a save starts when nothing is uploaded: what the policy calls until a `Loop` registers its
    uploader (`CheckpointPolicy.upload_with`; with `push_to_hub`, loopkit/trainer/hub.py's `HubPush`)."""

    repo_id = None

    def begin_push(self):
        return None

    def push_checkpoint(self, folder: str, push) -> None:
        pass

    def uploading(self, folder: str) -> bool:
        return False

    def wait(self) -> None:
        pass


class AtomicSaves:
    """The part of the checkpoint policy that writes: `save` (the run's entry point), the background writer of
    `async_save`, `wait`, and the failure policy (`on_save_error`). Receives the format (`states_to_save`,
    `write_checkpoint`), the run lineage (`record`, `replace_existing`, `is_own`, `last_checkpoint`), the rotation
    (`rotate` after each commit), the run and its context (the accelerator, the events), the options, which
    processes write (`writes_files`, `node_local_disks`), and the uploads (`hub`; the policy's `upload_with`)."""

    def __init__(self, format, lineage, rotation, run, context, *, async_save: bool, on_save_error: str,
                 writes_files: bool, node_local_disks: bool, hub):
        self.format, self.lineage, self.rotation, self.run, self.context = format, lineage, rotation, run, context
        self.async_save, self.on_save_error, self.hub = async_save, on_save_error, hub
        self.writes_files, self.node_local_disks = writes_files, node_local_disks
        self.writer = None  # the background thread of an asynchronous save
        self.writer_error = None
        self.committed: tuple = ()  # CommittedSave: complete checkpoints not yet announced (set by the writer)
        self.last_saved_step = None
        self.rng_for_next_save = None  # set when a checkpoint must hold an earlier RNG state (see Schedule)
        self.checkpoint_group = None  # the gloo process group of asynchronous saves with several processes
        self.weights_hold = None  # an asynchronous save's hold on the optimizer's next step, until staged

    def save(self, stage_states: dict) -> str:
        """Save a full checkpoint of the current step atomically, with `stage_states` (JSON values by stage name)
        as the loopkit state; return its final path."""
        run, context = self.run, self.context
        state = run.state
        self.wait()  # one save in flight at a time; raises a background failure first
        final = os.path.join(run.args.output_dir, f"{CHECKPOINT_PREFIX}-{state.global_step}")
        live_best = state.best_model_checkpoint
        if state.best_global_step is not None:
            best = os.path.join(run.args.output_dir, f"{CHECKPOINT_PREFIX}-{state.best_global_step}")
            if best == final or (os.path.isdir(best) and self.lineage.is_own(best)):  # never another run's folder
                state.best_model_checkpoint = best  # as HF: the checkpoint's own state names it (itself, maybe)
        run.state.record_callback_states(context.events.callback_objects + [run.control])
        checkpoint = self.collect(stage_states)
        # The run's state names a new best checkpoint once it is committed (`take_committed`), never before: a
        # save that fails or is killed must not leave `best_model_checkpoint` naming a folder that never existed.
        committed = CommittedSave(final, state.global_step, copy.deepcopy(state) if self.async_save else None,
                                  state.best_model_checkpoint)
        state.best_model_checkpoint = live_best
        push = self.hub.begin_push()  # on the training thread: on_push_begin, and the commit message (or None)
        self.last_saved_step, self.rng_for_next_save = state.global_step, None
        if self.async_save:
            self.writer = self.start_background_write(checkpoint, push, committed)
        else:
            self.write_handling_errors(checkpoint, push, committed)
        return final

    def take_committed(self, wait: bool) -> list[CommittedSave]:
        """On the training thread: the saves committed since the last call, oldest first, for their `on_save`; the
        run's state takes their `best_model_checkpoint`. `wait`: first wait for the save in flight (reporting its
        failure). Without `wait` an asynchronous save counts once its writer has finished, and with several
        processes only when waited for: every process then announces it at the same step (a callback's
        collectives at `on_save`, e.g. Ray Train's report, stay in step)."""
        if self.writer is None and not self.committed:
            return []  # most steps
        if self.writer is not None:
            if not wait and (self.context.accelerator.num_processes > 1 or self.writer.is_alive()):
                return []
            self.wait()
        committed, self.committed = list(self.committed), ()
        for save in committed:
            self.run.state.best_model_checkpoint = save.best_model_checkpoint
        return committed

    def collect(self, stage_states: dict) -> Checkpoint:
        """At the step boundary, on the training thread: everything the save writes (the format's
        `states_to_save`, the scheduler, scaler, RNG, trainer and stage states). For an asynchronous save the small
        states are copied to host memory here; the model's and the optimizer's are staged on a thread
        (`start_background_write`, staging.py)."""
        run, acc = self.run, self.context.accelerator
        copy = copy_to_cpu if self.async_save else (lambda x: x)
        full_state = not run.args.save_only_model
        stage_states, stage_tensors, own_stage_states = split_stage_states(stage_states)
        model_state, optimizer_state = self.format.states_to_save()
        checkpoint = Checkpoint(
            step=run.state.global_step, model_state=model_state, optimizer_state=optimizer_state,
            scheduler=copy(run.lr_scheduler.state_dict()) if full_state and self.writes_files else None,
            scaler=copy(acc.scaler.state_dict()) if full_state and acc.scaler is not None else None,
            rng=(self.rng_for_next_save or files.rng_state()) if full_state else None,
            trainer_state=run.state.to_json_string(),
            loopkit_state=json.dumps({**stage_states, RECORD_KEY: self.lineage.record()}, indent=2, sort_keys=True),
            stage_tensors=stage_tensors, own_stage_states=json.dumps(own_stage_states, sort_keys=True),
            writes_files=self.writes_files, process_index=acc.process_index, num_processes=acc.num_processes)
        if self.node_local_disks:
            from accelerate.utils import gather_object

            every = gather_object(checkpoint.process_files())  # small: RNG states, a batch read ahead
            checkpoint.process_parts = every if self.writes_files else []
        return checkpoint

    def start_background_write(self, checkpoint: Checkpoint, push: str | None,
                               committed: CommittedSave) -> threading.Thread:
        """`async_save`: the folder is opened on the training thread (every process); the model's and optimizer's
        states are copied to host memory on a staging thread while the next step's forward and backward run (the
        optimizer's next step waits for it: `WeightsHold`), and the format writes the copies on the writer thread.
        With several processes the write's collectives and the agreement that every process wrote run on a gloo
        group of their own, apart from training's."""
        tmp, final = self.open_folder(checkpoint.step)
        if self.context.accelerator.num_processes > 1:
            checkpoint.process_group = self.async_group()
        run = self.run
        model = unwrap_model(self.context.accelerator, run.model_wrapped, keep_torch_compile=False)
        staging = Staging(checkpoint, copy_now={name for name, _ in model.named_buffers()})
        self.weights_hold = WeightsHold(getattr(run.optimizer, "optimizer", run.optimizer), staging)
        writer = threading.Thread(target=self.write_in_background, args=(staging, tmp, final, push, committed),
                                  daemon=False)
        writer.start()
        return writer

    def async_group(self):
        """A gloo group for the writer thread's collectives (created once, by every process at the same save)."""
        if self.checkpoint_group is None:
            import torch.distributed as dist

            self.checkpoint_group = dist.new_group(backend="gloo")
        return self.checkpoint_group

    def write_in_background(self, staging: Staging, tmp: str, final: str, push: str | None,
                            committed: CommittedSave) -> None:
        checkpoint, group = staging.checkpoint, staging.checkpoint.process_group
        try:
            with heap_left_to_training():
                self.agreed(lambda: self.format.write_checkpoint(staging.result(), tmp), group,
                            "another process failed to write its part of the checkpoint")
                # Agreed again once renamed: no process announces the checkpoint before the writing ones renamed it.
                self.agreed(lambda: self.close_folder(tmp, final), group, "the rename of the checkpoint failed")
        except Exception as exc:  # handed to the training thread at the next save, step or the end
            self.discard_folder(tmp)
            self.writer_error = (checkpoint, exc)
            return
        self.after_save(final, push, committed.state)
        self.committed = (*self.committed, committed)  # read once this thread has ended (take_committed)

    def agreed(self, action, group, elsewhere: str) -> None:
        """`action()` on every process of `group`, then one agreement that all succeeded: raises this process's
        failure, or `RuntimeError(elsewhere)` when another process failed."""
        failure = None
        try:
            action()
        except Exception as exc:
            failure = exc
        if not self.all_wrote(failure is None, group) and failure is None:
            failure = RuntimeError(elsewhere)
        if failure is not None:
            raise failure

    @staticmethod
    def all_wrote(wrote: bool, group) -> bool:
        """Whether every process of `group` wrote its part (one all-reduce on it; True in one process)."""
        if group is None:
            return wrote
        import torch.distributed as dist

        flag = torch.tensor([0 if wrote else 1])
        dist.all_reduce(flag, group=group)
        return int(flag) == 0

    def write_handling_errors(self, checkpoint: Checkpoint, push: str | None = None,
                              committed: CommittedSave | None = None) -> None:
        try:
            self.write(checkpoint, push, committed)
        except Exception as exc:
            self.report_failure(checkpoint, exc)

    def wait(self) -> None:
        """Wait for an asynchronous save to finish; then act on its failure, if any."""
        self.wait_quietly()
        if self.writer_error is not None:
            checkpoint, exc = self.writer_error
            self.writer_error = None
            self.report_failure(checkpoint, exc)

    def wait_quietly(self) -> None:
        """On a failing run: let an asynchronous save finish (its checkpoint stays usable), reporting nothing."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None
        if self.weights_hold is not None:
            self.weights_hold.release()
            self.weights_hold = None

    def report_failure(self, checkpoint: Checkpoint, exc: Exception) -> None:
        previous = self.lineage.last_checkpoint()
        message = (f"Saving checkpoint-{checkpoint.step} failed ({type(exc).__name__}: {exc}). Nothing was "
                   f"half-written; the most recently saved complete checkpoint is still {previous}.")
        if self.on_save_error == "raise":
            raise RuntimeError(message + " (on_save_error='raise')") from exc
        warnings.warn(message + f" on_save_error={self.on_save_error!r}: "
                      + ("training goes on." if self.on_save_error == "continue" else "stopping training."))
        if self.on_save_error == "stop":
            self.run.control.should_training_stop = True

    def write(self, checkpoint: Checkpoint, push: str | None = None, committed: CommittedSave | None = None) -> None:
        """The atomic protocol: the format writes into `.tmp-checkpoint-N`, then fsync, rename to `checkpoint-N`,
        rotate; then `push` (a commit message from the uploader's `begin_push`) queues the uploads of the complete
        folder."""
        tmp, final = self.open_folder(checkpoint.step)
        try:
            self.format.write_checkpoint(checkpoint, tmp)
            self.context.accelerator.wait_for_everyone()
            self.close_folder(tmp, final)
        except BaseException:
            self.discard_folder(tmp)
            raise
        if committed is not None:  # committed: the run's state names its best (rotation keeps it), to announce
            self.run.state.best_model_checkpoint = committed.best_model_checkpoint
            self.committed = (*self.committed, committed)
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

    def close_folder(self, tmp: str, final: str) -> None:
        """Once every process has written its files: fsync, and the rename that makes the folder a checkpoint. No
        collective: it may run on a writer thread."""
        if not self.writes_files:
            return
        files.fsync_tree(tmp)
        if os.path.isdir(final):
            self.lineage.replace_existing(final, tmp)
        else:
            os.replace(tmp, final)
        files.fsync_dir(os.path.dirname(final))

    def discard_folder(self, tmp: str) -> None:
        if self.writes_files:
            shutil.rmtree(tmp, ignore_errors=True)

    def after_save(self, final: str, push: str | None, state=None) -> None:
        """Rotation (by `state`, the checkpoint's trainer state; None: the run's), then the push of the complete
        folder (after rotation: no upload lists a folder being deleted)."""
        if self.writes_files:
            self.rotation.rotate(state)
            self.hub.push_checkpoint(final, push)
