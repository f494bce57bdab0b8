"""Each of the five stages replaced by a subclass of a few lines, and the change takes effect.

Every test runs the default stage and the subclass from the same seed and weights, and checks the difference the
subclass must make (and only where it must make it), so a subclass that is ignored fails the test.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import TinyRegression
from safetensors.torch import load_file
from torch.utils.data import SequentialSampler

from loopkit import DataStage, EvalStage, Loop, LoopArgs, SetupStage, StepStage, TeardownStage
from loopkit.checkpoint import save_model_files
from loopkit.stages.setup import seed_everything

N_SAMPLES, BATCH = 12, 4




class RecordingRegression(TinyRegression):
    """Remembers the sample indices of every training batch (x[:, 0] carries the index)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, labels=None):
        if self.training:
            self.seen.append((x[:, 0] * 10).round().long().tolist())
        return super().forward(x, labels)


def model(seed: int = 0) -> RecordingRegression:
    torch.manual_seed(seed)
    return RecordingRegression()


def indexed_data(n: int = N_SAMPLES) -> list[dict]:
    """Sample i has x = (i/10, 1) and y = 2 x0 - x1 + 1, so a batch tells which samples it holds."""
    return [{"x": torch.tensor([i / 10, 1.0]), "labels": torch.tensor(2 * i / 10)} for i in range(n)]


def loop_args(tmp_path, **kwargs) -> LoopArgs:
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=BATCH, learning_rate=0.05,
                    logging_steps=1, save_strategy="no", disable_tqdm=True, num_train_epochs=2)
    settings.update(kwargs)
    return LoopArgs(**settings)


def epoch_orders(seen: list[list[int]]) -> list[list[int]]:
    per_epoch = N_SAMPLES // BATCH
    return [sum(seen[i:i + per_epoch], []) for i in range(0, len(seen), per_epoch)]


def losses(loop) -> list[float]:
    return [entry["loss"] for entry in loop.state.log_history if "loss" in entry]


# ---------------------------------------------------------------------------------------------------------------
# step: a multi-task loss
# ---------------------------------------------------------------------------------------------------------------
class AuxiliaryLossStep(StepStage):
    """Adds an auxiliary term (an L2 penalty standing in for a second task's loss) to the model's loss."""

    weight = 0.5

    def __init__(self):
        super().__init__()
        self.auxiliary_terms = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        auxiliary = self.weight * model.linear.weight.pow(2).sum()
        self.auxiliary_terms.append(auxiliary.detach())
        return (loss + auxiliary, outputs) if return_outputs else loss + auxiliary


def test_step_stage_with_an_auxiliary_loss(tmp_path):
    plain = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data())
    plain.train()
    step = AuxiliaryLossStep()
    multi_task = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data(), step=step)
    multi_task.train()

    assert len(step.auxiliary_terms) == len(losses(multi_task)) == 6  # one term per training forward
    # Same weights and batch at step 1, so the logged loss is the plain one plus the auxiliary term.
    assert losses(multi_task)[0] == pytest.approx(losses(plain)[0] + step.auxiliary_terms[0].item(), rel=1e-6)
    # The term's gradient took effect: the penalized weights end smaller.
    assert multi_task.model.linear.weight.norm() < plain.model.linear.weight.norm()


# ---------------------------------------------------------------------------------------------------------------
# data: another sampler
# ---------------------------------------------------------------------------------------------------------------
class InOrderData(DataStage):
    def train_sampler(self, dataset):
        return SequentialSampler(dataset)


def test_data_stage_with_a_sequential_sampler(tmp_path):
    shuffled = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data())
    shuffled.train()
    in_order = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data(), data=InOrderData())
    in_order.train()

    assert epoch_orders(in_order.model.seen) == [list(range(N_SAMPLES))] * 2
    # The default is HF's: epoch e visits randperm(n) seeded with seed + e.
    expected = [torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(42 + e)).tolist() for e in (0, 1)]
    assert epoch_orders(shuffled.model.seen) == expected


# ---------------------------------------------------------------------------------------------------------------
# setup: the model, and the seeding
# ---------------------------------------------------------------------------------------------------------------
class FrozenBiasSetup(SetupStage):
    """Freezes the bias before the model becomes the run's model (so the optimizer never holds it)."""

    def set_model(self, model):
        model.linear.bias.requires_grad_(False)
        super().set_model(model)


def test_setup_stage_that_changes_the_model(tmp_path):
    initial = model().linear.bias.detach().clone()
    default = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data())
    default.train()
    frozen = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data(), setup=FrozenBiasSetup())
    frozen.train()

    assert not torch.equal(default.model.linear.bias, initial)
    assert torch.equal(frozen.model.linear.bias, initial)
    assert not torch.equal(frozen.model.linear.weight, model().linear.weight)  # the rest still trains


class ShiftedSeedSetup(SetupStage):
    """Seeds with args.seed + 100 (e.g. one seed per ensemble member while keeping the args shared)."""

    def build(self, model):
        super().build(model)
        seed_everything(self.run.args.seed + 100)


