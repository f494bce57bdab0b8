"""The run report: where the time went, how fast it ran, what it reached, and charts of it.

`PhaseClock` adds up wall time per phase from timestamps the loop takes at boundaries it crosses anyway: two
`perf_counter()` calls per phase and step, no device synchronisation. On a GPU the host does not wait for kernels, so
device time shows up in the phase that next waits for the device (a logging point, the optimizer step); on a CPU the
split is exact. Every second of `train()` belongs to a phase: setup (until `on_train_begin`), data, forward,
backward, optimizer, logging (the training logs, where a GPU run waits for its device), callbacks, evaluation,
checkpoint, teardown (from the end of the last epoch) and the report itself; "other" is what falls between them
(the loop's own bookkeeping).

At the end of a run (and when it fails) the teardown stage writes `run_report.json` and `run_report.md` to the
output folder and prints a one-screen summary. The PNG charts of the loss, learning rate and evaluation metrics are
drawn after `train()` returns, by a background thread (one chart job at a time, in order; the interpreter waits for
it before exiting; `wait_for_charts()` waits for it explicitly). Without matplotlib the report says how to get them.

Each checkpoint carries a run record (`run_record()`, under "run_record" in `loopkit_state.json`): the elapsed time
and phase totals of every stretch of training so far (one per resume), and the metric settings. A resumed run's
report covers the whole run from it, and `python -m loopkit report RUN_DIR` rebuilds the report of a run killed
before its teardown from its newest checkpoint. Time a killed run spent after its last checkpoint is in no file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import statistics
import sys
import threading
import time
import warnings
from collections import deque

PHASES = ("setup", "data", "forward", "backward", "optimizer", "logging", "callbacks", "evaluation", "checkpoint",
          "teardown", "report")
REPORT_JSON, REPORT_MD = "run_report.json", "run_report.md"
RUN_RECORD_KEY = "run_record"  # the run record's top-level key in loopkit_state.json
SLOW_FACTOR, SLOW_WARMUP = 3.0, 20  # a step slower than 3x the running median, once 20 steps give a median
CHARTS_HINT = "Charts need matplotlib: pip install 'loopkit[charts]', then python -m loopkit report RUN_DIR."


class PhaseClock:
    """Seconds per phase, step durations, the steps much slower than the running median, and the stretches of
    training before this one (a resumed run's history, from its checkpoint's run record)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.timed = 0.0  # the sum of `totals`, kept up to date (read at every span)
        self.started = time.perf_counter()
        self.last_step_end = self.started
        self.recent = deque(maxlen=100)
        self.median = None
        self.totals_at_last_step = dict(self.totals)
        self.slow_steps = []
        self.steps = 0
        self.earlier_segments, self.first_step = [], 0
        self.background = None
        self.enter("setup")  # a run starts with its setup

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
        return Span(self, phase)

    def step_done(self, step: int) -> None:
        now = time.perf_counter()
        seconds, self.last_step_end = now - self.last_step_end, now
        self.steps += 1
        if self.median is not None and self.steps > SLOW_WARMUP and seconds > SLOW_FACTOR * self.median:
            phases = {p: round(self.totals[p] - self.totals_at_last_step[p], 6) for p in PHASES}
            self.slow_steps.append({"step": step, "seconds": round(seconds, 6), "median": round(self.median, 6),
                                    "phases": phases})
        self.recent.append(seconds)
        if self.steps % 10 == 0 or self.median is None:
            self.median = statistics.median(self.recent)
        self.totals_at_last_step = dict(self.totals)

    def segment(self, step: int) -> dict:
        """This stretch of training so far, as the run record stores it. The open background phase counts up to
        now without being closed (a checkpoint reads this mid-setup or mid-teardown too)."""
        phases = dict(self.totals)
        if self.background is not None:
            phases[self.background.phase] += self.background.own_seconds()
        return {"from_step": self.first_step, "to_step": step,
                "seconds": round(time.perf_counter() - self.started, 6),
                "phase_seconds": {p: round(v, 6) for p, v in phases.items()}}

    def segments(self, step: int) -> list[dict]:
        """Every stretch of the run: those before each resume, then this one."""
        return self.earlier_segments + [self.segment(step)]


