"""GRPOLoop against TRL's GRPOTrainer, run live side by side: a tiny Llama generating with `model.generate`, prompts
from real Rotten Tomatoes reviews, two rule rewards. Completions and rewards equal call by call, every key TRL logs
within 1e-5 relative, final weights within 1e-5; with accumulation, with a generation spanning optimizer steps, and
resumed from a checkpoint (where loopkit is exact and TRL is not: see test_resume_between_generations)."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch

pytest.importorskip("trl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from helpers import minilm_tokenizer, rotten_tomatoes, tiny_llama  # noqa: E402
from loopkit.trl import GRPOLoop  # noqa: E402
from loopkit.stages.data import DataStage  # noqa: E402
from loopkit.trl.grpo import GRPOStep, RolloutDataStage  # noqa: E402

TIMING_KEYS = ("train_runtime", "eval_runtime", "step_time")
RTOL = 1e-5


def prompts(n: int = 8) -> Dataset:
    """The first five words of `n` reviews."""
    return Dataset.from_dict({"prompt": [" ".join(text.split()[:5]) for text, _ in rotten_tomatoes(n)]})


def rewards(record: list):
    """Two rule rewards (length, and whether the completion holds a "y"), each recording what it was given."""
    def length(prompts, completions, **kwargs):
        record.append(("length", list(prompts), list(completions)))
        return [len(c) / 20 for c in completions]

    def has_y(prompts, completions, **kwargs):
        values = [float("y" in c) for c in completions]
        record.append(("has_y", values))
        return values

    return [length, has_y]


def base_model(folder: str) -> str:
    """A tiny Llama saved to `folder` (a path: TRL loads its reference model from it when beta > 0)."""
    tok = minilm_tokenizer()
    tiny_llama(vocab_size=len(tok)).save_pretrained(folder)
    return folder


def tokenizer():
    tok = minilm_tokenizer()
    tok.eos_token = "[SEP]"
    return tok


def config(output_dir: str, **overrides) -> GRPOConfig:
    fields = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=3,
                  logging_steps=1, learning_rate=5e-2, beta=0.04, seed=0, report_to="none", disable_tqdm=True,
                  bf16=False, use_cpu=True, save_strategy="no")
    fields.update(overrides)
    return GRPOConfig(output_dir=output_dir, **fields)


def train(trainer_class, model_path: str, output_dir: str, resume=None, eval_dataset=None, **overrides):
    """One run: its log history, the reward calls' record and the final weights."""
    record = []
    trainer = trainer_class(model=model_path, reward_funcs=rewards(record), args=config(output_dir, **overrides),
                            train_dataset=prompts(), eval_dataset=eval_dataset, processing_class=tokenizer())
    trainer.train(resume_from_checkpoint=resume)
    weights = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
    return trainer.state.log_history, record, weights


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-8)


def assert_same_logs(ours: list, theirs: list, skip: tuple = ()) -> float:
    """Every entry and key equal within RTOL (timing keys and `skip` excepted); returns the largest relative
    difference."""
    assert len(ours) == len(theirs)
    worst = 0.0
    ignored = (*TIMING_KEYS, *skip)
    for mine, reference in zip(ours, theirs):
        keys = {k for k in reference if k not in ignored and not k.endswith("_per_second")}
        assert keys == {k for k in mine if k not in ignored and not k.endswith("_per_second")}
        for key in keys:
            a, b = mine[key], reference[key]
            if a is None or b is None or (isinstance(b, float) and math.isnan(b)):
                assert a == b or (math.isnan(a) and math.isnan(b)), key
                continue
            worst = max(worst, relative(float(a), float(b)))
            assert relative(float(a), float(b)) <= RTOL, (key, mine.get("step"), a, b)
    return worst


def assert_same_weights(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=RTOL, atol=RTOL, msg=name)


def both(model_path: str, **overrides):
    with tempfile.TemporaryDirectory() as out_trl, tempfile.TemporaryDirectory() as out_loop:
        theirs = train(GRPOTrainer, model_path, out_trl, **overrides)
        ours = train(GRPOLoop, model_path, out_loop, **overrides)
    return ours, theirs


@pytest.fixture(scope="module")
def model_path():
    with tempfile.TemporaryDirectory() as folder:
        yield base_model(folder)


