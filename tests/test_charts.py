"""The run report's charts and slow steps, as a person reads them (loopkit/report/charts.py): loss with eval loss, the
best checkpoint and resumes marked; the learning rate with its warmup; one labelled axis per evaluation metric;
throughput over the steps; slow steps only beyond the run's normal spread, with how busy the machine was."""

import json
import signal
import sys

import numpy as np
import pytest
from matplotlib.colors import to_rgba

from helpers import regression_data, tiny_regression
from loopkit import Loop, LoopArgs, TrainingInterrupted, phases, report
from loopkit.guards import LAUNCHER_ENV

sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/scripts")
from interrupt_child import SignalAtStep  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def closeness(p):
    """A second evaluation metric besides the loss: the share of predictions within 1 of the label."""
    return {"close": float((np.abs(p.predictions - p.label_ids) < 1.0).mean())}


def interrupted_then_resumed(out, monkeypatch):
    """24 steps, 6 of warmup, evaluated every 6, best by eval loss; Ctrl-C at step 10, resumed to the end."""
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)

    def loop(callbacks=()):
        args = LoopArgs(output_dir=str(out), max_steps=24, per_device_train_batch_size=4, learning_rate=0.05,
                        warmup_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=6, save_steps=6,
                        metric_for_best_model="eval_loss", disable_tqdm=True, report_to="none", seed=3)
        return Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32),
                    eval_dataset=regression_data(8, seed=1), compute_metrics=closeness, callbacks=list(callbacks))

    with pytest.raises(TrainingInterrupted):
        loop([SignalAtStep(signal.SIGINT, 10)]).train()
    loop().train(resume_from_checkpoint=True)
    return json.load(open(out / "run_report.json"))