def test_setup_stage_that_changes_the_seeding(tmp_path):
    loop = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data(), setup=ShiftedSeedSetup())
    loop.train()
    # The data order follows the seed the setup stage chose.
    expected = [torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(142 + e)).tolist() for e in (0, 1)]
    assert epoch_orders(loop.model.seen) == expected


# ---------------------------------------------------------------------------------------------------------------
# evaluation: an extra metric
# ---------------------------------------------------------------------------------------------------------------
class WeightNormEval(EvalStage):
    """Adds `<prefix>_weight_norm` to every evaluation and prediction."""

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics[f"{metric_key_prefix}_weight_norm"] = self.run.model.linear.weight.norm().item()
        return output


def test_eval_stage_that_adds_a_metric(tmp_path):
    seen_by_callbacks = []

    class Watch:
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen_by_callbacks.append(metrics["eval_weight_norm"])

    args = loop_args(tmp_path, eval_strategy="epoch", metric_for_best_model="weight_norm", greater_is_better=False)
    loop = Loop(model=model(), args=args, train_dataset=indexed_data(), eval_dataset=indexed_data(4),
                evaluation=WeightNormEval(), callbacks=[Watch()])
    loop.train()

    logged = [entry["eval_weight_norm"] for entry in loop.state.log_history if "eval_loss" in entry]
    assert len(logged) == 2 and logged == seen_by_callbacks
    assert loop.state.best_metric == min(logged)  # the new metric can drive best-model tracking
    assert loop.evaluate()["eval_weight_norm"] == pytest.approx(loop.model.linear.weight.norm().item())
    assert "test_weight_norm" in loop.predict(indexed_data(4)).metrics


# ---------------------------------------------------------------------------------------------------------------
# teardown: something at the end
# ---------------------------------------------------------------------------------------------------------------
class SaveFinalTeardown(TeardownStage):
    """Saves the final weights to `<output_dir>/final`, and counts releases (they also happen when a run fails)."""

    def __init__(self):
        self.releases = 0

    def finish_training(self, plan, start_time, train_loss, steps_run):
        output = super().finish_training(plan, start_time, train_loss, steps_run)
        run = self.run
        save_model_files(run.model_wrapped, self.context.accelerator, os.path.join(run.args.output_dir, "final"))
        return output

    def release(self):
        self.releases += 1
        super().release()


def test_teardown_stage_that_saves_the_final_model(tmp_path):
    teardown = SaveFinalTeardown()
    loop = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data(), teardown=teardown)
    loop.train()
    saved = load_file(os.path.join(tmp_path, "final", "model.safetensors"))
    for name, tensor in loop.model.state_dict().items():
        assert torch.equal(saved[name], tensor), name
    assert teardown.releases == 1


def test_teardown_stage_releases_after_a_failure(tmp_path):
    class Explode:
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("boom")

    teardown = SaveFinalTeardown()
    loop = Loop(model=model(), args=loop_args(tmp_path), train_dataset=indexed_data(), teardown=teardown,
                callbacks=[Explode()])
    with pytest.raises(RuntimeError, match="boom"):
        loop.train()
    assert teardown.releases == 1
    assert not os.path.exists(os.path.join(tmp_path, "final"))


# ---------------------------------------------------------------------------------------------------------------
# A stage that listens to events: progressive unfreezing in on_epoch_end
# ---------------------------------------------------------------------------------------------------------------
class UnfreezingStep(StepStage):
    """Unfreezes the bias at the end of the first epoch and hands it to the optimizer."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_epoch_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.calls.append(("stage", state.epoch, model.linear.bias.detach().clone(), optimizer is not None))
        if not model.linear.bias.requires_grad:
            model.linear.bias.requires_grad_(True)
            self.add_param_group([model.linear.bias])


def test_stage_event_method_is_called(tmp_path):
    step = UnfreezingStep()

    class Watch:
        def on_epoch_end(self, args, state, control, **kwargs):
            step.calls.append(("callback", state.epoch, None, None))

    network = model()
    initial = network.linear.bias.detach().clone()
    network.linear.bias.requires_grad_(False)
    loop = Loop(model=network, args=loop_args(tmp_path), train_dataset=indexed_data(), step=step, callbacks=[Watch()])
    loop.train()

    # Called once per epoch, before the callbacks, with HF's keyword arguments.
    assert [(who, epoch) for who, epoch, *_ in step.calls] == [("stage", 1.0), ("callback", 1.0), ("stage", 2.0),
                                                                ("callback", 2.0)]
    stage_calls = [call for call in step.calls if call[0] == "stage"]
    assert all(has_optimizer for *_, has_optimizer in stage_calls)
    assert torch.equal(stage_calls[0][2], initial)  # frozen through epoch 1
    assert not torch.equal(loop.model.linear.bias, initial)  # trained in epoch 2
    assert any(p is loop.model.linear.bias for g in loop.optimizer.param_groups for p in g["params"])
