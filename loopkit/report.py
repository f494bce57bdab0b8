"""The run report: where the time went, how fast it ran, what it reached, and charts of it.

The time by phase comes from the phase clock (`PhaseClock`, loopkit/phases.py).

At the end of a run (and when it fails or is interrupted) the teardown stage writes `run_report.json` and
`run_report.md` to the output folder (each atomically: a temporary file, renamed; not forced to disk) and prints a
one-screen summary, all before `train()` returns or raises: no thread of loopkit's writes into the user's folder
afterwards, and every file the summary names exists when it is printed. That costs about a millisecond. The PNG
charts (loss with eval loss, the best checkpoint and resumes; the learning rate as the schedule set it, warmup
shaded; one axis per evaluation metric; one per key a step observer adds to the training logs, loopkit/observers/;
throughput) take about a second of matplotlib, most of a short run, so they are drawn on demand from what the report
records: `python -m loopkit report RUN_DIR` writes them into the folder, and a notebook's `loop.report` shows them
inline (drawn in memory, nothing written). `TeardownStage(charts=True)` draws them before `train()` returns instead
(timed in the "report" phase). Without matplotlib the report says how to get the charts.

Slow steps: a step slower than 3x the rolling median and beyond the run's normal spread (median + 5 robust standard
deviations, from the median absolute deviation), its scheduled evaluation and checkpoint left out. Each names its
phases, the load average and the process's share of a CPU during it, so a step slowed by other processes on a busy
machine reads as such; the report also says when the machine was busy over the run (load average above the cores),
and when a run on the CPU got far less CPU than torch's threads asked for (`cpu_starvation`): the threads, cores,
load and CPU share, and how to set fewer threads. The teardown stage also logs that advice once, at the first
training or evaluation log that measures it, so a long run says it when it is first known.

Each checkpoint carries a run record (`run_record()`, under "run_record" in `loopkit_state.json`): the elapsed time
and phase totals of every stretch of training so far (one per resume), the metric settings, the learning-rate
schedule's settings and how busy the machine was. A resumed run's report covers the whole run from it.
`python -m loopkit report RUN_DIR` prints the run's own report when it covers the newest checkpoint (by save numbers,
never file times), else rebuilds one from that checkpoint, its status from `run_status.json` (how the latest
`train()` ended, or "running" if it never did), and writes it beside the run's own (`--force`: over it); either way
it draws the charts. Time a killed run spent after its last checkpoint is in no file.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import math
import os
import resource
import statistics
import sys
import warnings

from .phases import PHASES, PhaseClock

REPORT_NAME, REBUILT_NAME = "run_report", "run_report.rebuilt"  # .json and .md
STATUS_JSON = "run_status.json"  # how the latest train() ended (`write_run_status`)
RUN_ENDS = ("running", "completed", "stopped_early", "interrupted", "failed")
RUN_RECORD_KEY = "run_record"  # the run record's top-level key in loopkit_state.json
# A run starved of CPU: its process got under this share of the cores its torch threads could use, on a busy machine.
STARVED_SHARE = 0.5
CHARTS_HINT = "Charts need matplotlib: pip install 'loopkit[charts]', then python -m loopkit report RUN_DIR."


def run_record(clock: PhaseClock, run) -> dict:
    """What a checkpoint remembers of the run as a whole (plain JSON): elapsed time and phase totals (None when a
    stretch before a resume is unknown), the metric settings, the learning-rate schedule's settings, how busy the
    machine was, and each stretch of training (`segments`: steps and seconds before and after every resume). `run`:
    the `RunState`."""
    args = run.args
    segments = clock.segments(run.state.global_step)
    seconds, phases = whole_run_totals(segments)
    return {"elapsed_seconds": seconds, "phase_seconds": phases,
            "metric_for_best_model": args.metric_for_best_model, "greater_is_better": args.greater_is_better,
            "lr_schedule": lr_schedule_settings(run), "machine": clock.machine(), "segments": segments}


def lr_schedule_settings(run) -> dict | None:
    """What the learning-rate chart redraws the schedule from, step by step: the scheduler `create_scheduler` builds
    from the arguments (type, peak rate, warmup, length, keywords); None when the user passed a scheduler of their
    own in `optimizers=` (its shape is unknown here)."""
    from .errors import plain

    args, max_steps = run.args, run.state.max_steps
    kwargs = args.lr_scheduler_kwargs or {}
    if run.optimizers_given[1] is not None or not isinstance(kwargs, dict):
        return None
    try:  # it goes into every checkpoint's JSON: keywords JSON cannot hold leave the schedule unknown instead
        kwargs = json.loads(json.dumps(kwargs))
    except (TypeError, ValueError):
        return None
    return {"type": str(plain(args.lr_scheduler_type)), "learning_rate": args.learning_rate,
            "warmup_steps": args.get_warmup_steps(max_steps), "training_steps": max_steps, "kwargs": kwargs}


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


def compile_record(segments: list[dict]) -> dict | None:
    """torch.compile over the run: compilations and their seconds (None when no segment compiled anything)."""
    count = sum(s.get("compilations") or 0 for s in segments)
    if not count:
        return None
    seconds = sum((s.get("phase_seconds") or {}).get("compile", 0.0) for s in segments)
    return {"compilations": count, "seconds": round(seconds, 6)}


def cpu_starvation(machine: dict, on_cpu: bool) -> dict | None:
    """Whether a run on the CPU got far less CPU than torch's threads asked for: several threads, a busy machine
    (load average above the cores) and under half a core per thread it could run (`STARVED_SHARE`). Its threads
    then wait for each other on cores other processes hold, and fewer threads run faster. None otherwise (a GPU
    run's CPU waits for its device; on an idle machine a low share is waiting for something else)."""
    threads, share = machine.get("torch_threads") or 1, machine.get("cpu_seconds_per_second")
    if not on_cpu or threads < 2 or share is None or not machine.get("busy"):
        return None
    if share >= STARVED_SHARE * min(threads, machine["cores"]):
        return None
    load = max(x for x in (machine["load_average_start"], machine["load_average_end"]) if x is not None)
    return {"torch_threads": threads, "cores": machine["cores"], "load_average": load,
            "cpu_seconds_per_second": share, "suggested_threads": max(1, int(share))}


def peak_host_memory_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 1024 if sys.platform != "darwin" else peak / 2**20, 1)


