"""HF's overridable methods, overridden on a `Loop` subclass, act exactly as on a `Trainer` subclass.

Each override is written once, as a mixin, and mixed into both `transformers.Trainer` and `loopkit.Loop`; both
subclasses then train the same tiny Llama on the same data (GA=2, so `num_items_in_batch` matters). The test
compares what the override saw (its own record of calls) and what it caused (batch order, logged loss / grad norm /
learning rate, evaluation metrics, final weights), and checks that the override changed something compared with a
plain `Loop`, so an override that is silently bypassed fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers import assert_close, assert_same_weights, hf_args, lm_data, tiny_llama
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.data.data_collator import default_data_collator

from loopkit import Loop

SETTINGS = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
                max_steps=3, learning_rate=1e-2, weight_decay=0.01, logging_steps=1, save_strategy="no")
RTOL = 1e-6




# ---------------------------------------------------------------------------------------------------------------
# The overrides, each usable on Trainer and on Loop
# ---------------------------------------------------------------------------------------------------------------
class Recording:
    """Gives each runner a `calls` list the overrides write to."""

    def __init__(self, *args, **kwargs):
        self.calls = []
        super().__init__(*args, **kwargs)


class ZLossComputeLoss(Recording):
    """A multi-task style loss: the model's loss plus a z-loss on the logits; sees `num_items_in_batch`."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        count = None if num_items_in_batch is None else int(num_items_in_batch)
        self.calls.append(("compute_loss", model.training, count, return_outputs))
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        loss = loss + 1e-2 * outputs.logits.logsumexp(-1).pow(2).mean()
        return (loss, outputs) if return_outputs else loss


