"""The recipes in examples/recipes/, each run at its tiny size, and a check that its technique had its effect.

Each test runs the recipe's own `main(tiny=True, ...)` (what `python <recipe>.py --tiny` runs) and then looks at
what the technique should have changed: logged statistics, the learning rate the optimizer used, which weights moved,
what the data loader served. Expected values are derived from the run itself (its logs, its recorded evaluations),
never copied from an earlier run. Torch runs single-threaded here: the machine's cores are shared.
"""

from __future__ import annotations

import glob
import math
import os
import statistics
import sys

import pytest
import torch

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "recipes")
sys.path.insert(0, RECIPES)

import common  # noqa: E402  (examples/recipes/common.py)




class WeightsPerStep:
    """Test callback: a copy of every parameter at each step's begin and end."""

    def __init__(self):
        self.before, self.changed = {}, {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.before = common.parameters_snapshot(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.changed[state.global_step] = any(not torch.equal(p, self.before[n]) for n, p in model.named_parameters())


# 1 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["stage", "callback"])
def test_gradient_monitoring_logs_attention_layers_every_n_steps(tmp_path, style):
    import gradient_monitoring as recipe
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    max_grad_norm = 1e-3  # clipping hard: statistics taken after clipping could not exceed this
    loop, monitor = recipe.main(tiny=True, output_dir=str(tmp_path), style=style, every_n_steps=3, max_steps=7,
                                max_grad_norm=max_grad_norm)
    layers = [f"bert.encoder.layer.{i}.attention" for i in range(len(common.encoder_layers(loop.model)))]
    assert monitor.computed_at_steps == [3, 6]  # the other steps paid nothing

    history = loop.state.log_history
    grad_logs = {h["step"]: h for h in history if f"grad_norm/{layers[0]}" in h}
    train_logs = {h["step"]: h for h in history if "loss" in h}
    assert sorted(grad_logs) == [3, 6]
    assert sorted(train_logs) == [3, 6]  # logging the statistics did not cancel the loop's own train log
    for step, logs in grad_logs.items():
        norms = [logs[f"grad_norm/{layer}"] for layer in layers]
        assert all(math.isfinite(n) and n > 0 for n in norms)
        assert all(0 < logs[f"grad_max/{layer}"] <= logs[f"grad_norm/{layer}"] for layer in layers)
        monitored = math.sqrt(sum(n * n for n in norms))
        assert max_grad_norm < monitored <= train_logs[step]["grad_norm"] * (1 + 1e-5)  # pre-clip, part of total

    runs = glob.glob(os.path.join(str(tmp_path), "runs", "*"))
    assert runs, "TensorBoard wrote no run folder"
    events = EventAccumulator(runs[0])
    events.Reload()
    tag = f"train/grad_norm/{layers[-1]}"
    assert tag in events.Tags()["scalars"]
    scalars = {e.step: e.value for e in events.Scalars(tag)}
    assert sorted(scalars) == [3, 6]
    assert scalars[6] == pytest.approx(grad_logs[6][f"grad_norm/{layers[-1]}"], rel=1e-5)


# 2 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["stage", "callback"])
def test_multitask_alpha_follows_the_sine_schedule(tmp_path, style):
    import multitask_loss as recipe

    loop, step = recipe.main(tiny=True, output_dir=str(tmp_path), style=style, max_steps=5)
    steps = [s for s, _, _, _ in step.history]
    alphas = [a for _, a, _, _ in step.history]
    assert steps == [0, 1, 2, 3, 4]
    assert alphas == pytest.approx([0.5 + 0.1 * math.sin(s / 100) for s in steps], abs=1e-12)
    assert len(set(alphas)) == len(alphas)  # it varies step to step

    # The loss the stage optimizes is main + alpha * aux, with the current alpha.
    batch = {k: v[:4] for k, v in loop.train_dataset.columns.items()}
    step.alpha = 0.7
    loss, outputs = step.compute_loss(loop.model, dict(batch), return_outputs=True)
    assert loss.item() == pytest.approx((outputs["main_loss"] + 0.7 * outputs["aux_loss"]).item(), rel=1e-6)


# 3 ---------------------------------------------------------------------------------------------------------------
def test_composite_loss_terms_follow_the_configured_coefficients(tmp_path):
    import composite_loss as recipe
    from loopkit import Loop

    config_file = tmp_path / "loss.json"
    config_file.write_text('{"l2": 0.5, "margin": 2.0, "margin_weight": 0.25}')
    config = recipe.LossConfig.from_json(str(config_file))
    assert config == recipe.LossConfig(l2=0.5, margin=2.0, margin_weight=0.25)
    (tmp_path / "bad.json").write_text('{"l2": 0.5, "lambda": 1}')
    with pytest.raises(ValueError, match="lambda"):
        recipe.LossConfig.from_json(str(tmp_path / "bad.json"))

    loop, _ = recipe.main(tiny=True, output_dir=str(tmp_path / "run"), config=config, max_steps=2)
    model = loop.model.eval()
    batch = {k: v[:8] for k, v in loop.train_dataset.columns.items()}

    def stage_loss(**coefficients):
        loop.step.config = recipe.LossConfig(**coefficients)
        return loop.compute_loss(model, dict(batch)).item()

    squared_weights = sum(p.pow(2).sum() for p in model.parameters() if p.requires_grad).item()
    base = stage_loss(l2=0.0, margin=2.0, margin_weight=0.0)
    assert stage_loss(l2=0.5, margin=2.0, margin_weight=0.0) - base == pytest.approx(0.5 * squared_weights, rel=1e-4)
    with torch.no_grad():
        hinge = recipe.margin_hinge(model(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                                    batch["labels"], 2.0).item()
    assert hinge > 0
    assert stage_loss(l2=0.0, margin=2.0, margin_weight=0.25) - base == pytest.approx(0.25 * hinge, rel=1e-4)

    # The compute_loss_func style computes the same number from the same configuration.
    function_loop = Loop(model=model, args=loop.args, compute_loss_func=recipe.composite_loss_func(model, config))
    assert function_loop.compute_loss(model, dict(batch)).item() == pytest.approx(
        stage_loss(l2=0.5, margin=2.0, margin_weight=0.25), rel=1e-6)


# 4 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["callback", "stage"])
def test_learning_rate_used_by_the_optimizer_follows_the_cosine(tmp_path, style):
    import cosine_lr_callback as recipe

    used = []

    class LearningRateUsed:
        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            used.append((state.global_step, [group["lr"] for group in optimizer.param_groups]))

    max_steps, min_fraction = 6, 0.1
    loop = recipe.main(tiny=True, output_dir=str(tmp_path), style=style, max_steps=max_steps,
                       min_lr_fraction=min_fraction, callbacks=[LearningRateUsed()])
    base = loop.args.learning_rate
    assert [step for step, _ in used] == list(range(max_steps))
    for step, group_lrs in used:
        expected = base * min_fraction + (base - base * min_fraction) * 0.5 * (1 + math.cos(math.pi * step / max_steps))
        assert group_lrs == pytest.approx([expected] * len(group_lrs), rel=1e-9)
    assert used[0][1][0] > used[-1][1][0]


# 5 ---------------------------------------------------------------------------------------------------------------
def test_early_stopping_stops_at_the_step_its_rule_gives(tmp_path):
    import early_stopping as recipe

    patience, min_relative = 2, 0.05
    loop, _ = recipe.main(tiny=True, output_dir=str(tmp_path), patience=patience,
                          min_relative_improvement=min_relative, eval_steps=2, num_train_epochs=3)
    evaluations = [(h["step"], h["eval_loss"]) for h in loop.state.log_history if "eval_loss" in h]

    # The rule, applied to the run's own evaluations: where should it have stopped?
    best, without_improvement, expected_stop = None, 0, None
    for step, value in evaluations:
        if best is not None:
            without_improvement = 0 if (best - value) / abs(best) > min_relative else without_improvement + 1
        best = value if best is None else min(best, value)
        if without_improvement >= patience:
            expected_stop = step
            break
    assert expected_stop is not None, f"the tiny run should plateau within 5%: {evaluations}"
    assert loop.state.global_step == expected_stop < loop.state.max_steps
    assert evaluations[-1][0] == expected_stop


# 6 ---------------------------------------------------------------------------------------------------------------
def expected_layers(epoch: int, num_layers: int = 4, top: int = 2) -> list[int]:
    return list(range(max(0, num_layers - top - epoch), num_layers))


def first_checkpoint(output_dir) -> str:
    return sorted(glob.glob(os.path.join(str(output_dir), "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[1]))[0]


def assert_same_weights(model, reference: dict) -> None:
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), reference[name], rtol=0, atol=1e-6, msg=name)


def test_progressive_unfreezing_updates_newly_unfrozen_layers(tmp_path):
    import progressive_unfreezing as recipe

    runs = {}
    for style, freeze_first in (("callback", False), ("stage", True)):
        # callback: frozen after the optimizer was built, so it holds every parameter;
        # stage: frozen before, so each unfrozen layer must be added to the optimizer (and the scheduler).
        loop, changes = recipe.main(tiny=True, output_dir=str(tmp_path / style), style=style,
                                    freeze_first=freeze_first, save_strategy="epoch")
        assert [c["layers"] for c in changes.changed_by_epoch] == [expected_layers(e) for e in range(3)], style
        assert not any(c["embeddings"] for c in changes.changed_by_epoch)
        runs[style] = (freeze_first, common.parameters_snapshot(loop.model))
        if style == "stage":
            assert len(loop.optimizer.param_groups) == 2 + 2  # decay / no-decay, then one group per added layer
            assert len(loop.lr_scheduler.base_lrs) == len(loop.optimizer.param_groups)

    # The pitfall the stage avoids: requires_grad alone, on layers the optimizer never held, trains nothing.
    _, changes = recipe.main(tiny=True, output_dir=str(tmp_path / "pitfall"), style="callback", freeze_first=True)
    assert [c["layers"] for c in changes.changed_by_epoch] == [expected_layers(0)] * 3

    # Resumed after epoch 0: the right layers train, and each run ends exactly where its uninterrupted run did
    # (for the stage, the optimizer's added groups are rebuilt before the checkpoint's optimizer state loads).
    for style, (freeze_first, uninterrupted) in runs.items():
        loop, changes = recipe.main(tiny=True, output_dir=str(tmp_path / style), style=style,
                                    freeze_first=freeze_first,
                                    resume_from_checkpoint=first_checkpoint(tmp_path / style))
        assert [(c["epoch"], c["layers"]) for c in changes.changed_by_epoch] == \
            [(e, expected_layers(e)) for e in (1, 2)], style
        assert_same_weights(loop.model, uninterrupted)


# 7 ---------------------------------------------------------------------------------------------------------------
def test_lora_trains_only_adapters_and_reloads_them(tmp_path):
    import lora_peft as recipe

    loop, reloaded, adapter_dir = recipe.main(tiny=True, output_dir=str(tmp_path), max_steps=4)
    model = loop.model
    in_optimizer = {id(p) for group in loop.optimizer.param_groups for p in group["params"]}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n, p in model.named_parameters() if id(p) in in_optimizer} == trainable
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert sum(p.numel() for n, p in model.named_parameters() if n in trainable) < \
        0.02 * sum(p.numel() for p in model.parameters())

    # The adapters trained (lora_B starts at zero); the base weights did not move.
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    fresh = common.load_classifier(common.Size.tiny_run())
    fresh_query = fresh.bert.encoder.layer[0].attention.self.query.weight
    trained_query = model.base_model.model.bert.encoder.layer[0].attention.self.query.base_layer.weight
    assert torch.equal(fresh_query, trained_query)

    assert os.path.exists(os.path.join(adapter_dir, "adapter_model.safetensors"))
    assert not os.path.exists(os.path.join(adapter_dir, "model.safetensors"))  # adapters only, not the base
    dataset = loop.eval_dataset
    trained_logits = recipe.logits_of(model, dataset)
    torch.testing.assert_close(recipe.logits_of(reloaded, dataset), trained_logits, rtol=0, atol=1e-6)
    other_head = common.load_classifier(common.Size.tiny_run(), seed=1234)
    assert not torch.allclose(recipe.logits_of(other_head, dataset), trained_logits)  # the reload mattered


# 8 ---------------------------------------------------------------------------------------------------------------
def test_dpo_raises_the_policy_margin_over_the_frozen_reference(tmp_path):
    import dpo_preference as recipe

    loop, step, before, after, weights = recipe.main(tiny=True, output_dir=str(tmp_path))
    assert before["train"] == pytest.approx(0.0, abs=1e-4)  # policy == reference at the start
    assert after["train"] > before["train"]
    with torch.no_grad():  # the unweighted DPO loss over all training pairs fell below its starting value, log 2
        margins = recipe.dpo_margin(loop.model.eval(), step.reference, recipe.whole_batch(loop.train_dataset))
    assert (-torch.nn.functional.logsigmoid(step.beta * margins)).mean().item() < math.log(2)
    assert all(not p.requires_grad for p in step.reference.parameters())
    assert any(not torch.equal(p, r) for p, r in zip(loop.model.parameters(), step.reference.parameters()))
    # The reward model's weights are constants that vary by pair, with mean 1.
    assert weights.std() > 0 and weights.mean().item() == pytest.approx(1.0, rel=1e-5)
    assert not weights.requires_grad


def test_dpo_docstring_claim_reward_only_loss_cannot_train_the_policy():
    """The seed's loss: reward-model scores under no_grad. It has no graph back to any policy parameter."""
    import dpo_preference as recipe

    reward_model = recipe.BagOfWordsSentiment(common.tokenizer().vocab_size)
    pairs = recipe.preference_pairs(4)
    with torch.no_grad():
        chosen = reward_model(*recipe.bag_of_tokens(c for _, c, _ in pairs))
        rejected = reward_model(*recipe.bag_of_tokens(r for _, _, r in pairs))
    seed_loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
    assert not seed_loss.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        seed_loss.backward()


# 9 ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["stage", "callback"])
def test_class_weights_follow_validation_recall(tmp_path, style):
    import dynamic_class_weights as recipe

    loop, weights = recipe.main(tiny=True, output_dir=str(tmp_path), style=style, eval_steps=2, max_steps=6)
    evaluations = [h for h in loop.state.log_history if "eval_recall_0" in h]
    assert [s for s, _ in weights.history[1:]] == [h["step"] for h in evaluations] == [2, 4, 6]

    # Replay the update rule on the logged recalls, from the inverse-frequency start.
    labels = loop.train_dataset.columns["labels"]
    counts = torch.bincount(labels, minlength=2).float()
    expected = (1 / counts) * 2 / (1 / counts).sum()
    assert weights.history[0][1] == pytest.approx(expected.tolist(), rel=1e-6)
    for (_, recorded), logs in zip(weights.history[1:], evaluations):
        target = torch.tensor([1 - logs["eval_recall_0"] + weights.floor, 1 - logs["eval_recall_1"] + weights.floor])
        expected = weights.momentum * expected + (1 - weights.momentum) * target
        expected = expected * 2 / expected.sum()
        assert recorded == pytest.approx(expected.tolist(), rel=1e-6)
    assert weights.history[-1][1] != pytest.approx(weights.history[0][1])

    # The training loss is the cross-entropy weighted by the current weights.
    batch = {k: v[:8] for k, v in loop.train_dataset.columns.items()}
    model = loop.model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        loss = loop.compute_loss(model, dict(batch)).item()
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(
        logits, batch["labels"], weight=weights.weights).item(), rel=1e-5)


# 10 --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["stage", "callback"])
def test_curriculum_switches_the_data_each_phase(tmp_path, style):
    import curriculum as recipe

    loop, dataset = recipe.main(tiny=True, output_dir=str(tmp_path), style=style, epochs_per_phase=1, phases=3)
    n = len(dataset)
    served = dataset.served_phases
    assert len(served) == 3 * n
    assert [set(served[e * n:(e + 1) * n]) for e in range(3)] == [{0}, {1}, {2}]
    lengths = [max(len(text.split()) for text, _ in pool.rows) for pool in dataset.pools]
    assert lengths[0] < lengths[2]  # phase 0 really is the short reviews
    assert len([h for h in loop.state.log_history if "eval_loss" in h]) == 3


# 11 --------------------------------------------------------------------------------------------------------------
def test_hyperparameter_search_reports_the_best_trial(tmp_path):
    import hyperparameter_search as recipe

    best_params, best_value, trials, models = recipe.main(tiny=True, output_dir=str(tmp_path), n_trials=3,
                                                          use_optuna=False)
    assert len(trials) == 3
    assert best_value == min(value for _, value in trials)
    assert best_params == next(params for params, value in trials if value == best_value)
    assert len({params["learning_rate"] for params, _ in trials}) == 3
    # model_init ran once in the constructor and once per trial, each time a new model with the trial's dropout.
    assert len(models) == 1 + 3 and len({id(m) for m in models}) == 4
    assert [m.config.classifier_dropout for m in models[1:]] == [params["dropout"] for params, _ in trials]


def test_hyperparameter_search_uses_optuna_when_installed(tmp_path):
    pytest.importorskip("optuna", reason="optuna is optional; without it the recipe's random search runs")
    import hyperparameter_search as recipe

    best_params, best_value, trials, _ = recipe.main(tiny=True, output_dir=str(tmp_path), n_trials=2,
                                                     use_optuna=True)
    assert best_value == min(value for _, value in trials)


# 12 --------------------------------------------------------------------------------------------------------------
def test_spike_step_is_skipped_and_leaves_the_weights_unchanged(tmp_path):
    import spike_skipping_stage as recipe

    watched = WeightsPerStep()
    loop, step = recipe.main(tiny=True, output_dir=str(tmp_path / "skip"), spike_steps=(5,), max_steps=8,
                             callbacks=[watched])
    assert step.skipped_steps == [5]
    assert watched.changed == {s: s != 5 for s in range(1, 9)}
    norms = {h["step"]: h["grad_norm"] for h in loop.state.log_history if "grad_norm" in h}
    assert norms[5] > step.factor * statistics.median(norms[s] for s in (1, 2, 3, 4))  # the spike is in the logs

    # Without the skip (an infinite threshold) the same spike does move the weights.
    watched = WeightsPerStep()
    recipe.main(tiny=True, output_dir=str(tmp_path / "control"), max_steps=6, callbacks=[watched],
                step=recipe.WithInjectedSpikes((5,), factor=math.inf))
    assert watched.changed[5]


# 13 --------------------------------------------------------------------------------------------------------------
def test_weight_averaging_returns_the_best_checkpoints_average_judged_on_the_average(tmp_path):
    import weight_averaging as recipe
    from safetensors.torch import load_file

    from loopkit.averaging import averaged_weights

    loop, report = recipe.main(tiny=True, output_dir=str(tmp_path))
    best = report["best"]
    average, trained = averaged_weights(best), load_file(os.path.join(best, "model.safetensors"))
    # The model returned holds the best checkpoint's average, which differs from that step's trained weights.
    assert all(torch.equal(p, average[n]) for n, p in loop.model.named_parameters())
    assert any(not torch.equal(average[n], trained[n]) for n in average)
    # The evaluation logged at the best step was the average's (evaluated again here), not the trained weights';
    # and the best step is the one with the best logged accuracy (the first of equals).
    logged = {h["step"]: h for h in loop.state.log_history if "eval_accuracy" in h}
    best_step = int(best.rsplit("-", 1)[1])
    assert report["averaged"]["eval_loss"] == pytest.approx(logged[best_step]["eval_loss"], rel=1e-5)
    assert report["trained"]["eval_loss"] != pytest.approx(logged[best_step]["eval_loss"], rel=1e-5)
    accuracies = [h["eval_accuracy"] for h in logged.values()]
    assert best_step == min(s for s, h in logged.items() if h["eval_accuracy"] == max(accuracies))
