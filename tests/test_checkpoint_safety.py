"""Checkpoints: no unpickling of code, clear errors on corrupt files with fallback, a full disk that loses nothing,
asynchronous saves, interchange with HF Trainer, non-finite losses, and the failure hook."""

import errno
import json
import os
import pickle

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)

from loopkit import EvalStage, Loop, LoopArgs, StepStage
from loopkit.checkpoint import checkpoint_dirs




def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def lm_data(n=24, length=12):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": (ids := torch.randint(0, 64, (length,), generator=g)), "labels": ids.clone()}
            for _ in range(n)]


def make_loop(out, evaluation=None, step=None, callbacks=None, **overrides):
    fields = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_steps=2, logging_steps=1,
                  learning_rate=1e-3, disable_tqdm=True, report_to="none")
    fields.update(overrides)
    return Loop(model=tiny_llama(), args=LoopArgs(**fields), train_dataset=lm_data(), evaluation=evaluation,
                step=step, callbacks=callbacks)


class RunsCode:
    """A pickle that would create a file if it were ever unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("victim", ["optimizer.pt", "rng_state.pth", "scheduler.pt"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, victim):
    make_loop(tmp_path / "run").train()
    checkpoint = tmp_path / "run" / "checkpoint-4"
    marker = tmp_path / "pwned"
    with open(checkpoint / victim, "wb") as f:
        pickle.dump({"state": RunsCode(str(marker))}, f)
    with pytest.raises(RuntimeError, match=victim.replace(".", r"\.")) as info:
        make_loop(tmp_path / "run", max_steps=8).train(resume_from_checkpoint=str(checkpoint))
    assert "weights_only" in str(info.value)
    assert not marker.exists(), "the planted pickle ran code"


@pytest.mark.parametrize("victim", ["model.safetensors", "trainer_state.json"])
def test_corrupt_file_is_named_and_resume_true_falls_back(tmp_path, victim):
    make_loop(tmp_path / "run").train()
    newest = tmp_path / "run" / "checkpoint-6"
    path = newest / victim
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        make_loop(tmp_path / "run", max_steps=8).train(resume_from_checkpoint=str(newest))
    with pytest.warns(UserWarning, match="Falling back to the previous checkpoint"):
        loop = make_loop(tmp_path / "run", max_steps=8)
        loop.train(resume_from_checkpoint=True)
    assert loop.state.log_history[0]["step"] == 1 and loop.state.global_step == 8
    first_new = [h["step"] for h in loop.state.log_history if "loss" in h]
    assert first_new == list(range(1, 9))  # resumed from checkpoint-4: its history, then steps 5..8


def disk_full_on(name):
    """torch.save that fails like a full disk when writing `name` (after writing a partial file)."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        path = getattr(f, "name", f)  # a path, or the open file loopkit's state files are written to
        if os.path.basename(str(path)) == name:
            if hasattr(f, "write"):
                f.write(b"partial")
            else:
                with open(f, "wb") as partial:
                    partial.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, f, *args, **kwargs)

    return save


def test_full_disk_fails_loudly_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    loop = make_loop(tmp_path / "run", callbacks=[FailSavesFrom(step=4, monkeypatch=monkeypatch)])
    with pytest.raises(RuntimeError, match="No space left on device") as info:
        loop.train()
    assert "checkpoint-2" in str(info.value)  # names the checkpoint that is still good
    assert [os.path.basename(p) for p in checkpoint_dirs(str(tmp_path / "run"))] == ["checkpoint-2"]
    assert not [p for p in os.listdir(tmp_path / "run") if p.startswith(".")], "a half-written folder remains"
    monkeypatch.undo()
    resumed = make_loop(tmp_path / "run")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6


@pytest.mark.parametrize("policy,final_step", [("continue", 6), ("stop", 4)])
def test_full_disk_policies(tmp_path, monkeypatch, policy, final_step):
    loop = make_loop(tmp_path / "run", evaluation=EvalStage(on_save_error=policy),
                     callbacks=[FailSavesFrom(step=4, monkeypatch=monkeypatch, until=5)])
    with pytest.warns(UserWarning, match="No space left"):
        loop.train()
    assert loop.state.global_step == final_step
    kept = [os.path.basename(p) for p in checkpoint_dirs(str(tmp_path / "run"))]
    assert "checkpoint-4" not in kept and "checkpoint-2" in kept


class FailSavesFrom(TrainerCallback):
    """Makes the optimizer file unwritable (a full disk) for the saves at steps `step` .. `until`."""

    def __init__(self, step, monkeypatch, until=10**9):
        self.step, self.until, self.monkeypatch = step, until, monkeypatch

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.monkeypatch.setattr(torch, "save", disk_full_on("optimizer.pt"))
        if state.global_step == self.until + 1:
            self.monkeypatch.undo()


