"""Early stopping: HF's `EarlyStoppingCallback` unchanged in a `Loop`, and loopkit's `EarlyStopping` (patience plus a
relative-improvement threshold) whose count survives a resume.

Each evaluation reports a scripted score chosen by the step, so the stopping step follows from the rule; the tests
derive it with a plain re-statement of the rule instead of copying numbers from a run.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from helpers import hf_args, regression_data, tiny_regression
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback

from loopkit import Loop
from loopkit.callbacks import EarlyStopping

BASE = dict(per_device_train_batch_size=4, logging_steps=100, eval_strategy="steps", eval_steps=2, save_steps=2,
            metric_for_best_model="score", use_cpu=True)


class StopAt(TrainerCallback):
    """Interrupts training after step `step` (its save still happens): a run cut short mid-way."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def run(runner, output_dir, scores: dict, callbacks, resume=None, **args):
    """Train a tiny regression whose evaluation at step s reports `scores[s]` as `eval_score`."""
    trainer = None

    def compute_metrics(_):
        return {"score": scores[trainer.state.global_step]}

    trainer = runner(tiny_regression(), hf_args(output_dir, **{**BASE, **args}), train_dataset=regression_data(64),
                     eval_dataset=regression_data(4, seed=1), compute_metrics=compute_metrics, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def expected_stop(scores: dict, patience: int, threshold: float, greater_is_better: bool, count=0, best=None):
    """The rule, restated: the step at which `patience` evaluations in a row improved on the best so far by no
    more than `threshold` (relative); None if that never happens."""
    for step in sorted(scores):
        value = scores[step]
        if best is None:
            best, count = value, 0
            continue
        gain = (value - best) if greater_is_better else (best - value)
        count = 0 if gain / abs(best) > threshold else count + 1
        best = max(best, value) if greater_is_better else min(best, value)
        if count >= patience:
            return step
    return None


# Lower is better. Relative gains: 10%, 2.2%, 1.1%, 1.1%, ... : with a 5% threshold and patience 2 the run stops at
# step 8; a callback that forgot its count after a resume at step 6 would stop only at step 12.
LOSS_LIKE = {2: 1.0, 4: 0.9, 6: 0.88, 8: 0.87, 10: 0.86, 12: 0.85, 14: 0.84, 16: 0.83}


def test_hf_early_stopping_callback_works_unchanged(tmp_path):
    """HF's verified case: scores [.1, .5, .3, .2, .4] every 2 steps, patience 2: same stop step and count."""
    scores = {2: 0.1, 4: 0.5, 6: 0.3, 8: 0.2, 10: 0.4}
    results = {}
    for name, runner in (("hf", Trainer), ("loopkit", Loop)):
        callback = EarlyStoppingCallback(early_stopping_patience=2)
        trainer = run(runner, tmp_path / name, scores, [callback], max_steps=10)
        results[name] = (trainer.state.global_step, callback.early_stopping_patience_counter,
                         trainer.state.best_metric)
    assert results["loopkit"] == results["hf"]
    assert results["loopkit"][0] == 8


@pytest.mark.parametrize("greater_is_better", [False, True])
def test_relative_threshold_rule(greater_is_better):
    """The callback alone, fed evaluations: it stops where the restated rule says, for both metric directions."""
    scores = LOSS_LIKE if not greater_is_better else {s: 2 - v for s, v in LOSS_LIKE.items()}
    callback = EarlyStopping(patience=2, min_relative_improvement=0.05)
    args = SimpleNamespace(metric_for_best_model="score", greater_is_better=greater_is_better)
    stopped_at = None
    for step in sorted(scores):
        control = SimpleNamespace(should_training_stop=False)
        callback.on_evaluate(args, None, control, metrics={"eval_score": scores[step]})
        if control.should_training_stop:
            stopped_at = step
            break
    assert stopped_at == expected_stop(scores, 2, 0.05, greater_is_better)
    assert stopped_at is not None


def test_relative_threshold_stops_training(tmp_path):
    trainer = run(Loop, tmp_path, LOSS_LIKE, [EarlyStopping(patience=2, min_relative_improvement=0.05)],
                  max_steps=16, greater_is_better=False)
    assert trainer.state.global_step == expected_stop(LOSS_LIKE, 2, 0.05, greater_is_better=False) == 8


def saved_state(checkpoint, name):
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        return json.load(f)["stateful_callbacks"][name]


@pytest.mark.parametrize("kind", ["loopkit", "hf_callback_with_restore_flag"])
def test_resumed_run_keeps_counting(tmp_path, kind):
    """Run cut at step 6 (one evaluation without improvement counted), resumed from checkpoint-6 with a fresh
    callback: it stops at step 8 like the uninterrupted run, not later as a callback counting from zero would.
    loopkit's EarlyStopping restores itself; HF's needs restore_callback_states_from_checkpoint=True."""
    if kind == "loopkit":
        make = lambda: EarlyStopping(patience=2, min_relative_improvement=0.05)  # noqa: E731
        name, counter, extra = "EarlyStopping", "evaluations_without_improvement", {}
    else:  # HF's absolute threshold, on a score scaled so 0.05 absolute is the same cut as 5% relative
        make = lambda: EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=0.05)  # noqa: E731
        name, counter, extra = "EarlyStoppingCallback", "early_stopping_patience_counter", \
            dict(restore_callback_states_from_checkpoint=True)
    args = dict(max_steps=16, greater_is_better=False, **extra)
    uninterrupted = run(Loop, tmp_path / "full", LOSS_LIKE, [make()], **args)

    run(Loop, tmp_path / "cut", LOSS_LIKE, [make(), StopAt(6)], **args)
    assert saved_state(tmp_path / "cut" / "checkpoint-6", name)["attributes"][counter] == 1
    resumed_callback = make()
    resumed = run(Loop, tmp_path / "cut", LOSS_LIKE, [resumed_callback], resume=str(tmp_path / "cut" / "checkpoint-6"),
                  **args)

    # A lost count would stop at 12 (loopkit's, whose best restarts too) or 10 (HF's, whose best is the state's).
    lost_count_stop = expected_stop({s: v for s, v in LOSS_LIKE.items() if s > 6}, 2, 0.05, False,
                                    best=None if kind == "loopkit" else LOSS_LIKE[6])
    assert resumed.state.global_step == uninterrupted.state.global_step == 8
    assert lost_count_stop > 8, "the scores must tell a kept count from a lost one"
    assert getattr(resumed_callback, counter) == 2


def test_loopkit_early_stopping_state_round_trips_through_hf_layout():
    callback = EarlyStopping(patience=3, min_relative_improvement=0.1)
    callback.evaluations_without_improvement, callback.best_value = 2, 0.5
    saved = json.loads(json.dumps(callback.state()))
    assert set(saved) == {"args", "attributes"}
    restored = EarlyStopping(**saved["args"])
    assert restored.restore_from({"EarlyStopping": saved})
    assert (restored.evaluations_without_improvement, restored.best_value) == (2, 0.5)
    # A fresh run (nothing saved) starts counting from zero.
    restored.on_train_begin(None, SimpleNamespace(stateful_callbacks={}), None)
    assert (restored.evaluations_without_improvement, restored.best_value) == (0, None)


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError, match="patience"):
        EarlyStopping(patience=0)
    with pytest.raises(ValueError, match="min_relative_improvement"):
        EarlyStopping(patience=2, min_relative_improvement=-0.1)
