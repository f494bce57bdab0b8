"""Trainer's log records against Loop's: the runs and the record keeping that tests/test_trainer_logging.py uses in
its own process, and, launched with 2 gloo processes, on a main and a replica process.

Usage (under a launcher): python logging_child.py OUT_DIR: each process runs every configuration of `CONFIGS` with
HF Trainer, then with Loop, and writes `records_rank<r>.json` ({configuration: {runner: run}}) into OUT_DIR.
"""

from __future__ import annotations

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for helpers

from transformers import Trainer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from helpers import hf_args, regression_data, tiny_regression  # noqa: E402
from loopkit import Loop  # noqa: E402

# Trainer's log fields on the main and the replica process: each process shows INFO on one of them.
CONFIGS = {"main_info": {"log_level": "info"},
           "replica_info": {"log_level": "warning", "log_level_replica": "info"}}
# HF's rotation sorts checkpoints by mtime and, when two were written within a second, warns (once per process)
# that mtime "may not be reliable on this filesystem"; loopkit rotates by step number (docs/differences.md).
HF_MTIME_WARNING = "mtime may not be reliable on this filesystem, falling back to numerical ordering"


class RecordKeeper(logging.Handler):
    """Every record that reaches it, as (logger name, level name, message)."""

    def __init__(self):
        super().__init__(logging.NOTSET)
        self.records = []

    def emit(self, record):
        self.records.append((record.name, record.levelname, record.getMessage()))


def comparable(records, output_dir) -> list[list[str]]:
    """The records with the run's folder written OUT, and without what differs on purpose: HF's mtime warning, and
    the hidden folder loopkit's atomic checkpoints are written into (`save_pretrained` logs the folder it writes)."""
    kept = []
    for name, level, message in records:
        if message == HF_MTIME_WARNING:
            continue
        message = message.replace(str(output_dir), "OUT").replace("OUT/.tmp-checkpoint-", "OUT/checkpoint-")
        kept.append([name, level, message])
    return kept


def recorded_run(runner, output_dir, work, trainer_kwargs=None, **arg_kwargs) -> dict:
    """Build `runner` (on a tiny regression model and data unless `trainer_kwargs` says otherwise) with
    `arg_kwargs`, then `work(trainer)`; the transformers log records of both, and the verbosity the construction set.
    The verbosity is put back afterwards."""
    keeper, library_logger = RecordKeeper(), hf_logging.get_logger()  # transformers' records stop at its root logger
    verbosity_before = hf_logging.get_verbosity()
    library_logger.addHandler(keeper)
    kwargs = {"model": tiny_regression(), "train_dataset": regression_data(16),
              "eval_dataset": regression_data(6, seed=1), **(trainer_kwargs or {})}
    try:
        trainer = runner(args=hf_args(output_dir, **arg_kwargs), **kwargs)
        verbosity = hf_logging.get_verbosity()
        work(trainer)
    finally:
        library_logger.removeHandler(keeper)
        hf_logging.set_verbosity(verbosity_before)
    return {"verbosity": verbosity, "records": comparable(keeper.records, output_dir)}


def train_evaluate_predict(trainer) -> None:
    trainer.train()
    trainer.evaluate()
    trainer.predict(regression_data(5, seed=2))


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    results = {}
    for config, log_fields in CONFIGS.items():
        results[config] = {
            name: recorded_run(runner, os.path.join(out, config, name), train_evaluate_predict, use_cpu=True,
                               max_steps=4, per_device_train_batch_size=2, logging_steps=2, eval_strategy="steps",
                               eval_steps=2, save_steps=4, **log_fields)
            for name, runner in (("hf", Trainer), ("loopkit", Loop))}
    with open(os.path.join(out, f"records_rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