class Span:
    """One timed block (a plain class: cheaper than a generator-based context manager on the hot path)."""

    __slots__ = ("clock", "phase", "start", "timed_before")

    def __init__(self, clock: PhaseClock, phase: str):
        self.clock, self.phase = clock, phase

    def __enter__(self):
        self.timed_before = self.clock.timed
        self.start = time.perf_counter()
        return self

    def own_seconds(self) -> float:
        return time.perf_counter() - self.start - (self.clock.timed - self.timed_before)

    def __exit__(self, *exc):
        clock = self.clock
        own = self.own_seconds()
        clock.totals[self.phase] += own
        clock.timed += own
        return False


def run_record(clock: PhaseClock, args, global_step: int) -> dict:
    """What a checkpoint remembers of the run as a whole (plain JSON): elapsed time and phase totals (None when a
    stretch before a resume is unknown), the metric settings, and each stretch of training (`segments`: steps and
    seconds before and after every resume)."""
    segments = clock.segments(global_step)
    seconds, phases = whole_run_totals(segments)
    return {"elapsed_seconds": seconds, "phase_seconds": phases,
            "metric_for_best_model": args.metric_for_best_model, "greater_is_better": args.greater_is_better,
            "segments": segments}


def whole_run_totals(segments: list[dict]) -> tuple[float | None, dict]:
    """Seconds of all segments (None if any is unknown) and phase seconds summed over the known ones."""
    phases = dict.fromkeys(PHASES, 0.0)
    for segment in segments:
        for phase, value in (segment.get("phase_seconds") or {}).items():
            phases[phase] = round(phases.get(phase, 0.0) + value, 6)
    known = [s["seconds"] for s in segments]
    return (round(sum(known), 6) if None not in known else None), phases


def time_by_phase(segments: list[dict]) -> dict | None:
    """Seconds and percent per phase over the segments whose time is known (`covers_steps` lists them); "other" is
    the rest of their time."""
    known = [s for s in segments if s["seconds"] is not None]
    if not known:
        return None
    total, phases = whole_run_totals(known)
    phases["other"] = round(max(0.0, total - sum(phases.values())), 6)
    return {"seconds": phases, "percent": {p: round(100 * v / total, 2) if total else 0.0 for p, v in phases.items()},
            "covers_steps": [[s["from_step"], s["to_step"]] for s in known]}


def peak_host_memory_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 1024 if sys.platform != "darwin" else peak / 2**20, 1)


def peak_device_memory_mb() -> float | None:
    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return None


def build_report(run, status: str, counters: dict, train_metrics: dict | None = None) -> dict:
    """The report of a live run (called by the teardown stage): `run` is the `RunState`, `counters` the input tokens
    and samples trained on. Building it is the "report" phase; the time by phase is read right after, so the files
    written next are the only part of `train()` outside it."""
    state, clock, args = run.state, run.clock, run.args
    with clock.span("report"):
        evals = [h for h in state.log_history if any(k.startswith("eval_") and k.endswith("_loss") for k in h)]
        history = list(state.log_history)
        report = RunReport({
            "status": status, "output_dir": args.output_dir, "global_step": state.global_step,
            "max_steps": state.max_steps, "epoch": state.epoch, "final_metrics": evals[-1] if evals else {},
            "best_metric": state.best_metric, "metric_for_best_model": args.metric_for_best_model,
            "greater_is_better": args.greater_is_better, "best_checkpoint": state.best_model_checkpoint,
            "train_metrics": train_metrics or {}, "input_tokens": counters["tokens"],
            "peak_host_memory_mb": peak_host_memory_mb(), "peak_device_memory_mb": peak_device_memory_mb(),
            "slow_steps": clock.slow_steps, "log_history": history, "charts": planned_charts(history),
        })
    clock.enter(None)  # closes the teardown phase: everything up to here is in the totals below
    segments = clock.segments(state.global_step)
    this_run = segments[-1]["seconds"]
    report.update(total_seconds=whole_run_totals(segments)[0], this_run_seconds=this_run, segments=segments,
                  time_by_phase=time_by_phase(segments),
                  samples_per_second=round(counters["samples"] / this_run, 3) if this_run else None,
                  tokens_per_second=round(counters["tokens"] / this_run, 3) if this_run else None)
    return report


