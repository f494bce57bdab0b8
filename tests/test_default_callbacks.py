"""A `Loop`'s default callbacks are HF's own classes (`DefaultFlowCallback`, `ProgressCallback`, `PrinterCallback`),
so code that finds them by `isinstance` or by class equality, as transformers' own callback tests do, finds them, and
`add_callback` / `pop_callback` / `remove_callback` leave the same list as on `Trainer` (run live here).

Each test runs twice: with the defaults HF's classes from the start (HF's module is imported in this process), and
with loopkit's stand-ins (what a process that has not imported it gets: loopkit/default_callbacks.py), which must
become HF's classes the moment the test can look (tests/test_stand_in_callbacks.py does the same in a fresh process).
"""

import pytest
from transformers import DefaultFlowCallback, PrinterCallback, ProgressCallback, TrainerCallback

import loopkit.default_callbacks as default_callbacks
from loopkit import Loop

from helpers import IGNORE_PIN_MEMORY_WARNING, Recorder, hf_args, regression_data, runners, tiny_regression

pytestmark = [IGNORE_PIN_MEMORY_WARNING, pytest.mark.filterwarnings("ignore:You are adding a")]

HF_CLASSES = (DefaultFlowCallback, ProgressCallback, PrinterCallback, TrainerCallback, Recorder)


@pytest.fixture(params=["hf classes", "stand-ins"], autouse=True)
def defaults(request, monkeypatch) -> str:
    """How a Loop gets its defaults; "stand-ins" as if `transformers.trainer_utils` had not been imported."""
    if request.param == "stand-ins":
        monkeypatch.setattr(default_callbacks, "NOISY_DEPENDENCY", "a module this process has not imported")
    return request.param


def build(runner, tmp_path, name, callbacks=None, **arg_kwargs):
    args = hf_args(tmp_path / name, **arg_kwargs)
    trainer = runner(tiny_regression(), args, train_dataset=regression_data(16),
                     eval_dataset=regression_data(8, seed=1), callbacks=callbacks)
    if runner is Loop:  # the mode is real: stand-ins exactly when asked for
        objects = trainer.callback_handler.callback_objects
        stand_ins = [cb for cb in objects if default_callbacks.is_stand_in(cb)]
        assert len(stand_ins) == (0 if default_callbacks.hf_classes_are_free() else 2)
    return trainer


def classes(trainer) -> list[type]:
    return [cb.__class__ for cb in trainer.callback_handler.callbacks]


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_default_callbacks_are_hf_classes(tmp_path, disable_tqdm):
    """transformers' test_trainer_callback.py way of checking: the list of classes, compared by equality."""
    found = {}
    for name, runner in runners():
        trainer = build(runner, tmp_path, name, callbacks=[Recorder], disable_tqdm=disable_tqdm)
        callbacks = trainer.callback_handler.callbacks
        found[name] = (classes(trainer), [[isinstance(cb, cls) for cls in HF_CLASSES] for cb in callbacks],
                       [type(cb) == DefaultFlowCallback for cb in callbacks])  # noqa: E721 (what user code does)
    progress = PrinterCallback if disable_tqdm else ProgressCallback
    assert found["hf"][0] == [DefaultFlowCallback, Recorder, progress]
    assert found["loopkit"] == found["hf"]


def operations(trainer):
    """add / pop / remove by class and by instance, as user code and transformers' tests do; yields the list of
    classes and what each call returned after every call."""
    handler = trainer.callback_handler
    flow = trainer.pop_callback(DefaultFlowCallback)
    yield "pop DefaultFlowCallback", type(flow), classes(trainer)
    yield "pop it again", trainer.pop_callback(DefaultFlowCallback), classes(trainer)
    trainer.add_callback(flow)
    yield "add the instance back", handler.callbacks[-1] is flow, classes(trainer)
    trainer.add_callback(DefaultFlowCallback)  # a duplicate: added, with a warning
    yield "add the class", type(handler.callbacks[-1]), classes(trainer)
    yield "pop the instance", trainer.pop_callback(flow) is flow, classes(trainer)
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)  # one of the two is not there: a no-op, as in HF
    yield "remove the progress classes", None, classes(trainer)
    trainer.add_callback(PrinterCallback)
    printer = handler.callbacks[-1]
    trainer.remove_callback(printer)
    yield "remove an instance", None, classes(trainer)
    with pytest.raises(ValueError):
        trainer.remove_callback(printer)
    yield "pop TrainerCallback (every callback is one)", type(trainer.pop_callback(TrainerCallback)), classes(trainer)


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_add_pop_remove_as_on_trainer(tmp_path, disable_tqdm):
    traces = {name: list(operations(build(runner, tmp_path, name, callbacks=[Recorder], disable_tqdm=disable_tqdm)))
              for name, runner in runners()}
    assert traces["hf"][0][1] is DefaultFlowCallback
    for mine, theirs in zip(traces["loopkit"], traces["hf"]):
        assert mine == theirs
    assert len(traces["loopkit"]) == len(traces["hf"])


class EvaluateFromStepOne(DefaultFlowCallback):
    """A user's flow rule, written against HF's class: also evaluate after the first step."""

    def on_step_end(self, args, state, control, **kwargs):
        control = super().on_step_end(args, state, control, **kwargs)
        if state.global_step == 1:
            control.should_evaluate = True
        return control


def test_a_replaced_default_flow_callback_drives_the_run_as_on_trainer(tmp_path):
    runs = {}
    for name, runner in runners():
        recorder = Recorder()
        trainer = build(runner, tmp_path, name, callbacks=[recorder], max_steps=4, per_device_train_batch_size=2,
                        eval_strategy="steps", eval_steps=2, save_strategy="no", logging_steps=2)
        trainer.remove_callback(DefaultFlowCallback)
        trainer.add_callback(EvaluateFromStepOne)
        assert isinstance(trainer.callback_handler.callbacks[-1], DefaultFlowCallback)
        trainer.train()
        runs[name] = recorder.events
    assert [e[1] for e in runs["hf"] if e[0] == "on_evaluate"] == [1, 2, 4]
    assert runs["loopkit"] == runs["hf"]
