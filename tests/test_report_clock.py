"""The run report's time accounting on a deterministic clock (`helpers.JumpingClock`): every second of `train()` is
counted once, in its phase, whatever the machine's load. Known amounts of virtual time are spent in the first and the
last user code `train()` runs, far more than the run's real time, so where they land is certain."""

import json
import sys

import pytest
from transformers import TrainerCallback

from helpers import JumpingClock, regression_data, tiny_regression
from loopkit import Loop, LoopArgs


class KnownTime(TrainerCallback):
    """Virtual seconds spent in `model_init` (the setup phase, right after the clock starts) and in `on_train_end`
    (the callbacks phase, right before the report): `spent` tallies them by phase."""

    def __init__(self, clock):
        self.clock, self.spent = clock, {"setup": 0.0, "callbacks": 0.0}

    def spend(self, phase, seconds):
        self.clock.jump(seconds)
        self.spent[phase] += seconds

    def model_init(self):
        self.spend("setup", 100.0)
        return tiny_regression()

    def on_train_end(self, args, state, control, **kwargs):
        self.spend("callbacks", 200.0)


def test_every_second_of_train_is_counted_once_in_its_phase(tmp_path, monkeypatch):
    """The known time is all in the report's total and in setup / callbacks, never twice; the total is no more than
    the time around train(); the phases add up to it. Twice in one process, as in a hyper-parameter search: the
    second report starts from zero."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no charts: this test is about the clock
    clock = JumpingClock().install(monkeypatch)
    for trial in range(2):
        known = KnownTime(clock)
        args = LoopArgs(output_dir=str(tmp_path / f"trial-{trial}"), max_steps=20, per_device_train_batch_size=4,
                        logging_steps=2, eval_strategy="steps", eval_steps=5, save_steps=5, disable_tqdm=True)
        loop = Loop(model_init=known.model_init, args=args, train_dataset=regression_data(64),
                    eval_dataset=regression_data(8, seed=1), callbacks=[known])
        known.spent = dict.fromkeys(known.spent, 0.0)  # what the constructor's model_init call spent is not train()'s
        start = clock()
        loop.train()
        around_train = clock() - start
        written = json.load(open(tmp_path / f"trial-{trial}" / "run_report.json"))
        seconds, total = written["time_by_phase"]["seconds"], written["total_seconds"]
        real = around_train - sum(known.spent.values())  # the run's own time: far less than any known span
        assert sum(known.spent.values()) <= total <= around_train + 1e-5, (known.spent, total, around_train)
        for phase, spent in known.spent.items():
            assert spent <= seconds[phase] <= spent + real, (phase, spent, seconds[phase], real)
        assert sum(seconds.values()) == pytest.approx(total, rel=1e-4)
        assert seconds["forward"] > 0 and seconds["evaluation"] > 0 and seconds["checkpoint"] > 0
