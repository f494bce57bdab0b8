"""Step observers: each optimizer step's result in, extra keys in the training logs out.

`Loop(..., observers=[...])` takes objects with two methods (subclass `StepObserver`, or write any class that has
them):

* `on_step(result, window, state)`: after every window of micro-batches the step stage trained on (the `Window`,
  loopkit/stages/data.py), with what the step produced (the `StepResult`, loopkit/stages/step.py: losses, pre-clip
  gradient norm, learning rate, FLOPs, tokens, samples, `seconds`, `completed`) and HF's `state`. Called before the
  step's log, evaluation and save. It runs at every step: accumulate, and keep values on the device (add tensors,
  never `.item()`), so it costs a few additions and no device sync.
* `start(state)` (optional; `StepObserver`'s does nothing): when a `train()` begins, before its first step: forget
  what an earlier `train()` accumulated after its last log, so a log counts only its own `train()`'s windows.
* `logs(state) -> dict`: at each training log (every `logging_steps`), the keys to add to it: read and reduce what
  was accumulated (this is where a value is read back from the device), and start accumulating afresh.

The keys join the training log before anything sees it: `state.log_history`, the `report_to` integrations
(TensorBoard, W&B, ...), the progress bar or printer, user callbacks' `on_log`, and the run report, which charts
every added numeric key (`step_metrics.png`). A key the log already has is refused (with the observer's name).
Observers are off unless passed, so a `Loop` without them logs exactly what `Trainer` logs.

`StepResult.seconds` is host time (`time.perf_counter`) from when the loop asked the data stage for the window to
the end of its step (`on_step_end` included; the log, evaluation and save that follow are not). Taking it waits for
nothing. On a GPU the host queues work ahead of the device, so one window's seconds are the time the host spent on
it; the host can run ahead only by the depth of its launch queue, so over many windows host time follows device
time, and the gap is settled at the next device read (a logging point, which windows leave out).

Each process observes its own windows: figures are this process's unless an observer reduces them across processes.
A gradient statistic needs the gradients before `zero_grad`: compute it in a callback's `on_gradients_ready` (pass
the same object in `callbacks=` and `observers=`) and report it from `logs()`. `loopkit/observers/throughput.py`
is a complete observer: real tokens per second and the padding share.
"""

from __future__ import annotations

from ..errors import config_error


class StepObserver:
    """Receives each optimizer step's result; adds keys to the training logs (see the module docstring)."""

    def start(self, state) -> None:
        """When a `train()` begins: drop what was accumulated since the last log of an earlier `train()`."""

    def on_step(self, result, window, state) -> None:
        """After each window's step: accumulate (device tensors stay on the device)."""

    def logs(self, state) -> dict:
        """At each training log: the keys to add, from what was accumulated since the last call."""
        return {}


def check_observers(observers) -> list:
    """`observers` as a list, each with `on_step` and `logs`; a clear error at construction otherwise."""
    observers = list(observers or [])
    for observer in observers:
        if not (callable(getattr(observer, "on_step", None)) and callable(getattr(observer, "logs", None))):
            raise config_error("observers", observer, "it has no on_step(result, window, state) and logs(state) "
                               "methods", "subclass loopkit.observers.StepObserver and pass an instance")
    return observers


def start_observers(observers, state) -> None:
    """A `train()` begins: each observer that has `start` forgets what it accumulated before."""
    for observer in observers:
        start = getattr(observer, "start", None)
        if callable(start):
            start(state)


def observer_logs(observers, logs: dict, state) -> dict:
    """`logs` with every observer's keys added, in observer order; a key already there is an error."""
    for observer in observers:
        added = observer.logs(state)
        taken = sorted(key for key in added if key in logs or key in ("epoch", "step"))
        if taken:
            raise ValueError(f"{type(observer).__name__}.logs() returned {taken}, which the training log has "
                             f"already. Fix: give the observer's keys names of their own.")
        logs.update(added)
    return logs
