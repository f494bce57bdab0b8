"""`python -m loopkit report RUN_DIR` says what the run's own report said: it never reads file times (a copied
folder has new ones), never writes over the run's own report (a rebuilt one goes beside it unless `--force`), and a
report rebuilt from a checkpoint takes the run's end (completed, stopped early, interrupted, failed, or never reached:
killed) from `run_status.json`."""

import json
import os
import shutil
import signal
import sys
import time

import pytest
from transformers import EarlyStoppingCallback

from helpers import regression_data, tiny_regression
from loopkit import Loop, LoopArgs, TrainingInterrupted, report
from loopkit.guards import LAUNCHER_ENV

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
sys.path.insert(0, SCRIPTS)
from interrupt_child import SignalAtStep  # noqa: E402
import report_child  # noqa: E402

CHARTS = "loss.png, learning_rate.png, eval_metrics.png, throughput.png"


@pytest.fixture(autouse=True)
def not_under_a_launcher(monkeypatch):
    for name in LAUNCHER_ENV:  # an interrupted train() raises, as in a script or a notebook
        monkeypatch.delenv(name, raising=False)


def loop(out, callbacks=(), **fields):
    fields = {"max_steps": 8, "per_device_train_batch_size": 4, "logging_steps": 2, "eval_strategy": "steps",
              "eval_steps": 2, "save_steps": 2, "learning_rate": 0.05, "disable_tqdm": True, "report_to": "none",
              "seed": 3, **fields}
    return Loop(model=tiny_regression(), args=LoopArgs(output_dir=str(out), **fields),
                train_dataset=regression_data(32), eval_dataset=regression_data(8, seed=1), callbacks=list(callbacks))


def copied(out, to):
    """`cp -r` without keeping times; then the checkpoints made to look newer than the report, as a copy or a
    restore may leave them (a rule reading file times would take the report for stale)."""
    shutil.copytree(out, to, copy_function=shutil.copyfile)
    later = time.time() + 60
    for root, dirs, files in os.walk(to):
        for name in dirs + files:
            if "checkpoint-" in os.path.join(root, name):
                os.utime(os.path.join(root, name), (later, later))
    return to


def cli(capsys, folder, *flags) -> str:
    capsys.readouterr()  # what the run printed before
    assert report.main(["report", str(folder), *flags]) == 0
    return capsys.readouterr().out


def files(folder, prefix="run_report"):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name.startswith(prefix)}


def test_a_copied_folder_reports_what_the_run_said_and_keeps_its_report(tmp_path, capsys):
    out = tmp_path / "run"
    loop(out).train()
    own = json.load(open(out / "run_report.json"))
    copy = copied(out, tmp_path / "copy")
    before = files(copy)
    printed = cli(capsys, copy)
    assert printed.startswith("loopkit run report: completed") and "rebuilt" not in printed
    assert f"{own['samples_per_second']:.1f} samples/s" in printed and "peak host memory" in printed
    assert files(copy) == before  # the run's own report, as it wrote it
    assert own["charts"] == [] and printed.endswith(f"  charts: {CHARTS}\n")  # drawn by the command
    assert all((copy / chart).is_file() for chart in CHARTS.split(", "))
    assert own["status"] == "completed" and own["end"] == "completed"


def test_a_copied_checkpoint_of_a_finished_run_is_not_called_incomplete(tmp_path, capsys):
    """Only the last checkpoint copied elsewhere (no run_status.json, no run report): the rebuilt report says what
    the checkpoint shows, all 8 steps trained, and that how the run ended is not recorded; one copied from the
    middle of the run is incomplete, with its step."""
    out = tmp_path / "run"
    loop(out).train()
    for step, expected in ((8, "all 8 steps trained (rebuilt from checkpoint-8; how the run ended is not recorded "
                                "here: no run_status.json of its run)"),
                           (4, "incomplete (rebuilt from checkpoint-4, step 4 of 8)")):
        copy = tmp_path / f"copy-{step}"
        shutil.copytree(out / f"checkpoint-{step}", copy / f"checkpoint-{step}")
        printed = cli(capsys, copy)
        assert printed.startswith(f"loopkit run report: {expected}  ({copy})")
        assert json.load(open(copy / "run_report.json"))["status"] == expected
        assert "final evaluation" not in printed and f"  last evaluation (step {step} of 8): eval_loss=" in printed