def peak_device_memory_mb() -> float | None:
    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return None


def build_report(run, context, status: str, end: str, counters: dict, train_metrics: dict | None = None,
                 charts: bool = False) -> dict:
    """The report of a live run (called by the teardown stage): `run` is the `RunState`, `context` its `RunContext`,
    `end` how it ended (`RUN_ENDS`), `counters` the input tokens and samples trained on; `saves` records the save
    number it covers (`is_current`). Its charts are drawn into the output folder now when `charts`, else left to be
    drawn on demand (`charts_on_demand`). Building it (and drawing the charts) is the "report" phase; the time by
    phase is read right after, so writing the two small report files next is the only part of `train()` outside
    it."""
    state, clock, args = run.state, context.clock, run.args
    with clock.span("report"):
        evals = [h for h in state.log_history if any(k.startswith("eval_") and k.endswith("_loss") for k in h)]
        machine = clock.machine()
        report = RunReport({
            "status": status, "end": end, "output_dir": args.output_dir, "global_step": state.global_step,
            "max_steps": state.max_steps, "epoch": state.epoch, "final_metrics": evals[-1] if evals else {},
            "best_metric": state.best_metric, "metric_for_best_model": args.metric_for_best_model,
            "greater_is_better": args.greater_is_better, "best_checkpoint": state.best_model_checkpoint,
            "train_metrics": train_metrics or {}, "input_tokens": counters["tokens"],
            "peak_host_memory_mb": peak_host_memory_mb(), "peak_device_memory_mb": peak_device_memory_mb(),
            "slow_steps": clock.slow_steps, "machine": machine, "log_history": list(state.log_history),
            "cpu_starved": cpu_starvation(machine, on_cpu=context.accelerator.device.type == "cpu"),
            "best_step": state.best_global_step, "warmup_steps": args.get_warmup_steps(state.max_steps),
            "lr_schedule": lr_schedule_settings(run),
            "interruption": interruption_record(context.preemption), "segments": clock.segments(state.global_step),
            "saves": {"run_id": context.checkpointer.run_id, "save_index": context.checkpointer.next_save_index - 1},
        })
        report["charts"] = charts_drawn(report, args.output_dir) if charts else charts_on_demand()
    clock.enter(None)  # closes the teardown phase: everything up to here is in the totals below
    segments = clock.segments(state.global_step)
    this_run = segments[-1]["seconds"]
    report.update(total_seconds=whole_run_totals(segments)[0], this_run_seconds=this_run, segments=segments,
                  time_by_phase=time_by_phase(segments),
                  compile=compile_record(segments),
                  samples_per_second=round(counters["samples"] / this_run, 3) if this_run else None,
                  tokens_per_second=round(counters["tokens"] / this_run, 3) if this_run else None)
    return report


class RunReport(dict):
    """The run report: the dict written to run_report.json, which a notebook renders as Markdown (`loop.report`)."""

    def _repr_markdown_(self) -> str:
        return report_markdown(self)


def report_markdown(report: dict) -> str:
    """The report as Markdown: the summary, time by phase as a table, and the charts: the files when they were drawn
    into the folder, else drawn now in memory and embedded (a notebook shows them; nothing is written)."""
    summary = summary_text(report).splitlines()
    lines = [f"**{summary[0]}**", "", *(f"- {line.strip()}" for line in summary[1:]
                                         if not line.strip().startswith(("time by phase", "charts")))]
    phases = report.get("time_by_phase")
    if phases:
        lines += ["", "| phase | seconds | % |", "|---|---:|---:|"]
        lines += [f"| {p} | {s:.2f} | {phases['percent'][p]:.0f} |" for p, s in phases["seconds"].items() if s > 0]
    charts = report.get("charts")
    if isinstance(charts, list) and charts:
        lines += [""] + [f"![{c}]({os.path.join(report['output_dir'], c).replace(' ', '%20')})" for c in charts]
    elif charts == []:
        lines += [""] + [f"![{name}](data:image/png;base64,{base64.b64encode(png).decode()})"
                         for name, png in charts_in_memory(report)]
    return "\n".join(lines)


