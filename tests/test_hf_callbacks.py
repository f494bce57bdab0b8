"""Unmodified HF callbacks, and callbacks written for HF Trainer, work in `Loop` with the same effect as in HF
`Trainer` (run live here): `EarlyStoppingCallback`, `PrinterCallback`, a callback that changes the learning rate
through `kwargs["optimizer"]`, and a hand-written early stopper reading `kwargs["metrics"]`.
"""

import ast
import json
import os

import pytest
from transformers import EarlyStoppingCallback, PrinterCallback, TrainerCallback

from loopkit import Loop

from helpers import (IGNORE_PIN_MEMORY_WARNING, Recorder, assert_close, assert_same_weights, checkpoint_folders,
                     hf_args, regression_data, runners, tiny_regression)

pytestmark = IGNORE_PIN_MEMORY_WARNING


def scripted_metric(scores):
    """A `compute_metrics` whose n-th call returns `{"score": scores[n]}`: a controlled metric sequence."""
    calls = iter(scores)

    def compute_metrics(eval_prediction):
        return {"score": next(calls)}

    return compute_metrics


def test_early_stopping_callback_stops_where_trainer_stops(tmp_path):
    """HF's best-model tracking: scores .1 .5 .3 .2 .4 every 2 steps, patience 2: stop at step 8, best checkpoint-4 loaded."""
    runs = {}
    for name, runner in runners():
        recorder = Recorder()
        args = hf_args(tmp_path / name, max_steps=20, per_device_train_batch_size=2, learning_rate=0.05,
                       eval_strategy="steps", eval_steps=2, save_steps=2, load_best_model_at_end=True,
                       metric_for_best_model="score")
        trainer = runner(tiny_regression(), args, train_dataset=regression_data(16),
                         eval_dataset=regression_data(4, seed=1), compute_metrics=scripted_metric([.1, .5, .3, .2, .4]),
                         callbacks=[EarlyStoppingCallback(early_stopping_patience=2), recorder])
        trainer.train()
        runs[name] = (trainer, recorder)
    (hf, hf_recorder), (lk, lk_recorder) = runs["hf"], runs["loopkit"]
    assert hf.state.global_step < hf.state.max_steps  # HF did stop early, so the comparison means something
    assert lk.state.global_step == hf.state.global_step
    assert lk_recorder.events == hf_recorder.events
    assert (lk.state.best_metric, lk.state.best_global_step) == (hf.state.best_metric, hf.state.best_global_step)
    assert os.path.basename(lk.state.best_model_checkpoint) == os.path.basename(hf.state.best_model_checkpoint)
    assert checkpoint_folders(tmp_path / "loopkit") == checkpoint_folders(tmp_path / "hf")
    early_stopper = next(cb for cb in lk.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback))
    assert early_stopper.early_stopping_patience_counter == 2
    assert_same_weights(lk.model, hf.model, 1e-6)  # both loaded the best checkpoint's weights