def drawn_lines(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def test_each_chart_shows_what_the_run_did(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    written = interrupted_then_resumed(out, monkeypatch)
    # train() wrote no chart; the summary names the command that draws them, which draws them all.
    assert written["charts"] == [] and not list(out.glob("*.png"))
    assert f"charts (loss, learning rate, evaluation metrics, throughput): python -m loopkit report {out} draws " \
           f"them" in capsys.readouterr().out
    assert report.main(["report", str(out)]) == 0
    charts = ["loss.png", "learning_rate.png", "eval_metrics.png", "throughput.png"]
    assert f"  charts: {', '.join(charts)}" in capsys.readouterr().out.splitlines()
    for name in charts:
        assert (out / name).read_bytes()[:8] == PNG, name
    history, best = written["log_history"], written["best_step"]
    eval_steps = [h["step"] for h in history if "eval_loss" in h]
    assert eval_steps == [6, 12, 18, 24] and best in eval_steps
    assert [(s["from_step"], s["to_step"]) for s in written["segments"]] == [(0, 10), (10, 24)]

    # Loss: training and eval loss over the same steps, the best checkpoint and the resume as vertical lines.
    ax = report.chart_figure("loss.png", written).axes[0]
    lines = drawn_lines(ax)
    assert list(lines["training loss"].get_xdata()) == [h["step"] for h in history if "loss" in h]
    assert list(lines["eval loss"].get_xdata()) == eval_steps
    assert list(lines["eval loss"].get_ydata()) == [h["eval_loss"] for h in history if "eval_loss" in h]
    best_label = f"best checkpoint (step {best}, eval_loss={written['best_metric']:.4g})"
    assert list(lines[best_label].get_xdata()) == [best, best]
    assert list(lines["resumed at step 10"].get_xdata()) == [10, 10]
    assert ax.get_ylabel() == "loss" and ax.get_xlabel() == "optimizer step"
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"training loss", "eval loss", best_label}

    # Learning rate: the warmup (6 steps) shaded from step 0, the axis starting at 0, the resume marked.
    ax = report.chart_figure("learning_rate.png", written).axes[0]
    warmup = [p for p in ax.patches if p.get_label().startswith("warmup")]
    assert len(warmup) == 1 and warmup[0].get_label() == "warmup: steps 0-6; logged every 2 steps"
    assert warmup[0].get_x() == 0 and warmup[0].get_width() == 6
    assert ax.get_ylim()[0] == 0 and ax.get_ylabel() == "learning rate"
    assert "resumed at step 10" in drawn_lines(ax)
    # ... and the schedule as it was: each step's rate, held over that step, through every logged rate, peaking
    # at step 7 (the first after 6 steps of warmup), not at the next logged step.
    lines = drawn_lines(ax)
    schedule, logged = lines["learning rate at each step (the schedule)"], lines["logged"]
    assert schedule.get_drawstyle() == "steps-pre" and logged.get_linestyle() == "None"
    rates = dict(zip(schedule.get_xdata()[1:], schedule.get_ydata()[1:]))
    assert list(rates) == list(range(1, 25))
    logged_rates = [(h["step"], h["learning_rate"]) for h in history if "learning_rate" in h]
    assert list(zip(logged.get_xdata(), logged.get_ydata())) == logged_rates
    assert all(rates[step] == pytest.approx(rate, rel=1e-9) for step, rate in logged_rates)
    assert max(rates, key=rates.get) == 7 and rates[7] == pytest.approx(0.05)
    assert [rates[s] for s in range(1, 8)] == pytest.approx([0.05 * s / 6 for s in range(0, 7)])

    # Evaluation metrics: one axis per metric, each labelled with its name, its values, its first and last value.
    axes = report.chart_figure("eval_metrics.png", written).axes
    assert [a.get_ylabel() for a in axes] == ["eval_close", "eval_loss"]  # in the order the evaluation logs them
    for a in axes:
        values = [h[a.get_ylabel()] for h in history if a.get_ylabel() in h]
        data = a.get_lines()[0]
        assert list(data.get_xdata()) == eval_steps and list(data.get_ydata()) == values
        assert data.get_label().startswith(f"first {values[0]:.4g}, last {values[-1]:.4g}")
        assert to_rgba(a.get_lines()[1].get_color()) == to_rgba("tab:green")  # the best checkpoint
        assert list(a.get_lines()[1].get_xdata()) == [best, best]

    # Throughput: positive speeds over both segments, the resume marked, a median line for reference.
    ax = report.chart_figure("throughput.png", written).axes[0]
    lines = drawn_lines(ax)
    steps, speeds = lines["training steps/s"].get_xdata(), lines["training steps/s"].get_ydata()
    assert min(steps) <= 10 < max(steps) == 24 and min(speeds) > 0
    assert any(label.startswith("median ") for label in lines) and "resumed at step 10" in lines


def clock_with(durations, cpu_share=None, slow_cpu_share=None, slow_at=()):
    """A PhaseClock fed step durations (seconds) through fake wall and CPU clocks."""
    clock = phases.PhaseClock()
    wall, cpu = [0.0], [0.0]
    clock.wall, clock.cpu = (lambda: wall[0]), (lambda: cpu[0])
    clock.reset()
    for step, seconds in enumerate(durations, start=1):
        wall[0] += seconds
        share = slow_cpu_share if step in slow_at and slow_cpu_share is not None else (cpu_share or 1.0)
        cpu[0] += seconds * share
        clock.step_done(step)
    return clock


def test_slow_steps_are_those_beyond_the_runs_normal_spread(monkeypatch):
    monkeypatch.setattr(phases, "load_average", lambda: 0.5)
    # A run whose steps normally vary from 10 to 50 ms (median 30, MAD 10): a 95 ms step, over 3x the median, is
    # within its spread (30 + 5 x 1.4826 x 10 = 104 ms); a 300 ms step is not.
    broad = [0.010, 0.020, 0.030, 0.040, 0.050] * 40
    broad[120], broad[160] = 0.095, 0.300
    clock = clock_with(broad)
    assert [s["step"] for s in clock.slow_steps] == [161]
    assert clock.slow_steps[0]["median"] == pytest.approx(0.030)
    assert clock.slow_steps[0]["threshold"] == pytest.approx(0.030 + 5 * 1.4826 * 0.010, rel=1e-3)
    # A steady run (10 ms +- 0.1 ms): 35 ms is slow.
    steady = [0.010 + 0.0001 * (i % 3 - 1) for i in range(200)]
    steady[150] = 0.035
    assert [s["step"] for s in clock_with(steady).slow_steps] == [151]


def test_slow_steps_say_when_the_machine_was_busy_or_the_process_waited(monkeypatch):
    steady = [0.010] * 100 + [0.100] * 5 + [0.010] * 50 + [0.100] + [0.010] * 20
    monkeypatch.setattr(phases, "load_average", lambda: 64.0)
    monkeypatch.setattr(phases.os, "cpu_count", lambda: 2)
    busy = clock_with(steady)
    assert [s["step"] for s in busy.slow_steps] == [101, 102, 103, 104, 105, 156]
    assert all(s["machine_busy"] and s["load_average"] == 64.0 for s in busy.slow_steps)
    text = report.slow_step_lines({"slow_steps": busy.slow_steps, "machine": busy.machine()})
    assert text[0].startswith("  slow steps 101-105: 0.100s vs median 0.010s")  # consecutive ones: one line
    assert text[0].endswith("machine busy: load 64.0 on 2 cores") and text[1].startswith("  slow step 156:")
    assert text[-1].startswith("  the machine was busy: load average 64.0 at the start, 64.0 at the end, on 2 cores")
    assert text[-1].endswith("6 of 6 slow steps came while it was busy")

    # An idle machine, and the process ran 10% of the slow step (usually all of it): it was waiting.
    monkeypatch.setattr(phases, "load_average", lambda: 0.3)
    idle = clock_with(steady, slow_cpu_share=0.1, slow_at={156})
    line = report.slow_step_lines({"slow_steps": idle.slow_steps, "machine": idle.machine()})[-1]
    assert line.startswith("  slow step 156:") and line.endswith("the process was waiting (it used 10% of a CPU, "
                                                                 "usually 100%)")
    assert not idle.machine()["busy"]


# ---------------------------------------------------------------------------------------------------------------
# What each chart says equals the data it is drawn from
# ---------------------------------------------------------------------------------------------------------------
def demo_like_schedule(**settings):
    """The demo's shape: 80 steps, warmup of 20, linear decay, the rate logged every 16 steps (a straight line
    between the logs at 16 and 32 would climb to step 32)."""
    schedule = {"type": "linear", "learning_rate": 1e-3, "warmup_steps": 20, "training_steps": 80, "kwargs": {},
                **settings}

    def rate(step):  # the rate step s trains at: the schedule after s - 1 steps
        s = step - 1
        return 1e-3 * (s / 20 if s < 20 else (80 - s) / 60)

    history = [{"step": s, "loss": 1.0, "learning_rate": rate(s)} for s in (16, 32, 48, 64, 80)]
    return {"log_history": history, "lr_schedule": schedule, "warmup_steps": 20, "global_step": 80,
            "segments": []}, rate


def test_the_learning_rate_chart_peaks_where_the_schedule_did():
    written, rate = demo_like_schedule()
    ax = report.chart_figure("learning_rate.png", written).axes[0]
    schedule = drawn_lines(ax)["learning rate at each step (the schedule)"]
    steps, rates = list(schedule.get_xdata()), list(schedule.get_ydata())
    assert steps == list(range(0, 81)) and rates[1:] == pytest.approx([rate(s) for s in range(1, 81)])
    assert steps[int(np.argmax(rates))] == 21  # the first step after 20 of warmup
    assert drawn_lines(ax)["logged"].get_xdata().tolist() == [16, 32, 48, 64, 80]


@pytest.mark.parametrize("settings", [None, {"type": "cosine"}, {"warmup_steps": 10}])
def test_without_the_schedule_that_was_logged_the_chart_shows_the_logged_points_alone(settings):
    """No settings (a scheduler passed in `optimizers=`), or settings that disagree with the logged rates: no line
    is drawn between the logs, which would invent the rates in between."""
    written, _ = demo_like_schedule(**(settings or {}))
    if settings is None:
        written["lr_schedule"] = None
    assert report.schedule_rates(written) is None
    ax = report.chart_figure("learning_rate.png", written).axes[0]
    (points,) = [line for line in ax.get_lines() if line.get_label().startswith("learning rate")]
    assert points.get_label() == "learning rate at each log (between logs: not recorded)"
    assert points.get_linestyle() == "None" and points.get_xdata().tolist() == [16, 32, 48, 64, 80]


def test_a_scheduler_passed_by_the_user_is_not_redrawn_from_the_arguments(tmp_path):
    import torch

    model = tiny_regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    args = LoopArgs(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                    save_strategy="no", disable_tqdm=True, report_to="none")
    Loop(model=model, args=args, train_dataset=regression_data(32), optimizers=(optimizer, scheduler)).train()
    written = json.load(open(tmp_path / "run_report.json"))
    assert written["lr_schedule"] is None and report.schedule_rates(written) is None
    args = LoopArgs(output_dir=str(tmp_path / "own"), max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                    save_strategy="no", disable_tqdm=True, report_to="none", lr_scheduler_type="cosine",
                    warmup_steps=2)
    Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32)).train()
    written = json.load(open(tmp_path / "own" / "run_report.json"))
    assert written["lr_schedule"] == {"type": "cosine", "learning_rate": 5e-5, "warmup_steps": 2,
                                      "training_steps": 6, "kwargs": {}}
    steps, rates = report.schedule_rates(written)
    assert steps == [1, 2, 3, 4, 5, 6]
    assert rates == pytest.approx([h["learning_rate"] for h in written["log_history"] if "learning_rate" in h])


