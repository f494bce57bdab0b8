"""Trainer's own logging under `Loop`: the verbosity set at construction from `log_level` / `log_level_replica`, and
the same records (logger name, level, message) as HF Trainer's, run live here: at INFO and WARNING, on the main
process, and on a replica of a 2-process gloo launch (tests/scripts/logging_child.py). No secret (`hub_token`)
reaches a log, the run report or a checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os

import pytest
import torch

from helpers import (IGNORE_PIN_MEMORY_WARNING, hf_args, lm_data, regression_data, runners,
                     tiny_llama, tiny_regression)
from loopkit import Loop
from test_distributed import child_env, finish

pytestmark = IGNORE_PIN_MEMORY_WARNING

CHILD_PATH = os.path.join(os.path.dirname(__file__), "scripts", "logging_child.py")
spec = importlib.util.spec_from_file_location("logging_child", CHILD_PATH)
child = importlib.util.module_from_spec(spec)
spec.loader.exec_module(child)

TRAINING_BLOCK = ["***** Running training *****", "  Num examples = 16", "  Num Epochs = 3",
                  "  Num update steps per epoch = 2", "  Instantaneous batch size per device = 4",
                  "  Total train batch size (w. parallel, distributed & accumulation) = 8",
                  "  Gradient Accumulation steps = 2", "  Total optimization steps = 6",
                  "  Number of trainable parameters = 3"]


def everything(trainer) -> None:
    """Train (evaluations, saves, best model, the save_total_limit clean-up), evaluate, predict, save_model, then
    resume from the last checkpoint."""
    trainer.train()
    trainer.evaluate()
    trainer.predict(regression_data(5, seed=2))
    trainer.save_model()
    trainer.train(resume_from_checkpoint=True)


# The best model by a scripted score (the evaluation loss in a message would differ in its last digits: loopkit sums
# it in float64, docs/differences.md): every evaluation scores 0.5, so checkpoint-2 stays the best, and the
# save_total_limit=1 clean-up deletes checkpoint-6.
RUN = dict(max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=2, logging_steps=2,
           eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=1, load_best_model_at_end=True,
           metric_for_best_model="score", greater_is_better=False)


def constant_score(eval_prediction):
    return {"score": 0.5}


@pytest.mark.parametrize("log_level", ["info", "warning"])
def test_records_of_a_run_equal_trainers(tmp_path, log_level):
    runs = {name: child.recorded_run(runner, tmp_path / name, everything, {"compute_metrics": constant_score},
                                     log_level=log_level, **RUN)
            for name, runner in runners()}
    hf, lk = runs["hf"], runs["loopkit"]
    assert hf["verbosity"] == getattr(logging, log_level.upper())
    messages = [message for _, _, message in hf["records"]]
    if log_level == "info":  # what the comparison covers
        start = messages.index(TRAINING_BLOCK[0])
        assert messages[start:start + len(TRAINING_BLOCK)] == TRAINING_BLOCK
        for expected in ("\n***** Running Evaluation *****", "\n***** Running Prediction *****",
                         "Saving model checkpoint to OUT/checkpoint-2", "Saving model checkpoint to OUT",
                         "Deleting older checkpoint [OUT/checkpoint-6] due to args.save_total_limit",
                         "Loading model from OUT/checkpoint-2.", "  Resuming training from checkpoint with epoch 1 "
                         "and global step 2", "Loading best model from OUT/checkpoint-2 (score: 0.5)."):
            assert any(m.startswith(expected) for m in messages), expected
    else:
        assert not any(level == "INFO" for _, level, _ in hf["records"])
    assert lk["verbosity"] == hf["verbosity"]
    assert lk["records"] == hf["records"]


def test_records_of_a_pretrained_model_and_the_clean_up_equal_trainers(tmp_path):
    """A `PreTrainedModel` (its `save_pretrained` logs too), the `save_total_limit=1` clean-up at the end of
    training deleting a checkpoint that is not the best, and a resume from the middle of an epoch."""
    def train_then_resume(trainer):
        trainer.train()
        trainer.train(resume_from_checkpoint=os.path.join(trainer.args.output_dir, "checkpoint-2"))

    def scores():  # the first evaluation is the best, so the last checkpoint is deleted at the end
        calls = iter([0.1, 0.5, 0.9, 0.8, 0.7])
        return lambda prediction: {"score": next(calls)}

    runs = {}
    for name, runner in runners():
        runs[name] = child.recorded_run(
            runner, tmp_path / name, train_then_resume, {"model": tiny_llama(), "train_dataset": lm_data(16),
                                             "eval_dataset": lm_data(4, seed=1), "compute_metrics": scores()},
            log_level="info", max_steps=6, per_device_train_batch_size=2, eval_strategy="steps", eval_steps=2,
            save_steps=2, save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=False)
    messages = [message for _, _, message in runs["hf"]["records"]]
    assert "Deleting older checkpoint [OUT/checkpoint-6] due to args.save_total_limit" in messages
    assert "  Fast-forwarding the dataloader past 0 epochs and 2 batches to resume from the exact training state." \
        in messages
    assert any(name == "transformers.modeling_utils" for name, _, _ in runs["hf"]["records"])
    assert runs["loopkit"]["records"] == runs["hf"]["records"]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(regression_data(16))


def test_construction_notes_equal_trainers(tmp_path):
    """An `IterableDataset` to train on, and `max_steps` with the default `num_train_epochs`: Trainer's notes."""
    runs = {name: child.recorded_run(runner, tmp_path / name, lambda trainer: None, {"train_dataset": Stream()},
                                     log_level="info", max_steps=3, train_sampling_strategy="sequential")
            for name, runner in runners()}
    assert [message[:40] for _, _, message in runs["hf"]["records"]] == [
        "max_steps is given, it will override any", "The `train_sampling_strategy='sequential"]
    assert runs["loopkit"] == runs["hf"]


