"""The run report's charts and slow steps, as a person reads them (loopkit/report.py): loss with eval loss, the best
checkpoint and resumes marked; the learning rate with its warmup; one labelled axis per evaluation metric;
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


def test_each_chart_shows_what_the_run_did(tmp_path, monkeypatch):
    out = tmp_path / "run"
    written = interrupted_then_resumed(out, monkeypatch)
    assert written["charts"] == ["loss.png", "learning_rate.png", "eval_metrics.png", "throughput.png"]
    for name in written["charts"]:
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
    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
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