def test_bounded_metrics_move_in_points_and_the_others_relatively():
    history = [{"step": 10, "eval_loss": 0.8, "eval_accuracy": 0.021, "eval_exact_match": 45.0, "eval_mcc": -0.1},
               {"step": 20, "eval_loss": 0.7, "eval_accuracy": 0.047, "eval_exact_match": 47.5, "eval_mcc": 0.2}]
    axes = report.chart_figure("eval_metrics.png", {"log_history": history, "segments": []}).axes
    labels = {ax.get_ylabel(): ax.get_lines()[0].get_label() for ax in axes}
    assert labels == {"eval_loss": "first 0.8, last 0.7 (-12.50%)",
                      "eval_accuracy": "first 0.021, last 0.047 (+2.60 points)",
                      "eval_exact_match": "first 45, last 47.5 (+2.50 points)",
                      "eval_mcc": "first -0.1, last 0.2 (+30.00 points)"}
    for ax in axes:
        key = ax.get_ylabel()
        assert ax.get_lines()[0].get_ydata().tolist() == [h[key] for h in history]
    assert ax.get_legend().get_texts()[0].get_text() == labels["eval_mcc"]  # the legend shows the label
    assert not report.is_bounded_metric("eval_close", [0.2, 0.5])  # no share by its name: relative
    assert not report.is_bounded_metric("eval_accuracy", [0.5, 150.0])  # out of any share's range