def test_async_save_writes_the_same_checkpoint(tmp_path):
    sync = make_loop(tmp_path / "sync")
    sync.train()
    background = make_loop(tmp_path / "async", evaluation=EvalStage(async_save=True))
    background.train()
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        a = AutoModelForCausalLM.from_pretrained(tmp_path / "sync" / name).state_dict()
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "async" / name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
        opt_a = torch.load(tmp_path / "sync" / name / "optimizer.pt", weights_only=True)
        opt_b = torch.load(tmp_path / "async" / name / "optimizer.pt", weights_only=True)
        assert torch.equal(opt_a["state"][0]["exp_avg"], opt_b["state"][0]["exp_avg"])
        state_a = json.load(open(tmp_path / "sync" / name / "trainer_state.json"))
        state_b = json.load(open(tmp_path / "async" / name / "trainer_state.json"))
        assert state_a["global_step"] == state_b["global_step"]


def hf_args(out, **overrides):
    fields = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, save_steps=2, logging_steps=1,
                  learning_rate=1e-3, disable_tqdm=True, report_to="none")
    fields.update(overrides)
    return TrainingArguments(**fields)


def test_loopkit_checkpoint_resumes_in_hf_trainer_and_back(tmp_path):
    reference = Trainer(model=tiny_llama(), args=hf_args(tmp_path / "ref", max_steps=8), train_dataset=lm_data())
    reference.train()
    # loopkit -> HF Trainer: optimizer, scheduler, RNG and state come through
    Loop(model=tiny_llama(), args=hf_args(tmp_path / "lk", max_steps=8), train_dataset=lm_data()).train()
    hf = Trainer(model=tiny_llama(), args=hf_args(tmp_path / "hf_resumed", max_steps=8), train_dataset=lm_data())
    hf.train(resume_from_checkpoint=str(tmp_path / "lk" / "checkpoint-4"))
    assert hf.state.global_step == 8
    for (name, a), (_, b) in zip(hf.model.state_dict().items(), reference.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    # HF Trainer -> loopkit (no completeness marker: accepted with a warning)
    with pytest.warns(UserWarning, match="not written by loopkit"):
        loop = Loop(model=tiny_llama(), args=hf_args(tmp_path / "lk_resumed", max_steps=8),
                    train_dataset=lm_data())
        loop.train(resume_from_checkpoint=str(tmp_path / "ref" / "checkpoint-4"))
    for (name, a), (_, b) in zip(loop.model.state_dict().items(), reference.model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    # the model folder inside a checkpoint loads with from_pretrained and reproduces the outputs
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "lk" / "checkpoint-8")
    ids = torch.randint(0, 64, (2, 8))
    lk_model = Loop(model=tiny_llama(), args=hf_args(tmp_path / "x")).model  # same init, untrained: differs
    with torch.no_grad():
        trained = reloaded(ids).logits
        assert not torch.allclose(trained, lk_model(ids).logits)
        torch.testing.assert_close(trained, reference.model.eval()(ids).logits, rtol=1e-4, atol=1e-5)


class NaNAtStep(TrainerCallback):
    """Poisons one parameter's gradient at one optimizer step (as an overflow would)."""

    def __init__(self, step):
        self.step = step

    def on_gradients_ready(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            next(model.parameters()).grad.fill_(float("nan"))


@pytest.mark.parametrize("policy", ["skip", "stop", "raise"])
def test_nonfinite_gradient_policies(tmp_path, policy):
    recorded = {}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            recorded[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}

    loop = make_loop(tmp_path / "run", step=StepStage(nonfinite=policy), callbacks=[NaNAtStep(3), Record()],
                     max_steps=12, save_steps=100)
    loop.guard_check_every = 5
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="the first was step 3"):
            loop.train()
        assert recorded and 5 in recorded and 6 not in recorded  # found at the check after step 5
        return
    with pytest.warns(UserWarning, match=r"the first was step 3 \(epoch 0, micro-batches 2\.\.2"):
        loop.train()
    assert all(torch.equal(recorded[2][k], recorded[3][k]) for k in recorded[2]), "the bad step was applied"
    assert all(torch.isfinite(v).all() for v in loop.model.state_dict().values())
    if policy == "stop":
        assert loop.state.global_step == 5 and (tmp_path / "run" / "checkpoint-5").is_dir()
    else:
        assert loop.state.global_step == 12


def test_skip_needs_a_fused_optimizer(tmp_path):
    loop = make_loop(tmp_path / "run", step=StepStage(nonfinite="skip"), optim="adamw_torch")
    with pytest.raises(ValueError, match="nonfinite='skip'.*adamw_torch_fused"):
        loop.train()


def test_failure_hook_sees_the_exception_and_the_last_checkpoint_resumes(tmp_path):
    seen = []

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise KeyError("boom")

    class Failed(TrainerCallback):
        def on_train_failed(self, args, state, control, exception=None, **kwargs):
            seen.append((type(exception), state.global_step))

    with pytest.raises(KeyError):
        make_loop(tmp_path / "run", callbacks=[Boom(), Failed()]).train()
    assert seen == [(KeyError, 5)]
    loop = make_loop(tmp_path / "run")
    loop.train(resume_from_checkpoint=True)
    assert loop.state.global_step == 6
