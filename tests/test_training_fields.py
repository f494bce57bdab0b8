"""TrainingArguments fields that used to be refused (issue 12, item 4, part 1), each run against HF Trainer live in
the same test: label smoothing, input-token counting, NEFTune, `torch_empty_cache_steps`, `bf16_full_eval`,
`eval_use_gather_object`, memory metrics and `debug="underflow_overflow"`.

Every run builds its own tiny model and data, HF's first (tests/helpers.py); logs are compared key for key and value
for value (timings aside), and weights within 1e-6 relative.
"""

import pytest
import torch

from helpers import (IGNORE_PIN_MEMORY_WARNING, assert_close, assert_same_weights, hf_args, lm_data, runners,
                     tiny_llama)
from loopkit import Loop, LoopArgs, LoopConfigError

pytestmark = IGNORE_PIN_MEMORY_WARNING

RTOL = 1e-6
TIMING = ("runtime", "per_second", "preparation_time", "_mem_", "before_init_mem")


def without_timings(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if not any(t in k for t in TIMING)}


def assert_same_history(runs, rtol=RTOL):
    """Each log_history entry: the same keys in order, the same values (timings and memory aside)."""
    hf, lk = runs["hf"].state.log_history, runs["loopkit"].state.log_history
    assert [list(entry) for entry in lk] == [list(entry) for entry in hf]
    for i, (lk_entry, hf_entry) in enumerate(zip(lk, hf)):
        expected = without_timings(hf_entry)
        assert_close(without_timings(lk_entry).values(), expected.values(), rtol, f"log_history[{i}] {list(expected)}")


def train_both(tmp_path, data, eval_data=None, model=tiny_llama, **fields):
    """Train HF Trainer then `Loop` (build-then-train one at a time) with the same fields; the trainers by name."""
    common = dict(per_device_train_batch_size=2, per_device_eval_batch_size=3, num_train_epochs=1, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", use_cpu=True)
    runs = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, **{**common, **fields})
        trainer = runner(model(), args, train_dataset=data, eval_dataset=eval_data)
        trainer.train()
        runs[name] = trainer
    return runs


def padded_lm_data(n: int) -> list[dict]:
    """`lm_data` whose attention masks have padding (zeros at the end), as a padding collator leaves them."""
    samples = lm_data(n, seq_len=8)
    for i, sample in enumerate(samples):
        sample["attention_mask"][8 - i % 4:] = 0
    return samples


# ---------------------------------------------------------------------------------------------------------------
def test_label_smoothing_matches_trainer_with_accumulation_and_evaluation(tmp_path):
    """HF's LabelSmoother over shifted labels (a causal LM), normalised by num_items_in_batch over each window
    (ragged -100 labels, gradient accumulation 2 with a short last window), in training and in evaluation."""
    runs = train_both(tmp_path, lm_data(10), lm_data(5, seed=1), label_smoothing_factor=0.2,
                      gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2)
    from transformers.trainer_pt_utils import LabelSmoother

    smoother = runs["loopkit"].label_smoother
    assert isinstance(smoother, LabelSmoother) and smoother.epsilon == 0.2
    assert_same_history(runs)
    assert any("eval_loss" in entry for entry in runs["hf"].state.log_history)
    assert_same_weights(runs["loopkit"].model, runs["hf"].model, RTOL)


