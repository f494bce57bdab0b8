"""The run report says, once, when the process got far less CPU than torch's threads asked for (a busy machine:
its threads then wait for each other on cores other processes hold), with the numbers and what to do. The
measurement is injected (a real busy machine is not reproducible); a run that got its CPU says nothing. The advice
is also logged once, at the first log that measures it, so a long run says it when it can still act on it."""

import json
import logging
import time

import torch
from transformers import TrainerCallback

from helpers import regression_data, tiny_regression
from loopkit import Loop, LoopArgs, phases, report


def run(out):
    args = LoopArgs(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_strategy="no",
                    disable_tqdm=True, report_to="none")
    Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32)).train()
    return json.load(open(out / "run_report.json")), open(out / "run_report.md").read()


def starve(monkeypatch):
    """4 torch threads on 2 cores, load average 6.5, and the process gets 0.05 CPU-seconds per wall second."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(phases, "load_average", lambda: 6.5)
    monkeypatch.setattr(phases.os, "cpu_count", lambda: 2)
    started = time.perf_counter()
    monkeypatch.setattr(phases.PhaseClock, "cpu", staticmethod(lambda: 0.05 * (time.perf_counter() - started)))


def test_a_starved_run_says_so_once_with_the_numbers_and_the_fix(tmp_path, monkeypatch, capsys):
    starve(monkeypatch)
    written, markdown = run(tmp_path)
    printed = capsys.readouterr().out
    assert printed.count("CPU starved") == 1 and markdown.count("CPU starved") == 1, printed
    starved = written["cpu_starved"]
    assert starved["torch_threads"] == 4 and starved["cores"] == 2 and starved["load_average"] == 6.5
    assert starved["cpu_seconds_per_second"] == written["machine"]["cpu_seconds_per_second"]
    assert abs(starved["cpu_seconds_per_second"] - 0.05) < 0.01 and starved["suggested_threads"] == 1
    line = (f"  CPU starved: torch ran 4 threads on 2 cores under a load average of 6.5, and the process got "
            f"{starved['cpu_seconds_per_second']} CPU-seconds per second ({starved['cpu_seconds_per_second'] / 4:.0%}"
            f" of what its threads asked for): set fewer threads, OMP_NUM_THREADS=1 before Python starts or "
            f"torch.set_num_threads(1)")
    assert line in printed.splitlines()


class StarvedWarningsSeen(TrainerCallback):
    """At each step's end, how many "CPU starved" log records the run has logged so far."""

    def __init__(self, caplog):
        self.caplog, self.seen = caplog, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.seen[state.global_step] = len(starved_records(self.caplog))


def starved_records(caplog):
    return [r for r in caplog.records if r.name == "loopkit" and r.getMessage().startswith("CPU starved")]


def test_a_starved_run_logs_the_advice_once_when_first_measured(tmp_path, monkeypatch, caplog, capsys):
    """At the first training log (step 2 of 6), not only at the end: one warning on the `loopkit` logger."""
    starve(monkeypatch)
    seen = StarvedWarningsSeen(caplog)
    args = LoopArgs(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=2,
                    save_strategy="no", disable_tqdm=True, report_to="none")
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32), callbacks=[seen]).train()
    assert seen.seen == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}  # logged at step 2's log (after its on_step_end)
    (record,) = starved_records(caplog)  # once, though every later log measured it too
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert message.startswith("CPU starved at step 2: torch ran 4 threads on 2 cores under a load average of 6.5, "
                              "and the process got ")
    assert message.endswith("set fewer threads, OMP_NUM_THREADS=1 before Python starts or torch.set_num_threads(1)")
    assert capsys.readouterr().out.count("CPU starved") == 1  # the summary's line, at the end

    caplog.clear()  # an evaluate() outside train() measures no training: nothing; a second train() says it, once
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32),
                    eval_dataset=regression_data(8))
        loop.evaluate()
        assert not starved_records(caplog)
        loop.train()
    assert len(starved_records(caplog)) == 1


def test_a_run_that_got_its_cpu_says_nothing(tmp_path, monkeypatch, capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="loopkit"):
        written, markdown = run(tmp_path / "real")  # the tests' own threads: 1 (tests/conftest.py)
    assert not starved_records(caplog)
    assert written["cpu_starved"] is None and "CPU starved" not in markdown + capsys.readouterr().out
    # Several threads that got their share on a busy machine, and a starved process on an idle one (it was waiting
    # for something else than the CPU): nothing either.
    busy_but_served = {"cores": 2, "load_average_start": 5.0, "load_average_end": 5.0, "busy": True,
                       "cpu_seconds_per_second": 1.8, "torch_threads": 2}
    idle = dict(busy_but_served, load_average_start=0.3, load_average_end=0.4, busy=False,
                cpu_seconds_per_second=0.2)
    assert report.cpu_starvation(busy_but_served, on_cpu=True) is None
    assert report.cpu_starvation(idle, on_cpu=True) is None
    starved = dict(busy_but_served, cpu_seconds_per_second=0.3)
    assert report.cpu_starvation(starved, on_cpu=False) is None  # a GPU run's CPU waits for its device
    assert report.cpu_starvation(starved, on_cpu=True)["suggested_threads"] == 1
