"""docs/differences.md, "What differs from Trainer and why", each claim checked."""

import math
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback

from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, lm_data, tiny_llama

from loopkit import Loop, LoopArgs


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def test_gpt2_loss_is_the_true_token_mean_under_accumulation(tmp_path):
    """GA=2, logging every step: the first logged loss must be the mean over every shifted label token of the
    window, as computed directly; HF Trainer counts unshifted tokens for GPT-2 and logs less."""
    data = lm_data(8, seq_len=12)
    model = gpt2()
    with torch.no_grad():  # the window of step 1 under the first epoch's order, from the untrained model
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42)).tolist()[:4]
        ids = torch.stack([data[i]["input_ids"] for i in order])
        labels = torch.stack([data[i]["labels"] for i in order])
        logits = model(input_ids=ids).logits[:, :-1]
        target = labels[:, 1:]
        expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), target.reshape(-1),
                                                     ignore_index=-100).item()
    args = dict(max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=1,
                save_strategy="no", seed=42)
    loop = Loop(model=gpt2(), args=hf_args(tmp_path / "lk", **args), train_dataset=data)
    loop.train()
    logged = loop.state.log_history[0]["loss"]
    assert math.isclose(logged, expected, rel_tol=1e-5), (logged, expected)
    hf = Trainer(model=gpt2(), args=hf_args(tmp_path / "hf", **args), train_dataset=data)
    hf.train()
    assert hf.state.log_history[0]["loss"] < expected * 0.99  # HF's deflated value, for the record


def test_rotation_goes_by_step_number_not_mtime(tmp_path):
    loop = Loop(model=tiny_llama(), args=LoopArgs(output_dir=str(tmp_path), max_steps=6, save_steps=2,
                                                  per_device_train_batch_size=4, disable_tqdm=True),
                train_dataset=lm_data(16))
    loop.train()
    # Make the oldest checkpoint look newest (as a copy or a backup restore does), then rotate to 2.
    now = time.time()
    for step, age in ((2, 0), (4, 100), (6, 200)):
        os.utime(tmp_path / f"checkpoint-{step}", (now - age, now - age))
    loop.args.save_total_limit = 2
    loop.checkpointer.rotate()
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint-")) == ["checkpoint-4", "checkpoint-6"]


def test_checkpoints_hold_no_pickled_arguments(tmp_path):
    Loop(model=tiny_llama(), args=LoopArgs(output_dir=str(tmp_path), max_steps=2, save_steps=2,
                                           per_device_train_batch_size=4, disable_tqdm=True),
         train_dataset=lm_data(8)).train()
    files = os.listdir(tmp_path / "checkpoint-2")
    assert "training_args.bin" not in files and "trainer_state.json" in files and "model.safetensors" in files


LOOPKIT_STATE = {"loopkit_state.json", "loopkit_tensors.safetensors"}  # loopkit's own, in a checkpoint beside Trainer's


@IGNORE_PIN_MEMORY_WARNING  # Trainer runs here too
def test_training_arguments_are_written_as_trainer_writes_them(tmp_path):
    """With a `TrainingArguments`, `training_args.bin` is in every checkpoint and in output_dir after `save_model`,
    as Trainer writes it (its readers, and transformers' own tests, read it): the same file names as Trainer's
    checkpoint and output folder. loopkit never reads it; the user does, as here, from their own file."""
    args = dict(max_steps=2, save_steps=2, per_device_train_batch_size=4, disable_tqdm=True, report_to="none")
    folders = {}
    for name, runner in (("hf", Trainer), ("loop", Loop)):
        out = tmp_path / name
        trainer = runner(model=tiny_llama(), args=hf_args(out, **args), train_dataset=lm_data(8))
        trainer.train()
        trainer.save_model()
        folders[name] = (out, trainer.args)
    for name, (out, training_args) in folders.items():
        for folder in (out / "checkpoint-2", out):
            saved = torch.load(folder / "training_args.bin", weights_only=False)  # the user's own file
            assert type(saved) is type(training_args) and saved == training_args, (name, folder)
    (hf, _), (loop, _) = folders["hf"], folders["loop"]
    hf_files, loop_files = set(os.listdir(hf / "checkpoint-2")), set(os.listdir(loop / "checkpoint-2"))
    assert loop_files - LOOPKIT_STATE == hf_files, sorted((loop_files - LOOPKIT_STATE) ^ hf_files)
    # output_dir after save_model: Trainer's files, beside loopkit's run report
    assert {p for p in os.listdir(hf) if not p.startswith("checkpoint-")} <= set(os.listdir(loop))


