"""`RewardLoop` (loopkit/trl/reward.py) against TRL's `RewardTrainer`, both run live here on the same tiny reward model
(a 2-layer Llama with a one-output score head, tests/scripts/trl_reward_child.py), the real MiniLM tokenizer and
real Rotten Tomatoes reviews (chosen = a fresh review, rejected = a rotten one), seed 0, fp32: every key of every
`log_history` entry (the loss, `grad_norm`, `learning_rate`, TRL's `num_tokens`, `min/mean/max_reward`, `accuracy`,
`margin`, the `eval_*` keys, `train_loss`, `total_flos`; not the timings) within 1e-5 relative, the final weights
within 1e-5, `evaluate()`'s and `predict()`'s output; the three data formats, a `margin` column,
`center_rewards_coefficient`, gradient accumulation, a LoRA `peft_config`; an exact resume; 2 processes (an uneven
last batch in training and evaluation, and a plain `Loop`'s `gather_for_metrics` against `Trainer`'s); the example
script; a user's own reward loss (a `RewardStep` subclass's `reward_loss`) against a hand computation, and
docs/trl.md's block.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("trl")
from trl import RewardTrainer  # noqa: E402

from loopkit.trl import RewardLoop  # noqa: E402
from loopkit.trl.reward import RewardStep  # noqa: E402

from helpers import IGNORE_PIN_MEMORY_WARNING, assert_same_weights, wait_for  # noqa: E402

pytestmark = IGNORE_PIN_MEMORY_WARNING
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHILD_PATH = os.path.join(os.path.dirname(__file__), "scripts", "trl_reward_child.py")
_spec = importlib.util.spec_from_file_location("trl_reward_child", CHILD_PATH)
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)

TIMING_KEYS = ("train_runtime", "eval_runtime", "test_runtime", "eval_model_preparation_time")
RTOL = 1e-5


def comparable(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in TIMING_KEYS and not k.endswith("_per_second")}


def relative_difference(actual: float, expected: float) -> float:
    return abs(actual - expected) / max(abs(expected), 1e-12)


def assert_same_logs(actual: list[dict], expected: list[dict], what: str) -> float:
    """Every entry, every key (timings aside) within RTOL relative; returns the largest relative difference (and
    prints where it was)."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} log entries vs TRL's {len(expected)}"
    worst, where = 0.0, None
    for ours, theirs in zip(actual, expected):
        ours, theirs = comparable(ours), comparable(theirs)
        assert ours.keys() == theirs.keys(), f"{what}: keys {sorted(ours)} vs TRL's {sorted(theirs)}"
        for key, value in theirs.items():
            difference = relative_difference(ours[key], value)
            assert difference <= RTOL, (f"{what}, step {theirs.get('step')}, {key}: loopkit {ours[key]!r} vs TRL "
                                        f"{value!r}")
            if difference > worst:
                worst, where = difference, (theirs.get("step"), key)
    if where is not None:
        print(f"\n{what}: largest relative difference {worst:.3g} at (step, key) {where}")
    return worst


def run_both(train_dataset, eval_dataset=None, evaluate=None, peft=False, **config):
    """TRL's RewardTrainer, then RewardLoop (built and trained one after the other: both seed the global RNG);
    `evaluate`: a dataset (unprocessed, as a user passes it) for `evaluate()` after training, then `predict()`."""
    results, predictions = {}, {}
    for name, trainer_class in (("trl", RewardTrainer), ("loopkit", RewardLoop)):
        peft_config = None
        if peft:  # a fresh config per trainer: TRL's preparation may edit it
            from peft import LoraConfig
            peft_config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        with tempfile.TemporaryDirectory() as output_dir:
            trainer = child.train(trainer_class, output_dir, train_dataset, eval_dataset, peft_config=peft_config,
                                  **config)
            results[name] = trainer, trainer.evaluate(evaluate) if evaluate is not None else None
            if evaluate is not None:  # predict(): the rewards (chosen rows, then rejected rows) of each batch
                predictions[name] = trainer.predict(trainer.eval_dataset)
    return results, predictions


