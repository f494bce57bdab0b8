"""The overhead profile's wrappers: every callback event, every stage of loopkit's step and the torch work, timed
by `perf_counter` and attributed exclusively (a line's time excludes the wrapped calls inside it).

Worker side (imports torch and loopkit inside the functions). Used by benchmarks/profiles/overhead.py.
"""

from __future__ import annotations

import statistics
import threading
import time

from ..workloads.spec import TrainSpec

# Thread -> the Profiler timing its calls: two contenders in one process (lockstep) each get their own lines, and a
# call in a thread without one runs untimed.
ROUTES = {}


def current_profiler():
    return ROUTES.get(threading.get_ident())


class Profiler:
    """Exclusive time per named block, summed per optimizer step, for the thread that makes it (a step ends at the
    contender's end of step: `step_boundary`)."""

    def __init__(self):
        self.stack = []  # [name, start, time of the timed blocks inside, how many]
        self.current = {}  # name -> seconds in this step
        self.steps = []  # one dict per step
        self.step_started = None
        self.recording = False
        self.calls = 0  # wrapped calls in this step (the profiler's own cost scales with it)
        # What one wrapped call costs its caller beyond the time the callee measures: taken off the caller's line.
        self.per_call = 0.0
        ROUTES[threading.get_ident()] = self
        self.per_call = wrapper_cost_us(self) / 1e6

    def active_from(self, step: int, warmup_steps: int, last_step: int) -> None:
        self.recording = warmup_steps <= step < last_step

    @staticmethod
    def wrap(name, function):
        """`function`, timed on the calling thread's profiler under `name`."""
        routes, thread, now = ROUTES, threading.get_ident, time.perf_counter

        def timed(*args, **kwargs):
            profiler = routes.get(thread())
            if profiler is None:
                return function(*args, **kwargs)
            stack, entry = profiler.stack, [name, now(), 0.0, 0]
            stack.append(entry)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = now() - entry[1]
                stack.pop()
                current = profiler.current
                current[name] = current.get(name, 0.0) + elapsed - entry[2] - entry[3] * profiler.per_call
                if stack:
                    stack[-1][2] += elapsed
                    stack[-1][3] += 1
                profiler.calls += 1

        timed.__wrapped__ = function
        return timed

    @staticmethod
    def patch(owner, attribute: str, name: str) -> None:
        """Wrap `owner.attribute`, if there is one (an earlier loopkit may lack it)."""
        if owner is not None and hasattr(owner, attribute):
            setattr(owner, attribute, Profiler.wrap(name, getattr(owner, attribute)))

    def pause(self, seconds: float) -> None:
        """`seconds` just passed outside the contender (another's turn in lockstep): leave them out."""
        for entry in self.stack:
            entry[1] += seconds
        if self.step_started is not None:
            self.step_started += seconds

    def step_boundary(self) -> None:
        """The end of an optimizer step (and the start of the next): store this step's lines."""
        now = time.perf_counter()
        if self.step_started is not None and self.recording:
            step = dict(self.current)
            step["step, total"] = now - self.step_started
            step["_calls"] = self.calls
            self.steps.append(step)
        self.current.clear()
        self.calls = 0
        self.step_started = now

    def table(self) -> dict:
        """Name -> median microseconds per step; 'loop, unattributed' = total - every line (per step)."""
        names = sorted({name for step in self.steps for name in step if not name.startswith("_")})
        rows = {name: statistics.median(step.get(name, 0.0) for step in self.steps) * 1e6 for name in names}
        unattributed = [step["step, total"] - step["_calls"] * self.per_call -
                        sum(v for k, v in step.items() if not k.startswith("_") and k != "step, total")
                        for step in self.steps]
        rows["loop, unattributed"] = statistics.median(unattributed) * 1e6
        rows["_wrapped calls per step"] = statistics.median(step["_calls"] for step in self.steps)
        return rows


def wrapper_cost_us(profiler: Profiler, calls: int = 20000) -> float:
    """What one wrapped call adds to its caller's line beyond what the callee's line measures (the best of five
    tries, in microseconds); the profiler takes it off the caller's line."""
    nothing = profiler.wrap("nothing", lambda: None)
    outer = profiler.wrap("outer", lambda: [nothing() for _ in range(calls)])
    costs = []
    for _ in range(5):
        outer()
        costs.append(profiler.current.pop("outer") / calls * 1e6)
        profiler.current.clear()
    profiler.calls = 0
    return min(costs)


INSTRUMENTED = set()


def instrument(contender: str) -> None:
    """Wrap the per-step blocks of `contender` ("raw" or "loopkit") and the torch work, once per process."""
    for part in ("torch", contender):
        if part not in INSTRUMENTED:
            INSTRUMENTED.add(part)
            {"torch": instrument_torch, "raw": instrument_raw, "loopkit": instrument_loopkit}[part](Profiler)


