"""`loop.callback_handler` is called exactly as HF's `CallbackHandler` is: every `on_<event>` has its signature
(`metrics` for on_evaluate / on_predict and `logs` for on_log may come positionally), and a Trainer subclass written
like transformers' question-answering example (examples/pytorch/question-answering/trainer_qa.py: overrides
`evaluate` and `predict`, post-processes the predictions, calls the handler positionally, logs) runs on `Loop` as on
`Trainer` (run live here).
"""

import inspect
import math
import time

import numpy as np
import pytest
from transformers import EvalPrediction
from transformers.trainer_callback import CallbackHandler, TrainerControl
from transformers.trainer_utils import PredictionOutput, speed_metrics

from loopkit.events import HF_EVENTS, EventHandler

from helpers import IGNORE_PIN_MEMORY_WARNING, Recorder, hf_args, regression_data, runners, tiny_regression

pytestmark = IGNORE_PIN_MEMORY_WARNING

FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")


def parameters(function) -> list[tuple]:
    """A signature as (name, kind, has a default) per parameter, `self` left out: what a caller can rely on."""
    return [(p.name, p.kind, p.default is not p.empty) for p in inspect.signature(function).parameters.values()
            if p.name != "self"]


@pytest.mark.parametrize("event", HF_EVENTS)
def test_each_handler_method_has_hf_callback_handler_signature(event):
    assert parameters(getattr(EventHandler, event)) == parameters(getattr(CallbackHandler, event))


