"""The report's charts, drawn from what the report records: into the run's folder (`charts_drawn`, for
`python -m loopkit report` and `TeardownStage(charts=True)`) or in memory for a notebook (`charts_in_memory`).
matplotlib's object API only (never pyplot), imported when a chart is drawn."""

from __future__ import annotations

import importlib.util
import io
import math
import os
import statistics
import sys
import warnings

CHARTS_HINT = "Charts need matplotlib: pip install 'loopkit[charts]', then python -m loopkit report RUN_DIR."


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

        from ..optimizers import build_scheduler

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