def tiny_classifier():
    """A 1-layer BertForSequenceClassification with 3 labels and no dropout: label smoothing without the shift."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def test_label_smoothing_matches_trainer_on_a_classifier(tmp_path):
    data = [{"input_ids": s["input_ids"], "attention_mask": s["attention_mask"], "labels": torch.tensor(i % 3)}
            for i, s in enumerate(lm_data(10))]
    runs = train_both(tmp_path, data, data[:5], model=tiny_classifier, label_smoothing_factor=0.1,
                      gradient_accumulation_steps=2, eval_strategy="steps", eval_steps=2)
    assert_same_history(runs)
    assert_same_weights(runs["loopkit"].model, runs["hf"].model, RTOL)


@pytest.mark.parametrize("setting", ["all", "non_padding", True])
def test_num_input_tokens_seen_matches_trainer(tmp_path, setting):
    """`state.num_input_tokens_seen` and the `num_input_tokens_seen` / `train_tokens_per_second` log keys, in step,
    evaluation and summary logs (padding in the attention masks: "non_padding" counts fewer)."""
    runs = train_both(tmp_path, padded_lm_data(10), lm_data(3, seed=1), include_num_input_tokens_seen=setting,
                      eval_strategy="steps", eval_steps=2, max_grad_norm=0.0)
    assert_same_history(runs)
    hf_seen, lk_seen = runs["hf"].state.num_input_tokens_seen, runs["loopkit"].state.num_input_tokens_seen
    # 10 samples of 8 tokens; 13 of them are padding (0, 1, 2, 3, 0, 1, 2, 3, 0, 1 per sample)
    assert lk_seen == hf_seen == (80 if setting != "non_padding" else 67)
    assert "train_tokens_per_second" in runs["loopkit"].state.log_history[0]


def test_neftune_noise_matches_trainer_and_is_removed_after_training(tmp_path):
    """NEFTune's uniform noise on the input embeddings during training only (the same RNG draws as Trainer's), and
    no hook left on the embeddings once train() returns."""
    runs = train_both(tmp_path, lm_data(8), lm_data(3, seed=1), neftune_noise_alpha=5.0, eval_strategy="steps",
                      eval_steps=2)
    assert_same_history(runs)
    assert_same_weights(runs["loopkit"].model, runs["hf"].model, RTOL)
    for trainer in runs.values():
        assert not trainer.model.get_input_embeddings()._forward_hooks
    # The noise did act: the same run without it trains to other weights.
    plain = Loop(tiny_llama(), hf_args(tmp_path / "plain", per_device_train_batch_size=2, num_train_epochs=1,
                                        learning_rate=1e-2, save_strategy="no", use_cpu=True),
                 train_dataset=lm_data(8))
    plain.train()
    assert not torch.allclose(plain.model.lm_head.weight, runs["loopkit"].model.lm_head.weight)


def test_torch_empty_cache_steps_empties_the_cache_when_trainer_does(tmp_path, monkeypatch):
    """HF clears the device cache at every micro-batch whose step (before it) is a multiple of the interval."""
    import accelerate.utils.memory
    import transformers.trainer

    calls = {"hf": [], "loopkit": []}
    for name, module in (("hf", transformers.trainer), ("loopkit", accelerate.utils.memory)):
        # Accelerate's own free_memory() calls it with garbage_collection=True: only the training step's call counts.
        monkeypatch.setattr(module, "clear_device_cache",
                            lambda name=name, **kwargs: None if kwargs else calls[name].append(step_of[name]()))
    step_of = {}

    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1,
                  save_strategy="no", use_cpu=True, torch_empty_cache_steps=2)
    for name, runner in runners():
        trainer = runner(tiny_llama(), hf_args(tmp_path / name, **common), train_dataset=lm_data(12))
        step_of[name] = lambda trainer=trainer: trainer.state.global_step
        trainer.train()
    assert calls["hf"] == [0, 0, 2, 2]  # 6 micro-batches, 3 steps: steps 0 and 2, two micro-batches each
    assert calls["loopkit"] == calls["hf"]


def test_bf16_full_eval_casts_outside_training_only_as_trainer(tmp_path):
    """Evaluations during training run in float32 (no cast while training); evaluate() afterwards casts the model
    to bfloat16 in place and gives Trainer's eval_loss."""
    runs = train_both(tmp_path, lm_data(8), lm_data(5, seed=1), bf16_full_eval=True, eval_strategy="steps",
                      eval_steps=2)
    assert_same_history(runs)
    assert_same_weights(runs["loopkit"].model, runs["hf"].model, RTOL)
    during_training = [entry["eval_loss"] for entry in runs["hf"].state.log_history if "eval_loss" in entry][-1]
    metrics = {name: trainer.evaluate() for name, trainer in runs.items()}
    for trainer in runs.values():
        assert trainer.model.lm_head.weight.dtype == torch.bfloat16
    # loopkit sums evaluation losses in float64, HF in float32: the same bfloat16 losses, summed differently.
    assert_close([metrics["loopkit"]["eval_loss"]], [metrics["hf"]["eval_loss"]], RTOL, "eval_loss")
    assert metrics["hf"]["eval_loss"] != during_training  # the same weights in bfloat16: the cast did act


def test_fp16_full_eval_casts_the_model(tmp_path):
    args = LoopArgs(output_dir=str(tmp_path), report_to="none", fp16_full_eval=True, per_device_eval_batch_size=4)
    loop = Loop(tiny_llama(), args, eval_dataset=lm_data(4))
    loop.evaluate()
    assert loop.model.lm_head.weight.dtype == torch.float16


def test_eval_use_gather_object_reaches_gather_for_metrics(tmp_path):
    """Plumbing: the gather function is Accelerate's gather_for_metrics with use_gather_object=True, as in
    Trainer, and the evaluation gives Trainer's metrics through it."""
    metrics = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, eval_use_gather_object=True, per_device_eval_batch_size=3, use_cpu=True)
        trainer = runner(tiny_llama(), args, eval_dataset=lm_data(5),
                         compute_metrics=lambda p: {"rows": float(len(p.predictions))})
        assert trainer.gather_function.keywords == {"use_gather_object": True}
        assert trainer.gather_function.func == trainer.accelerator.gather_for_metrics
        metrics[name] = without_timings(trainer.evaluate())
    assert metrics["loopkit"] == metrics["hf"] and metrics["hf"]["eval_rows"] == 5


