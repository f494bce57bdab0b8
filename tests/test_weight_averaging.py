"""Weight averaging (`Loop(..., averaging=EMA(...))`, loopkit/averaging.py): the average against one computed here
from the training weights of every step, evaluation and the best model on it, the checkpoint's two sets of weights,
resume bit for bit, the model's weights when train() returns, the refusals, and no host sync in the update."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from helpers import lm_data, regression_data, tiny_llama, tiny_regression, wait_for
from loopkit import EMA, SWA, Loop, LoopArgs, LoopConfigError
from loopkit.averaging import averaged_weights

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
from averaging_child import StopAt  # noqa: E402  (the DDP child's: a run stopped after a step)

STEPS, SAVE_EVERY = 8, 4


class TrainingWeights(TrainerCallback):
    """The training weights after every optimizer step, and the weights the model holds at each evaluation."""

    def __init__(self):
        self.after_step, self.evaluated = {}, {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after_step[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.evaluated[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}


def regression_loop(out, averaging, callbacks=(), compute_metrics=None, **fields) -> Loop:
    fields = {**dict(max_steps=STEPS, per_device_train_batch_size=4, learning_rate=0.1, optim="sgd",
                     save_steps=SAVE_EVERY, eval_strategy="steps", eval_steps=2, report_to="none",
                     disable_tqdm=True, log_level="error"), **fields}
    return Loop(tiny_regression(), LoopArgs(output_dir=str(out), **fields), train_dataset=regression_data(64),
                eval_dataset=regression_data(16, seed=1), callbacks=list(callbacks), compute_metrics=compute_metrics,
                averaging=averaging)


def expected_ema(after_step: dict, decay: float, start_step: int = 0) -> dict:
    """The EMA of the training weights, step by step, in float64: the first update copies."""
    average = None
    for step in sorted(after_step):
        if step <= start_step:
            continue
        weights = {n: w.double() for n, w in after_step[step].items()}
        average = weights if average is None else {n: decay * average[n] + (1 - decay) * weights[n] for n in weights}
        yield step, average


def assert_weights(actual: dict, expected: dict, what: str, exact: bool = False):
    assert actual.keys() == expected.keys(), what
    for name in expected:
        if exact:
            assert torch.equal(actual[name], expected[name]), f"{what}: {name}"
        else:
            torch.testing.assert_close(actual[name].double(), expected[name].double(), rtol=1e-6, atol=1e-7,
                                       msg=f"{what}: {name}")


def test_ema_is_evaluated_checkpointed_beside_the_training_weights_and_kept_at_the_end():
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryDirectory() as plain_out:
        watch = TrainingWeights()
        loop = regression_loop(out, EMA(decay=0.6), [watch])
        loop.train()
        ema = dict(expected_ema(watch.after_step, 0.6))
        assert sorted(ema) == list(range(1, STEPS + 1))
        # Each evaluation (steps 2, 4, 6, 8) ran on the average of that step; the metric is the average's.
        assert sorted(watch.evaluated) == [2, 4, 6, 8]
        for step, weights in watch.evaluated.items():
            assert_weights(weights, ema[step], f"weights evaluated at step {step}")
            assert not torch.equal(weights["linear.weight"], watch.after_step[step]["linear.weight"])
        # Training is untouched: the training weights equal those of a run without averaging, bit for bit.
        plain_watch = TrainingWeights()
        regression_loop(plain_out, None, [plain_watch]).train()
        for step in range(1, STEPS + 1):
            assert_weights(watch.after_step[step], plain_watch.after_step[step], f"step {step}", exact=True)
        # Each checkpoint: the training weights in model.safetensors, the average in the stage-tensor file.
        for step in (4, 8):
            folder = os.path.join(out, f"checkpoint-{step}")
            assert_weights(load_file(os.path.join(folder, "model.safetensors")), watch.after_step[step],
                           f"checkpoint-{step} model", exact=True)
            assert_weights(averaged_weights(folder), ema[step], f"checkpoint-{step} average")
        # train() returns a model holding the final average (no load_best_model_at_end).
        assert_weights(dict(loop.model.named_parameters()), ema[STEPS], "the model after train()")
        # Outside train() the model is evaluated as it is: evaluate() gives the last evaluation's loss again.
        last_evaluation = [h for h in loop.state.log_history if "eval_loss" in h][-1]
        assert last_evaluation["step"] == STEPS
        assert loop.evaluate()["eval_loss"] == pytest.approx(last_evaluation["eval_loss"], rel=1e-6)


def scripted_scores(*scores):
    """`compute_metrics` giving `score` = the next of `scores` at each evaluation, whatever the weights: it makes
    one evaluation the best (greater is better)."""
    remaining = list(scores)
    return lambda prediction: {"score": remaining.pop(0)}


def best_model_run(out, averaging, watch, scores) -> Loop:
    return regression_loop(out, averaging, [watch], compute_metrics=scripted_scores(*scores), eval_steps=SAVE_EVERY,
                           load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True)


def test_the_best_model_is_the_average_of_the_best_step():
    with tempfile.TemporaryDirectory() as out:
        watch = TrainingWeights()
        loop = best_model_run(out, EMA(decay=0.6), watch, scores=(1.0, 0.0))  # step 4 the best, step 8 not
        loop.train()
        assert loop.state.best_model_checkpoint == os.path.join(out, "checkpoint-4")
        ema = dict(expected_ema(watch.after_step, 0.6))
        # The average evaluated at step 4, not the training weights that teardown loaded first, nor the last average.
        model = dict(loop.model.named_parameters())
        assert_weights(model, ema[4], "the best model")
        assert_weights(model, averaged_weights(os.path.join(out, "checkpoint-4")), "the best model", exact=True)
        assert not torch.equal(model["linear.weight"], watch.after_step[4]["linear.weight"])
        assert not torch.equal(model["linear.weight"], ema[STEPS]["linear.weight"].float())


def test_a_best_model_chosen_before_the_first_update_keeps_its_training_weights():
    """With start_step=4 the step-4 evaluation is on the training weights (no average yet): those are the best."""
    with tempfile.TemporaryDirectory() as out:
        watch = TrainingWeights()
        loop = best_model_run(out, EMA(decay=0.6, start_step=4), watch, scores=(1.0, 0.0))
        loop.train()
        assert averaged_weights(os.path.join(out, "checkpoint-4")) is None
        assert_weights(watch.evaluated[4], watch.after_step[4], "evaluated at step 4", exact=True)
        assert_weights(dict(loop.model.named_parameters()), watch.after_step[4], "the best model", exact=True)
        ema = dict(expected_ema(watch.after_step, 0.6, start_step=4))
        assert sorted(ema) == [5, 6, 7, 8]
        assert_weights(watch.evaluated[8], ema[8], "evaluated at step 8")


@pytest.mark.parametrize("make", [lambda: EMA(decay=0.75, every_n_steps=2), lambda: SWA(start_step=2)],
                         ids=["EMA-every-2", "SWA-from-2"])
def test_resume_gives_the_uninterrupted_training_and_averaged_weights_bit_for_bit(make):
    with tempfile.TemporaryDirectory() as whole, tempfile.TemporaryDirectory() as resumed:
        uninterrupted = regression_loop(whole, make())
        uninterrupted.train()
        # The same run stopped after step 4 (its checkpoint), then resumed from it by a new Loop.
        regression_loop(resumed, make(), callbacks=[StopAt(SAVE_EVERY)]).train()
        assert "checkpoint-4" in os.listdir(resumed) and "checkpoint-8" not in os.listdir(resumed)
        again = regression_loop(resumed, make())
        again.train(resume_from_checkpoint=os.path.join(resumed, "checkpoint-4"))
        for step in (4, 8):
            a, b = (os.path.join(folder, f"checkpoint-{step}") for folder in (whole, resumed))
            assert_weights(load_file(os.path.join(b, "model.safetensors")),
                           load_file(os.path.join(a, "model.safetensors")), f"step {step} model", exact=True)
            assert_weights(averaged_weights(b), averaged_weights(a), f"step {step} average", exact=True)
        assert_weights(dict(again.model.named_parameters()), dict(uninterrupted.model.named_parameters()),
                       "the model after train()", exact=True)
        evaluations = [[h["eval_loss"] for h in loop.state.log_history if "eval_loss" in h]
                       for loop in (again, uninterrupted)]
        assert evaluations[0] == evaluations[1] and len(evaluations[0]) == STEPS // 2


def test_a_checkpoint_with_an_average_resumed_without_averaging_says_so():
    with tempfile.TemporaryDirectory() as out:
        regression_loop(out, EMA(decay=0.9), max_steps=SAVE_EVERY, eval_strategy="no").train()
        with pytest.warns(UserWarning, match="holds averaged weights, and this Loop has no averaging=: .* Pass the"):
            regression_loop(out, None, max_steps=SAVE_EVERY + 1, eval_strategy="no", save_strategy="no").train(
                resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE_EVERY}"))


def test_swa_is_the_mean_of_the_training_weights_since_its_start():
    with tempfile.TemporaryDirectory() as out:
        watch = TrainingWeights()
        loop = regression_loop(out, SWA(start_step=3, every_n_steps=2), [watch])
        loop.train()
        averaged_steps = [5, 7]  # after step 3, every 2 steps
        mean = {n: sum(watch.after_step[s][n].double() for s in averaged_steps) / 2 for n in watch.after_step[8]}
        assert_weights(dict(loop.model.named_parameters()), mean, "the model after train()")
        assert_weights(averaged_weights(os.path.join(out, "checkpoint-8")), mean, "checkpoint-8's average")
        # Before the first update (step 5) evaluations ran on the training weights.
        assert_weights(watch.evaluated[2], watch.after_step[2], "evaluated at step 2", exact=True)


def test_accumulation_updates_once_per_optimizer_step_and_only_the_trained_parameters():
    """A causal LM with its embeddings frozen and 2 micro-batches per step: the average covers the parameters the
    optimizer updates, and moves once per optimizer step."""
    with tempfile.TemporaryDirectory() as out:
        model = tiny_llama()
        model.model.embed_tokens.weight.requires_grad_(False)
        watch = TrainingWeights()
        args = LoopArgs(output_dir=out, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                        save_steps=3, report_to="none", disable_tqdm=True, log_level="error")
        loop = Loop(model, args, train_dataset=lm_data(16), callbacks=[watch], averaging=EMA(decay=0.5))
        loop.train()
        ema = dict(expected_ema(watch.after_step, 0.5))
        saved = averaged_weights(os.path.join(out, "checkpoint-3"))
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        assert set(saved) == trained and "model.embed_tokens.weight" not in trained
        assert_weights(saved, {n: ema[3][n] for n in trained}, "checkpoint-3's average")


@pytest.mark.parametrize("make, field, value", [
    (lambda: EMA(decay=1.0), "decay", 1.0), (lambda: EMA(decay=0), "decay", 0),
    (lambda: EMA(decay=-0.5), "decay", -0.5),
    (lambda: EMA(decay="0.99"), "decay", "0.99"), (lambda: EMA(decay=True), "decay", True),
    (lambda: EMA(start_step=-1), "start_step", -1), (lambda: SWA(every_n_steps=0), "every_n_steps", 0),
    (lambda: SWA(start_step=1.5), "start_step", 1.5),
])
def test_bad_values_are_refused_at_construction_naming_field_value_and_fix(make, field, value):
    with pytest.raises(LoopConfigError) as refused:
        make()
    assert str(refused.value).startswith(f"{field}={value!r}: ") and "Fix: " in str(refused.value)


def test_averaging_takes_only_a_weight_averaging_and_one_per_loop():
    with tempfile.TemporaryDirectory() as out:
        with pytest.raises(LoopConfigError, match=r"averaging=0\.999: .* Fix: pass loopkit\.EMA\(decay=0\.999\)"):
            regression_loop(out, 0.999)
        ema = EMA(decay=0.9)
        regression_loop(out, ema)
        with pytest.raises(LoopConfigError, match=r"averaging=EMA\(decay=0\.9, .*another Loop\. Fix: pass a new one"):
            regression_loop(out, ema)


def test_the_update_does_not_sync_the_host(monkeypatch):
    """The per-step update reads nothing back: `.item()`, `.cpu()`, `.tolist()`, `bool()` and `float()` of a tensor
    fail inside it."""
    with tempfile.TemporaryDirectory() as out:
        ema = EMA(decay=0.9)
        loop = regression_loop(out, ema, max_steps=1, eval_strategy="no", save_strategy="no")
        loop.train()  # binds the parameters

        def refuse(*args, **kwargs):
            raise AssertionError("host sync in the averaging update")

        for name in ("item", "cpu", "tolist", "__bool__", "__float__", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, refuse)
        state = loop.state
        for step in (2, 3):
            state.global_step = step
            ema.on_step_end(loop.args, state, loop.control)
        monkeypatch.undo()
        assert ema.updates == 3


def test_an_evaluation_that_raises_during_training_leaves_the_training_weights_in_the_model():
    def fails_at_step_4(prediction, calls=[]):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("metric failed")
        return {}

    with tempfile.TemporaryDirectory() as out:
        watch = TrainingWeights()
        loop = regression_loop(out, EMA(decay=0.6), [watch], compute_metrics=fails_at_step_4)
        with pytest.raises(RuntimeError, match="metric failed"):
            loop.train()
        assert max(watch.after_step) == 4
        assert_weights(dict(loop.model.named_parameters()), watch.after_step[4], "the model", exact=True)


def test_ddp_ranks_keep_the_same_average_and_resume_it_bit_for_bit(forked):
    """2 gloo processes (what `torchrun --nproc_per_node 2` starts, forked: helpers.ForkServer.launch), each running
    tests/scripts/averaging_child.py: an EMA run uninterrupted, and the same run stopped after its step-4 checkpoint
    and resumed from it. Each rank checkpoints its own copy of the average (loopkit_tensors_<rank>.safetensors)."""
    with tempfile.TemporaryDirectory() as out:
        script = os.path.join(os.path.dirname(__file__), "scripts", "averaging_child.py")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
        env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                   PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        launch = forked.launch([script, out], 2, "the 2-process averaging launch", env=env)
        output = wait_for(launch, "the 2-process averaging launch")
        assert launch.returncode == 0, output[-3000:]
        for step in (4, 8):
            whole, resumed = (os.path.join(out, run, f"checkpoint-{step}") for run in ("whole", "resumed"))
            assert {"loopkit_tensors_0.safetensors", "loopkit_tensors_1.safetensors"} <= set(os.listdir(whole))
            assert_weights(load_file(os.path.join(resumed, "model.safetensors")),
                           load_file(os.path.join(whole, "model.safetensors")), f"step {step} model", exact=True)
            averages = [averaged_weights(folder, 2, rank) for folder in (whole, resumed) for rank in (0, 1)]
            for other in averages[1:]:
                assert_weights(other, averages[0], f"step {step}: each rank's average, whole and resumed", exact=True)
            assert not torch.equal(averages[0]["linear.weight"],
                                   load_file(os.path.join(whole, "model.safetensors"))["linear.weight"])
        finals = [load_file(os.path.join(out, f"{run}_rank{rank}.safetensors")) for run in ("whole", "resumed")
                  for rank in (0, 1)]
        for final in finals:
            assert_weights(final, averaged_weights(os.path.join(out, "whole", "checkpoint-8"), 2, 0),
                           "the model after train(): the final average", exact=True)
        # Resumed by another number of processes, the average is refused (each process checkpointed its own).
        with pytest.raises(RuntimeError, match="another number of processes"):
            regression_loop(os.path.join(out, "one"), EMA(decay=0.75)).train(
                resume_from_checkpoint=os.path.join(out, "whole", "checkpoint-4"))


def test_the_docs_example_returns_the_best_checkpoints_average():
    """docs/weight-averaging.md's example (it asserts the model returned holds checkpoint-4's average)."""
    from test_docs import run_python_block

    namespace = run_python_block("docs/weight-averaging.md", "averaged_weights(best)")
    assert namespace["loop"].state.best_global_step == 4


@pytest.mark.parametrize("engine", ["FSDP", "DEEPSPEED"])
def test_an_engine_that_shards_the_parameters_is_refused_when_the_loop_is_built(engine):
    """The average is a whole copy of each process's parameters: under FSDP or DeepSpeed it is refused at the end of
    `Loop(...)` (its `on_init_end`), naming the engine and the fix. A launch is not needed to reach the check: the
    engine is what the run's accelerator reports, replaced here after a one-process Loop was built."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    with tempfile.TemporaryDirectory() as out:
        loop = Loop(model=tiny_regression(), args=LoopArgs(output_dir=out, report_to="none"),
                    train_dataset=regression_data(8), averaging=EMA(decay=0.9))  # one process: accepted
        loop.context.accelerator = SimpleNamespace(distributed_type=DistributedType[engine])
        with pytest.raises(LoopConfigError, match=f"averaging='under {engine}'.*Fix: train with DDP, or without averaging"):
            loop.context.events.fire("on_init_end")
