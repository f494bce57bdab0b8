"""The phase clock, on the training hot path: wall time per phase, step durations, slow steps; and `speed_metrics`.

`PhaseClock` adds up wall time per phase from timestamps the loop takes at boundaries it crosses anyway: two
`perf_counter()` calls per phase and step, no device synchronisation. On a GPU the host does not wait for kernels, so
device time shows up in the phase that next waits for the device (a logging point, the optimizer step); on a CPU the
split is exact. Every second of `train()` belongs to a phase: setup (until `on_train_begin`), compile (torch.compile's
compilations, wherever they fall; counted too, loopkit/compilation.py), data, forward, backward, optimizer, logging
(the training logs, where a GPU run waits for its device), callbacks, evaluation, checkpoint, teardown (from the
end of the last epoch) and the report itself; "other" is what falls between them (the loop's own bookkeeping).

The run report (loopkit/report/) reads the clock. `speed_metrics` makes HF's `*_runtime` and `*_per_second`
keys for the schedule, the evaluation and the teardown.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque

PHASES = ("setup", "compile", "data", "forward", "backward", "optimizer", "logging", "callbacks", "evaluation",
          "checkpoint", "teardown", "report")
# A slow step: slower than 3x the running median AND beyond the run's normal spread (median + 5 robust standard
# deviations, from the median absolute deviation), once 20 steps give a median. A step's scheduled evaluation and
# checkpoint time is left out: it is expected, not slowness.
SLOW_FACTOR, SLOW_SPREADS, SLOW_WARMUP = 3.0, 5.0, 20
RECENT_STEPS = 100  # the running median's window
MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal distribution is 0.6745 sigma
SCHEDULED_PHASES = ("evaluation", "checkpoint")
TIMELINE_POINTS = 512  # the step timeline (throughput chart) keeps at most about this many points per segment


class PhaseClock:
    """Seconds per phase, step durations, the steps much slower than the running median, and the stretches of
    training before this one (a resumed run's history, from its checkpoint's run record)."""

    # The step clocks (wall and process CPU time), replaceable in a test of the slow-step detector.
    wall, cpu = staticmethod(time.perf_counter), staticmethod(time.process_time)

    def __init__(self):
        self.compile_watch = None
        self.reset()

    def reset(self) -> None:
        self.stop_watching_compilations()
        self.compilations = 0  # torch.compile's, while `watch_compilations()` is on
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.timed = 0.0  # the sum of `totals`, kept up to date (read at every span)
        self.started = time.perf_counter()
        self.last_step_end = self.wall_started = self.wall()
        self.cpu_started = self.last_step_cpu = self.cpu()
        self.load_at_start = load_average()
        self.cores = os.cpu_count() or 1  # read once: ~70 us a call on some machines, and it is asked at every log
        self.recent = deque(maxlen=RECENT_STEPS)  # recent steps' seconds, scheduled evaluation/checkpoint time left out
        self.recent_cpu_share = deque(maxlen=RECENT_STEPS)  # process CPU seconds per wall second of those steps
        self.median = self.spread = self.usual_cpu_share = None
        self.threshold = math.inf  # slow_threshold(), kept with the median it comes from
        # [step, seconds since start, scheduled seconds so far], rounded when a segment is read
        self.timeline, self.timeline_stride = [], 1
        self.totals_at_last_step = dict(self.totals)
        self.slow_steps = []
        self.steps = 0
        self.earlier_segments, self.first_step = [], 0
        self.background = None
        self.spans = {phase: Span(self, phase) for phase in PHASES}  # reused while not open (no allocation per span)
        self.enter("setup")  # a run starts with its setup

    def watch_compilations(self) -> None:
        """From now on count torch.compile's compilations, and their time as the "compile" phase (until
        `stop_watching_compilations()` or the next `reset()`; loopkit/compilation.py)."""
        from .compilation import CompileWatch

        self.stop_watching_compilations()
        self.compile_watch = CompileWatch(self)

    def stop_watching_compilations(self) -> None:
        if self.compile_watch is not None:
            self.compile_watch.stop()
        self.compile_watch = None

    def enter(self, phase: str | None) -> None:
        """From now on, the time no other phase claims counts as `phase` (setup and teardown: stretches of many
        small steps), until the next `enter`; `enter(None)` hands it back to "other"."""
        if self.background is not None:
            self.background.__exit__(None, None, None)
        self.background = Span(self, phase).__enter__() if phase is not None else None

    def resume_from(self, record: dict | None, step: int) -> None:
        """This run continues from `step` of a checkpoint whose run record is `record` (None: a checkpoint without
        one, e.g. HF Trainer's, so the time up to `step` is unknown)."""
        self.first_step = step
        if record is not None:
            self.earlier_segments = [dict(s) for s in record.get("segments", [])]
        elif step > 0:
            self.earlier_segments = [{"from_step": 0, "to_step": step, "seconds": None, "phase_seconds": None}]

    def add(self, phase: str, seconds: float) -> None:
        self.totals[phase] += seconds
        self.timed += seconds

    def span(self, phase: str) -> "Span":
        """Time a block, leaving out the time of the phases timed inside it (backward inside a training step,
        the callbacks an optimizer step fires, ...): each second is counted once."""
        span = self.spans.get(phase)
        return span if span is not None and span.start is None else Span(self, phase)

    def step_done(self, step: int) -> None:
        now, cpu = self.wall(), self.cpu()
        seconds, self.last_step_end = now - self.last_step_end, now
        cpu_seconds, self.last_step_cpu = cpu - self.last_step_cpu, cpu
        totals, before = self.totals, self.totals_at_last_step  # the SCHEDULED_PHASES, spelled out (every step)
        scheduled = totals["evaluation"] - before["evaluation"] + totals["checkpoint"] - before["checkpoint"]
        work = max(seconds - scheduled, 1e-9)
        self.steps += 1
        if work > self.threshold and self.steps > SLOW_WARMUP:
            self.slow_steps.append(self.slow_step(step, seconds, work, cpu_seconds))
        self.recent.append(work)
        self.recent_cpu_share.append(cpu_seconds / seconds if seconds > 0 else 1.0)
        # The running median and spread: every 10 steps until the window is full, then every 50 (each costs
        # ~50 us; at every 10th step that was a tenth of a small model's step on a CPU).
        if self.median is None or self.steps % (10 if self.steps <= RECENT_STEPS else 50) == 0:
            median = self.median = statistics.median(self.recent)
            self.spread = MAD_TO_SIGMA * statistics.median([abs(s - median) for s in self.recent])
            self.usual_cpu_share = statistics.median(self.recent_cpu_share)
            self.threshold = self.slow_threshold()
        self.totals_at_last_step = totals.copy()
        if self.steps % self.timeline_stride == 0:
            self.add_to_timeline(step, now)

    def slow_threshold(self) -> float:
        return max(SLOW_FACTOR * self.median, self.median + SLOW_SPREADS * self.spread)

    def slow_step(self, step, seconds, work, cpu_seconds) -> dict:
        """A slow step's record: its phases, and whether the machine was busy (load average above the cores) or
        the process waited (its CPU share far below the run's usual one): two syscalls, at slow steps only."""
        load, cores = load_average(), self.cores
        phases = {p: self.totals[p] - self.totals_at_last_step[p] for p in PHASES}
        return {"step": step, "seconds": round(seconds, 6), "without_scheduled": round(work, 6),
                "median": round(self.median, 6), "spread": round(self.spread, 6),
                "threshold": round(self.slow_threshold(), 6), "phases": {p: round(v, 6) for p, v in phases.items()},
                "cpu_share": round(cpu_seconds / seconds, 3) if seconds > 0 else None,
                "usual_cpu_share": round(self.usual_cpu_share, 3), "load_average": load, "cores": cores,
                "machine_busy": load is not None and load > cores}

    def add_to_timeline(self, step: int, now: float) -> None:
        """The throughput chart's points; past TIMELINE_POINTS every other point goes and the stride doubles."""
        totals = self.totals  # the SCHEDULED_PHASES, spelled out (every step, until the stride grows)
        self.timeline.append([step, now - self.wall_started, totals["evaluation"] + totals["checkpoint"]])
        if len(self.timeline) > TIMELINE_POINTS:
            self.timeline, self.timeline_stride = self.timeline[1::2], self.timeline_stride * 2

    def machine(self) -> dict:
        """How busy the machine was over this stretch: load averages and the process's CPU seconds per second."""
        wall = self.wall() - self.wall_started
        cpu = self.cpu() - self.cpu_started
        load_end, cores = load_average(), self.cores
        loads = [x for x in (self.load_at_start, load_end) if x is not None]
        return {"cores": cores, "load_average_start": self.load_at_start, "load_average_end": load_end,
                "cpu_seconds_per_second": round(cpu / wall, 3) if wall > 0 else None,
                "busy": bool(loads) and max(loads) > cores, "torch_threads": torch_threads()}

    def segment(self, step: int) -> dict:
        """This stretch of training so far, as the run record stores it. The open background phase counts up to
        now without being closed (a checkpoint reads this mid-setup or mid-teardown too)."""
        phases = dict(self.totals)
        if self.background is not None:
            phases[self.background.phase] += self.background.own_seconds()
        return {"from_step": self.first_step, "to_step": step,
                "seconds": round(time.perf_counter() - self.started, 6),
                "phase_seconds": {p: round(v, 6) for p, v in phases.items()},
                "timeline": [[step, round(at, 6), round(scheduled, 6)] for step, at, scheduled in self.timeline],
                "compilations": self.compilations}

    def segments(self, step: int) -> list[dict]:
        """Every stretch of the run: those before each resume, then this one."""
        return self.earlier_segments + [self.segment(step)]


class Span:
    """One timed block (a plain class: cheaper than a generator-based context manager on the hot path)."""

    __slots__ = ("clock", "phase", "start", "timed_before")

    def __init__(self, clock: PhaseClock, phase: str):
        self.clock, self.phase, self.start = clock, phase, None  # start: None while not open

    def __enter__(self):
        self.timed_before = self.clock.timed
        self.start = time.perf_counter()
        return self

    def own_seconds(self) -> float:
        return time.perf_counter() - self.start - (self.clock.timed - self.timed_before)

    def __exit__(self, *exc):
        clock = self.clock
        own = time.perf_counter() - self.start - (clock.timed - self.timed_before)  # own_seconds(), inlined
        clock.totals[self.phase] += own
        clock.timed += own
        self.start = None
        return False


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def speed_metrics(split: str, start_time: float, num_samples=None, num_steps=None, num_tokens=None) -> dict:
    runtime = time.time() - start_time
    result = {f"{split}_runtime": round(runtime, 4)}
    if runtime == 0:
        return result
    if num_samples is not None:
        result[f"{split}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps is not None:
        result[f"{split}_steps_per_second"] = round(num_steps / runtime, 3)
    if num_tokens is not None:
        result[f"{split}_tokens_per_second"] = round(num_tokens / runtime, 3)
    return result
