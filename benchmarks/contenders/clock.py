"""The clock every contender is timed by: `StepClock` timestamps each optimizer step's start (before the first
forward of its accumulation window) and end (after `zero_grad`, before any logging or saving); `ClockCallback`
takes them in HF Trainer and loopkit, the hand-written loop and the peers call the clock themselves.
"""

from __future__ import annotations

import time


class StepClock:
    """Timestamps of every optimizer step's start and end, and the harness's requests: save after step k, stop
    after step k. `listeners` are called with the step number right after each end timestamp.

    On a GPU the host runs ahead of the device, so `synchronize` (e.g. `torch.cuda.synchronize`) is called before
    the end timestamps of the steps in `sync_at`: the boundaries of a timed span, never every step."""

    def __init__(self, save_at=(), stop_at: int | None = None, sync_at=(), synchronize=None):
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []  # time.process_time() at each end: the process's CPU time, all its threads
        self.first_end_wall: float | None = None  # time.time() at the end of the first step (process-start clocks)
        self.save_at, self.stop_at = set(save_at), stop_at
        self.sync_at, self.synchronize = set(sync_at), synchronize
        self.listeners = []

    def begin(self) -> None:
        self.begins.append(time.perf_counter())

    def end(self, step: int) -> tuple[bool, bool]:
        """Record the end of optimizer step `step`; return (save now, stop now)."""
        if step in self.sync_at and self.synchronize is not None:
            self.synchronize()
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        if self.first_end_wall is None:
            self.first_end_wall = time.time()
        for listener in self.listeners:
            listener(step)
        return step in self.save_at, self.stop_at is not None and step >= self.stop_at


class ClockCallback:
    """The clock as a callback (loopkit takes any object with `on_*` methods; HF gets a `TrainerCallback` subclass)."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_step_begin(self, args, state, control, **kwargs):
        self.clock.begin()

    def on_step_end(self, args, state, control, **kwargs):
        save, stop = self.clock.end(state.global_step)
        control.should_save = control.should_save or save
        control.should_training_stop = control.should_training_stop or stop


def as_hf_callback(callback):
    """HF calls every event on every callback: give a duck-typed callback `TrainerCallback`'s no-op defaults."""
    from transformers import TrainerCallback

    hf_class = type(f"HF{type(callback).__name__}", (type(callback), TrainerCallback), {})
    adapted = object.__new__(hf_class)
    adapted.__dict__.update(vars(callback))
    return adapted
