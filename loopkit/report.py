"""The run report: where the time went, how fast it ran, what it reached, and charts of it.

`PhaseClock` adds up wall time per phase (data wait, forward, backward, optimizer, callbacks, evaluation,
checkpointing) from timestamps the loop takes at boundaries it crosses anyway: two `perf_counter()` calls per phase
and step, no device synchronisation. On a GPU the host does not wait for kernels, so device time shows up in the
phase that next waits for the device (a logging point, the optimizer step); on a CPU the split is exact.

At the end of a run (and when it fails) the teardown stage writes `run_report.json` and `run_report.md` to the
output folder, PNG charts of the loss, learning rate and evaluation metrics over steps (with matplotlib; without it
the report says how to get them), and prints a one-screen summary. `python -m loopkit report RUN_DIR` rebuilds the
report from a finished or crashed run's files.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections import deque

PHASES = ("data", "forward", "backward", "optimizer", "callbacks", "evaluation", "checkpoint")
REPORT_JSON, REPORT_MD = "run_report.json", "run_report.md"
SLOW_FACTOR, SLOW_WARMUP = 3.0, 20  # a step slower than 3x the running median, once 20 steps give a median


class PhaseClock:
    """Seconds per phase, step durations, and the steps much slower than the running median."""

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

    def breakdown(self) -> dict:
        total = time.perf_counter() - self.started
        phases = {p: round(v, 6) for p, v in self.totals.items()}
        phases["other"] = round(max(0.0, total - sum(self.totals.values())), 6)
        return {"seconds": phases, "percent": {p: round(100 * v / total, 2) if total else 0.0
                                               for p, v in phases.items()}}


class Span:
    """One timed block (a plain class: cheaper than a generator-based context manager on the hot path)."""

    __slots__ = ("clock", "phase", "start", "timed_before")

    def __init__(self, clock: PhaseClock, phase: str):
        self.clock, self.phase = clock, phase

    def __enter__(self):
        self.timed_before = self.clock.timed
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        clock = self.clock
        own = time.perf_counter() - self.start - (clock.timed - self.timed_before)
        clock.totals[self.phase] += own
        clock.timed += own
        return False


def peak_host_memory_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 1024 if sys.platform != "darwin" else peak / 2**20, 1)


def peak_device_memory_mb() -> float | None:
    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return None


def build_report(run, status: str, counters: dict, train_metrics: dict | None = None) -> dict:
    """The report of a live run (called by the teardown stage): `run` is the `RunState`, `counters` the input
    tokens and samples trained on."""
    state, clock = run.state, run.clock
    runtime = time.perf_counter() - clock.started
    evals = [h for h in state.log_history if any(k.startswith("eval_") and k.endswith("_loss") for k in h)]
    return {
        "status": status,
        "output_dir": run.args.output_dir,
        "global_step": state.global_step,
        "max_steps": state.max_steps,
        "epoch": state.epoch,
        "final_metrics": evals[-1] if evals else {},
        "best_metric": state.best_metric,
        "metric_for_best_model": run.args.metric_for_best_model,
        "best_checkpoint": state.best_model_checkpoint,
        "train_metrics": train_metrics or {},
        "total_seconds": round(runtime, 3),
        "samples_per_second": round(counters["samples"] / runtime, 3) if runtime else None,
        "tokens_per_second": round(counters["tokens"] / runtime, 3) if runtime else None,
        "input_tokens": counters["tokens"],
        "peak_host_memory_mb": peak_host_memory_mb(),
        "peak_device_memory_mb": peak_device_memory_mb(),
        "time_by_phase": clock.breakdown(),
        "slow_steps": clock.slow_steps,
        "log_history": state.log_history,
    }


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


def write_charts(report: dict, folder: str) -> list[str] | str:
    """loss.png, learning_rate.png and eval_metrics.png; or, without matplotlib, the sentence saying how."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "Charts need matplotlib: pip install 'loopkit[charts]', then python -m loopkit report RUN_DIR."
    history, written = report["log_history"], []
    panels = [("loss.png", ["loss"], "training loss"), ("learning_rate.png", ["learning_rate"], "learning rate"),
              ("eval_metrics.png", eval_metric_keys(history), "evaluation metrics")]
    for name, keys, title in panels:
        plotted = [(k, *series(history, k)) for k in keys]
        plotted = [p for p in plotted if p[1]]
        if not plotted:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for key, steps, values in plotted:
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, label=key)
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(plotted) > 1:
            ax.legend()
        fig.tight_layout()
        path = os.path.join(folder, name)
        fig.savefig(path)
        plt.close(fig)
        written.append(name)
    # matplotlib caches open font files for the life of the process; a training library should not hold them.
    clear_font_cache = getattr(getattr(matplotlib, "font_manager", None), "_get_font", None)
    if hasattr(clear_font_cache, "cache_clear"):
        clear_font_cache.cache_clear()
    return written


def summary_text(report: dict) -> str:
    """The one-screen summary, also the body of run_report.md."""
    lines = [f"loopkit run report: {report['status']}  ({report['output_dir']})",
             f"  steps {report['global_step']}/{report['max_steps']}, epoch {report['epoch']:.3g}, "
             f"{report['total_seconds']:.1f} s"]
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
        lines.append(f"  best {report.get('metric_for_best_model')}={report['best_metric']:.4g} at "
                     f"{report.get('best_checkpoint')}")
    phases = report.get("time_by_phase")
    if phases:
        lines.append("  time by phase: " + ", ".join(f"{p} {s:.2f}s ({phases['percent'][p]:.0f}%)"
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
    os.makedirs(folder, exist_ok=True)
    report["charts"] = write_charts(report, folder)
    with open(os.path.join(folder, REPORT_JSON), "w") as f:
        json.dump(report, f, indent=2, default=str)
    text = summary_text(report)
    with open(os.path.join(folder, REPORT_MD), "w") as f:
        f.write("```\n" + text + "\n```\n")
        for chart in report["charts"] if isinstance(report["charts"], list) else []:
            f.write(f"\n![{chart}]({chart})\n")
    if echo:
        print(text)
    return report


def report_from_files(run_dir: str) -> dict:
    """Rebuild the report of a finished or crashed run: its `run_report.json` if the run got to write one, else
    the most recently saved checkpoint's `trainer_state.json` (a run killed before its teardown)."""
    from .checkpoint import TRAINER_STATE_NAME, last_checkpoint

    path = os.path.join(run_dir, REPORT_JSON)
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    newest = last_checkpoint(run_dir)
    if newest is None:
        raise FileNotFoundError(f"{run_dir} holds neither {REPORT_JSON} nor a checkpoint: nothing to report.")
    with open(os.path.join(newest, TRAINER_STATE_NAME)) as f:
        state = json.load(f)
    evals = [h for h in state["log_history"] if any(k.startswith("eval_") for k in h)]
    return {"status": f"incomplete (rebuilt from {os.path.basename(newest)})", "output_dir": run_dir,
            "global_step": state["global_step"], "max_steps": state["max_steps"], "epoch": state["epoch"] or 0,
            "final_metrics": evals[-1] if evals else {}, "best_metric": state.get("best_metric"),
            "metric_for_best_model": None, "best_checkpoint": state.get("best_model_checkpoint"),
            "total_seconds": 0.0, "log_history": state["log_history"], "slow_steps": []}


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loopkit", description="loopkit command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    report_cmd = sub.add_parser("report", help="rebuild the run report (summary, JSON, charts) of RUN_DIR")
    report_cmd.add_argument("run_dir")
    args = parser.parse_args(argv)
    write_report(report_from_files(args.run_dir), args.run_dir)
    return 0