def test_a_rebuilt_throughput_chart_says_the_machine_was_busy(tmp_path, monkeypatch):
    monkeypatch.setattr(phases, "load_average", lambda: 64.0)
    monkeypatch.setattr(phases.os, "cpu_count", lambda: 2)
    out = tmp_path / "run"
    args = LoopArgs(output_dir=str(out), max_steps=8, per_device_train_batch_size=4, logging_steps=2, save_steps=8,
                    disable_tqdm=True, report_to="none")
    Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32)).train()
    own = json.load(open(out / "run_report.json"))
    rebuilt, is_own = report.report_from_files(str(out), force=True)
    assert not is_own and rebuilt["machine"]["busy"] and rebuilt["machine"]["load_average_end"] == 64.0
    note = "machine busy: load average 64.0 on 2 cores"
    for written in (own, rebuilt):
        assert report.chart_figure("throughput.png", written).axes[0].get_title().endswith("\n" + note)


def test_only_a_run_that_reached_its_end_has_a_final_evaluation():
    evaluation = {"step": 30, "epoch": 1.0, "eval_loss": 0.25}
    written = {"status": "s", "output_dir": "/d", "global_step": 30, "max_steps": 80, "epoch": 1.0,
               "final_metrics": evaluation, "segments": []}
    for end in ("interrupted", "failed", "running", "unknown"):
        text = report.summary_text(dict(written, end=end))
        assert "  last evaluation (step 30 of 80): eval_loss=0.25" in text.splitlines() and "final" not in text
    finished = dict(written, global_step=80, max_steps=80, final_metrics=dict(evaluation, step=80))
    assert "  final evaluation: eval_loss=0.25" in report.summary_text(dict(finished, end="completed")).splitlines()
    stopped = dict(written, end="stopped_early")  # stopped by a callback at its evaluation: the run's last word
    assert "  final evaluation: eval_loss=0.25" in report.summary_text(stopped).splitlines()
    later = dict(finished, end="completed", final_metrics=evaluation)  # 50 steps trained after it
    assert "  last evaluation (step 30 of 80): eval_loss=0.25" in report.summary_text(later).splitlines()