def test_memory_metrics_have_trainers_keys(tmp_path):
    """skip_memory_metrics=False: the init/train/eval/test memory keys where Trainer puts them (train summary log
    and TrainOutput; evaluate's and predict's returned metrics, not the eval log), with plausible byte counts."""
    found = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, skip_memory_metrics=False, per_device_train_batch_size=2, max_steps=2,
                       save_strategy="no", use_cpu=True)
        trainer = runner(tiny_llama(), args, train_dataset=lm_data(4), eval_dataset=lm_data(3))
        output = trainer.train()
        found[name] = (list(output.metrics), list(trainer.state.log_history[-1]), list(trainer.evaluate()),
                       list(trainer.state.log_history[-1]), list(trainer.predict(lm_data(2)).metrics))
        train_metrics = output.metrics
    assert found["loopkit"] == found["hf"]
    assert "init_mem_cpu_alloc_delta" in found["hf"][0] and "eval_mem_cpu_peaked_delta" in found["hf"][2]
    assert "test_mem_cpu_alloc_delta" in found["hf"][4]
    assert train_metrics["before_init_mem_cpu"] > 10_000_000  # this Python process holds torch: tens of MB
    assert all(isinstance(v, int) and v >= 0 for k, v in train_metrics.items() if "peaked" in k)


def test_debug_underflow_overflow_reports_and_stops_as_trainer(tmp_path, capsys):
    """DebugUnderflowOverflow's hooks on the model: the same report of the last frames and the same error at the
    first inf."""

    def overflowing_llama():
        model = tiny_llama()
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
        return model

    reports, errors = {}, {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, debug="underflow_overflow", per_device_train_batch_size=2, max_steps=2,
                       save_strategy="no", use_cpu=True)
        trainer = runner(overflowing_llama(), args, train_dataset=lm_data(4))
        capsys.readouterr()
        with pytest.raises(ValueError, match="DebugUnderflowOverflow: inf/nan detected") as error:
            trainer.train()
        reports[name], errors[name] = capsys.readouterr().out, str(error.value)
    assert "Detected inf/nan during batch_number=0" in reports["hf"] and "down_proj" in reports["hf"]
    # loopkit then prints its run report's summary (a failed run gets one too)
    assert reports["loopkit"].startswith(reports["hf"]) and errors["loopkit"] == errors["hf"]


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, names", [
    ({"debug": "tpu_metrics_debug"}, ("debug='tpu_metrics_debug'", "torch_xla")),
    ({"bf16_full_eval": True, "fp16_full_eval": True}, ("fp16_full_eval=True", "only one")),
    ({"torch_empty_cache_steps": 0}, ("torch_empty_cache_steps=0", "positive integer")),
    ({"include_num_input_tokens_seen": "some"}, ("include_num_input_tokens_seen='some'", "'non_padding'")),
])
def test_bad_values_name_the_field_and_the_fix(tmp_path, fields, names):
    with pytest.raises(LoopConfigError) as error:
        Loop(tiny_llama(), LoopArgs(output_dir=str(tmp_path), report_to="none", **fields))
    message = str(error.value)
    assert all(name in message for name in names) and "Fix:" in message, message


def test_loop_args_map_the_fields_as_training_arguments(tmp_path):
    for value, expected in ((True, "all"), (False, "no"), ("non_padding", "non_padding")):
        assert LoopArgs(include_num_input_tokens_seen=value).include_num_input_tokens_seen == expected
        assert hf_args(tmp_path, include_num_input_tokens_seen=value).include_num_input_tokens_seen == expected
    assert LoopArgs(debug="underflow_overflow").debug == ["underflow_overflow"] and LoopArgs().debug == []


def test_greedy_lr_scheduler_steps_on_the_evaluation_metric_as_trainer(tmp_path):
    """`lr_scheduler_type="greedy"` (transformers' GreedyLR) steps after each evaluation with metric_for_best_model,
    never after an optimizer step: the learning rates it logs, the eval losses and the weights equal Trainer's."""
    runs = train_both(tmp_path, lm_data(12), lm_data(4, seed=1), lr_scheduler_type="greedy",
                      lr_scheduler_kwargs={"patience": 1, "factor": 0.5}, eval_strategy="steps", eval_steps=1,
                      metric_for_best_model="loss", num_train_epochs=2)
    assert_same_history(runs)
    rates = [h["learning_rate"] for h in runs["loopkit"].state.log_history if "learning_rate" in h]
    assert len(set(rates)) > 1, "the scheduler never moved the learning rate: the test shows nothing"
    assert_same_weights(runs["loopkit"].model, runs["hf"].model, RTOL)
