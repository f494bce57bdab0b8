"""When a public call of a `Loop` returns or raises, nothing of loopkit's is still writing into, or holding, the
user's folders: every file the report names exists, no thread of ours is left running, and the folder's listing and
file times stay as they are. The runs here draw their charts before `train()` returns (`TeardownStage(charts=True)`;
by default they are drawn on demand, and no chart is written at all). Drawing is made slow on purpose (each chart
sleeps first), so a chart drawn after the call returns would show up as a live thread and a change in the folder,
whatever the machine's speed."""

import json
import os
import signal
import sys
import tempfile
import threading
import time
import warnings

import pytest
from transformers import TrainerCallback

from helpers import regression_data, tiny_regression
from loopkit import Loop, LoopArgs, TrainingInterrupted, report
from loopkit.guards import LAUNCHER_ENV
from loopkit.stages.teardown import TeardownStage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from interrupt_child import SignalAtStep  # noqa: E402

DRAW_SLEEP = 0.3  # seconds each chart waits before it is drawn
SETTLE = 1.5  # how long the folder is watched after the call: longer than all four slow charts


@pytest.fixture
def slow_drawing(monkeypatch):
    real = report.chart_figure

    def slow_chart_figure(name, written):
        time.sleep(DRAW_SLEEP)
        return real(name, written)

    monkeypatch.setattr(report.charts, "chart_figure", slow_chart_figure)
    for name in LAUNCHER_ENV:  # an interrupted train() raises here, as in a notebook
        monkeypatch.delenv(name, raising=False)


def listing(folder) -> dict:
    """Every file and folder under `folder`, with its size and modification time."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            found[os.path.relpath(path, folder)] = (stat.st_size if name in files else None, stat.st_mtime_ns)
    return found


def assert_settled(folder, threads_before) -> dict:
    """Right after a call returned: no new thread is alive, and the folder does not change over SETTLE seconds."""
    alive = [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    assert alive == [], f"threads still running after the call returned: {alive}"
    before = listing(folder)
    time.sleep(SETTLE)
    after = listing(folder)
    assert after == before, {"appeared or changed": sorted(k for k in after if after[k] != before.get(k)),
                             "disappeared": sorted(set(before) - set(after))}
    return before


def assert_named_files_exist(folder):
    """Every file the run report names (its charts included) is in the folder."""
    written = json.load(open(os.path.join(folder, "run_report.json")))
    charts = written["charts"]
    assert isinstance(charts, list) and charts, charts
    for name in charts:
        assert os.path.isfile(os.path.join(folder, name)), name
    markdown = open(os.path.join(folder, "run_report.md")).read()
    for name in charts:
        assert f"]({name})" in markdown


def loop(out, callbacks=(), teardown=None, **fields):
    fields = {"max_steps": 8, "per_device_train_batch_size": 4, "logging_steps": 2, "eval_strategy": "steps",
              "eval_steps": 4, "save_steps": 4, "learning_rate": 0.05, "disable_tqdm": True, "report_to": "none",
              **fields}
    return Loop(model=tiny_regression(), args=LoopArgs(output_dir=str(out), **fields),
                train_dataset=regression_data(32), eval_dataset=regression_data(8, seed=1), callbacks=list(callbacks),
                teardown=teardown if teardown is not None else TeardownStage(charts=True))


class RaiseAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"failing at step {self.step}")


def test_train_returns_with_its_charts_drawn_and_nothing_left_running(tmp_path, slow_drawing):
    out = tmp_path / "run"
    threads = set(threading.enumerate())
    loop(out).train()
    assert_named_files_exist(out)
    files = assert_settled(out, threads)
    assert {"loss.png", "learning_rate.png", "eval_metrics.png", "throughput.png"} <= set(files)
    assert not [name for name in files if name.endswith(".tmp") or ".tmp-" in name]


def test_a_failing_train_raises_with_its_report_and_charts_written(tmp_path, slow_drawing):
    out = tmp_path / "run"
    threads = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="failing at step 6"):
        loop(out, [RaiseAt(6)]).train()
    assert json.load(open(out / "run_report.json"))["status"].startswith("failed: RuntimeError")
    assert_named_files_exist(out)
    assert_settled(out, threads)


def test_an_interrupted_train_raises_with_everything_written(tmp_path, slow_drawing):
    out = tmp_path / "run"
    threads = set(threading.enumerate())
    with pytest.raises(TrainingInterrupted):
        loop(out, [SignalAtStep(signal.SIGINT, 3)]).train()
    assert json.load(open(out / "run_report.json"))["status"].startswith("interrupted by SIGINT")
    assert_named_files_exist(out)
    assert_settled(out, threads)


def test_evaluate_predict_save_model_and_export_leave_the_folder_settled(tmp_path, slow_drawing):
    out = tmp_path / "run"
    trained = loop(out)
    trained.train()
    for call in (lambda: trained.evaluate(), lambda: trained.predict(regression_data(8, seed=2)),
                 lambda: trained.save_model(str(out / "saved")),
                 lambda: trained.export(str(out / "exported"), {"x": regression_data(2)[0]["x"][None]},
                                        formats=["torch_export"])):
        threads = set(threading.enumerate())
        call()
        assert_settled(out, threads)


def test_a_run_in_a_temporary_directory_cleans_up(slow_drawing):
    threads = set(threading.enumerate())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tempfile.TemporaryDirectory() as folder:  # its clean-up raises if a file appears meanwhile
            loop(folder).train()
            assert_named_files_exist(folder)
        time.sleep(SETTLE)
    assert not os.path.exists(folder)
    assert not [str(w.message) for w in caught if "chart" in str(w.message)]
    assert [t.name for t in threading.enumerate() if t not in threads and t.is_alive()] == []


@pytest.mark.parametrize("teardown", [TeardownStage, lambda: TeardownStage(charts=False)])
def test_charts_can_be_turned_off(tmp_path, teardown):
    """The default and `charts=False`: no chart drawn or named as a file; the summary names the command."""
    out = tmp_path / "run"
    loop(out, teardown=teardown()).train()
    written = json.load(open(out / "run_report.json"))
    assert written["charts"] == [] and not list(out.glob("*.png"))
    assert ".png" not in open(out / "run_report.md").read()
    assert f"python -m loopkit report {out} draws them" in open(out / "run_report.md").read()


def test_the_report_files_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A failure while the new report is written (here: its write fails, as on a full disk) leaves the previous
    report as it was and no temporary file behind."""
    out = tmp_path / "run"
    loop(out, teardown=TeardownStage(charts=False), max_steps=4, save_strategy="no").train()
    previous = {name: (out / name).read_bytes() for name in ("run_report.json", "run_report.md")}

    def failing_write(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report.files.os, "write", failing_write)
    with pytest.warns(UserWarning, match="Could not write the run report"):
        loop(out, teardown=TeardownStage(charts=False), max_steps=8, save_strategy="no").train()
    assert {name: (out / name).read_bytes() for name in previous} == previous
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("run_report", ".run_report"))) == \
        ["run_report.json", "run_report.md"]