class Received:
    """A callback that keeps, per event, the control flags it was called with, and the keywords it got."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("on_"):
            raise AttributeError(name)

        def method(args, state, control, **kwargs):
            flags = {flag: getattr(control, flag) for flag in FLAGS}
            payload = {key: kwargs[key] for key in ("metrics", "logs", "extra") if key in kwargs}
            self.calls.append((name, flags, sorted(kwargs), payload))
            control.should_log = True  # what a callback may do; the handler returns this control

        return method


def calls_from_hf_signature(event, args, state, control) -> list[tuple[tuple, dict]]:
    """Every way HF's `CallbackHandler.on_<event>` may be called: its required parameters positionally, then as
    keywords, each with an extra keyword a caller may pass on to the callbacks."""
    given = {"args": args, "state": state, "control": control, "metrics": {"eval_loss": 0.5}, "logs": {"loss": 1.0}}
    required = [p.name for p in inspect.signature(getattr(CallbackHandler, event)).parameters.values()
                if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD]
    return [(tuple(given[name] for name in required), {"extra": 1}),
            ((), {**{name: given[name] for name in required}, "extra": 1}),
            (tuple(given[name] for name in required[:3]), {name: given[name] for name in required[3:]})]


@pytest.mark.parametrize("event", HF_EVENTS)
def test_calls_generated_from_hf_signatures_do_what_they_do_on_trainers_handler(tmp_path, event):
    """Each call form, on `trainer.callback_handler` and `loop.callback_handler`: the callback gets the same flags
    (after the handler's resets), the same keywords (the run's objects, the payload, the caller's extras), and the
    handler returns the same control."""
    outcomes = {}
    for name, runner in runners():
        received = Received()
        trainer = runner(tiny_regression(), hf_args(tmp_path / name), callbacks=[received])
        received.calls.clear()  # on_init_end of the construction
        returned = []
        for positional, keywords in calls_from_hf_signature(event, trainer.args, trainer.state, TrainerControl()):
            control = positional[2] if len(positional) > 2 else keywords["control"]
            for flag in FLAGS:
                setattr(control, flag, True)
            result = getattr(trainer.callback_handler, event)(*positional, **keywords)
            returned.append({flag: getattr(result, flag) for flag in FLAGS})
        outcomes[name] = (received.calls, returned)
    assert len(outcomes["hf"][0]) == 3
    assert outcomes["loopkit"] == outcomes["hf"]


# ---------------------------------------------------------------------------------------------------------------
# A Trainer subclass in the style of transformers' question-answering example
# ---------------------------------------------------------------------------------------------------------------
def post_process(examples, dataset, predictions, stage="eval"):
    """The example's post-processing step, for regression: predictions rounded to one decimal, paired with the
    reference answers (`examples`)."""
    return EvalPrediction(predictions=np.round(predictions, 1), label_ids=np.asarray(examples))


def mean_absolute_error(eval_prediction):
    return {"mae": float(np.abs(eval_prediction.predictions - eval_prediction.label_ids).mean())}


def question_answering_style(base):
    """trainer_qa.py's `QuestionAnsweringTrainer`, with `base` (Trainer or Loop) as its base class."""

    class QuestionAnsweringTrainer(base):
        def __init__(self, *args, eval_examples=None, post_process_function=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.eval_examples = eval_examples
            self.post_process_function = post_process_function

        def loop_without_metrics(self, dataloader, description, ignore_keys, metric_key_prefix):
            """The example's evaluation loop with metric computation disabled (done after post-processing)."""
            compute_metrics = self.compute_metrics
            self.compute_metrics = None
            start_time = time.time()
            try:
                output = self.evaluation_loop(dataloader, description=description,
                                              prediction_loss_only=True if compute_metrics is None else None,
                                              ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            finally:
                self.compute_metrics = compute_metrics
            total_batch_size = self.args.eval_batch_size * self.args.world_size
            output.metrics.update(speed_metrics(metric_key_prefix, start_time, num_samples=output.num_samples,
                                                num_steps=math.ceil(output.num_samples / total_batch_size)))
            return output

        def prefixed_metrics(self, eval_preds, output, metric_key_prefix):
            metrics = self.compute_metrics(eval_preds)
            for key in list(metrics.keys()):
                if not key.startswith(f"{metric_key_prefix}_"):
                    metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
            metrics.update(output.metrics)
            return metrics

        def evaluate(self, eval_dataset=None, eval_examples=None, ignore_keys=None, metric_key_prefix="eval"):
            eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
            eval_dataloader = self.get_eval_dataloader(eval_dataset)
            eval_examples = self.eval_examples if eval_examples is None else eval_examples
            output = self.loop_without_metrics(eval_dataloader, "Evaluation", ignore_keys, metric_key_prefix)
            if self.post_process_function is not None and self.compute_metrics is not None and self.args.should_save:
                eval_preds = self.post_process_function(eval_examples, eval_dataset, output.predictions)
                metrics = self.prefixed_metrics(eval_preds, output, metric_key_prefix)
            else:
                metrics = output.metrics
            if self.args.should_log:
                self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

        def predict(self, predict_dataset, predict_examples, ignore_keys=None, metric_key_prefix="test"):
            predict_dataloader = self.get_test_dataloader(predict_dataset)
            output = self.loop_without_metrics(predict_dataloader, "Prediction", ignore_keys, metric_key_prefix)
            if self.post_process_function is None or self.compute_metrics is None:
                return output
            predictions = self.post_process_function(predict_examples, predict_dataset, output.predictions, "predict")
            metrics = self.prefixed_metrics(predictions, output, metric_key_prefix)
            self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics)
            return PredictionOutput(predictions=predictions.predictions, label_ids=predictions.label_ids,
                                    metrics=metrics)

    return QuestionAnsweringTrainer


def without_timings(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}


def test_question_answering_style_subclass_runs_on_loop_as_on_trainer(tmp_path):
    eval_data, test_data = regression_data(6, seed=1), regression_data(5, seed=2)
    results = {}
    for name, runner in runners():
        recorder = Recorder()
        trainer = question_answering_style(runner)(
            tiny_regression(), hf_args(tmp_path / name, max_steps=4, per_device_train_batch_size=2,
                                       per_device_eval_batch_size=4, learning_rate=0.05, logging_steps=2,
                                       eval_strategy="steps", eval_steps=2, save_strategy="no"),
            train_dataset=regression_data(16), eval_dataset=eval_data, callbacks=[recorder],
            eval_examples=[float(s["labels"]) for s in eval_data], post_process_function=post_process,
            compute_metrics=mean_absolute_error)
        trainer.train()
        metrics = trainer.evaluate()
        prediction = trainer.predict(test_data, [float(s["labels"]) for s in test_data])
        results[name] = (trainer, recorder, metrics, prediction)
    (hf, hf_recorder, hf_metrics, hf_prediction), (lk, lk_recorder, lk_metrics, lk_prediction) = \
        results["hf"], results["loopkit"]
    assert "eval_mae" in hf_metrics and "test_mae" in hf_prediction.metrics  # the post-processing ran
    assert [e[0] for e in hf_recorder.events].count("on_evaluate") == 3  # two during training, one after
    assert lk_recorder.events == hf_recorder.events
    assert without_timings(lk_metrics) == pytest.approx(without_timings(hf_metrics), rel=1e-5)
    assert without_timings(lk_prediction.metrics) == pytest.approx(without_timings(hf_prediction.metrics), rel=1e-5)
    np.testing.assert_allclose(lk_prediction.predictions, hf_prediction.predictions, rtol=1e-5)
    assert [list(entry) for entry in lk.state.log_history] == [list(entry) for entry in hf.state.log_history]
    for mine, theirs in zip(lk.state.log_history, hf.state.log_history):
        assert without_timings(mine) == pytest.approx(without_timings(theirs), rel=1e-5)