def instrument_torch(profiler) -> None:
    """Wrap the torch work every contender does: forward, backward, clipping, the optimizer and scheduler steps."""
    import torch

    profiler.patch(torch.Tensor, "backward", "torch: backward")
    profiler.patch(torch.nn.Module, "_call_impl", "torch: model forward")
    profiler.patch(torch.optim.AdamW, "step", "torch: AdamW.step")
    profiler.patch(torch.optim.lr_scheduler.LRScheduler, "step", "torch: scheduler.step")
    profiler.patch(torch.nn.utils, "clip_grad_norm_", "torch: clip_grad_norm_")


def instrument_raw(profiler) -> None:
    """The hand-written loop: its data (the loader's batches grouped per step); a step ends at the clock's end of
    step (`cpu_per_step` / `lockstep` add the listener)."""
    from ..contenders import raw  # train_raw looks accumulation_windows up in its module

    original_windows = raw.accumulation_windows

    def accumulation_windows(loader, grad_accum):
        iterator = original_windows(loader, grad_accum)
        fetch = profiler.wrap(DATA_LINE, lambda: next(iterator, None))
        while (window := fetch()) is not None:
            yield window

    raw.accumulation_windows = accumulation_windows


DATA_LINE = "data: fetch a window (loader, collate, to device)"


def instrument_loopkit(profiler) -> None:
    """Wrap loopkit's per-step blocks (classes, so every instance the run makes is timed)."""
    import accelerate.utils

    from loopkit import events, phases, schedule
    from loopkit.loop import Loop
    try:
        from loopkit import work
    except ImportError:  # before loopkit/work.py: the step stage counted the work itself
        work = None
    from loopkit.stages import data, step

    instrument_events(profiler, events)
    # The data stage: fetching a window (Accelerate's loader, collation, moving to the device).
    original_windows = data.DataStage.windows

    def windows(stage, *args, **kwargs):
        iterator = original_windows(stage, *args, **kwargs)
        fetch = profiler.wrap(DATA_LINE, lambda: next(iterator, None))
        while (window := fetch()) is not None:
            yield window

    data.DataStage.windows = windows
    profiler.patch(accelerate.utils, "send_to_device", "data: send_to_device")
    # The step stage's parts, and the torch work inside them.
    for attribute in ("run_step", "count_loss_items", "training_step", "compute_loss", "optimizer_step",
                      "clip_gradients"):
        profiler.patch(step.StepStage, attribute, f"step: {attribute}")
    profiler.patch(getattr(work, "WorkCounter", None), "count", "step: work counting")
    profiler.patch(step.StepStage, "count_work", "step: work counting")
    profiler.patch(step.TrainMode, "enter", "step: TrainMode.enter")
    # Between steps: the schedule, the guards, the phase clock.
    profiler.patch(schedule.Schedule, "record", "schedule: record")
    profiler.patch(schedule.Schedule, "after_step", "schedule: after_step (log/eval/save)")
    profiler.patch(Loop, "check_guards", "guards: check_guards")
    profiler.patch(phases.Span, "__enter__", "phase clock: spans")
    profiler.patch(phases.Span, "__exit__", "phase clock: spans")
    original_step_done = phases.PhaseClock.step_done
    timed_step_done = profiler.wrap("phase clock: step_done", original_step_done)

    def step_done(clock, step_number):
        timed_step_done(clock, step_number)
        if current_profiler() is not None:
            current_profiler().step_boundary()

    phases.PhaseClock.step_done = step_done


def profile_steps(profiler: Profiler, contender: str, clock, spec: TrainSpec, warmup_steps: int) -> None:
    """Time `contender`'s steps after the first `warmup_steps` on `profiler` (this thread's)."""
    instrument(contender)
    clock.listeners.append(lambda step: profiler.active_from(step, warmup_steps, spec.max_steps))
    if contender == "raw":  # loopkit's steps end at its phase clock's step_done (instrument_loopkit)
        clock.listeners.append(lambda step: profiler.step_boundary())


def profile_result(profiler: Profiler) -> dict:
    return {"lines_us_per_step": profiler.table(), "wrapper_cost_us": profiler.per_call * 1e6,
            "profiled_steps": len(profiler.steps)}


def instrument_events(profiler, events) -> None:
    """loopkit's events (`loopkit.events`): each fire, and each callback's method, on lines of their own."""
    original_fire = events.EventHandler.fire

    def fire(handler, event, **extra):
        return profiler.wrap(f"event {event}: dispatch", original_fire)(handler, event, **extra)

    events.EventHandler.fire = fire
    original_rebuild = events.EventHandler._rebuild

    def rebuild(handler):
        original_rebuild(handler)
        for event, methods in handler.methods_by_event.items():
            handler.methods_by_event[event] = [
                profiler.wrap(f"event {event}: {type(m.__self__).__name__}", m) for m in methods]

    events.EventHandler._rebuild = rebuild
