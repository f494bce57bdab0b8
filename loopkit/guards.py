"""Run guards: preemption signals and non-finite losses or gradients, watched without a host sync per step.

Interruption (Ctrl-C, SIGTERM): while `train()` runs, the first SIGTERM or SIGINT prints at once what will happen
("finishing step N, then saving checkpoint-N; press Ctrl-C again to stop without saving") and sets a flag. The loop
finishes the current optimizer step, writes an atomic checkpoint, fires `on_save`, ends the run through the normal
teardown (`on_train_end`; `save_total_limit=1` keeps that checkpoint too) and its report names the checkpoint and the
call that resumes it. A second signal stops at once: a save in progress is abandoned (its temporary folder is
removed) and the checkpoints already on disk stay as they are. A signal during evaluation abandons the evaluation;
the checkpoint is the last optimizer step's, and a resumed run runs the pending evaluation first.

How `train()` then ends depends on who runs the process:
* under a launcher or scheduler (several processes, or any of the environment variables in `LAUNCHER_ENV`:
  torchrun/torchelastic, `accelerate launch`, SLURM, MPI) and not interactive, the process exits with status
  128 + signal (143 for SIGTERM, 130 for SIGINT), as the launcher expects (`Preempted`, a `SystemExit`);
* otherwise (a script, a notebook, a REPL) `train()` raises `TrainingInterrupted`, a `KeyboardInterrupt` that carries
  the checkpoint path and the resume call, so code after `train()` can catch it and go on. Uncaught in a script it
  ends the process with a traceback and status 1 (Python's rule for an exception other than KeyboardInterrupt itself).

With several processes the ranks agree after every optimizer step through one all-reduce of a flag, on a gloo group
of their own (host memory: no device sync, nothing in the training group's stream) made when `train()` starts. It
is started after step N and read after step N + 1, so no process waits for it: a signal during step N (or during
its log/evaluate/save) stops every process after step N + 1 at the latest, the same step on each. A single process
checks every step, which costs nothing. docs/distributed.md ("Preemption") gives the bound against a launcher's
grace period.

Under a launcher a repeated SIGTERM is the same preemption again (SLURM signals every process of a job step, and
torchrun forwards its own SIGTERM to its workers: a worker gets two); it is noted and the save goes on. The
launcher's SIGKILL at the end of its grace period is the hard stop. A second SIGINT (Ctrl-C) still stops at once.

Non-finite values: `nonfinite=` on the step stage chooses the policy:
* "ignore" (HF Trainer's behaviour): train on; the logged loss filters NaN/Inf (`logging_nan_inf_filter`).
* "skip": an optimizer step whose loss or gradient norm is not finite is not applied. Done on the device through the
  fused optimizer's `found_inf` input (`optim="adamw_torch_fused"`, the default), so nothing waits for the device.
  The scheduler still advances on a skipped step.
* "stop": skip as above, and at the next check write a checkpoint and stop training.
* "raise": at the next check, raise `FloatingPointError` (the last complete checkpoint stays resumable).
Each check reports the first bad step and the micro-batches of the epoch that formed it.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading

import torch

NONFINITE_POLICIES = ("ignore", "skip", "stop", "raise")


# Set by torchrun/torchelastic, `accelerate launch` (one process: ACCELERATE_DYNAMO_BACKEND; several: torchrun's),
# SLURM and MPI launchers: their presence means a launcher or scheduler reads this process's exit status.
LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "ACCELERATE_DYNAMO_BACKEND", "SLURM_JOB_ID",
                "OMPI_COMM_WORLD_RANK", "PMI_RANK")


class Preempted(SystemExit):
    """Raised to end the process after an interruption under a launcher; its code is 128 + the signal number."""


class TrainingInterrupted(KeyboardInterrupt):
    """`train()` was interrupted by a signal outside a launcher. `checkpoint`: the newest complete checkpoint (None
    if there is none), `saved`: whether it was written for this interruption (False after a second signal: an
    earlier one), `resume`: the call that resumes from it, `signum`: the signal."""

    def __init__(self, signum: int, checkpoint: str | None, saved: bool):
        self.signum, self.checkpoint, self.saved = signum, checkpoint, saved
        self.resume = resume_call(checkpoint)
        self.status = interruption_text(signum, checkpoint, saved)  # the run report's status line
        super().__init__(self.status + (f"; resume: {self.resume}" if self.resume else ""))


class EvaluationInterrupted(Exception):
    """A preemption signal arrived during evaluation: the evaluation is abandoned."""


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def under_launcher(num_processes: int) -> bool:
    """Whether a launcher or scheduler reads this process's exit status (see the module docstring)."""
    interactive = hasattr(sys, "ps1") or sys.flags.interactive or "ipykernel" in sys.modules
    return not interactive and (num_processes > 1 or any(name in os.environ for name in LAUNCHER_ENV))


