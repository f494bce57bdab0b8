"""Run guards: preemption signals and non-finite losses or gradients, watched without a host sync per step.

Preemption: while `train()` runs, SIGTERM and SIGINT only set a flag. The loop finishes the current optimizer step,
writes an atomic checkpoint, fires `on_save`, ends the run through the normal teardown (`on_train_end`) and exits
with status 128 + signal (143 for SIGTERM, 130 for SIGINT). A signal during evaluation abandons the evaluation; the
checkpoint is the last optimizer step's, and a resumed run runs the pending evaluation first.

With several processes the ranks agree through one small all-reduce every `check_every` optimizer steps (so the
worst-case delay between the signal and the stop is `check_every - 1` steps); a single process checks every step,
which costs nothing.

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
import signal
import threading

import torch

NONFINITE_POLICIES = ("ignore", "skip", "stop", "raise")


class Preempted(SystemExit):
    """Raised to end the process after a preemption checkpoint; its code is 128 + the signal number."""


class EvaluationInterrupted(Exception):
    """A preemption signal arrived during evaluation: the evaluation is abandoned."""


class PreemptionWatch:
    """Installs SIGTERM/SIGINT handlers for the duration of a run (main thread only) and records the signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = None
        self.previous = {}
        self.active = False

    def __enter__(self):
        self.signum, self.active = None, True
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self.record)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous, self.active = {}, False

    def record(self, signum, frame):
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None


def preemption_agreed(preemption: PreemptionWatch, accelerator) -> bool:
    """Several processes: one tiny all-reduce, so a signal on any rank stops every rank at this same step."""
    flag = torch.tensor(float(preemption.requested), device=accelerator.device)
    agreed = accelerator.reduce(flag, reduction="max").item() > 0
    if agreed and preemption.signum is None:
        preemption.signum = 15  # another rank was signalled: leave as that rank does (SIGTERM)
    return agreed


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


def with_batch_size_search(run_training, run):
    """`run_training(batch_size, ...)` with `args.auto_find_batch_size` applied as Trainer applies it: Accelerate's
    `find_executable_batch_size` restarts the run with a smaller per-device batch after an out-of-memory error
    (this Accelerate version multiplies it by 0.9 each time), starting from a resumed checkpoint's batch size."""
    args = run.args
    if not args.auto_find_batch_size:
        return functools.partial(run_training, args.per_device_train_batch_size)
    from accelerate.utils import find_executable_batch_size

    def search(resume_from_checkpoint, trial, ignore_keys_for_eval):
        batch_size = args.per_device_train_batch_size
        checkpoint = run.checkpointer.resolve(resume_from_checkpoint)
        if checkpoint is not None:
            batch_size = run.checkpointer.read_trainer_state(checkpoint).train_batch_size or batch_size
        return find_executable_batch_size(run_training, starting_batch_size=batch_size)(
            resume_from_checkpoint, trial, ignore_keys_for_eval)

    return search