def printed_logs(capsys) -> list[dict]:
    """The dicts printed since the last call, one per printed line."""
    return [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def without_timings(logs: dict) -> dict:
    return {k: v for k, v in logs.items() if "runtime" not in k and "per_second" not in k}


@pytest.mark.parametrize("printer", ["default", "hf_printer_callback"])
def test_printer_prints_what_trainer_prints(tmp_path, capsys, printer):
    """disable_tqdm=True prints each log as under Trainer (the default printer is HF's PrinterCallback); a
    PrinterCallback popped and added again prints the same, and pops `total_flos` from the train metrics as in HF."""
    printed, outputs = {}, {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, disable_tqdm=True, max_steps=4, per_device_train_batch_size=2,
                       logging_steps=2, eval_strategy="steps", eval_steps=4, save_strategy="no")
        trainer = runner(tiny_regression(), args, train_dataset=regression_data(8),
                         eval_dataset=regression_data(4, seed=1))
        if name == "loopkit" and printer == "hf_printer_callback":
            assert trainer.pop_callback(PrinterCallback) is not None
            trainer.add_callback(PrinterCallback)
        capsys.readouterr()
        outputs[name] = trainer.train()
        printed[name] = printed_logs(capsys)
    assert len(printed["hf"]) == 4  # two step logs, one evaluation, the summary
    assert [list(logs) for logs in printed["loopkit"]] == [list(logs) for logs in printed["hf"]]
    assert [without_timings(logs) for logs in printed["loopkit"]] == [without_timings(logs) for logs in printed["hf"]]
    assert "total_flos" not in outputs["hf"].metrics
    assert list(outputs["loopkit"].metrics) == list(outputs["hf"].metrics)


class DynamicLearningRate(TrainerCallback):
    """A user's callback (as written for HF Trainer): from step 2 on, set the learning rate by hand."""

    def __init__(self, lr):
        self.lr = lr
        self.used = []

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= 2:
            for group in kwargs["optimizer"].param_groups:
                group["lr"] = self.lr

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.used.append(kwargs["optimizer"].param_groups[0]["lr"])


def test_dynamic_learning_rate_callback(tmp_path):
    def run(runner, name, callbacks):
        args = hf_args(tmp_path / name, max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3,
                       logging_steps=1, save_strategy="no")
        trainer = runner(tiny_regression(), args, train_dataset=regression_data(12), callbacks=callbacks)
        trainer.train()
        return trainer

    results = {}
    for name, runner in runners():
        callback = DynamicLearningRate(lr=0.1)
        results[name] = (run(runner, name, [callback]), callback)
    (hf, hf_callback), (lk, lk_callback) = results["hf"], results["loopkit"]
    assert hf_callback.used[2:] == [0.1] * 4  # the edited LR is the one the optimizer steps with
    assert lk_callback.used == hf_callback.used
    hf_losses = [entry["loss"] for entry in hf.state.log_history if "loss" in entry]
    assert_close([entry["loss"] for entry in lk.state.log_history if "loss" in entry], hf_losses, 1e-6, "loss")
    assert_same_weights(lk.model, hf.model, 1e-6)

    unchanged = run(Loop, "loopkit_without_callback", [])
    moved = (lk.model.linear.weight - unchanged.model.linear.weight).abs().max().item()
    assert moved > 1e-3, "the LR edit made no difference to training"


class SmartEarlyStopping(TrainerCallback):
    """A user's early stopper (as written for HF Trainer): stop when eval_loss stops improving by `min_delta`."""

    def __init__(self, min_delta):
        self.min_delta = min_delta
        self.best = None

    def on_evaluate(self, args, state, control, **kwargs):
        eval_loss = kwargs["metrics"]["eval_loss"]
        if self.best is not None and eval_loss > self.best - self.min_delta:
            control.should_training_stop = True
        self.best = eval_loss if self.best is None else min(self.best, eval_loss)


def test_smart_early_stopping_callback(tmp_path):
    runs = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, max_steps=40, per_device_train_batch_size=4, learning_rate=0.05,
                       eval_strategy="steps", eval_steps=2, save_strategy="no", logging_steps=2)
        trainer = runner(tiny_regression(), args, train_dataset=regression_data(32),
                         eval_dataset=regression_data(8, seed=1), callbacks=[SmartEarlyStopping(min_delta=0.05)])
        trainer.train()
        runs[name] = trainer
    hf, lk = runs["hf"], runs["loopkit"]
    assert 2 < hf.state.global_step < hf.state.max_steps  # it trained a while, then the callback stopped it
    assert lk.state.global_step == hf.state.global_step
    hf_eval = [entry["eval_loss"] for entry in hf.state.log_history if "eval_loss" in entry]
    assert_close([entry["eval_loss"] for entry in lk.state.log_history if "eval_loss" in entry], hf_eval, 1e-6,
                 "eval_loss")
    assert_same_weights(lk.model, hf.model, 1e-6)


def test_early_stopping_state_restored_on_resume(tmp_path):
    """`restore_callback_states_from_checkpoint`: the EarlyStoppingCallback's saved patience and counter, and the
    control flags, come back from the checkpoint (stored under HF's names, e.g. "TrainerControl") as in HF."""
    arg_kwargs = dict(per_device_train_batch_size=2, eval_strategy="steps", eval_steps=2, save_steps=2,
                      metric_for_best_model="score", restore_callback_states_from_checkpoint=True)
    resumed = {}
    for name, runner in runners():
        def build(max_steps, scores, patience):
            callback = EarlyStoppingCallback(early_stopping_patience=patience)
            trainer = runner(tiny_regression(), hf_args(tmp_path / name, max_steps=max_steps, **arg_kwargs),
                             train_dataset=regression_data(16), eval_dataset=regression_data(4, seed=1),
                             compute_metrics=scripted_metric(scores), callbacks=[callback])
            return trainer, callback

        first, _ = build(max_steps=6, scores=[.5, .4, .3], patience=5)
        first.train()
        second, callback = build(max_steps=10, scores=[.2, .1], patience=9)  # the checkpoint's patience wins
        second.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-6"))
        live = next(cb for cb in second.callback_handler.callbacks if isinstance(cb, EarlyStoppingCallback))
        resumed[name] = (live.early_stopping_patience, live.early_stopping_patience_counter, second.state.global_step,
                         {flag: getattr(second.control, flag) for flag in vars(second.control)})
        with open(tmp_path / name / "checkpoint-6" / "trainer_state.json") as f:
            assert set(json.load(f)["stateful_callbacks"]) == {"EarlyStoppingCallback", "TrainerControl"}
    assert resumed["hf"][:2] == (5, 4)  # patience from the checkpoint, counter continued: 2 before, 2 after
    assert resumed["loopkit"] == resumed["hf"]