def interruption_record(preemption) -> dict | None:
    """The signal that ended the run, the checkpoint to resume from and the call that does it (`preemption`: the
    run's `PreemptionWatch`, loopkit/guards.py)."""
    interruption = preemption.interruption() if preemption is not None else None
    if interruption is None:
        return None
    from .guards import signal_name

    return {"signal": signal_name(interruption.signum), "checkpoint": interruption.checkpoint,
            "saved": interruption.saved, "resume": interruption.resume}


# -- charts ------------------------------------------------------------------------------------------------------
# Each chart answers one question: is the loss going down, and where is the best checkpoint (loss.png)? What did the
# learning rate do, warmup included (learning_rate.png)? How did each evaluation metric move (eval_metrics.png, one
# axis per metric)? How did each key added to the training logs move (step_metrics.png)? Did the speed hold
# (throughput.png)? Resumes are marked on every chart over steps.
EVAL_SKIP = ("_runtime", "_samples_per_second", "_steps_per_second", "_model_preparation_time")
# The keys of Trainer's own training log (charted elsewhere, or not at all): any other number there is charted.
TRAINING_LOG_KEYS = ("loss", "grad_norm", "learning_rate", "epoch", "step", "num_input_tokens_seen", "train_runtime",
                     "train_tokens_per_second")