def label_clear_of_dots(axis, label, dots, along: int) -> None:
    """`label` (an annotation) lies past every one of `dots` ((x, y) data points) along axis `along` (0: x, 1: y),
    in display coordinates, and inside the axes."""
    box, frame = label.get_window_extent(), axis.get_window_extent()
    ends = axis.transData.transform(dots)[:, along]
    assert (box.x0 if along == 0 else box.y0) > ends.max(), label.get_text()
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, label.get_text()


def test_benchmark_value_labels_sit_clear_of_the_rounds_dots():
    """The median's label of each bar, past the bar and every round's dot (benchmarks/reports/tables.py and the ladder's
    chart, benchmarks/suite/ladder.py), and inside the panel."""
    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.reports import ladder as bench_ladder
    from benchmarks.reports.verdicts import fmt, median
    from benchmarks.reports.tables import comparison_chart

    samples = {"raw": [1.0, 1.2, 1.1], "hf": [2.0, 2.6, 2.1], "loopkit": [1.5, 1.52, 1.9]}
    row = {"name": "step time", "unit": "ms", "samples": samples, "check": {"mismatched": []}}
    figure = comparison_chart({"title": "t", "rows": [row]}, plt)
    axis = figure.axes[0]
    figure.canvas.draw()
    labels = {text.get_text(): text for text in axis.texts}
    for x, values in enumerate(samples.values()):
        label = labels[fmt(median(values))]  # the bar's value as its text
        assert label.xy == (x, max(values))
        assert [tuple(p) for p in axis.collections[x].get_offsets()] == [(x, v) for v in values]
        label_clear_of_dots(axis, label, [(x, v) for v in values], along=1)
    plt.close(figure)

    runs = {name: [{"tokens_per_second": 1000.0 * (i + 1) + 300 * r, "peak_rss_mb": 500.0 + 80 * r}
                   for r in range(3)] for i, name in enumerate(bench_ladder.RUNGS)}
    figure = bench_ladder.chart({"runs": runs}, plt)
    figure.canvas.draw()
    for axis, key in zip(figure.axes, ("tokens_per_second", "peak_rss_mb")):
        for y, name in enumerate(bench_ladder.RUNGS):
            values = [r[key] for r in runs[name]]
            (label,) = [t for t in axis.texts if t.xy[1] == y]
            assert label.get_text() == fmt(median(values))
            label_clear_of_dots(axis, label, [(v, y) for v in values], along=0)
    plt.close(figure)
