"""Interruption a person can follow (loopkit/guards.py): the first signal says at once what will happen, a second
stops without saving and leaves the checkpoints on disk as they were, the report names the checkpoint and the call
that resumes it, and `train()` raises `TrainingInterrupted` outside a launcher (exits 128 + signal under one)."""

import json
import os
import signal
import sys
from types import SimpleNamespace

import pytest

from helpers import regression_data, tiny_regression
from loopkit import Loop, LoopArgs, TrainingInterrupted
from loopkit.checkpoint import checkpoint_problem
from loopkit.guards import LAUNCHER_ENV, PreemptionWatch, under_launcher

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
CHILD = os.path.join(SCRIPTS, "interrupt_child.py")
sys.path.insert(0, SCRIPTS)
from interrupt_child import SignalAtStep  # noqa: E402


def run_child(forked, out, mode="", launcher=False):
    """The child in its own process (forked from the session's fork server, conftest.forked: one intra-op thread,
    unbuffered), stderr merged into stdout so the order of what is printed is kept."""
    env = {k: v for k, v in forked.env.items() if k not in LAUNCHER_ENV}
    if launcher:
        env["SLURM_JOB_ID"] = "4242"
    return forked.run([sys.executable, CHILD, str(out), mode], f"scripts/interrupt_child.py {mode}", env=env,
                      merge_stderr=True)


def checkpoints(out):
    return sorted(name for name in os.listdir(out) if "checkpoint" in name)


def plan_line(out, signame, step):
    return (f"loopkit: {signame} received: finishing step {step}, then saving checkpoint-{step} in {out}; "
            f"press Ctrl-C again to stop without saving.")


def test_sigterm_under_a_scheduler_says_what_it_does_saves_and_exits_143(tmp_path, forked):
    out = tmp_path / "run"
    result = run_child(forked, out, "sigterm", launcher=True)
    printed = result.stdout
    assert result.returncode == 143, printed[-3000:]
    # Printed at once: before step 3's log line, which comes when the step it announces is done.
    assert plan_line(out, "SIGTERM", 3) in printed, printed[-3000:]
    assert printed.index(plan_line(out, "SIGTERM", 3)) < printed.index("'epoch': '0.375'")
    assert f"loopkit run report: interrupted by SIGTERM: saved {out}/checkpoint-3" in printed
    assert f'resume with: train(resume_from_checkpoint="{out}/checkpoint-3") on a Loop built as before' in printed
    assert "after train()" not in printed  # under a scheduler the process ends
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-3"]
    assert checkpoint_problem(str(out / "checkpoint-3")) is None
    report = json.load(open(out / "run_report.json"))
    assert report["interruption"] == {"signal": "SIGTERM", "checkpoint": f"{out}/checkpoint-3", "saved": True,
                                      "resume": f'train(resume_from_checkpoint="{out}/checkpoint-3") on a Loop '
                                                'built as before'}



def test_a_second_ctrl_c_stops_at_once_without_saving_and_keeps_the_previous_checkpoint(tmp_path, forked):
    out = tmp_path / "run"
    result = run_child(forked, out, "sigint-twice")  # the second SIGINT arrives while checkpoint-3 is being written
    printed = result.stdout
    assert result.returncode == 1, printed[-3000:]  # an uncaught exception in a script (not under a launcher)
    assert plan_line(out, "SIGINT", 3) in printed
    stopped = f"stopped by a second SIGINT without saving: the newest checkpoint is {out}/checkpoint-2"
    assert f"TrainingInterrupted: {stopped}; resume: train(resume_from_checkpoint=" in printed
    assert f"loopkit run report: {stopped}" in printed
    assert "after train()" not in printed
    # The half-written checkpoint-3 is gone, temporary folder included; checkpoint-2 is whole.
    assert checkpoints(out) == ["checkpoint-2"]
    assert checkpoint_problem(str(out / "checkpoint-2")) is None
    report = json.load(open(out / "run_report.json"))
    assert report["interruption"]["saved"] is False and report["interruption"]["checkpoint"] == f"{out}/checkpoint-2"


def test_interrupted_train_raises_and_the_code_after_it_runs(tmp_path, monkeypatch, capfd):
    """As in a notebook or a REPL: Ctrl-C (a real SIGINT to this process) at step 3; `train()` raises
    `TrainingInterrupted` carrying the checkpoint, the signal handlers are back as they were, and the code after it
    runs: here it resumes the run to the end in the same process, whose report covers both stretches."""
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    handler_before = signal.getsignal(signal.SIGINT)
    args = LoopArgs(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=0.05,
                    logging_steps=1, save_steps=5, disable_tqdm=True, report_to="none", seed=3)
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32),
                callbacks=[SignalAtStep(signal.SIGINT, 3)])
    try:
        loop.train()
        interrupted = None
    except KeyboardInterrupt as exc:  # what code written for Ctrl-C catches
        interrupted = exc
    assert isinstance(interrupted, TrainingInterrupted)
    assert interrupted.signum == signal.SIGINT and interrupted.saved
    assert interrupted.checkpoint == str(tmp_path / "checkpoint-3")  # not a save step: written for the signal
    assert checkpoint_problem(interrupted.checkpoint) is None
    assert signal.getsignal(signal.SIGINT) is handler_before
    assert plan_line(tmp_path, "SIGINT", 3) in capfd.readouterr().err

    output = loop.train(resume_from_checkpoint=interrupted.checkpoint)
    assert output.global_step == 8
    # The resumed run's report covers the whole run, each stretch marked.
    report = json.load(open(tmp_path / "run_report.json"))
    assert report["status"] == "completed" and report["interruption"] is None
    assert [(s["from_step"], s["to_step"]) for s in report["segments"]] == [(0, 3), (3, 8)]
    assert report["total_seconds"] == pytest.approx(sum(s["seconds"] for s in report["segments"]), abs=1e-5)
    summary = open(tmp_path / "run_report.md").read()
    assert "steps 8/8" in summary and "in all" in summary and "2 segments:" in summary
    assert "started at step 0: steps 0-3 in" in summary and "resumed at step 3: steps 3-8 in" in summary


def test_under_a_launcher_is_told_by_the_process_count_the_launchers_variables_and_interactivity(monkeypatch):
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not under_launcher(1)
    assert under_launcher(2)
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "SLURM_JOB_ID"):
        monkeypatch.setenv(name, "0")
        assert under_launcher(1), name
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # a REPL inside a SLURM allocation: raise, not exit
    assert not under_launcher(1)


def test_the_first_signal_names_the_step_it_stops_after_with_one_process_and_with_several():
    """The step in the message is the one the loop's guard check acts on (loopkit/loop.py `check_guards`)."""
    run = SimpleNamespace(state=SimpleNamespace(global_step=4), args=SimpleNamespace(output_dir="/runs/a"))
    context = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1))
    watch = PreemptionWatch(run, context)
    watch.signum = signal.SIGTERM
    tail = "then saving checkpoint-{} in /runs/a; press Ctrl-C again to stop without saving."
    watch.checked(4, 10)  # step 4 checked: the next check is after step 5
    assert watch.plan_text().endswith("SIGTERM received: finishing step 5, " + tail.format(5))
    run.state.global_step = 5  # step 5 done, its log/evaluate/save running: the check after it acts
    assert "SIGTERM received: step 5 is done" in watch.plan_text()
    assert watch.plan_text().endswith(tail.format(5))
    context.accelerator.num_processes = 2  # the flag sent after step 5 is read after step 6: the ranks stop there
    assert "finishing the steps up to step 6 (the ranks agree one step behind), " + tail.format(6) in \
        watch.plan_text()