def test_same_rollouts_logs_and_weights(model_path):
    """beta > 0 (the reference model and `kl`), one generation per optimizer step."""
    (logs, record, weights), (trl_logs, trl_record, trl_weights) = both(model_path)
    assert record == trl_record  # the same prompts, completions and rewards, call by call
    assert any(values for name, *rest in record if name == "has_y" for values in rest if any(values))
    assert {"kl", "entropy", "reward", "reward_std", "rewards/length/mean", "rewards/has_y/mean", "num_tokens",
            "completions/mean_length", "clip_ratio/region_mean"} <= set(trl_logs[0])
    assert_same_logs(logs, trl_logs)
    assert_same_weights(weights, trl_weights)


@pytest.mark.parametrize("overrides", [
    dict(gradient_accumulation_steps=2, max_steps=2),  # steps_per_generation = 2: one rollout per window
    dict(steps_per_generation=2, max_steps=4, loss_type="grpo", beta=0.0),  # a rollout spans two optimizer steps
], ids=["accumulation", "generation_spans_steps"])
def test_same_with_accumulation_and_generation_batches(model_path, overrides):
    (logs, record, weights), (trl_logs, trl_record, trl_weights) = both(model_path, **overrides)
    assert record == trl_record
    assert_same_logs(logs, trl_logs)
    assert_same_weights(weights, trl_weights)