class RunReport(dict):
    """The run report: the dict written to run_report.json, which a notebook renders as Markdown (`loop.report`)."""

    def _repr_markdown_(self) -> str:
        return report_markdown(self)


def report_markdown(report: dict) -> str:
    """The report as Markdown: the summary, time by phase as a table, and the charts (waited for: they are drawn
    after `train()` returns)."""
    summary = summary_text(report).splitlines()
    lines = [f"**{summary[0]}**", "", *(f"- {line.strip()}" for line in summary[1:]
                                         if not line.strip().startswith(("time by phase", "charts")))]
    phases = report.get("time_by_phase")
    if phases:
        lines += ["", "| phase | seconds | % |", "|---|---:|---:|"]
        lines += [f"| {p} | {s:.2f} | {phases['percent'][p]:.0f} |" for p, s in phases["seconds"].items() if s > 0]
    charts = report.get("charts")
    if isinstance(charts, list) and charts:
        wait_for_charts()
        lines += [""] + [f"![{c}]({os.path.join(report['output_dir'], c).replace(' ', '%20')})" for c in charts]
    return "\n".join(lines)


# -- charts ------------------------------------------------------------------------------------------------------
def series(log_history: list, key: str) -> tuple[list, list]:
    points = [(h["step"], h[key]) for h in log_history if isinstance(h.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def eval_metric_keys(log_history: list) -> list[str]:
    skip = ("_runtime", "_samples_per_second", "_steps_per_second", "_model_preparation_time")
    keys = []
    for h in log_history:
        for k, v in h.items():
            if k.startswith("eval_") and not k.endswith(skip) and isinstance(v, (int, float)) and k not in keys:
                keys.append(k)
    return keys


def chart_panels(log_history: list) -> list[tuple[str, str, list]]:
    """(file name, title, [(key, steps, values), ...]) of each chart that has something to draw."""
    panels = [("loss.png", ["loss"], "training loss"), ("learning_rate.png", ["learning_rate"], "learning rate"),
              ("eval_metrics.png", eval_metric_keys(log_history), "evaluation metrics")]
    drawn = []
    for name, keys, title in panels:
        lines = [(key, *series(log_history, key)) for key in keys]
        lines = [line for line in lines if line[1]]
        if lines:
            drawn.append((name, title, lines))
    return drawn


def matplotlib_missing() -> bool:
    if "matplotlib" in sys.modules:
        return sys.modules["matplotlib"] is None
    return importlib.util.find_spec("matplotlib") is None


def planned_charts(log_history: list) -> list[str] | str:
    """The chart files a report will have, or, without matplotlib, the sentence saying how to get them."""
    if matplotlib_missing():
        return CHARTS_HINT
    return [name for name, _, _ in chart_panels(log_history)]


def draw_charts(log_history: list, folder: str) -> list[str]:
    """Draw the charts into `folder` now. Uses matplotlib's object API, never pyplot: no global backend switch in
    the user's process, no shared figure registry, safe off the main thread. Each PNG appears complete or not at
    all (written under a temporary name, then renamed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    written = []
    for name, title, lines in chart_panels(log_history):
        fig = Figure(figsize=(6.4, 3.6), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for key, steps, values in lines:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=key)
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend()
        path = os.path.join(folder, name)
        fig.savefig(path + ".tmp", format="png")
        os.replace(path + ".tmp", path)
        written.append(name)
    # matplotlib caches open font files for the life of the process; a training library should not hold them.
    import matplotlib.font_manager

    clear_font_cache = getattr(matplotlib.font_manager, "_get_font", None)
    if hasattr(clear_font_cache, "cache_clear"):
        clear_font_cache.cache_clear()
    return written


class ChartQueue:
    """Chart jobs drawn one at a time, in order, by a background thread that exists only while there is work.

    The thread is not a daemon: the interpreter waits for it at exit, so no chart is lost. One job at a time keeps
    matplotlib's caches single-threaded; the next `train()` in the process (a hyper-parameter search) only shares
    the CPU with it. A failed job is a warning, never an exception in the training thread."""

    def __init__(self):
        self.forget()
        # A process forked while a job runs would inherit a held lock and no worker: it starts afresh instead.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.forget)

    def forget(self) -> None:
        self.jobs = deque()
        self.lock = threading.Lock()
        self.worker = None

    def submit(self, log_history: list, folder: str) -> None:
        with self.lock:
            self.jobs.append((log_history, folder))
            if self.worker is None:
                self.worker = threading.Thread(target=self.drain, name="loopkit-charts", daemon=False)
                self.worker.start()

    def drain(self) -> None:
        while True:
            with self.lock:
                if not self.jobs:
                    self.worker = None
                    return
                log_history, folder = self.jobs.popleft()
            try:
                draw_charts(log_history, folder)
            except Exception as exc:
                if not os.path.isdir(folder):
                    continue  # the run's folder was deleted meanwhile (a temporary run): nobody wants its charts
                warnings.warn(f"Could not draw the run's charts in {folder}: {type(exc).__name__}: {exc}. "
                              f"`python -m loopkit report {folder}` draws them again.")

    def wait(self) -> None:
        while True:
            with self.lock:
                worker = self.worker
            if worker is None:
                return
            worker.join()


CHARTS = ChartQueue()


def wait_for_charts() -> None:
    """Block until every chart scheduled so far is drawn (the interpreter also waits for them at exit)."""
    CHARTS.wait()


# -- the report's text and files ---------------------------------------------------------------------------------
def seconds_text(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def duration_text(report: dict) -> str:
    segments = report.get("segments") or []
    if report.get("total_seconds") is None:
        unknown = next((s for s in segments if s["seconds"] is None), None)
        where = f" (steps {unknown['from_step']}-{unknown['to_step']} ran without a run record)" if unknown else ""
        text = f"time unknown{where}"
    else:
        text = seconds_text(report["total_seconds"])
    if len(segments) > 1:
        text += f", in {len(segments)} segments (resumed at step " + ", ".join(
            str(s["from_step"]) for s in segments[1:]) + ")"
    return text


def summary_text(report: dict) -> str:
    """The one-screen summary, also the body of run_report.md."""
    lines = [f"loopkit run report: {report['status']}  ({report['output_dir']})",
             f"  steps {report['global_step']}/{report['max_steps']}, epoch {report['epoch']:.3g}, "
             f"{duration_text(report)}"]
    if report.get("samples_per_second") is not None:
        lines.append(f"  {report['samples_per_second']:.1f} samples/s, {report['tokens_per_second']:.0f} input "
                     f"tokens/s, peak host memory {report['peak_host_memory_mb']:.0f} MB"
                     + (f", peak device memory {report['peak_device_memory_mb']:.0f} MB"
                        if report.get("peak_device_memory_mb") else ""))
    final = {k: v for k, v in report.get("final_metrics", {}).items() if k not in ("step", "epoch")
             and not k.endswith(("_runtime", "_per_second"))}
    if final:
        lines.append("  final evaluation: " + ", ".join(f"{k}={v:.4g}" for k, v in final.items()
                                                          if isinstance(v, (int, float))))
    if report.get("best_metric") is not None:
        lines.append(f"  best {report.get('metric_for_best_model') or '(metric name unknown)'}="
                     f"{report['best_metric']:.4g} at {report.get('best_checkpoint')}")
    phases = report.get("time_by_phase")
    if phases:
        covered = "" if report.get("total_seconds") is not None else " (steps " + ", ".join(
            f"{a}-{b}" for a, b in phases.get("covers_steps", [])) + ")"
        lines.append(f"  time by phase{covered}: " + ", ".join(f"{p} {s:.2f}s ({phases['percent'][p]:.0f}%)"
                                                     for p, s in phases["seconds"].items() if s > 0))
    for slow in report.get("slow_steps", [])[:5]:
        worst = max(slow["phases"], key=slow["phases"].get)
        lines.append(f"  slow step {slow['step']}: {slow['seconds']:.3f}s vs median {slow['median']:.3f}s "
                     f"(mostly {worst}: {slow['phases'][worst]:.3f}s)")
    charts = report.get("charts")
    if isinstance(charts, list) and charts:
        lines.append("  charts: " + ", ".join(charts))
    elif isinstance(charts, str):
        lines.append("  " + charts)
    return "\n".join(lines)


def write_report(report: dict, folder: str, echo: bool = True) -> dict:
    """run_report.json, run_report.md and the console summary; the charts go to the background queue."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, REPORT_JSON), "w") as f:
        json.dump(report, f, indent=2, default=str)
    text = summary_text(report)
    charts = report.get("charts")
    with open(os.path.join(folder, REPORT_MD), "w") as f:
        f.write("```\n" + text + "\n```\n")
        for chart in charts if isinstance(charts, list) else []:
            f.write(f"\n![{chart}]({chart})\n")
    if echo:
        print(text)
    if isinstance(charts, list) and charts:
        CHARTS.submit(report["log_history"], folder)  # last: from here on the drawing competes for the CPU
    return report


def report_from_files(run_dir: str) -> dict:
    """Rebuild the report of a finished or crashed run: its `run_report.json` if that is newer than its most
    recently saved checkpoint, else that checkpoint's `trainer_state.json` and run record (a run killed before its
    teardown)."""
    from .checkpoint import last_checkpoint

    path = os.path.join(run_dir, REPORT_JSON)
    newest = last_checkpoint(run_dir)
    if os.path.isfile(path) and (newest is None or os.path.getmtime(path) >= os.path.getmtime(newest)):
        with open(path) as f:
            report = json.load(f)
        report["charts"] = planned_charts(report.get("log_history", []))
        return report
    if newest is None:
        raise FileNotFoundError(f"{run_dir} holds neither {REPORT_JSON} nor a checkpoint: nothing to report.")
    return report_from_checkpoint(run_dir, newest)


def report_from_checkpoint(run_dir: str, checkpoint: str) -> dict:
    """The report as far as `checkpoint` knows the run. Without a run record (HF Trainer's checkpoints, loopkit's
    before it had one) the time and the metric name are unknown, and the report says so."""
    from .checkpoint import LOOPKIT_STATE_NAME, TRAINER_STATE_NAME

    with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as f:
        state = json.load(f)
    record = None
    if os.path.isfile(os.path.join(checkpoint, LOOPKIT_STATE_NAME)):
        with open(os.path.join(checkpoint, LOOPKIT_STATE_NAME)) as f:
            record = json.load(f).get(RUN_RECORD_KEY)
    step = state["global_step"]
    segments = record["segments"] if record else [{"from_step": 0, "to_step": step, "seconds": None,
                                                  "phase_seconds": None}]
    history = state["log_history"]
    evals = [h for h in history if any(k.startswith("eval_") for k in h)]
    return {"status": f"incomplete (rebuilt from {os.path.basename(checkpoint)})", "output_dir": run_dir,
            "global_step": step, "max_steps": state["max_steps"], "epoch": state["epoch"] or 0,
            "final_metrics": evals[-1] if evals else {}, "best_metric": state.get("best_metric"),
            "metric_for_best_model": record.get("metric_for_best_model") if record else None,
            "greater_is_better": record.get("greater_is_better") if record else None,
            "best_checkpoint": state.get("best_model_checkpoint"), "total_seconds": whole_run_totals(segments)[0],
            "segments": segments, "time_by_phase": time_by_phase(segments), "log_history": history,
            "slow_steps": [], "charts": planned_charts(history)}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loopkit", description="loopkit command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    report_cmd = sub.add_parser("report", help="rebuild the run report (summary, JSON, charts) of RUN_DIR")
    report_cmd.add_argument("run_dir")
    args = parser.parse_args(argv)
    write_report(report_from_files(args.run_dir), args.run_dir)
    return 0  # the interpreter waits for the charts before it exits