def test_main_and_replica_process_of_a_two_process_launch(tmp_path, forked):
    """The ranks `torchrun --nproc_per_node 2` starts, forked from the session's fork server (helpers.ForkServer.launch;
    every configuration sets both log levels, so the verbosity the server's imports read does not count)."""
    env = {**child_env(cpu_mode=True), "TRANSFORMERS_VERBOSITY": "warning"}
    output = finish(forked.launch([CHILD_PATH, tmp_path], 2, "the 2-process logging launch", env=env))
    ranks = []
    for rank in (0, 1):
        path = tmp_path / f"records_rank{rank}.json"
        assert path.exists(), output[-4000:]
        ranks.append(json.loads(path.read_text()))
    for rank, config, shows_info in ((0, "main_info", True), (1, "main_info", False), (0, "replica_info", False),
                                     (1, "replica_info", True)):
        hf, lk = ranks[rank][config]["hf"], ranks[rank][config]["loopkit"]
        assert hf["verbosity"] == (logging.INFO if shows_info else logging.WARNING), (rank, config)
        assert ("***** Running training *****" in [m for _, _, m in hf["records"]]) == shows_info, (rank, config)
        assert lk["verbosity"] == hf["verbosity"], (rank, config)
        assert lk["records"] == hf["records"], (rank, config)


def test_no_hub_token_in_logs_report_or_checkpoints(tmp_path, capfd):
    secret = "hf_SECRETtokenValue1234567890"
    keeper = child.RecordKeeper()
    root = logging.getLogger()
    root.addHandler(keeper)
    try:
        run = child.recorded_run(Loop, tmp_path / "run", everything, {"compute_metrics": constant_score},
                                 log_level="debug", hub_token=secret,
                                 hub_model_id="me/model", **RUN)
    finally:
        root.removeHandler(keeper)
    assert secret not in json.dumps(run["records"] + keeper.records)
    assert any(name.startswith("transformers.trainer") for name, _, _ in run["records"])  # the logs were seen
    captured = capfd.readouterr()
    assert secret not in captured.out + captured.err
    files = [os.path.join(folder, name) for folder, _, names in os.walk(tmp_path) for name in names]
    assert any(name.endswith("trainer_state.json") for name in files) and any("run_report" in f for f in files)
    for path in files:
        with open(path, "rb") as f:
            assert secret.encode() not in f.read(), path


@pytest.mark.parametrize("log_level", ["info", "error"])
def test_loopargs_log_level_sets_the_verbosity_as_trainingarguments_does(tmp_path, log_level):
    """`LoopArgs` has Trainer's three logging fields, with its defaults, and they act as TrainingArguments' do."""
    from transformers.utils import logging as hf_logging

    from loopkit import LoopArgs

    verbosity = {}
    saved = hf_logging.get_verbosity()
    try:
        for name, args in (("hf", hf_args(tmp_path / "hf", log_level=log_level)),
                           ("loopkit", LoopArgs(output_dir=str(tmp_path / "loopkit"), log_level=log_level))):
            hf_logging.set_verbosity_warning()
            Loop(model=tiny_regression(), args=args)
            verbosity[name] = hf_logging.get_verbosity()
    finally:
        hf_logging.set_verbosity(saved)
    assert verbosity["loopkit"] == verbosity["hf"] == hf_logging.get_log_levels_dict()[log_level]