class NaNLossAt(TrainerCallback):
    """Makes the model's loss NaN for the micro-batch of one step (a wrapper around its forward)."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        poison = state.global_step + 1 == self.step
        if not hasattr(model, "real_forward"):
            model.real_forward = model.forward
        model.forward = (lambda *a, **k: self.poisoned(model, *a, **k)) if poison else model.real_forward

    @staticmethod
    def poisoned(model, *args, **kwargs):
        out = model.real_forward(*args, **kwargs)
        out.loss = out.loss * float("nan")
        return out


def test_nan_loss_filter_logs_like_trainer_without_a_host_sync(tmp_path, monkeypatch):
    """logging_nan_inf_filter: a NaN step loss is replaced by the running mean, as in HF Trainer (the logged losses
    are compared live), and loopkit's hot path never calls `.item()` outside logging points to do it."""
    args = dict(max_steps=4, per_device_train_batch_size=4, logging_steps=4, save_strategy="no", max_grad_norm=0.0,
                learning_rate=0.0)  # lr 0: the NaN gradient cannot poison the weights of the next steps
    hf = Trainer(model=tiny_llama(), args=hf_args(tmp_path / "hf", **args), train_dataset=lm_data(16),
                 callbacks=[NaNLossAt(3)])
    hf.train()
    items = []
    real_item = torch.Tensor.item

    def counting_item(self):
        items.append(1)
        return real_item(self)

    loop = Loop(model=tiny_llama(), args=hf_args(tmp_path / "lk", **args), train_dataset=lm_data(16),
                callbacks=[NaNLossAt(3)])
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    loop.train()
    monkeypatch.undo()
    expected, got = hf.state.log_history[0]["loss"], loop.state.log_history[0]["loss"]
    assert math.isfinite(got) and math.isclose(got, expected, rel_tol=1e-6), (got, expected)
    # One log (the loss sum, read again after the filter recomputes it: a NaN was added; the grad norm), the summary
    # and the report: none per step.
    assert len(items) <= 5


def test_documented_fix_for_models_that_ignore_num_items_in_batch(tmp_path):
    """BERT's classifier takes **kwargs but averages its loss per batch: with GA=2 the logged loss doubles (as in HF
    Trainer) unless `loss_is_scaled_for_ga = False`, docs/differences.md's fix; then GA=2 x 2 equals GA=1 x 4."""
    from transformers import BertConfig, BertForSequenceClassification

    def bert():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (8,), generator=g), "labels": i % 2} for i in range(8)]

    class PerBatchMeanLoop(Loop):
        loss_is_scaled_for_ga = False

    def first_loss(cls, batch, ga, out):
        loop = cls(model=bert(), args=hf_args(tmp_path / out, max_steps=1, per_device_train_batch_size=batch,
                                              gradient_accumulation_steps=ga, logging_steps=1,
                                              save_strategy="no"), train_dataset=data)
        loop.train()
        return loop.state.log_history[0]["loss"]

    full_batch = first_loss(Loop, 4, 1, "a")
    assert math.isclose(first_loss(PerBatchMeanLoop, 2, 2, "b"), full_batch, rel_tol=1e-5)
    assert math.isclose(first_loss(Loop, 2, 2, "c"), 2 * full_batch, rel_tol=0.2)  # the trap, documented