CASES = {
    # implicit prompt, an evaluation every 2 steps, evaluate() after training; 18 pairs at 4: an uneven last batch
    # and evaluate() of a raw dataset after training (RewardTrainer.evaluate prepares it)
    "implicit-eval": dict(data=dict(n=18), eval_data=dict(n=6, skip=18), evaluate=dict(n=5, skip=24),
                          config=dict(max_steps=5, eval_strategy="steps", eval_steps=2)),
    # explicit prompt with a margin column, 2 micro-batches per step (7 micro-batches: the last step has one)
    "explicit-margin-accumulation": dict(data=dict(n=14, form="explicit", margin=True),
                                         config=dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                                     max_steps=4)),
    # conversational (prompt and messages through the chat template), rewards centred
    "conversational-centred": dict(data=dict(n=12, form="conversational"),
                                   config=dict(center_rewards_coefficient=0.01, max_steps=3)),
    # TRL's `peft_config`: a LoRA adapter on the attention, the score head trained in full (PEFT's SEQ_CLS)
    "lora": dict(data=dict(n=8), peft=True, config=dict(max_steps=2, learning_rate=1e-2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_reward_loop_logs_and_weights_equal_reward_trainers(case):
    spec = CASES[case]
    eval_dataset = child.preference_pairs(**spec["eval_data"]) if "eval_data" in spec else None
    evaluate = child.preference_pairs(**spec["evaluate"]) if "evaluate" in spec else None
    results, predictions = run_both(child.preference_pairs(**spec["data"]), eval_dataset, evaluate,
                                    spec.get("peft", False), **spec["config"])
    (trl, trl_metrics), (loop, loop_metrics) = results["trl"], results["loopkit"]
    assert type(loop).__name__ == "RewardLoop" and isinstance(loop, RewardTrainer)
    if spec.get("peft"):
        assert any("lora_A" in name for name, _ in loop.model.named_parameters()), type(loop.model)
    worst = assert_same_logs(loop.state.log_history, trl.state.log_history, case)
    losses = [entry["loss"] for entry in trl.state.log_history if "loss" in entry]
    assert len(losses) == spec["config"]["max_steps"]
    assert {"num_tokens", "accuracy", "margin", "min_reward", "mean_reward", "max_reward"} <= set(
        trl.state.log_history[0])
    if trl_metrics is not None:
        assert "eval_loss" in trl_metrics and "eval_accuracy" in trl_metrics
        worst = max(worst, assert_same_logs([loop_metrics], [trl_metrics], f"{case} evaluate()"))
        ours, theirs = predictions["loopkit"], predictions["trl"]
        assert ours.label_ids == theirs.label_ids == ()  # Trainer's for a batch without label columns
        # Trainer's: 6 pairs at 4 a batch give 8 + 4 reward rows, but gather_for_metrics cuts the last batch to its
        # `remainder` (2) rows, as if each pair were one row: the last batch's rejected rewards are dropped. Mirrored.
        assert ours.predictions.shape == theirs.predictions.shape == (10, 1)
        torch.testing.assert_close(torch.as_tensor(ours.predictions), torch.as_tensor(theirs.predictions),
                                   rtol=RTOL, atol=1e-7)
        worst = max(worst, assert_same_logs([ours.metrics], [theirs.metrics], f"{case} predict()"))
    assert_same_weights(loop.model, trl.model, RTOL)
    print(f"\n{case}: largest relative difference over every logged key: {worst:.3g}")


def after_step(trainer, step: int) -> list[dict]:
    return [entry for entry in trainer.state.log_history if entry["step"] > step]


def run_and_resume(trainer_class, output_dir, pairs, resume_at: int, **config):
    """A whole run saving every `resume_at` steps, then a second run resumed from its first checkpoint."""
    whole = child.train(trainer_class, output_dir, pairs, save_strategy="steps", save_steps=resume_at, **config)
    checkpoint = os.path.join(output_dir, f"checkpoint-{resume_at}")
    resumed = child.train(trainer_class, output_dir, pairs, resume_from=checkpoint, save_strategy="no", **config)
    return whole, resumed


def test_resumed_reward_loop_continues_exactly_where_reward_trainers_running_metrics_restart():
    """Saved at step 2 of 6, logged at steps 3 and 6: the log at step 3 averages TRL's metrics over steps 1-3, two of
    them from before the checkpoint. loopkit checkpoints TRL's running metrics (and its running loss), so a resumed
    RewardLoop logs exactly what the uninterrupted run logs; RewardTrainer keeps neither, so its resumed `num_tokens`
    restarts from 0 and its step-3 averages cover step 3 only (both numbers asserted below)."""
    pairs = child.preference_pairs(16, "explicit")
    config = dict(max_steps=6, logging_steps=3)
    runs, model_cards = {}, {}
    for name, trainer_class in (("trl", RewardTrainer), ("loopkit", RewardLoop)):
        with tempfile.TemporaryDirectory() as output_dir:
            runs[name] = run_and_resume(trainer_class, output_dir, pairs, resume_at=2, **config)
            with open(os.path.join(output_dir, "README.md")) as f:  # written at each save (_save_checkpoint's)
                model_cards[name] = f.read().replace(os.path.basename(output_dir), "OUTPUT")
    assert "reward-trainer" in model_cards["trl"] and model_cards["loopkit"] == model_cards["trl"]
    (trl_whole, trl_resumed), (loop_whole, loop_resumed) = runs["trl"], runs["loopkit"]
    assert_same_logs(loop_whole.state.log_history, trl_whole.state.log_history, "uninterrupted")
    # train_loss covers the steps of this train() call (HF Trainer's rule, so TRL's): compared with TRL's resumed run
    resumed_logs, whole_logs = after_step(loop_resumed, 2), after_step(loop_whole, 2)
    assert_same_logs([{"train_loss": resumed_logs[-1].pop("train_loss")}],
                     [{"train_loss": after_step(trl_resumed, 2)[-1]["train_loss"]}], "resumed train_loss")
    whole_logs[-1] = {k: v for k, v in whole_logs[-1].items() if k != "train_loss"}
    worst = assert_same_logs(resumed_logs, whole_logs, "resumed vs uninterrupted")
    assert_same_weights(loop_resumed.model, loop_whole.model, RTOL)
    assert_same_weights(trl_resumed.model, trl_whole.model, RTOL)  # TRL's weights resume exactly too; its logs do not
    print(f"\nresumed RewardLoop vs uninterrupted: largest relative difference {worst:.3g}")

    whole_step3, resumed_step3 = after_step(trl_whole, 2)[0], after_step(trl_resumed, 2)[0]
    loop_step3 = after_step(loop_resumed, 2)[0]
    assert loop_step3["num_tokens"] == whole_step3["num_tokens"]
    assert resumed_step3["num_tokens"] < whole_step3["num_tokens"] / 2, (resumed_step3, whole_step3)
    assert resumed_step3["mean_reward"] != whole_step3["mean_reward"]  # TRL's average over step 3 alone
    print(f"num_tokens at step 3: uninterrupted {whole_step3['num_tokens']}, RewardLoop resumed "
          f"{loop_step3['num_tokens']}, RewardTrainer resumed {resumed_step3['num_tokens']}")
    for key in ("accuracy", "margin", "mean_reward"):
        print(f"{key} at step 3: uninterrupted {whole_step3[key]:.6g}, RewardLoop resumed {loop_step3[key]:.6g}, "
              f"RewardTrainer resumed {resumed_step3[key]:.6g}")


class HingeRewardStep(RewardStep):
    """A user's own reward loss, as docs/trl.md shows it: a hinge on the reward difference."""

    def reward_loss(self, rewards_chosen, rewards_rejected, margin):
        return torch.relu(1.0 - (rewards_chosen - rewards_rejected)).mean()


def hinge_loop(**kwargs) -> RewardLoop:
    """RewardLoop with the hinge step (a fresh stage for each loop), built as `child.train` builds a trainer."""
    return RewardLoop(step=HingeRewardStep(), **kwargs)


def test_a_reward_loss_of_ones_own_is_what_is_logged_evaluated_and_trained_on():
    """One SGD step on 4 pairs (one batch) with the hinge loss above, against the hand computation: each sequence's
    reward from an untouched copy of the model, unpadded, one at a time; the loss; its gradient; the SGD update."""
    pairs = child.preference_pairs(4)
    learning_rate = 0.5
    with tempfile.TemporaryDirectory() as output_dir:
        loop = child.train(hinge_loop, output_dir, pairs, eval_dataset=pairs, max_steps=1, optim="sgd",
                           learning_rate=learning_rate, lr_scheduler_type="constant", max_grad_norm=0.0)
        evaluated = loop.evaluate()["eval_loss"]
    assert type(loop.step) is HingeRewardStep
    by_hand = child.reward_model(child.reward_tokenizer())
    by_hand.config.pad_token_id = loop.model.config.pad_token_id

    def hinge_loss():
        def reward(ids):
            return by_hand(input_ids=torch.tensor([ids])).logits[0, 0]
        chosen = torch.stack([reward(ids) for ids in loop.train_dataset["chosen_ids"]])
        rejected = torch.stack([reward(ids) for ids in loop.train_dataset["rejected_ids"]])
        return torch.clamp(1.0 - (chosen - rejected), min=0.0).sum() / len(chosen)

    loss = hinge_loss()
    loss.backward()
    logged = loop.state.log_history[0]["loss"]
    assert abs(logged - loss.item()) <= RTOL * abs(loss.item()), (logged, loss.item())
    with torch.no_grad():
        for parameter in by_hand.parameters():
            parameter -= learning_rate * parameter.grad
        after_step = hinge_loss().item()
    assert_same_weights(loop.model, by_hand, RTOL)
    assert abs(evaluated - after_step) <= RTOL * abs(after_step), (evaluated, after_step)  # eval: the same loss
    assert abs(logged - child.LOG_2) > 0.01  # not RewardTrainer's loss, log 2 for near-equal rewards


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory, forked):
    """One launch of 2 forked ranks (torchrun's worker environment, CPU mode, gloo): RewardTrainer and RewardLoop
    on each scenario of the child script, one after the other in the same processes."""
    out = tmp_path_factory.mktemp("trl_reward_two_processes")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launch = forked.launch([CHILD_PATH, out], 2, "the 2-process reward launch", env=env)
    output = wait_for(launch, "the 2-process reward launch")
    assert launch.returncode == 0, f"the 2-process launch failed (rc {launch.returncode}):\n{output[-6000:]}"

    def result(scenario, name, rank=0):
        with open(os.path.join(out, f"{scenario}_{name}_rank{rank}.json")) as f:
            return json.load(f), load_file(os.path.join(out, f"{scenario}_{name}_rank{rank}.safetensors"))
    result.out = out
    return result


def assert_same_tensors(actual: dict, expected: dict, what: str):
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        scale = tensor.double().abs().max().clamp_min(1e-12)
        difference = ((actual[key].double() - tensor.double()).abs().max() / scale).item()
        assert difference <= RTOL, f"{what}: weight {key} differs by {difference:.3g} relative"


def test_two_processes_reward_loop_equals_reward_trainer_on_two_processes(two_process_runs):
    """2 ranks x 2 pairs x 2 micro-batches, a margin column, an uneven evaluation set (9 pairs at 4 a batch: the last
    batch holds 1 real pair): every logged key, evaluate() and the weights of every rank equal RewardTrainer's on the
    same 2 ranks."""
    (trl, trl_weights), (loop, loop_weights) = two_process_runs("even", "trl"), two_process_runs("even", "loopkit")
    worst = assert_same_logs(loop["log_history"], trl["log_history"], "2 processes")
    worst = max(worst, assert_same_logs([loop["evaluate"]], [trl["evaluate"]], "2 processes, evaluate()"))
    assert_same_tensors(loop_weights, trl_weights, "2 processes")
    assert_same_tensors(two_process_runs("even", "loopkit", rank=1)[1], loop_weights, "rank 1 vs rank 0")
    print(f"\n2 processes: largest relative difference over every logged key: {worst:.3g}")


def test_two_processes_short_last_batch_every_key_equal_trls_gathered_metrics_included(two_process_runs):
    """13 pairs on 2 ranks x 2: the epoch's last micro-batch holds 1 real pair (rank 0) and 3 that Accelerate repeats
    from the epoch's start. TRL's `num_tokens`, `accuracy` and `margin` go through `gather_for_metrics`, which keeps
    only the first `remainder` (= 1) of the per-rank values at that window (rank 0's) when Accelerate's state marks
    the loader's end: loopkit's data stage marks it as Trainer's loader does, so every logged key, evaluate() (9
    pairs: the same cut at its last batch) and the weights equal RewardTrainer's."""
    (trl, trl_weights), (loop, loop_weights) = two_process_runs("uneven", "trl"), two_process_runs("uneven", "loopkit")
    worst = assert_same_logs(loop["log_history"], trl["log_history"], "2 processes, uneven")
    worst = max(worst, assert_same_logs([loop["evaluate"]], [trl["evaluate"]], "2 processes, uneven, evaluate()"))
    assert_same_tensors(loop_weights, trl_weights, "2 processes, uneven")
    at_step_2 = [(e["num_tokens"], e["margin"]) for run in (loop, trl) for e in run["log_history"]
                 if e["step"] == 2 and "loss" in e]
    print(f"\nnum_tokens and margin at step 2 (the short micro-batch): RewardLoop {at_step_2[0]}, TRL {at_step_2[1]}; "
          f"largest relative difference over every logged key: {worst:.3g}")


def test_two_processes_plain_loop_gathers_for_metrics_as_trainer(two_process_runs):
    """transformers' Trainer and a plain Loop on 2 ranks, 13 training rows at 2 x 2 a micro-batch, 9 evaluation rows
    with `compute_metrics`: what `accelerator.gather_for_metrics` returns inside `compute_loss`, micro-batch by
    micro-batch, is the same, and is cut to the 1 real row (of 4 gathered) in the epoch's last window, as Trainer's
    prepared loader marks it; the logs and `evaluate()`'s metrics (9 rows) equal Trainer's."""
    def read(name):
        with open(os.path.join(two_process_runs.out, f"plain_{name}_rank0.json")) as f:
            return json.load(f)

    trainer, loop = read("trainer"), read("loop")
    assert loop["gathered"] == trainer["gathered"]
    rows_per_micro_batch = [len(rows) for rows, _ in trainer["gathered"]]
    assert rows_per_micro_batch == [4, 4, 1, 1], rows_per_micro_batch  # the last window: remainder 13 % 4 = 1
    assert [len(means) for _, means in trainer["gathered"]] == [2, 2, 1, 1]
    assert trainer["evaluate"]["eval_rows"] == 9
    assert_same_logs(loop["log_history"], trainer["log_history"], "2 processes, plain Loop vs Trainer")
    assert_same_logs([loop["evaluate"]], [trainer["evaluate"]], "2 processes, plain Loop vs Trainer, evaluate()")


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "trl",
                       "reward_reviews.py")
