"""`use_liger_kernel` / `liger_kernel_config` as Trainer 5.24 takes them, each run with HF Trainer and with `Loop` in
the same test.

Trainer applies Liger's kernels (transformers' `apply_liger_kernel`, which calls liger-kernel's
`_apply_liger_kernel_to_instance`) at the start of every `train()`, and in a loss-only evaluation passes
`skip_logits=True` to the model (Liger's fused loss then never builds the logits). Where liger-kernel is missing,
`train()` raises Trainer's ImportError; an evaluation still runs. Liger's kernels are Triton, which runs on GPUs:
on a CPU machine liger-kernel installs and patches the model, and the first forward fails in Triton ("0 active
drivers"), the same failure for both. Training with the kernels is benchmarks/gpu.py's `liger` variant.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, lm_data, runners, tiny_llama

pytestmark = IGNORE_PIN_MEMORY_WARNING


# ---------------------------------------------------------------------------------------------------------------
# skip_logits in a loss-only evaluation (transformers' tests/trainer/test_skip_logits_eval.py, with both runners)
# ---------------------------------------------------------------------------------------------------------------
class Numbered(Dataset):
    """Four rows of three token ids and one label: the shape of transformers' own test."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i, i + 1, i + 2]), "labels": torch.tensor([1])}


class SeesSkipLogits(nn.Module):
    """Records the `skip_logits` of every forward; returns a loss (and logits unless told to skip them)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.seen = []

    def forward(self, input_ids=None, labels=None, skip_logits=None, **kwargs):
        self.seen.append(skip_logits)
        out = {"loss": self.weight.sum() + 0.5}
        if not skip_logits:
            out["logits"] = torch.zeros(input_ids.shape[0], 2)
        return out


def skip_logits_seen(runner, tmp_path, compute_metrics=None, **fields) -> list:
    model = SeesSkipLogits()
    args = hf_args(tmp_path, per_device_eval_batch_size=2, do_eval=True, **fields)
    runner(model=model, args=args, eval_dataset=Numbered(), compute_metrics=compute_metrics).evaluate()
    return model.seen


def rows_seen(prediction) -> dict:
    return {"rows": len(prediction.label_ids)}


@pytest.mark.parametrize("fields, expected", [
    (dict(use_liger_kernel=True, prediction_loss_only=True), [True, True]),  # transformers' test
    (dict(use_liger_kernel=True), [True, True]),  # no compute_metrics: evaluate() is loss-only anyway
    (dict(use_liger_kernel=True, compute_metrics=rows_seen), [None, None]),  # logits wanted: not skipped
    (dict(prediction_loss_only=True), [None, None]),  # no Liger: never passed
])
def test_loss_only_evaluation_passes_skip_logits_as_trainer(tmp_path, fields, expected):
    """Runs without liger-kernel too (Trainer's evaluation never imports it): the flag is Trainer's decision."""
    seen = {name: skip_logits_seen(runner, tmp_path / name, **fields) for name, runner in runners()}
    assert seen["hf"] == expected
    assert seen["loopkit"] == seen["hf"]


def test_an_unlabelled_batch_gets_no_skip_logits(tmp_path):
    """No labels: no loss to compute, so the model runs for its logits and is never told to skip them (Trainer's
    `model(**inputs)` branch)."""
    rows = [{"input_ids": torch.tensor([i, i + 1, i + 2])} for i in range(4)]
    seen = {}
    for name, runner in runners():
        model = SeesSkipLogits()
        args = hf_args(tmp_path / name, per_device_eval_batch_size=2, use_liger_kernel=True,
                       prediction_loss_only=True)
        runner(model=model, args=args).predict(rows)
        seen[name] = model.seen
    assert seen["hf"] == [None, None] and seen["loopkit"] == seen["hf"]


# ---------------------------------------------------------------------------------------------------------------
# The kernels applied at train(), and Trainer's error where liger-kernel is missing
# ---------------------------------------------------------------------------------------------------------------
def patched_parts(model) -> dict:
    """Each module's class and the function behind its `forward` (Liger replaces both, per instance)."""
    return {name: (type(module).__name__, getattr(module.forward, "__qualname__", repr(module.forward)))
            for name, module in model.named_modules()}


def train_with_liger(runner, tmp_path, **fields):
    """train() a tiny Llama with use_liger_kernel; returns (the model as train() left it, the error it raised).
    Liger also swaps the classes in transformers' modeling_llama module (process-wide); they are put back after, so
    the next run builds its model from Llama's own classes, as a fresh process would."""
    from transformers.models.llama import modeling_llama

    module_before = dict(vars(modeling_llama))
    try:
        return train_patched(runner, tmp_path, **fields)
    finally:
        for name, value in module_before.items():
            setattr(modeling_llama, name, value)


def train_patched(runner, tmp_path, **fields):
    model = tiny_llama()
    args = hf_args(tmp_path, use_liger_kernel=True, max_steps=1, per_device_train_batch_size=2, save_strategy="no",
                   use_cpu=True, **fields)
    trainer = runner(model=model, args=args, train_dataset=lm_data(4))
    try:
        trainer.train()
        error = None
    except Exception as exc:  # on CPU: Triton's, at the first forward
        error = exc
    return model, error


@pytest.mark.parametrize("config", [None, {"rms_norm": False, "swiglu": False}])
def test_train_applies_liger_kernels_as_trainer(tmp_path, config):
    pytest.importorskip("liger_kernel", reason="liger-kernel is in the test extras (pip install -e '.[test]')")
    plain = patched_parts(tiny_llama())
    results = {name: train_with_liger(runner, tmp_path / name, liger_kernel_config=config)
               for name, runner in runners()}
    (hf_model, hf_error), (loop_model, loop_error) = results["hf"], results["loopkit"]
    assert patched_parts(loop_model) == patched_parts(hf_model)
    changed = {name for name, part in patched_parts(hf_model).items() if part != plain[name]}
    norms = {name for name in plain if name.endswith("norm")}
    mlps = {name for name in plain if name.endswith(".mlp")}
    if config is None:  # Liger's defaults for Llama: RMSNorm and SwiGLU swapped in, the causal LM's forward too
        assert norms | mlps | {""} <= changed
    else:  # the config reaches liger-kernel: those two stay Llama's
        assert "" in changed and not changed & (norms | mlps)
    # Nothing of Liger outlives the runs (the module's classes are put back): a new Llama runs on torch's kernels.
    fresh = tiny_llama()
    assert patched_parts(fresh) == plain
    assert torch.isfinite(fresh(**{k: v.unsqueeze(0) for k, v in lm_data(1)[0].items()}).loss)
    if torch.cuda.is_available():  # a GPU: the kernels run, and both trained
        assert hf_error is None and loop_error is None
    else:  # Triton has no CPU driver: the same failure for both, from the patched forward
        assert type(loop_error) is type(hf_error) and str(loop_error) == str(hf_error)
        assert "active drivers" in str(hf_error)


@pytest.fixture
def liger_missing(monkeypatch):
    """liger-kernel unimportable in this process (as where it is not installed): `find_spec` finds nothing and an
    import fails. transformers caches its availability check, so the cache is cleared around the test."""
    from transformers.utils import is_liger_kernel_available

    for name in [m for m in sys.modules if m == "liger_kernel" or m.startswith("liger_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    is_liger_kernel_available.cache_clear()
    yield
    is_liger_kernel_available.cache_clear()


def test_missing_liger_kernel_gives_trainers_error_at_train(tmp_path, liger_missing):
    """Built and evaluated without complaint (Trainer checks at train()), then Trainer's ImportError, same words."""
    errors = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, use_liger_kernel=True, max_steps=1, per_device_train_batch_size=2,
                       per_device_eval_batch_size=2, prediction_loss_only=True, save_strategy="no")
        trainer = runner(model=tiny_llama(), args=args, train_dataset=lm_data(4), eval_dataset=lm_data(4))
        assert "eval_loss" in trainer.evaluate()  # Llama ignores skip_logits without Liger's forward
        with pytest.raises(ImportError) as raised, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        errors[name] = raised.value
        # The failed run's report and charts are written, though the run had not created its folder yet.
        assert not [w for w in caught if "Could not" in str(w.message)], [str(w.message) for w in caught]
    assert type(errors["loopkit"]) is type(errors["hf"])
    assert str(errors["loopkit"]) == str(errors["hf"])
    assert "pip install liger-kernel" in str(errors["hf"])