def series(log_history: list, key: str) -> tuple[list, list]:
    points = [(h["step"], h[key]) for h in log_history if isinstance(h.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def eval_metric_keys(log_history: list) -> list[str]:
    keys = []
    for h in log_history:
        for k, v in h.items():
            if k.startswith("eval_") and not k.endswith(EVAL_SKIP) and isinstance(v, (int, float)) and k not in keys:
                keys.append(k)
    return keys


def step_metric_keys(log_history: list) -> list[str]:
    """The numeric keys added to the training logs (those with "loss"): a step observer's, or a `Loop.log`
    override's."""
    keys = []
    for h in log_history:
        for k, v in h.items() if "loss" in h else ():
            if k not in TRAINING_LOG_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool) and k not in keys:
                keys.append(k)
    return keys


def throughput(segments: list[dict]) -> tuple[list, list]:
    """Training steps per second between the points of each segment's timeline (evaluation and checkpoint time left
    out), at the steps where each stretch ends; about 40 stretches per segment."""
    steps, speeds = [], []
    for segment in segments:
        timeline = segment.get("timeline") or []
        stride = max(1, len(timeline) // 40)
        points = [[segment["from_step"], 0.0, 0.0]] + timeline[stride - 1::stride]
        for (step0, wall0, sched0), (step1, wall1, sched1) in zip(points, points[1:]):
            seconds = (wall1 - wall0) - (sched1 - sched0)
            if step1 > step0 and seconds > 0:
                steps.append(step1)
                speeds.append((step1 - step0) / seconds)
    return steps, speeds


def chart_names(report: dict) -> list[str]:
    """The charts `report` has something to draw for, in order."""
    history = report.get("log_history", [])
    names = []
    if series(history, "loss")[0] or series(history, "eval_loss")[0]:
        names.append("loss.png")
    if series(history, "learning_rate")[0]:
        names.append("learning_rate.png")
    if eval_metric_keys(history):
        names.append("eval_metrics.png")
    if step_metric_keys(history):
        names.append("step_metrics.png")
    if throughput(report.get("segments") or [])[0]:
        names.append("throughput.png")
    return names


def matplotlib_missing() -> bool:
    if "matplotlib" in sys.modules:
        return sys.modules["matplotlib"] is None
    return importlib.util.find_spec("matplotlib") is None


def planned_charts(report: dict) -> list[str] | str:
    """The chart files a report will have, or, without matplotlib, the sentence saying how to get them."""
    if matplotlib_missing():
        return CHARTS_HINT
    return chart_names(report)


def mark_resumes(ax, report: dict) -> None:
    for segment in (report.get("segments") or [])[1:]:
        ax.axvline(segment["from_step"], color="tab:purple", linestyle=":", linewidth=1.5,
                   label=f"resumed at step {segment['from_step']}")


def loss_chart(ax, report: dict) -> None:
    history = report["log_history"]
    for key, label, style in (("loss", "training loss", {}), ("eval_loss", "eval loss", {"marker": "o"})):
        steps, values = series(history, key)
        if steps:
            ax.plot(steps, values, label=label, **style)
    best = report.get("best_step")
    if best is not None:
        ax.axvline(best, color="tab:green", linestyle="--", linewidth=1.5,
                   label=f"best checkpoint (step {best}, {report.get('metric_for_best_model')}="
                         f"{report['best_metric']:.4g})" if report.get("best_metric") is not None
                   else f"best checkpoint (step {best})")
    mark_resumes(ax, report)
    ax.set_ylabel("loss")
    trained, evaluated = (bool(series(history, key)[0]) for key in ("loss", "eval_loss"))
    ax.set_title("Loss: training and evaluation" if trained and evaluated else
                 "Loss: training (no evaluation logged)" if trained else
                 "Loss: evaluation only (no training loss was logged; see logging_steps)")


def schedule_rates(report: dict) -> tuple[list, list] | None:
    """The learning rate of every optimizer step up to the report's last one, as the schedule set it: step s trains
    at the rate the scheduler holds after s - 1 steps, the rate its training log records. Rebuilt from the report's
    `lr_schedule` (the scheduler `create_scheduler` builds from the arguments), and only when it equals every logged
    rate: None for a scheduler of the user's, a metric-driven one (ReduceLROnPlateau), a record without settings,
    or any disagreement (then the chart shows the logged rates alone). A long run is sampled (at most about 4,000
    steps, the end of warmup and every logged step included)."""
    settings, (logged_steps, logged) = report.get("lr_schedule"), series(report["log_history"], "learning_rate")
    if not settings or not logged_steps:
        return None
    try:
        import torch

        from .optimizers import build_scheduler

        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=settings["learning_rate"])
        scheduler = build_scheduler(settings["type"], optimizer, settings["warmup_steps"], settings["training_steps"],
                                    settings.get("kwargs") or None)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            return None
        multiplier, peak = scheduler.lr_lambdas[0], settings["learning_rate"]
        if not all(math.isclose(peak * multiplier(step - 1), value, rel_tol=1e-6, abs_tol=1e-12)
                   for step, value in zip(logged_steps, logged)):
            return None
        last = max(report.get("global_step") or 0, max(logged_steps))
        warmup = settings["warmup_steps"]
        steps = sorted(set(range(1, last + 1, max(1, last // 4000))) | {last} | set(logged_steps)
                       | {s for s in (warmup, warmup + 1, warmup + 2) if 1 <= s <= last})
        return steps, [peak * multiplier(step - 1) for step in steps]
    except Exception:  # a schedule that cannot be rebuilt here: the logged rates are still drawn
        return None


def learning_rate_chart(ax, report: dict) -> None:
    """The schedule as it was, one step at a time (each step's rate held from the step before it to that step),
    the logged rates as points on it; without a rebuilt schedule the logged points alone, not joined (a line
    between them would invent the rates in between, e.g. move the end of warmup to the next log)."""
    steps, values = series(report["log_history"], "learning_rate")
    schedule = schedule_rates(report)
    if schedule is not None:
        ax.plot([0] + schedule[0], schedule[1][:1] + schedule[1], drawstyle="steps-pre", color="tab:blue",
                label="learning rate at each step (the schedule)")
        ax.plot(steps, values, linestyle="none", marker="o", markersize=3, color="tab:blue",
                label="logged")
    else:
        ax.plot(steps, values, linestyle="none", marker="o", markersize=3, color="tab:blue",
                label="learning rate at each log (between logs: not recorded)")
    warmup = report.get("warmup_steps") or 0
    if warmup:
        logged = sorted(set(steps))
        every = logged[1] - logged[0] if len(logged) > 1 else None
        note = f"; logged every {every} steps" if every and every > warmup / 4 else ""
        ax.axvspan(0, warmup, color="tab:orange", alpha=0.2, label=f"warmup: steps 0-{warmup}{note}")
    mark_resumes(ax, report)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.set_ylabel("learning rate")
    ax.set_title("Learning rate")


# Metrics that are shares of something (0-1, or 0-100 when reported in percent; -1-1 for a correlation): their
# change reads in points.
BOUNDED_METRIC_WORDS = ("accuracy", "acc", "f1", "precision", "recall", "exact", "auc", "matthews", "mcc", "rouge",
                        "iou", "jaccard", "dice", "share")


def is_bounded_metric(key: str, values: list) -> bool:
    """A share-like metric (accuracy, f1, exact_match, rouge1, padding_share, ...): its name says so and its values
    lie in -1-100."""
    words = key.removeprefix("eval_").lower().replace("-", "_").replace("@", "_").split("_")
    named = any(word.rstrip("0123456789") in BOUNDED_METRIC_WORDS or word.startswith("rouge") for word in words)
    return named and min(values) >= -1 and max(values) <= 100


def change_text(key: str, values: list) -> str:
    """How far a metric moved from its first to its last value: in points for a share (0.021 -> 0.047 is +2.6
    points, not +126%), relative for the rest (a loss: -12.5%)."""
    first, last = values[0], values[-1]
    if is_bounded_metric(key, values):
        scale = 100 if max(values) <= 1 and min(values) >= -1 else 1  # a share of 1, else already in percent
        return f" ({(last - first) * scale:+.2f} points)"
    return f" ({(last - first) / abs(first):+.2%})" if first else ""


def metric_charts(fig, report: dict, keys: list[str], title: str) -> None:
    """One axis per metric, stacked, sharing the step axis; the best step marked on each."""
    history, best = report["log_history"], report.get("best_step")
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys):
        steps, values = series(history, key)
        # The axis zooms onto the values: the legend says how far they actually moved.
        ax.plot(steps, values, marker="o", color="tab:blue",
                label=f"first {values[0]:.4g}, last {values[-1]:.4g}{change_text(key, values)}")
        if best is not None:
            ax.axvline(best, color="tab:green", linestyle="--", linewidth=1.2)
        mark_resumes(ax, report)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(handles=ax.get_lines()[:1], fontsize="small")
    if best is not None:
        title += f" (dashed: best checkpoint, step {best})"
    axes[0].set_title(title)
    axes[-1].set_xlabel("optimizer step")


def throughput_chart(ax, report: dict) -> None:
    steps, speeds = throughput(report["segments"])
    ax.plot(steps, speeds, drawstyle="steps-pre", label="training steps/s")
    median = statistics.median(speeds)
    ax.axhline(median, color="gray", linestyle="--", linewidth=1, label=f"median {median:.3g} steps/s")
    mark_resumes(ax, report)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("optimizer steps / second")
    title = "Throughput (evaluation and checkpoint time left out)"
    machine = report.get("machine") or {}
    if machine.get("busy"):  # the swings may be other processes', not the run's
        title += (f"\nmachine busy: load average {machine['load_average_end']} on {machine['cores']} cores")
        ax.figure.subplots_adjust(top=1 - 0.65 / ax.figure.get_figheight())  # room for the second line
    ax.set_title(title)


# What the summary calls each chart when it is not drawn yet (no file name: no file is there).
CHART_TITLES = {"loss.png": "loss", "learning_rate.png": "learning rate", "eval_metrics.png": "evaluation metrics",
                "step_metrics.png": "step metrics", "throughput.png": "throughput"}
# The charts of one axis per key: which keys, and the title.
METRIC_CHARTS = {"eval_metrics.png": (eval_metric_keys, "Evaluation metrics"),
                 "step_metrics.png": (step_metric_keys, "Added to the training logs (step observers)")}


def chart_figure(name: str, report: dict):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys_of, title = METRIC_CHARTS.get(name, (None, None))
    keys = keys_of(report["log_history"]) if keys_of is not None else []
    height = max(3.8, 2.0 * len(keys) + 0.6)
    fig = Figure(figsize=(7.2, height), dpi=100)
    FigureCanvasAgg(fig)
    # Fixed margins (in inches, whatever the height): a layout engine would double the drawing time, and the
    # drawing shares the CPU with the next train() of a hyper-parameter search.
    fig.subplots_adjust(left=0.95 / 7.2, right=0.98, top=1 - 0.4 / height, bottom=0.55 / height, hspace=0.15)
    if keys_of is not None:
        metric_charts(fig, report, keys, title)
        fig.axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole (shared axis)
        return fig
    ax = fig.add_subplot()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    {"loss.png": loss_chart, "learning_rate.png": learning_rate_chart, "throughput.png": throughput_chart}[name](
        ax, report)
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return fig


def draw_charts(report: dict, folder: str, prefix: str = "") -> list[str]:
    """Draw the charts of `report` into `folder` now (as `prefix` + each chart's name); returns the file names
    written. Uses matplotlib's object API, never pyplot: no global backend switch in the user's process, no shared
    figure registry. Each PNG appears complete or not at all (written under a temporary name, then renamed), and a
    failure or an interruption mid-way leaves no temporary file behind."""
    written = []
    os.makedirs(folder, exist_ok=True)  # a run that failed before writing anything has no output folder yet
    for name in chart_names(report):
        path = os.path.join(folder, prefix + name)
        try:
            chart_figure(name, report).savefig(path + ".tmp", format="png")
            os.replace(path + ".tmp", path)
        finally:
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")
        written.append(prefix + name)
    # matplotlib caches open font files for the life of the process; a training library should not hold them.
    import matplotlib.font_manager

    clear_font_cache = getattr(matplotlib.font_manager, "_get_font", None)
    if hasattr(clear_font_cache, "cache_clear"):
        clear_font_cache.cache_clear()
    return written


def charts_drawn(report: dict, folder: str, prefix: str = "") -> list[str] | str:
    """The report's "charts" entry after drawing them now: the files written, the sentence saying how to get
    matplotlib, or what went wrong (a failed chart is a warning, never the run's exception)."""
    planned = planned_charts(report)
    if not isinstance(planned, list) or not planned:
        return planned
    try:
        return draw_charts(report, folder, prefix)
    except Exception as exc:
        warnings.warn(f"Could not draw the run's charts in {folder}: {type(exc).__name__}: {exc}.")
        return f"charts not drawn ({type(exc).__name__}: {exc}): python -m loopkit report {folder} draws them"


def charts_on_demand() -> list | str:
    """The "charts" entry of a report whose charts are left to `python -m loopkit report` (or `loop.report` in a
    notebook): none in the folder ([]; the summary says how to draw them), or the sentence saying how to get
    matplotlib. Costs no import."""
    return CHARTS_HINT if matplotlib_missing() else []


def charts_in_memory(report: dict) -> list[tuple[str, bytes]]:
    """Each chart of `report` as PNG bytes, drawn now and written nowhere; [] without matplotlib (a failed chart is
    a warning)."""
    if matplotlib_missing():
        return []
    drawn = []
    try:
        for name in chart_names(report):
            buffer = io.BytesIO()
            chart_figure(name, report).savefig(buffer, format="png")
            drawn.append((name, buffer.getvalue()))
    except Exception as exc:
        warnings.warn(f"Could not draw the run's charts: {type(exc).__name__}: {exc}.")
    return drawn


# -- the report's text and files ---------------------------------------------------------------------------------
def seconds_text(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def duration_text(report: dict) -> str:
    if report.get("total_seconds") is not None:
        return seconds_text(report["total_seconds"])
    unknown = next((s for s in report.get("segments") or [] if s["seconds"] is None), None)
    return "time unknown" + (f" (steps {unknown['from_step']}-{unknown['to_step']} ran without a run record)"
                             if unknown else "")


def segment_lines(report: dict) -> list[str]:
    """A resumed run: each stretch of training, with its steps and time, marked where it was resumed."""
    segments = report.get("segments") or []
    if len(segments) < 2:
        return []
    lines = [f"  {len(segments)} segments:"]
    for number, segment in enumerate(segments):
        took = seconds_text(segment["seconds"]) if segment["seconds"] is not None else "time unknown"
        how = "started" if number == 0 else "resumed"
        lines.append(f"    {how} at step {segment['from_step']}: steps {segment['from_step']}-{segment['to_step']}"
                     f" in {took}")
    return lines


def interruption_lines(report: dict) -> list[str]:
    interruption = report.get("interruption")
    if not interruption:
        return []
    if interruption.get("resume"):
        return [f"  resume with: {interruption['resume']}"]
    return ["  no checkpoint to resume from: train() starts afresh"]


def slow_step_lines(report: dict) -> list[str]:
    """Slow steps, consecutive ones grouped, with what the machine was doing; the machine's load over the run."""
    slow, lines = report.get("slow_steps") or [], []
    groups = []
    for record in slow:
        if groups and record["step"] == groups[-1][-1]["step"] + 1:
            groups[-1].append(record)
        else:
            groups.append([record])
    for group in groups[:5]:
        first, last = group[0], group[-1]
        where = f"step {first['step']}" if len(group) == 1 else f"steps {first['step']}-{last['step']}"
        worst = max(first["phases"], key=first["phases"].get)
        line = (f"  slow {where}: {max(r['seconds'] for r in group):.3f}s vs median {first['median']:.3f}s "
                f"(normal spread {first.get('spread', 0):.3f}s; mostly {worst}: {first['phases'][worst]:.3f}s)")
        if any(r.get("machine_busy") for r in group):
            line += f"; machine busy: load {first['load_average']} on {first['cores']} cores"
        elif first.get("cpu_share") is not None and first["cpu_share"] < 0.5 * first["usual_cpu_share"]:
            line += (f"; the process was waiting (it used {first['cpu_share']:.0%} of a CPU, usually "
                     f"{first['usual_cpu_share']:.0%})")
        lines.append(line)
    if len(groups) > 5:
        lines.append(f"  ... {len(slow)} slow steps in all (run_report.json lists them)")
    machine = report.get("machine")
    if machine and machine.get("busy"):
        busy = sum(1 for r in slow if r.get("machine_busy"))
        lines.append(f"  the machine was busy: load average {machine['load_average_start']} at the start, "
                     f"{machine['load_average_end']} at the end, on {machine['cores']} cores; the process used "
                     f"{machine['cpu_seconds_per_second']} CPU-seconds per second"
                     + (f"; {busy} of {len(slow)} slow steps came while it was busy" if slow else ""))
    return lines


def starvation_text(starved: dict) -> str:
    """A run starved of CPU (`cpu_starvation`): the numbers and what to do."""
    share, threads, fewer = starved["cpu_seconds_per_second"], starved["torch_threads"], starved["suggested_threads"]
    return (f"torch ran {threads} threads on {starved['cores']} cores under a load average of "
            f"{starved['load_average']}, and the process got {share} CPU-seconds per second ({share / threads:.0%} "
            f"of what its threads asked for): set fewer threads, OMP_NUM_THREADS={fewer} before Python starts or "
            f"torch.set_num_threads({fewer})")


def starvation_lines(report: dict) -> list[str]:
    """The one line of the summary for a run starved of CPU."""
    starved = report.get("cpu_starved")
    return [f"  CPU starved: {starvation_text(starved)}"] if starved else []


def evaluation_title(report: dict) -> str:
    """"final evaluation" only for the evaluation at the last step of a run that reached its end (completed, or
    stopped early by a callback); otherwise the last one so far, with its step (an interrupted, failed or killed
    run's evaluation at step 30 of 80 is no final one)."""
    step = report.get("final_metrics", {}).get("step")
    if report.get("end") in ("completed", "stopped_early") and step == report.get("global_step"):
        return "final evaluation"
    return f"last evaluation (step {step} of {report.get('max_steps')})" if step is not None else "last evaluation"


def summary_text(report: dict) -> str:
    """The one-screen summary, also the body of run_report.md."""
    lines = [f"loopkit run report: {report['status']}  ({report['output_dir']})", *interruption_lines(report),
             f"  steps {report['global_step']}/{report['max_steps']}, epoch {report['epoch']:.3g}, "
             f"{duration_text(report)}" + (" in all" if len(report.get("segments") or []) > 1 else ""),
             *segment_lines(report)]
    if report.get("samples_per_second") is not None:
        tokens = f", {report['tokens_per_second']:.0f} input tokens/s" if report.get("input_tokens") else \
            " (no token count: the batches have no model main input)"
        lines.append(f"  {report['samples_per_second']:.1f} samples/s{tokens}"
                     + (" (this segment)" if len(report.get("segments") or []) > 1 else "")
                     + f", peak host memory {report['peak_host_memory_mb']:.0f} MB"
                     + (f", peak device memory {report['peak_device_memory_mb']:.0f} MB"
                        if report.get("peak_device_memory_mb") else ""))
    final = {k: v for k, v in report.get("final_metrics", {}).items() if k not in ("step", "epoch")
             and not k.endswith(("_runtime", "_per_second"))}
    if final:
        lines.append(f"  {evaluation_title(report)}: " + ", ".join(f"{k}={v:.4g}" for k, v in final.items()
                                                                 if isinstance(v, (int, float))))
    if report.get("best_metric") is not None:
        lines.append(f"  best {report.get('metric_for_best_model') or '(metric name unknown)'}="
                     f"{report['best_metric']:.4g} at {report.get('best_checkpoint')}")
    if report.get("compile"):
        lines.append(f"  torch.compile: {report['compile']['compilations']} compilations, compile time "
                     f"{report['compile']['seconds']:.2f}s (not in the step phases)")
    phases = report.get("time_by_phase")
    if phases:
        covered = "" if report.get("total_seconds") is not None else " (steps " + ", ".join(
            f"{a}-{b}" for a, b in phases.get("covers_steps", [])) + ")"
        lines.append(f"  time by phase{covered}: " + ", ".join(f"{p} {s:.2f}s ({phases['percent'][p]:.0f}%)"
                                                     for p, s in phases["seconds"].items() if s > 0))
    lines += slow_step_lines(report) + starvation_lines(report)
    charts = report.get("charts")
    if isinstance(charts, list) and charts:
        lines.append("  charts: " + ", ".join(charts))
    elif isinstance(charts, str):
        lines.append("  " + charts)
    elif charts == [] and chart_names(report):
        titles = ", ".join(CHART_TITLES[name] for name in chart_names(report))
        lines.append(f"  charts ({titles}): python -m loopkit report {report['output_dir']} draws them")
    return "\n".join(lines)


def write_atomically(path: str, text: str) -> None:
    """`text` into `path`, whole or not at all: written beside it, then renamed over it (a reader or a crash of the
    process never sees half a file; a failure, e.g. a full disk, leaves the previous file and no temporary one).
    Not forced to disk: an fsync costs tens of milliseconds on a busy disk, most of the report's cost at the end of a
    short run, and these files are derived: after a power loss `python -m loopkit report` rebuilds the report from
    the checkpoints, which are forced to disk."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_report(report: dict, folder: str, echo: bool = True, name: str = REPORT_NAME) -> dict:
    """`name`.json and `name`.md (each written atomically) and the console summary; the charts are already drawn."""
    os.makedirs(folder, exist_ok=True)
    text = summary_text(report)
    charts = report.get("charts")
    markdown = "```\n" + text + "\n```\n" + "".join(
        f"\n![{chart}]({chart})\n" for chart in (charts if isinstance(charts, list) else []))
    write_atomically(os.path.join(folder, name + ".json"), json.dumps(report, indent=2, default=str))
    write_atomically(os.path.join(folder, name + ".md"), markdown)
    if echo:
        print(text)
    return report


def write_run_status(folder: str, status: dict) -> None:
    """`run_status.json`: how the latest `train()` in `folder` ended ("running" from its start until its end), for
    a report rebuilt from a checkpoint (`report_from_files`) to say what the run's own report said."""
    os.makedirs(folder, exist_ok=True)
    write_atomically(os.path.join(folder, STATUS_JSON), json.dumps(status, indent=2))


def read_json(path: str) -> dict | None:
    """A JSON file's object; None when it is missing or unreadable (a file from a run killed mid-write: none of
    loopkit's, which are written atomically)."""
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def is_current(own: dict, newest) -> bool:
    """Whether the run's own report covers the newest checkpoint (`newest`: its `CheckpointRecord`), by save
    numbers (loopkit/checkpoint.py), else by steps: never by file times, which a copy or a restore changes."""
    if newest is None:
        return True
    saves = own.get("saves") or {}
    if isinstance(saves.get("save_index"), int) and newest.save_index is not None:
        return newest.save_index <= saves["save_index"]
    return own.get("global_step", -1) >= newest.step


def rebuilt_end(run_status: dict | None, newest, max_steps: int) -> tuple[str, str]:
    """How the run of checkpoint `newest` ended (`RUN_ENDS`, or "unknown") and the status line of a report rebuilt
    from it: what the run recorded of its end when `run_status` is that run's; "incomplete" when it never reached
    its end (killed, or the machine went); without its record (a copied checkpoint, or a later run's record in the
    folder), what the checkpoint itself shows: all `max_steps` steps trained, or not."""
    name = os.path.basename(os.path.normpath(newest.path))
    if run_status is None or run_status.get("run_id") != newest.run_id:
        if max_steps and newest.step >= max_steps:
            return "unknown", (f"all {max_steps} steps trained (rebuilt from {name}; how the run ended is not "
                               f"recorded here: no run_status.json of its run)")
        return "unknown", f"incomplete (rebuilt from {name}, step {newest.step} of {max_steps})"
    if run_status.get("end") == "running":
        return "running", f"incomplete: the run stopped without reaching its end (killed?), rebuilt from {name}"
    return run_status["end"], f"{run_status['status']} (rebuilt from {name}, step {newest.step})"


def report_from_files(run_dir: str, force: bool = False) -> tuple[dict, bool]:
    """The report of a finished, failed or killed run from its folder, and whether it is the run's own: its
    `run_report.json` when that covers the newest checkpoint (and not `force`), else a report rebuilt from that
    checkpoint's `trainer_state.json` and run record, its status from `run_status.json`."""
    from .checkpoint import checkpoints_by_recency

    own = read_json(os.path.join(run_dir, REPORT_NAME + ".json"))
    records = checkpoints_by_recency(run_dir)
    newest = records[-1] if records else None
    if own is not None and (newest is None or (not force and is_current(own, newest))):
        return own, True
    if newest is None:
        raise FileNotFoundError(f"{run_dir} holds neither {REPORT_NAME}.json nor a checkpoint: nothing to report.")
    report = report_from_checkpoint(run_dir, newest.path)
    report["end"], report["status"] = rebuilt_end(read_json(os.path.join(run_dir, STATUS_JSON)), newest,
                                                  report["max_steps"])
    return report, False


def report_from_checkpoint(run_dir: str, checkpoint: str) -> dict:
    """The report as far as `checkpoint` knows the run. Without a run record (HF Trainer's checkpoints, loopkit's
    before it had one) the time and the metric name are unknown, and the report says so."""
    from .checkpoint import read_states  # through the checkpoint's format (any storage's)

    state, loopkit_state = read_states(checkpoint)
    record = loopkit_state.get(RUN_RECORD_KEY)
    step = state["global_step"]
    segments = record["segments"] if record else [{"from_step": 0, "to_step": step, "seconds": None,
                                                  "phase_seconds": None}]
    history = state["log_history"]
    evals = [h for h in history if any(k.startswith("eval_") for k in h)]
    record = record or {}
    schedule = record.get("lr_schedule")
    report = {"status": f"incomplete (rebuilt from {os.path.basename(checkpoint)})", "end": "unknown",
              "output_dir": run_dir, "global_step": step, "max_steps": state["max_steps"],
              "epoch": state["epoch"] or 0, "final_metrics": evals[-1] if evals else {},
              "best_metric": state.get("best_metric"), "metric_for_best_model": record.get("metric_for_best_model"),
              "greater_is_better": record.get("greater_is_better"),
              "best_checkpoint": state.get("best_model_checkpoint"),
              "total_seconds": whole_run_totals(segments)[0], "segments": segments,
              "time_by_phase": time_by_phase(segments), "log_history": history,
              "best_step": state.get("best_global_step"), "slow_steps": [], "interruption": None,
              "compile": compile_record(segments), "machine": record.get("machine"), "lr_schedule": schedule,
              "warmup_steps": schedule["warmup_steps"] if schedule else None}
    return report


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loopkit", description="loopkit command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    report_cmd = sub.add_parser("report", help="print the run report of RUN_DIR and draw its charts; rebuild it "
                                "from the newest checkpoint when the run's own report does not cover it")
    report_cmd.add_argument("run_dir")
    report_cmd.add_argument("--force", action="store_true", help="rebuild from the newest checkpoint and write "
                            "over the run's own run_report.* (otherwise a rebuilt report goes beside it)")
    report_cmd.add_argument("--storage", metavar="MODULE:CLASS", help="the checkpoint storage that wrote RUN_DIR, "
                            "when it is not a built-in one (HFStorage, DCPStorage)")
    args = parser.parse_args(argv)
    if args.storage:
        from .checkpoint import register_format

        register_format(args.storage)
    report, own = report_from_files(args.run_dir, args.force)
    if own:  # the run's own report: printed, its charts drawn again, its files left as the run wrote them
        report["charts"] = charts_drawn(report, args.run_dir)
        print(summary_text(report))
        return 0
    beside = not args.force and os.path.isfile(os.path.join(args.run_dir, REPORT_NAME + ".json"))
    name = REBUILT_NAME if beside else REPORT_NAME
    report["charts"] = charts_drawn(report, args.run_dir, prefix=name + "." if beside else "")
    write_report(report, args.run_dir, name=name)
    if beside:
        print(f"  the run's own {REPORT_NAME}.json covers an earlier stretch and is kept; this rebuilt report is "
              f"{name}.json (--force writes it over the run's own)")
    return 0