class HalfGradientTrainingStep(Recording):
    """A hand-written training step that back-propagates half the loss (and must call backward itself)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.calls.append(("training_step", int(num_items_in_batch)))
        model.train()
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self.accelerator.backward(0.5 * loss)
        return loss.detach()


class SGDOptimizer(Recording):
    def create_optimizer(self, model=None):
        self.calls.append(("create_optimizer", model is None))
        if self.optimizer is None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.args.learning_rate, momentum=0.9)
        return self.optimizer


class StepDecayScheduler(Recording):
    def create_scheduler(self, num_training_steps, optimizer=None):
        self.calls.append(("create_scheduler", num_training_steps))
        if self.lr_scheduler is None:
            optimizer = self.optimizer if optimizer is None else optimizer
            self.lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return self.lr_scheduler


class InOrderTrainLoader(Recording):
    def get_train_dataloader(self):
        self.calls.append(("get_train_dataloader",))
        return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size,
                          collate_fn=default_data_collator)


class HalfEvalSetLoader(Recording):
    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        self.calls.append(("get_eval_dataloader", len(dataset)))
        return super().get_eval_dataloader(dataset[: len(dataset) // 2])


class DoubledLossPredictionStep(Recording):
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.calls.append(("prediction_step", prediction_loss_only))
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return (None if loss is None else 2 * loss), logits, labels


class BatchCountEvaluationLoop(Recording):
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self.calls.append(("evaluation_loop", description, prediction_loss_only, metric_key_prefix))
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                         metric_key_prefix)
        output.metrics[f"{metric_key_prefix}_batches"] = len(dataloader)
        return output


# ---------------------------------------------------------------------------------------------------------------
# Running both
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    runner: object
    batches: list  # the first tokens of each training micro-batch, in order
    metrics: dict  # evaluate() after training, timing keys dropped

    @property
    def log(self):
        return [entry for entry in self.runner.state.log_history if "loss" in entry]


def run(base, override, folder) -> Outcome:
    """Build, train and evaluate one runner (one at a time: both constructors seed the global RNG)."""
    runner_class = type(f"{override.__name__}{base.__name__}", (override, base), {}) if override else base
    model = tiny_llama(seed=0)
    batches = []

    def remember_batch(module, args, kwargs):
        if module.training:
            batches.append(kwargs["input_ids"][:, :4].tolist())

    model.register_forward_pre_hook(remember_batch, with_kwargs=True)
    runner = runner_class(model=model, args=hf_args(folder, **SETTINGS), train_dataset=lm_data(12),
                          eval_dataset=lm_data(4, seed=1))
    runner.train()
    metrics = {k: v for k, v in runner.evaluate().items() if not k.endswith(("_runtime", "_per_second"))}
    return Outcome(runner, batches, metrics)


@pytest.fixture(scope="module")
def plain_loop(tmp_path_factory) -> Outcome:
    return run(Loop, None, tmp_path_factory.mktemp("plain"))


def run_both(override, tmp_path) -> tuple[Outcome, Outcome]:
    hf, ours = run(Trainer, override, tmp_path / "hf"), run(Loop, override, tmp_path / "loopkit")
    assert ours.runner.calls == hf.runner.calls, "the override was called differently"
    assert ours.batches == hf.batches, "different training batches"
    for key in ("loss", "grad_norm", "learning_rate", "epoch"):
        assert_close([e[key] for e in ours.log], [e[key] for e in hf.log], RTOL, key)
    assert set(ours.metrics) == set(hf.metrics), "different evaluation metrics"
    assert_close([ours.metrics[k] for k in sorted(hf.metrics)], [hf.metrics[k] for k in sorted(hf.metrics)], RTOL,
                 f"metrics {sorted(hf.metrics)}")
    assert_same_weights(ours.runner.model, hf.runner.model, RTOL)
    return hf, ours


def logged(outcome: Outcome, key: str) -> list[float]:
    return [entry[key] for entry in outcome.log]


# ---------------------------------------------------------------------------------------------------------------
# One test per override
# ---------------------------------------------------------------------------------------------------------------
def test_compute_loss(tmp_path, plain_loop):
    hf, ours = run_both(ZLossComputeLoss, tmp_path)
    training = [call for call in ours.runner.calls if call[1]]
    assert len(training) == 3 * 2 and all(count is not None for _, _, count, _ in training)  # 3 steps x GA 2
    assert logged(ours, "loss")[0] > logged(plain_loop, "loss")[0]  # the extra term is in the loss


def test_training_step(tmp_path, plain_loop):
    hf, ours = run_both(HalfGradientTrainingStep, tmp_path)
    assert len(ours.runner.calls) == 6
    assert logged(ours, "grad_norm")[0] == pytest.approx(logged(plain_loop, "grad_norm")[0] / 2, rel=1e-5)


def test_create_optimizer(tmp_path, plain_loop):
    hf, ours = run_both(SGDOptimizer, tmp_path)
    assert isinstance(getattr(ours.runner.optimizer, "optimizer", ours.runner.optimizer), torch.optim.SGD)
    assert logged(ours, "loss")[1] != pytest.approx(logged(plain_loop, "loss")[1], rel=1e-4)


def test_create_scheduler(tmp_path, plain_loop):
    hf, ours = run_both(StepDecayScheduler, tmp_path)
    assert ours.runner.calls == [("create_scheduler", 3)]
    assert logged(ours, "learning_rate") == pytest.approx([1e-2, 5e-3, 2.5e-3])
    assert logged(plain_loop, "learning_rate") != pytest.approx(logged(ours, "learning_rate"))


def test_get_train_dataloader(tmp_path, plain_loop):
    hf, ours = run_both(InOrderTrainLoader, tmp_path)
    data = lm_data(12)
    in_order = [[sample["input_ids"][:4].tolist() for sample in data[i:i + 2]] for i in range(0, 12, 2)]
    assert ours.batches == in_order
    assert plain_loop.batches != in_order


def test_get_eval_dataloader(tmp_path, plain_loop):
    hf, ours = run_both(HalfEvalSetLoader, tmp_path)
    assert ours.runner.calls == [("get_eval_dataloader", 4)]
    assert ours.metrics["eval_loss"] != pytest.approx(plain_loop.metrics["eval_loss"], rel=1e-4)


def test_prediction_step(tmp_path, plain_loop):
    hf, ours = run_both(DoubledLossPredictionStep, tmp_path)
    assert ours.runner.calls == [("prediction_step", True)] * 2  # 4 samples, batch 2, no compute_metrics
    assert ours.metrics["eval_loss"] == pytest.approx(2 * plain_loop.metrics["eval_loss"], rel=1e-6)


def test_evaluation_loop(tmp_path, plain_loop):
    hf, ours = run_both(BatchCountEvaluationLoop, tmp_path)
    assert ours.runner.calls == [("evaluation_loop", "Evaluation", True, "eval")]
    assert ours.metrics["eval_batches"] == 2 and "eval_batches" not in plain_loop.metrics