def test_an_early_stopped_run_says_so_in_its_report_and_in_a_rebuilt_one(tmp_path, capsys):
    out = tmp_path / "run"
    # No evaluation after the first can improve by 1e9: the run stops at the second evaluation, step 4 of 20.
    stopper = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=1e9)
    loop(out, [stopper], max_steps=20, load_best_model_at_end=True, metric_for_best_model="eval_loss").train()
    stopped = "stopped early at step 4 of 20"
    own = json.load(open(out / "run_report.json"))
    assert own["status"].startswith(stopped) and own["end"] == "stopped_early"
    assert json.load(open(out / "run_status.json"))["end"] == "stopped_early"
    assert cli(capsys, copied(out, tmp_path / "copy")).startswith(f"loopkit run report: {stopped}")

    # Without the run's report, the one rebuilt from checkpoint-4 says the same.
    os.remove(out / "run_report.json")
    printed = cli(capsys, out)
    rebuilt = json.load(open(out / "run_report.json"))
    assert rebuilt["status"].startswith(stopped) and rebuilt["status"].endswith("(rebuilt from checkpoint-4, step 4)")
    assert printed.startswith(f"loopkit run report: {stopped}") and rebuilt["global_step"] == 4


def test_an_interrupted_then_resumed_run(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted):
        loop(out, [SignalAtStep(signal.SIGINT, 3)]).train()
    printed = cli(capsys, copied(out, tmp_path / "interrupted"))
    assert printed.startswith(f"loopkit run report: interrupted by SIGINT: saved {out}/checkpoint-3")
    assert "resume with:" in printed
    # Its last evaluation (step 2) is no final one.
    assert "  last evaluation (step 2 of 8): eval_loss=" in printed and "final evaluation" not in printed

    loop(out).train(resume_from_checkpoint=True)
    copy = copied(out, tmp_path / "resumed")
    before = files(copy)
    printed = cli(capsys, copy)
    assert printed.startswith("loopkit run report: completed") and "2 segments:" in printed
    assert files(copy) == before
    # --force rebuilds from the newest checkpoint over the run's own report, and says what the run said.
    cli(capsys, copy, "--force")
    forced = json.load(open(copy / "run_report.json"))
    assert forced["status"] == "completed (rebuilt from checkpoint-8, step 8)"
    assert [(s["from_step"], s["to_step"]) for s in forced["segments"]] == [(0, 3), (3, 8)]


def test_a_sigkilled_resume_is_rebuilt_beside_the_runs_own_report(tmp_path, capsys, forked):
    """Interrupted at step 4 (its report written), resumed in a child process and SIGKILLed at step 8: the newest
    checkpoint (6) is past the run's own report, which stays as it is; the rebuilt one goes beside it."""
    out = tmp_path / "run"
    timeline = report_child.Timeline()
    timeline.start = time.perf_counter()
    interrupted = report_child.build_loop(out, timeline)
    interrupted.add_callback(SignalAtStep(signal.SIGINT, 4))
    with pytest.raises(TrainingInterrupted):
        interrupted.train()
    before = files(out)
    # Forked from the session's fork server (conftest.forked: one intra-op thread, unbuffered).
    result = forked.run([sys.executable, report_child.__file__, str(out), "8"], "the resumed run killed at step 8")
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]

    printed = cli(capsys, out)
    assert files(out, "run_report.json") == {"run_report.json": before["run_report.json"]}
    assert files(out, "run_report.md") == {"run_report.md": before["run_report.md"]}
    assert json.load(open(out / "run_status.json"))["end"] == "running"  # the resumed run never reached its end
    rebuilt = json.load(open(out / "run_report.rebuilt.json"))
    assert rebuilt["status"] == "incomplete: the run stopped without reaching its end (killed?), rebuilt from " \
                                "checkpoint-6"
    assert rebuilt["global_step"] == 6 and [(s["from_step"], s["to_step"]) for s in rebuilt["segments"]] == \
        [(0, 4), (4, 6)]
    assert "run_report.rebuilt.json" in printed and "is kept" in printed
    assert all(name.startswith("run_report.rebuilt.") and (out / name).is_file() for name in rebuilt["charts"])

    cli(capsys, out, "--force")
    assert json.load(open(out / "run_report.json"))["status"] == rebuilt["status"]