def resume_call(checkpoint: str | None) -> str | None:
    """The call that resumes from `checkpoint` (named without guessing what the user called their `Loop`), and for
    a script run with `--output_dir` (HF's example scripts) the command line too."""
    if checkpoint is None:
        return None
    call = f'train(resume_from_checkpoint="{os.path.abspath(checkpoint)}") on a Loop built as before'
    argv = [a for a in sys.argv if not a.startswith("--resume_from_checkpoint")]
    if "--output_dir" in argv or any(a.startswith("--output_dir=") for a in argv):
        command = " ".join(["python", *argv, "--resume_from_checkpoint", os.path.abspath(checkpoint)])
        call += f", or run: {command}"
    return call


def interruption_text(signum: int, checkpoint: str | None, saved: bool) -> str:
    if saved:
        return f"interrupted by {signal_name(signum)}: saved {checkpoint}"
    kept = f"the newest checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written yet"
    return f"stopped by a second {signal_name(signum)} without saving: {kept}"


class PreemptionWatch:
    """Installs SIGTERM/SIGINT handlers for the duration of a run (main thread only) and records the signal.

    With `run` and `context` (the `RunState` and `RunContext`), the first signal prints what will happen and a
    second one raises `TrainingInterrupted` at once. The loop's guard check tells it the step it checked
    (`checked`), so a signal at that step is acted on after the next one, and one at a later step after that step's
    log/evaluate/save."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, run=None, context=None):
        self.run, self.context, self.check_every = run, context, 1
        self.signum = None
        self.stopped_without_saving = None  # the TrainingInterrupted a second signal raised
        self.checked_step = None
        self.previous = {}
        self.active = False
        self.group = None  # several processes: the gloo group the flag is all-reduced on (made at the first train())
        self.flag = self.pending = None  # the all-reduce started after the last step, read after the next

    def __enter__(self):
        self.signum, self.stopped_without_saving, self.checked_step, self.active = None, None, None, True
        self.flag = self.pending = None
        accelerator = getattr(self.context, "accelerator", None)
        if self.group is None and accelerator is not None and accelerator.num_processes > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # by every process, as train() starts
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self.record)
        return self

    def __exit__(self, exc_type, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous, self.active = {}, False
        if self.pending is not None and exc_type is None:  # every process started it after the last step
            self.pending.wait()
        self.flag = self.pending = None

    def record(self, signum, frame):
        if self.signum == signal.SIGTERM == signum and self.run is not None and under_launcher(
                self.context.accelerator.num_processes):  # the same preemption, signalled again (module docstring)
            os.write(2, b"\nloopkit: SIGTERM again: the preemption save goes on\n")
            return
        if self.signum is not None and self.run is not None:  # the second signal: stop now, save nothing
            self.stopped_without_saving = TrainingInterrupted(signum, self.newest_checkpoint(), saved=False)
            raise self.stopped_without_saving
        self.signum = signum
        if self.run is not None:
            os.write(2, (self.plan_text() + "\n").encode())  # os.write: print() may be mid-write in this thread

    def checked(self, step: int, check_every: int) -> None:
        """The loop checked for a signal after `step` (and for non-finite values every `check_every` steps)."""
        self.checked_step, self.check_every = step, check_every

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agreed(self) -> bool:
        """After each optimizer step: whether to stop now. One process: whether a signal came. Several: whether any
        process had one when the previous step's flag was sent (read now: that all-reduce ran during this step);
        then this step's flag is sent. Every process gets the same answer at the same step."""
        if self.group is None:
            return self.requested
        import torch.distributed as dist

        stop = False
        if self.pending is not None:
            self.pending.wait()
            stop = bool(self.flag[0])
        if stop:
            self.flag = self.pending = None
            if self.signum is None:
                self.signum = signal.SIGTERM  # another process was signalled: leave as it does
            return True
        self.flag = torch.tensor([1 if self.requested else 0], dtype=torch.int32)
        self.pending = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def plan_text(self) -> str:
        """What the first signal does, in the words printed at once."""
        run, context = self.run, self.context
        step = run.state.global_step if run.state is not None else 0
        several = context.accelerator is not None and context.accelerator.num_processes > 1
        if several:  # the flag sent after the next step is read after the one after it (module docstring)
            if self.checked_step is None:
                return (f"\nloopkit: {signal_name(self.signum)} received: finishing the steps up to the ranks' "
                        f"agreement (at most two optimizer steps), then saving their checkpoint in "
                        f"{run.args.output_dir}; press Ctrl-C again to stop without saving.")
            step = self.checked_step + 2
            how = f"finishing the steps up to step {step} (the ranks agree one step behind)"
        elif self.checked_step is None or step == self.checked_step:
            step += 1
            how = f"finishing step {step}"
        else:
            how = f"step {step} is done (an evaluation now running is abandoned; it runs first on resume)"
        return (f"\nloopkit: {signal_name(self.signum)} received: {how}, then saving checkpoint-{step} in "
                f"{run.args.output_dir}; press Ctrl-C again to stop without saving.")

    def newest_checkpoint(self) -> str | None:
        return self.context.checkpointer.last_checkpoint()

    def interruption(self) -> TrainingInterrupted | None:
        """The interruption of this run, once it is over (None: not interrupted)."""
        if self.stopped_without_saving is not None or self.signum is None:
            return self.stopped_without_saving
        saved = self.context.checkpointer.last_saved_step == self.run.state.global_step
        return TrainingInterrupted(self.signum, self.newest_checkpoint(), saved=saved)

    def status(self, failure: BaseException | None = None) -> str:
        """The run report's status: how the run ended (`failure`: the exception `train()` is raising)."""
        if failure is not None and failure is not self.stopped_without_saving:
            return f"failed: {type(failure).__name__}: {failure}"
        interruption = self.interruption()
        return interruption.status if interruption is not None else "completed"

    def leave(self, failure: BaseException | None = None) -> None:
        """The end of an interrupted `train()`: under a launcher `Preempted` (exit 128 + signal), otherwise
        `TrainingInterrupted`. Returns when the run was not interrupted (or failed for another reason)."""
        interruption = self.interruption()
        if interruption is None or (failure is not None and failure is not self.stopped_without_saving):
            return
        if under_launcher(self.context.accelerator.num_processes):
            raise Preempted(128 + interruption.signum) from None
        raise interruption


