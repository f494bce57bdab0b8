"""`loop.show_wiring()` (loopkit/trainer/wiring_text.py): for each event in firing order, the stage methods and callbacks that run,
in the order they run, and where each of HF's overridable methods runs (a `Loop` subclass's override included).
Checked against what a run actually calls."""

from __future__ import annotations

import io

from transformers import TrainerCallback

from helpers import hf_args, regression_data, tiny_regression
from loopkit import EVENTS, Loop, StepStage
from loopkit.trainer.wiring_text import FIRING_ORDER


class CountedLoss(Loop):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.calls.append("CountedLoss.compute_loss")
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class AuxStep(StepStage):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def on_step_end(self, args, state, control, **kwargs):
        self.calls.append("AuxStep.on_step_end")


class UserCallback(TrainerCallback):
    def __init__(self, calls):
        self.calls = calls

    def on_step_end(self, args, state, control, **kwargs):
        self.calls.append("UserCallback.on_step_end")

    def on_log(self, args, state, control, **kwargs):
        self.calls.append("UserCallback.on_log")


def event_section(text: str, event: str) -> list[str]:
    """The lines printed under `event`: its own line and the continuation lines below it, column 2 onwards."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [event])
    section = [lines[start].split(None, 1)[1]]
    for line in lines[start + 1:]:
        if not line.startswith("   ") or line.strip().startswith("("):
            break
        section.append(line.strip())
    return [" ".join(entry.split()) for entry in section]


def test_show_wiring_prints_who_runs_where_as_a_run_calls_them(tmp_path):
    calls = []  # the order in which the test's override, stage and callback are called
    args = hf_args(tmp_path, per_device_train_batch_size=4, max_steps=2, logging_steps=1, save_strategy="no")
    loop = CountedLoss(model=tiny_regression(), args=args, train_dataset=regression_data(16),
                       step=AuxStep(calls), callbacks=[UserCallback(calls)])
    loop.calls = calls
    printed = io.StringIO()
    loop.show_wiring(file=printed)
    text = printed.getvalue()

    assert event_section(text, "on_step_end") == ["step stage AuxStep.on_step_end",
                                                  "callback DefaultFlowCallback.on_step_end",
                                                  "callback UserCallback.on_step_end"]
    assert event_section(text, "on_log") == ["teardown stage TeardownStage.on_log",  # the CPU-starved advice
                                             "callback UserCallback.on_log", "callback PrinterCallback.on_log"]
    assert event_section(text, "on_init_end") == ["setup stage SetupStage.on_init_end"]
    assert event_section(text, "on_push_begin") == ["(nobody)"]
    methods = {line.split()[0]: " ".join(line.split()[1:]) for line in text.split("\n\n")[1].splitlines()[1:]}
    assert methods["compute_loss"] == "step stage CountedLoss.compute_loss (the Loop subclass's override)"
    assert methods["training_step"] == "step stage StepStage.training_step"
    assert methods["evaluation_loop"] == "evaluation stage EvalStage.evaluation_loop"
    assert "observers" not in text  # none passed

    loop.train()
    step_one = calls[:calls.index("UserCallback.on_log")]
    assert step_one == ["CountedLoss.compute_loss", "AuxStep.on_step_end", "UserCallback.on_step_end"]


def test_the_firing_order_is_every_event_once_and_the_order_a_run_meets_them(tmp_path):
    """A run with accumulation, evaluation, a save and a prediction meets the events it fires in the printed order
    (by first occurrence); on_train_failed and on_push_begin are not met here."""
    assert sorted(FIRING_ORDER) == sorted(EVENTS) and len(FIRING_ORDER) == len(EVENTS)
    met = []

    class FirstOccurrences(TrainerCallback):
        pass

    for event in EVENTS:
        setattr(FirstOccurrences, event, lambda self, *a, _event=event, **k: met.append(_event) if _event not in met
                else None)
    args = hf_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
                   logging_steps=1, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(16),
                eval_dataset=regression_data(8, seed=1), callbacks=[FirstOccurrences()])
    loop.train()
    loop.predict(regression_data(4, seed=2))
    assert set(FIRING_ORDER) - set(met) == {"on_train_failed", "on_push_begin"}
    assert met == [event for event in FIRING_ORDER if event in met]


def test_observers_show_where_they_run(tmp_path):
    from loopkit.observers.throughput import Throughput

    loop = Loop(model=tiny_regression(), args=hf_args(tmp_path), train_dataset=regression_data(8),
                observers=[Throughput()])
    printed = io.StringIO()
    loop.show_wiring(file=printed)
    lines = [" ".join(line.split()) for line in printed.getvalue().splitlines()]
    at = lines.index("(after each step) step observers' on_step(): Throughput")
    assert lines[at + 1] == "(training logs) step observers' logs(): Throughput"
    assert lines[at + 2].startswith("on_log ")
    step_end = next(i for i, line in enumerate(lines) if line.startswith("on_step_end "))
    assert all(line.startswith(("callback ", "step stage ")) for line in lines[step_end + 1:at])