LOOPKIT_IMPORT = "    from loopkit.trl import RewardLoop\n"


def load_example(use_trl: bool):
    """examples/trl/reward_reviews.py as a module; `use_trl`: its one loopkit line swapped for TRL's trainer."""
    with open(EXAMPLE) as f:
        source = f.read()
    assert source.count(LOOPKIT_IMPORT) == 1
    if use_trl:
        source = source.replace(LOOPKIT_IMPORT, "    from trl import RewardTrainer as RewardLoop\n")
    module = type(sys)("reward_reviews")
    exec(compile(source, EXAMPLE, "exec"), module.__dict__)
    return module


def test_the_reward_example_runs_small_and_evaluates_as_on_trls_trainer(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_example(use_trl=False).main(["--help"])
    assert exit_info.value.code == 0 and "--max-steps" in capsys.readouterr().out
    results = {}
    for name in ("trl", "loopkit"):
        with tempfile.TemporaryDirectory() as output_dir:
            results[name] = load_example(use_trl=name == "trl").main(
                ["--pairs", "8", "--eval-pairs", "4", "--max-steps", "2", "--batch-size", "4", "--hidden-size", "16",
                 "--output-dir", output_dir])
    (trl, *trl_metrics), (loop, *loop_metrics) = results["trl"], results["loopkit"]
    assert type(loop).__name__ == "RewardLoop" and type(trl).__name__ == "RewardTrainer"
    assert_same_logs(loop_metrics, trl_metrics, "the example's evaluations before and after training")
    assert_same_logs(loop.state.log_history, trl.state.log_history, "the example's training logs")
    assert "held-out accuracy (chosen scored above rejected)" in capsys.readouterr().out


def test_the_reward_example_trains_its_hinge_step_with_loss_hinge():
    """`--loss hinge`: the example's RewardStep subclass trains. While every reward difference d is below 1 (a fresh
    model's are near 0), the hinge loss mean(relu(1 - d)) is 1 - mean(d), and TRL logs mean(d) as `margin` from the
    same forward pass; RewardTrainer's loss would be about log 2 there."""
    with tempfile.TemporaryDirectory() as output_dir:
        loop, _, _ = load_example(use_trl=False).main(
            ["--pairs", "8", "--eval-pairs", "4", "--max-steps", "1", "--batch-size", "8", "--hidden-size", "16",
             "--output-dir", output_dir, "--loss", "hinge"])
    assert type(loop).__name__ == "RewardLoop" and type(loop.step).__name__ == "HingeRewardStep"
    first = loop.state.log_history[0]
    assert abs(first["margin"]) < 0.5 and first["loss"] == pytest.approx(1.0 - first["margin"], rel=1e-5)
    assert abs(first["loss"] - child.LOG_2) > 0.1


def test_a_reward_loss_on_the_loop_or_a_step_of_another_kind_is_refused():
    from loopkit import LoopConfigError, StepStage

    with pytest.raises(TypeError, match="reward_loss.*RewardStep subclass.*step=YourStage"):
        class OnTheLoop(RewardLoop):
            def reward_loss(self, rewards_chosen, rewards_rejected, margin):
                return (rewards_rejected - rewards_chosen).mean()
    with tempfile.TemporaryDirectory() as output_dir:
        with pytest.raises(LoopConfigError, match="step='StepStage'.*RewardStep"):
            child.train(functools.partial(RewardLoop, step=StepStage()), output_dir, child.preference_pairs(4))


def test_the_docs_hinge_variant_trains_on_the_hinge_loss_checked_by_hand(tmp_path, monkeypatch):
    """docs/trl.md's reward variant, run as printed (from `pairs`, `model`, `tokenizer`), logs the losses of
    HingeRewardStep above, whose loss, update and eval_loss the hand computation checks."""
    from test_docs import python_block

    block = python_block("docs/trl.md", "class HingeRewardStep(RewardStep)")
    monkeypatch.chdir(tmp_path)
    pairs = child.preference_pairs(8)
    tokenizer = child.reward_tokenizer()
    namespace = {"pairs": pairs, "model": child.reward_model(tokenizer), "tokenizer": tokenizer}
    exec(block, namespace)
    documented = namespace["loop"]
    assert type(documented.step).__name__ == "HingeRewardStep" and documented.state.global_step == 2
    args = documented.args  # RewardConfig's defaults where the block sets nothing
    checked = child.train(hinge_loop, tmp_path / "checked", pairs, max_steps=2, seed=args.seed,
                          learning_rate=args.learning_rate, lr_scheduler_type=args.lr_scheduler_type)
    assert_same_weights(documented.model, checked.model, RTOL)
    losses = [run.state.log_history[-1]["train_loss"] for run in (documented, checked)]
    assert abs(losses[0] - losses[1]) <= RTOL * abs(losses[1]) and abs(losses[1] - child.LOG_2) > 0.01, losses
    assert os.path.isdir(tmp_path / "runs" / "hinge-reward")