def test_evaluation_during_training_matches_trl(model_path):
    """An evaluation at step 2 (TRL's eval sampler, rollouts and loss in eval mode): the eval rollouts and every
    `eval_*` key equal TRL's."""
    overrides = dict(max_steps=2, beta=0.0, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    with tempfile.TemporaryDirectory() as out_trl, tempfile.TemporaryDirectory() as out_loop:
        theirs = train(GRPOTrainer, model_path, out_trl, eval_dataset=prompts(4), **overrides)
        ours = train(GRPOLoop, model_path, out_loop, eval_dataset=prompts(4), **overrides)
    assert ours[1] == theirs[1]
    assert any("eval_reward" in entry for entry in theirs[0])
    assert_same_logs(ours[0], theirs[0])


def test_resume_between_generations(model_path):
    """A rollout serves two optimizer steps; the checkpoint after step 1 falls between them. loopkit's checkpoint
    holds the rollout and its position: the resumed run's logs and weights are the uninterrupted run's. TRL's holds
    neither: its resumed run generates anew and trains on the new rollout's first half, so its step 2 differs."""
    overrides = dict(steps_per_generation=2, max_steps=4, save_strategy="steps", save_steps=1, beta=0.0)
    with tempfile.TemporaryDirectory() as out:
        full = train(GRPOLoop, model_path, out, **overrides)
        resumed = train(GRPOLoop, model_path, out, resume=os.path.join(out, "checkpoint-1"), **overrides)
    # train_loss is the mean over the steps of one train() call (HF's), so a resumed run's is its own
    assert_same_logs(resumed[0], full[0], skip=("train_loss",))
    assert_same_weights(resumed[2], full[2])
    with tempfile.TemporaryDirectory() as out:
        trl_full = train(GRPOTrainer, model_path, out, **overrides)
        trl_resumed = train(GRPOTrainer, model_path, out, resume=os.path.join(out, "checkpoint-1"), **overrides)
    step_2, trl_step_2 = trl_full[0][1], trl_resumed[0][1]
    assert step_2["step"] == trl_step_2["step"] == 2
    assert "reward" not in step_2 and "reward" in trl_step_2  # TRL's resumed run generated again at step 2
    assert relative(trl_step_2["loss"], step_2["loss"]) > 1e-3
    assert max((trl_resumed[2][name] - trl_full[2][name]).abs().max() for name in trl_full[2]) > 1e-4


def test_resume_at_a_generation_boundary_matches_trl(model_path):
    """A checkpoint after a whole rollout: TRL's resume is exact too, and loopkit's resumed run equals it."""
    overrides = dict(max_steps=3, save_strategy="steps", save_steps=2)
    with tempfile.TemporaryDirectory() as out:
        train(GRPOTrainer, model_path, out, **overrides)
        trl_resumed = train(GRPOTrainer, model_path, out, resume=os.path.join(out, "checkpoint-2"), **overrides)
    with tempfile.TemporaryDirectory() as out:
        train(GRPOLoop, model_path, out, **overrides)
        resumed = train(GRPOLoop, model_path, out, resume=os.path.join(out, "checkpoint-2"), **overrides)
    assert resumed[1] == trl_resumed[1]
    assert_same_logs(resumed[0], trl_resumed[0])
    assert_same_weights(resumed[2], trl_resumed[2])


def test_stages_are_swappable(model_path):
    """A custom rollout post-processing and a custom loss are each one subclass, passed as data= / step=."""
    seen = {}

    class ClippedAdvantages(RolloutDataStage):
        def rollout(self, generation_batch):
            batch = super().rollout(generation_batch)
            batch["advantages"] = batch["advantages"].clamp(-1.0, 1.0)
            seen["rollouts"] = seen.get("rollouts", 0) + 1
            return batch

    class CountedLoss(GRPOStep):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen["losses"] = seen.get("losses", 0) + 1
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with tempfile.TemporaryDirectory() as out:
        loop = GRPOLoop(model=model_path, reward_funcs=rewards([]), args=config(out, max_steps=2, beta=0.0),
                        train_dataset=prompts(), processing_class=tokenizer(), data=ClippedAdvantages(),
                        step=CountedLoss())
        loop.train()
    assert seen == {"rollouts": 2, "losses": 2}
    with pytest.raises(ValueError, match="data.*RolloutDataStage"):
        GRPOLoop(model=model_path, reward_funcs=rewards([]), args=config(out, beta=0.0), train_dataset=prompts(),
                 processing_class=tokenizer(), data=DataStage())


def test_an_iterable_train_dataset_is_refused(model_path, tmp_path):
    stream = prompts(4).to_iterable_dataset()
    with pytest.raises(ValueError, match="train_dataset.*RepeatSampler"):
        GRPOLoop(model=model_path, reward_funcs=rewards([]), args=config(str(tmp_path), beta=0.0),
                 train_dataset=stream, processing_class=tokenizer())


def test_overriding_a_hook_the_run_does_not_call_is_refused():
    with pytest.raises(TypeError, match="_prepare_inputs.*RolloutDataStage"):
        class Mine(GRPOLoop):
            def _prepare_inputs(self, generation_batch):
                return generation_batch
    with pytest.raises(TypeError, match="defines rollout.*RolloutDataStage subclass.*data=YourStage"):
        class OnTheLoop(GRPOLoop):
            def rollout(self, generation_batch):
                return generation_batch


def test_example_script_runs_at_a_tiny_size():
    """examples/trl/grpo_reviews.py: one step, a reference model (beta > 0) and the clipped-advantage stage."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "trl",
                        "grpo_reviews.py")
    spec = importlib.util.spec_from_file_location("grpo_reviews", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with tempfile.TemporaryDirectory() as out:
        loop = example.main(["--output-dir", out, "--max-steps", "1", "--prompts", "4", "--num-generations", "2",
                             "--beta", "0.04", "--clip-advantages", "0.5"])
    assert type(loop.data).__name__ == "ClippedAdvantages"
    first = loop.state.log_history[0]
    assert {"kl", "reward", "rewards/length_reward/mean", "rewards/reuse_reward/mean"} <= set(first)


def test_the_docs_example_runs(tmp_path, monkeypatch):
    """docs/trl.md's GRPO block: a reward function and a RolloutDataStage subclass, two steps."""
    from test_docs import run_python_block

    monkeypatch.chdir(tmp_path)
    loop = run_python_block("docs/trl.md", "GRPOLoop(")["loop"]
    assert type(loop.data).__name__ == "ClippedAdvantages" and loop.state.global_step == 2
    assert "rewards/has_y/mean" in loop.state.log_history[0]


def test_two_processes_match_trl(forked, model_path, tmp_path):
    """GRPOTrainer and GRPOLoop each on 2 forked ranks (DDP, gloo), accumulation 2, beta > 0: rank 0's rollouts,
    every logged key and the final weights equal."""
    import json

    from safetensors.torch import load_file

    from helpers import wait_for

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "grpo_child.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", ACCELERATE_USE_CPU="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.path.dirname(os.path.abspath(__file__))]))
    results = {}
    for which in ("trl", "loopkit"):
        launch = forked.launch([script, tmp_path, which, model_path], 2, f"GRPO on 2 ranks ({which})", env=env)
        output = wait_for(launch, f"GRPO on 2 ranks ({which})")
        assert launch.returncode == 0, output[-6000:]
        with open(tmp_path / f"{which}.json") as f:
            results[which] = json.load(f), load_file(tmp_path / f"{which}.safetensors")
    (ours, our_weights), (theirs, their_weights) = results["loopkit"], results["trl"]
    assert ours["record"] == theirs["record"]
    assert_same_logs(ours["log_history"], theirs["log_history"])
    assert_same_weights(our_weights, their_weights)
