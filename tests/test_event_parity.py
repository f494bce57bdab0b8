"""Event parity: a recording `transformers.TrainerCallback` sees the same events, in the same order, with the same
`global_step`, `epoch`, control flags and logged keys under `Loop` as under HF `Trainer` (run live here).

Configurations: the six of transformers' own `tests/trainer/test_trainer_callback.py::test_event_flow` (64 samples,
batch 8, 3 epochs), sequences (a) (with a following `evaluate()` and `predict()`) and (b) below, `eval_on_start`, and
5.x's forced final evaluation.
"""

import json

import pytest

from helpers import (IGNORE_PIN_MEMORY_WARNING, Recorder, checkpoint_folders, hf_args, regression_data, runners,
                     tiny_regression)

pytestmark = IGNORE_PIN_MEMORY_WARNING

# transformers' test_event_flow configurations (its _create_trainer: RegressionDataset(64) for train and eval).
HF_CALLBACK_TEST_CONFIGS = {
    "defaults": {},
    "logging_steps=5": {"logging_steps": 5},
    "save_steps=5": {"save_steps": 5},
    "eval_steps=5": {"eval_strategy": "steps", "eval_steps": 5},
    "eval_epoch": {"eval_strategy": "epoch"},
    "everything": {"logging_steps": 3, "save_steps": 10, "eval_steps": 5, "eval_strategy": "steps"},
}

# Sequence (a): 32 train samples, GA 2, logs/evals every 2 steps, a save at 4, stop at 4 (mid-epoch).
SEQUENCE_A = dict(max_steps=4, gradient_accumulation_steps=2, logging_steps=2, eval_strategy="steps", eval_steps=2,
                  save_steps=4, per_device_train_batch_size=2, per_device_eval_batch_size=2)
# Sequence (b): 2 epochs of 4 steps, everything per epoch.
SEQUENCE_B = dict(num_train_epochs=2, eval_strategy="epoch", save_strategy="epoch", logging_strategy="epoch",
                  per_device_train_batch_size=2, per_device_eval_batch_size=2)


def record_run(runner, output_dir, train_size, eval_size, test_size=0, **arg_kwargs):
    """Build one runner, train, then `evaluate()` and `predict()` when `test_size`; return (recorder, runner)."""
    recorder = Recorder()
    trainer = runner(tiny_regression(), hf_args(output_dir, **arg_kwargs), train_dataset=regression_data(train_size),
                     eval_dataset=regression_data(eval_size, seed=1), callbacks=[recorder])
    output = trainer.train()
    if test_size:
        trainer.evaluate()
        trainer.predict(regression_data(test_size, seed=2))
    return recorder, trainer, output


def both(tmp_path, train_size, eval_size, test_size=0, **arg_kwargs):
    """Run HF Trainer, then Loop, on the same configuration; returns {"hf": (...), "loopkit": (...)}."""
    return {name: record_run(runner, tmp_path / name, train_size, eval_size, test_size, **arg_kwargs)
            for name, runner in runners()}


def assert_same_events(runs):
    hf_events, lk_events = runs["hf"][0].events, runs["loopkit"][0].events
    assert hf_events, "HF Trainer fired no event: the recorder is broken"
    for i, (expected, actual) in enumerate(zip(hf_events, lk_events)):
        assert actual == expected, (f"event {i} differs: loopkit {actual} vs HF {expected}\n"
                                    f"HF context: {hf_events[max(0, i - 3):i + 2]}")
    shorter = min(len(lk_events), len(hf_events))
    assert len(lk_events) == len(hf_events), (f"loopkit fired {len(lk_events)} events, HF {len(hf_events)}; the "
                                              f"first unmatched: {(lk_events[shorter:] + hf_events[shorter:])[0]}")


@pytest.mark.parametrize("config", HF_CALLBACK_TEST_CONFIGS.values(), ids=HF_CALLBACK_TEST_CONFIGS.keys())
def test_hf_callback_test_configurations(tmp_path, config):
    runs = both(tmp_path, train_size=64, eval_size=64, **config)
    assert_same_events(runs)


def test_recorded_sequence_a_with_evaluate_and_predict(tmp_path):
    runs = both(tmp_path, train_size=32, eval_size=5, test_size=3, **SEQUENCE_A)
    assert_same_events(runs)
    names = [event[0] for event in runs["hf"][0].events]
    assert names[-1] == "on_predict" and "on_substep_end" in names  # the configuration exercises what it should
    for name, _ in runners():
        assert checkpoint_folders(tmp_path / name) == ["checkpoint-4"]


def test_recorded_sequence_b_epoch_strategies(tmp_path):
    runs = both(tmp_path, train_size=8, eval_size=4, **SEQUENCE_B)
    assert_same_events(runs)
    for name, _ in runners():
        assert checkpoint_folders(tmp_path / name) == ["checkpoint-4", "checkpoint-8"]


def test_eval_on_start(tmp_path):
    runs = both(tmp_path, train_size=8, eval_size=4, max_steps=2, eval_on_start=True, eval_strategy="steps",
                eval_steps=2, per_device_train_batch_size=2)
    assert_same_events(runs)
    names = [event[0] for event in runs["hf"][0].events]
    assert names.index("on_evaluate") < names.index("on_epoch_begin")


def test_forced_final_evaluation(tmp_path):
    runs = both(tmp_path, train_size=16, eval_size=4, max_steps=3, eval_strategy="steps", eval_steps=2,
                per_device_train_batch_size=2)
    assert_same_events(runs)
    eval_steps = [event[1] for event in runs["hf"][0].events if event[0] == "on_evaluate"]
    assert eval_steps == [2, 3]


def test_log_history_train_output_and_trainer_state_keys(tmp_path):
    """For sequence (a): the same log_history entries (keys in order, steps, epochs), the same TrainOutput shape and
    metric keys, and the same trainer_state.json keys (top level and per log entry)."""
    runs = both(tmp_path, train_size=32, eval_size=5, **SEQUENCE_A)
    (_, hf, hf_output), (_, lk, lk_output) = runs["hf"], runs["loopkit"]

    def shape(history):
        return [(tuple(entry), entry["step"], entry["epoch"]) for entry in history]

    assert shape(lk.state.log_history) == shape(hf.state.log_history)
    assert type(lk_output).__name__ == type(hf_output).__name__ == "TrainOutput"
    assert lk_output._fields == hf_output._fields
    assert lk_output.global_step == hf_output.global_step
    assert list(lk_output.metrics) == list(hf_output.metrics)

    def saved_state(name):
        with open(tmp_path / name / "checkpoint-4" / "trainer_state.json") as f:
            return json.load(f)

    hf_saved, lk_saved = saved_state("hf"), saved_state("loopkit")
    assert list(lk_saved) == list(hf_saved)
    assert [list(entry) for entry in lk_saved["log_history"]] == [list(entry) for entry in hf_saved["log_history"]]
    assert {k: v for k, v in lk_saved.items() if k not in ("log_history", "total_flos", "stateful_callbacks")} == \
        {k: v for k, v in hf_saved.items() if k not in ("log_history", "total_flos", "stateful_callbacks")}
    assert lk_saved["stateful_callbacks"] == hf_saved["stateful_callbacks"]