class NonFiniteWatch:
    """Counts optimizer steps with a non-finite loss or gradient norm, on the device, between two checks."""

    def __init__(self, policy: str):
        self.policy = policy
        self.count = self.first_bad_step = None
        self.windows = {}  # step -> (epoch, first micro-batch index, micro-batches) since the last check
        self.total = 0

    def start(self, device) -> None:
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first_bad_step = torch.full((), -1, dtype=torch.int64, device=device)
        self.windows, self.total = {}, 0

    def observe(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, where: tuple) -> torch.Tensor:
        """Record one optimizer step; returns the device flag `found_inf` (1.0 = do not apply this step)."""
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.count += bad
        self.first_bad_step = torch.where(bad & (self.first_bad_step < 0), step, self.first_bad_step)
        self.windows[step] = where
        return bad.float()

    def check(self) -> str | None:
        """One host sync: a report of the bad steps since the last check, or None. Resets the device counters."""
        count, first = torch.stack([self.count, self.first_bad_step]).tolist()
        where = self.windows.get(first)
        self.windows = {}
        if count == 0:
            return None
        self.count.zero_()
        self.first_bad_step.fill_(-1)
        self.total += count
        place = f" (epoch {where[0]}, micro-batches {where[1]}..{where[1] + where[2] - 1} of the epoch)" \
            if where else ""
        return (f"{count} optimizer step(s) had a non-finite loss or gradient norm since the last check "
                f"({self.total} in this run); the first was step {first}{place}")


def stop_at_step_boundary(run, context, check_every: int, check_nonfinite, save_checkpoint) -> None:
    """After an optimizer step: a preemption agreed by every process, or non-finite values found (read back every
    `check_every` steps), save this step's checkpoint (unless just saved) and stop training."""
    step = run.state.global_step
    watch = context.preemption
    watch.checked(step, check_every)  # what the next signal's message says
    preempted = watch.agreed()  # several processes: one small all-reduce on a gloo group, read a step later
    stop_for_nonfinite = check_nonfinite() if step % check_every == 0 else False
    if preempted or stop_for_nonfinite:
        if context.checkpointer.last_saved_step != step:
            save_checkpoint()  # on_save once committed (schedule.py)
        run.control.should_training_stop = True


def with_batch_size_search(run_training, run, context):
    """`run_training(batch_size, ...)` with `args.auto_find_batch_size` applied as Trainer applies it: Accelerate's
    `find_executable_batch_size` restarts the run with a smaller per-device batch after an out-of-memory error
    (this Accelerate version multiplies it by 0.9 each time), starting from a resumed checkpoint's batch size."""
    args = run.args
    if not args.auto_find_batch_size:
        return functools.partial(run_training, args.per_device_train_batch_size)
    from accelerate.utils import find_executable_batch_size

    def search(resume_from_checkpoint, trial, ignore_keys_for_eval):
        batch_size = args.per_device_train_batch_size
        checkpoint = context.checkpointer.resolve(resume_from_checkpoint)
        if checkpoint is not None:
            batch_size = context.checkpointer.read_trainer_state(checkpoint).train_batch_size or batch_size
        return find_executable_batch_size(run_training, starting_batch_size=batch_size)(
            resume_from_checkpoint, trial, ignore_keys_for_eval)

    return search
