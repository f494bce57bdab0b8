"""Staging an asynchronous save: the host copies of the model's and the optimizer's states, made on a thread of their
own while the next step's forward and backward run, instead of on the training thread at the step boundary.

Between two optimizer steps nothing writes the parameters or the optimizer's state: the forward and the backward
read the parameters and write gradients (which a checkpoint does not hold). So the copy may overlap them, as long
as the optimizer's next step waits for it: one hook, the optimizer's own step pre-hook (`register_step_pre_hook`,
which every path to `optimizer.step()` runs: Accelerate's wrapper, the GradScaler, the fused step). What a forward
may write (the model's buffers, e.g. BatchNorm's running statistics) is copied at once, on the training thread.
"""

from __future__ import annotations

import threading

import torch


def copy_to_cpu(obj):
    """A deep copy with every tensor moved to (new) CPU memory: what an asynchronous save writes."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: copy_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_to_cpu(v) for v in obj)
    return obj


class Staging:
    """The host copies of `checkpoint.model_state` and `checkpoint.optimizer_state`, made on a thread; `wait()`
    returns once they are in place (the checkpoint then holds only copies). `copy_now`: the model-state keys copied
    at once (the buffers a forward may write)."""

    def __init__(self, checkpoint, copy_now: set):
        self.checkpoint, self.error = checkpoint, None
        model = checkpoint.model_state
        if model is not None:
            checkpoint.model_state = {key: copy_to_cpu(value) if key in copy_now else value
                                      for key, value in model.items()}
        self.later = {key for key in (model or {}) if key not in copy_now}
        self.thread = threading.Thread(target=self.copy, name="loopkit-checkpoint-staging", daemon=True)
        self.thread.start()

    def copy(self) -> None:
        checkpoint = self.checkpoint
        try:
            if checkpoint.model_state is not None:
                checkpoint.model_state = {key: copy_to_cpu(value) if key in self.later else value
                                          for key, value in checkpoint.model_state.items()}
            checkpoint.optimizer_state = copy_to_cpu(checkpoint.optimizer_state)
        except BaseException as exc:  # the writer reports it (on_save_error); training is never blocked by it
            self.error = exc

    def wait(self) -> None:
        self.thread.join()

    def result(self):
        """The staged checkpoint, once the copies are made (the writer thread calls this); raises their failure."""
        self.wait()
        if self.error is not None:
            raise self.error
        return self.checkpoint


class WeightsHold:
    """Holds the optimizer's next step until a staging is done (the optimizer's step pre-hook). Released at the next
    save or when the run waits for its save (`release`, on the training thread: a hook cannot remove itself while
    the optimizer runs its hooks)."""

    def __init__(self, optimizer, staging: Staging):
        self.staging, self.handle = staging, None
        if optimizer is None:  # nothing trains the weights (save_only_model, an evaluation-only run)
            return
        if not hasattr(optimizer, "register_step_pre_hook"):  # not a torch optimizer: the copy is waited for now
            staging.wait()
            return
        self.handle = optimizer.register_step_pre_hook(self.before_step)

    def before_step(self, optimizer, args, kwargs) -> None:
        if self.staging is not None:
            self.staging.wait()
            self.staging = None  # later steps: a no-op until released

    def release(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
