"""loopkit's events around an evaluation and a prediction (`on_evaluate_begin` / `on_evaluate_end`,
`on_predict_begin` / `on_predict_end`): where they fire, that the end event fires when evaluation raises, that a
stage hears them, that HF's `TrainerCallback` (which lacks them) still works, and the documented order at the end of
`train()`: the best model is loaded before `on_train_end`."""

from __future__ import annotations

import os
import tempfile

import pytest
from safetensors.torch import load_file
from transformers import TrainerCallback

from helpers import Recorder, regression_data, tiny_regression
from loopkit import EvalStage, Loop, LoopArgs
from loopkit.events import HF_EVENTS, LOOPKIT_EVENTS

NEW_EVENTS = ("on_evaluate_begin", "on_evaluate_end", "on_predict_begin", "on_predict_end")


class EvaluationOrder(TrainerCallback):
    """An HF callback with the new methods: records them and HF's evaluation events in the order they fire."""

    def __init__(self):
        self.events = []

    def record(self, name):
        def method(args, state, control, **kwargs):
            self.events.append((name, state.global_step))
        return method

    def __getattribute__(self, name):
        if name in NEW_EVENTS + ("on_log", "on_prediction_step", "on_evaluate", "on_predict", "on_save"):
            return object.__getattribute__(self, "record")(name)
        return object.__getattribute__(self, name)


def loop_for(out, callbacks=(), evaluation=None, compute_metrics=None, **fields) -> Loop:
    args = LoopArgs(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                    eval_strategy="steps", eval_steps=2, save_steps=2, report_to="none", disable_tqdm=True,
                    log_level="error", **fields)
    return Loop(tiny_regression(), args, train_dataset=regression_data(32), eval_dataset=regression_data(16, seed=1),
                callbacks=list(callbacks), evaluation=evaluation, compute_metrics=compute_metrics)


def test_the_new_events_are_loopkits_and_hf_lacks_them():
    assert set(NEW_EVENTS) <= set(LOOPKIT_EVENTS) and not set(NEW_EVENTS) & set(HF_EVENTS)
    assert not any(hasattr(TrainerCallback, event) for event in NEW_EVENTS)


def test_they_frame_each_evaluation_and_prediction():
    with tempfile.TemporaryDirectory() as out:
        order = EvaluationOrder()
        loop = loop_for(out, [order])
        loop.train()
        # 16 evaluation rows in batches of 8: two prediction steps; the evaluation's log, then on_evaluate; the save
        # after the evaluation's end.
        evaluation = ["on_evaluate_begin", "on_prediction_step", "on_prediction_step", "on_log", "on_evaluate",
                      "on_evaluate_end"]
        assert [name for name, step in order.events if step == 2] == evaluation + ["on_save"]
        order.events.clear()
        loop.predict(regression_data(8, seed=2))
        assert [name for name, _ in order.events] == ["on_predict_begin", "on_prediction_step", "on_predict",
                                                      "on_predict_end"]
        order.events.clear()
        loop.evaluate({"a": regression_data(8, seed=3), "b": regression_data(8, seed=4)})  # each set framed
        assert [name for name, _ in order.events] == 2 * ["on_evaluate_begin", "on_prediction_step", "on_log",
                                                          "on_evaluate", "on_evaluate_end"]


def test_the_end_event_fires_when_the_evaluation_raises():
    def failing_metrics(prediction):
        raise RuntimeError("metric failed")

    with tempfile.TemporaryDirectory() as out:
        order = EvaluationOrder()
        loop = loop_for(out, [order], compute_metrics=failing_metrics)
        with pytest.raises(RuntimeError, match="metric failed"):
            loop.evaluate()
        assert [name for name, _ in order.events] == ["on_evaluate_begin", "on_prediction_step", "on_prediction_step",
                                                      "on_evaluate_end"]


class HearingEvalStage(EvalStage):
    """A stage that listens to the new events hears them before the callbacks."""

    def __init__(self, heard: list):
        super().__init__()
        self.heard = heard

    def on_evaluate_begin(self, args, state, control, **kwargs):
        self.heard.append("stage on_evaluate_begin")

    def on_predict_end(self, args, state, control, **kwargs):
        self.heard.append("stage on_predict_end")


def test_a_stage_hears_them_first_and_an_unmodified_hf_callback_keeps_working():
    heard = []

    class Listener(TrainerCallback):
        def on_evaluate_begin(self, args, state, control, **kwargs):
            heard.append("callback on_evaluate_begin")

    with tempfile.TemporaryDirectory() as out:
        hf_recorder = Recorder()  # a plain TrainerCallback subclass: HF's events only
        loop = loop_for(out, [hf_recorder, Listener()], evaluation=HearingEvalStage(heard))
        loop.evaluate()
        loop.predict(regression_data(8, seed=2))
        assert heard == ["stage on_evaluate_begin", "callback on_evaluate_begin", "stage on_predict_end"]
        assert [event[0] for event in hf_recorder.events] == ["on_init_end", "on_prediction_step", "on_prediction_step",
                                                              "on_log", "on_evaluate", "on_prediction_step",
                                                              "on_predict"]
        # Fired by hand through HF's handler signature, as every other event.
        heard.clear()
        loop.callback_handler.on_evaluate_begin(loop.args, loop.state, loop.control)
        assert heard == ["stage on_evaluate_begin", "callback on_evaluate_begin"]


def test_on_train_end_fires_after_the_best_model_is_loaded():
    class WeightsAtTrainEnd(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            self.weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            self.best = state.best_model_checkpoint

    with tempfile.TemporaryDirectory() as out:
        scores = [1.0, 0.0]  # the evaluation at step 2 is the best, step 4's is not
        at_end = WeightsAtTrainEnd()
        loop = loop_for(out, [at_end], compute_metrics=lambda prediction: {"score": scores.pop(0)},
                        load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True)
        loop.train()
        assert at_end.best == os.path.join(out, "checkpoint-2")
        best = load_file(os.path.join(out, "checkpoint-2", "model.safetensors"))
        last = load_file(os.path.join(out, "checkpoint-4", "model.safetensors"))
        assert all(w.equal(best[n]) for n, w in at_end.weights.items())
        assert not all(w.equal(last[n]) for n, w in at_end.weights.items())
