"""`SFTLoop` against TRL's `SFTTrainer`, run live side by side: the same tiny Llama (vocab = MiniLM's tokenizer), the
same real reviews, seed 0, fp32. Every mode of issue 42: plain text, prompt-completion (completion-only loss and
not), conversational messages with `assistant_only_loss`, `packing=True` (bfd: packed samples must not attend across
their boundaries), `max_length` truncation, `loss_type="dft"`, a LoRA adapter, gradient accumulation 2, an
evaluation set evaluated during training and after it, SFTConfig's own defaults on a CPU (bf16 autocast, gradient
checkpointing), and an exact resume. Every key TRL logs is compared (timings aside), and the final weights.

`SFTTrainer(` -> `SFTLoop(` is the only difference between the two runs of each test (`run` below).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from helpers import minilm_tokenizer, rotten_tomatoes, tiny_llama
from loopkit.trl import SFTLoop

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

RTOL = 1e-5

# A small chat template with TRL's `{% generation %}` markers around the assistant's turns, which
# `assistant_only_loss=True` needs (MiniLM's tokenizer has no template of its own).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] }} [SEP]{% endgeneration %}{% else %}{{ message['role'] }}: {{ message['content'] }} "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def chat_tokenizer():
    tokenizer = minilm_tokenizer()
    tokenizer.eos_token = "[SEP]"  # MiniLM's tokenizer has no eos token
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def reviews(form: str, n: int, skip: int = 0) -> Dataset:
    """`n` Rotten Tomatoes reviews (after the first `skip`) in one of TRL's dataset forms."""
    rows = rotten_tomatoes(skip + n)[skip:]
    if form == "text":
        return Dataset.from_dict({"text": [text for text, _ in rows]})
    if form == "prompt-completion":
        words = [text.split() for text, _ in rows]
        return Dataset.from_dict({"prompt": [" ".join(w[:4]) for w in words],
                                  "completion": [" ".join(w[4:]) for w in words]})
    assert form == "messages"
    return Dataset.from_dict({"messages": [
        [{"role": "user", "content": text}, {"role": "assistant", "content": "fresh" if label else "rotten"}]
        for text, label in rows]})


SFTCONFIG_DEFAULT = object()  # a field left to SFTConfig's own default


def sft_config(output_dir, **fields) -> SFTConfig:
    """fp32 on the CPU, seed 0, a log at every step; SFTConfig's own defaults otherwise, unless `fields` says."""
    defaults = dict(report_to="none", disable_tqdm=True, use_cpu=True, bf16=False, gradient_checkpointing=False,
                    seed=0, learning_rate=1e-2, max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                    save_strategy="no")
    given = {key: value for key, value in {**defaults, **fields}.items() if value is not SFTCONFIG_DEFAULT}
    return SFTConfig(output_dir=str(output_dir), **given)


class BatchRecorder:
    """What the model's forward receives at each training micro-batch: positions where a packed sample starts
    (`position_ids == 0`), rows, the longest row, label tokens and attended tokens; and whether the decoder layers
    ran under CPU autocast and with gradient checkpointing on."""

    def __init__(self, model):
        self.batches = []
        model.register_forward_pre_hook(self.record, with_kwargs=True)
        model.model.layers[0].register_forward_pre_hook(self.record_layer)

    def record_layer(self, layer, args):
        if layer.training and self.batches:
            self.batches[-1].update(autocast=torch.is_autocast_enabled("cpu"),
                                    checkpointing=layer.gradient_checkpointing)

    def record(self, module, args, kwargs):
        if module.training and "input_ids" in kwargs:
            ids, positions, labels = kwargs["input_ids"], kwargs.get("position_ids"), kwargs.get("labels")
            mask = kwargs.get("attention_mask")
            self.batches.append({
                "rows": ids.shape[0], "length": ids.shape[1],
                "starts": None if positions is None else int((positions == 0).sum()),
                "label_tokens": None if labels is None else int((labels != -100).sum()),
                "tokens": int(mask.sum()) if mask is not None else ids.numel()})


class CollatorRecorder:
    """TRL's collator, recording the columns each batch's examples hold and how many samples they carry (a packed
    row carries one per entry of its `seq_lengths`)."""

    def __init__(self, collator):
        self.collator, self.batches = collator, []

    def __call__(self, examples):
        self.batches.append({"columns": sorted(examples[0]), "samples": sum(
            len(example["seq_lengths"]) if "seq_lengths" in example else 1 for example in examples)})
        return self.collator(examples)


def tiny_mixtral(seed: int = 0, vocab_size: int = 64):
    """A 2-layer, 2-expert Mixtral returning its router logits: SFTTrainer adds its load-balancing loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, output_router_logits=True,
        router_aux_loss_coef=0.1))


def run(trainer_class, output_dir, form="text", n=16, eval_n=0, peft_config=None, resume=None, after=None,
        build_model=tiny_llama, **fields):
    """Build and train one runner (TRL's `SFTTrainer` or `SFTLoop`, the same arguments); its logs, final weights,
    the batches its model saw and, if `after` is given, `after(trainer)`."""
    tokenizer = chat_tokenizer()
    model = build_model(0, vocab_size=len(tokenizer))
    recorder = BatchRecorder(model)
    trainer = trainer_class(model=model, args=sft_config(output_dir, **fields), train_dataset=reviews(form, n),
                            eval_dataset=reviews(form, eval_n, skip=n) if eval_n else None,
                            processing_class=tokenizer, peft_config=peft_config)
    trainer.data_collator = collator = CollatorRecorder(trainer.data_collator)
    trainer.train(resume_from_checkpoint=resume)
    weights = {name: tensor.detach().clone() for name, tensor in trainer.model.state_dict().items()}
    extra = after(trainer) if after is not None else None
    return {"logs": trainer.state.log_history, "weights": weights, "batches": recorder.batches, "extra": extra,
            "trainer": trainer, "collated": collator.batches}


def timing(key: str) -> bool:
    return key.endswith("_runtime") or key.endswith("_per_second")


def compare_logs(actual: list[dict], expected: list[dict], what: str) -> float:
    """Every logged key of every entry (timings aside) within RTOL relative; returns the largest difference."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} log entries vs {len(expected)}"
    worst = 0.0
    for mine, theirs in zip(actual, expected):
        keys = {k for k in theirs if not timing(k)}
        assert {k for k in mine if not timing(k)} == keys, f"{what}: keys {sorted(mine)} vs TRL's {sorted(theirs)}"
        for key in keys:
            difference = abs(mine[key] - theirs[key]) / max(abs(theirs[key]), 1e-12)
            assert difference <= RTOL, f"{what}, step {theirs['step']}, {key}: {mine[key]!r} vs TRL's {theirs[key]!r}"
            worst = max(worst, difference)
    return worst


def compare_weights(actual: dict, expected: dict, what: str) -> float:
    assert actual.keys() == expected.keys(), what
    worst = 0.0
    for name, tensor in expected.items():
        scale = tensor.double().abs().max().clamp_min(1e-12)
        difference = ((actual[name].double() - tensor.double()).abs().max() / scale).item()
        assert difference <= RTOL, f"{what}: weight {name} differs by {difference:.3g} (relative to its largest)"
        worst = max(worst, difference)
    return worst


def both(tmp, **options):
    """TRL's run, then loopkit's, from the same arguments (each builds its own model and data)."""
    return run(SFTTrainer, os.path.join(tmp, "trl"), **options), run(SFTLoop, os.path.join(tmp, "loopkit"), **options)


def assert_same_run(trl_run, loop_run, what: str, keys=("loss", "grad_norm", "learning_rate", "entropy",
                                                        "mean_token_accuracy", "num_tokens")):
    for key in keys:  # the comparison covers what TRL logs in this mode
        assert any(key in entry for entry in trl_run["logs"]), f"{what}: TRL logged no {key}"
    worst = compare_logs(loop_run["logs"], trl_run["logs"], what)
    compare_weights(loop_run["weights"], trl_run["weights"], what)
    assert type(loop_run["trainer"]) is SFTLoop and loop_run["batches"] == trl_run["batches"], \
        f"{what}: the model saw other batches than under TRL"
    assert loop_run["collated"] == trl_run["collated"], f"{what}: the collator saw other examples than under TRL"
    return worst


# ---------------------------------------------------------------------------------------------------------------
# The modes
# ---------------------------------------------------------------------------------------------------------------
MODES = {
    "prompt-completion": dict(form="prompt-completion"),  # completion_only_loss=None: on for this form
    "prompt-completion-full-loss": dict(form="prompt-completion", completion_only_loss=False),
    "assistant-only": dict(form="messages", assistant_only_loss=True),
    "max-length": dict(form="text", max_length=12),
    "dft": dict(form="text", loss_type="dft"),
    "accumulation-2": dict(form="text", per_device_train_batch_size=2, gradient_accumulation_steps=2),
    # TRL divides the MoE auxiliary loss by the step's micro-batches (`current_gradient_accumulation_steps`)
    "moe-aux-loss-accumulation-2": dict(form="text", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                        build_model=tiny_mixtral),
}


def test_plain_text_logs_what_sfttrainer_logs():
    with tempfile.TemporaryDirectory() as tmp:
        trl_run, loop_run = both(tmp, form="text")
    assert_same_run(trl_run, loop_run, "text")
    assert any(entry.get("mean_token_accuracy", 0) > 0 for entry in trl_run["logs"])  # the comparison bites


# TRL's compute_loss is written for HF's loss-scaling rule under accumulation: no warning about it (loopkit/trl/base.py)
@pytest.mark.filterwarnings("error:compute_loss is overridden")
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_logs_what_sfttrainer_logs(mode):
    with tempfile.TemporaryDirectory() as tmp:
        trl_run, loop_run = both(tmp, **MODES[mode])
    assert_same_run(trl_run, loop_run, mode)
    batch = loop_run["batches"][0]
    if mode == "prompt-completion":  # the loss covers the completion only
        assert batch["label_tokens"] < batch["tokens"] - 4 * batch["rows"]
    if mode == "prompt-completion-full-loss":
        assert batch["label_tokens"] == batch["tokens"]
    if mode == "assistant-only":  # one word and [SEP] per conversation
        assert batch["label_tokens"] == 2 * batch["rows"]
    if mode == "moe-aux-loss-accumulation-2":
        assert all("aux_loss" in entry for entry in trl_run["logs"][:-1])
    if mode == "max-length":
        assert all(b["length"] <= 12 for b in loop_run["batches"])


def test_packing_keeps_seq_lengths_so_packed_samples_do_not_attend_across_boundaries():
    """bfd packing: TRL's dataset keeps each row's `seq_lengths`, from which its collator builds `position_ids`
    restarting at every packed sample (its attention never crosses one). loopkit's `remove_unused_columns` must keep
    that column: without it the collator marks one start per packed row."""
    with tempfile.TemporaryDirectory() as tmp:
        trl_run, loop_run = both(tmp, packing=True, max_length=48)
    collated = loop_run["collated"]
    assert all("seq_lengths" in batch["columns"] for batch in collated), collated[0]["columns"]
    # TRL's padding-free collator lays a batch's packed rows end to end, position_ids restarting at each sample
    # (the collator runs one batch ahead of the model, in TRL's trainer as here)
    starts = [b["starts"] for b in loop_run["batches"]]
    assert starts == [batch["samples"] for batch in collated][:len(starts)] and sum(starts) > 4 * len(starts), starts
    assert_same_run(trl_run, loop_run, "packing")


@pytest.mark.parametrize("packing", [False, True], ids=["plain", "packed"])
def test_loopkits_lm_head_scores_the_label_tokens_with_trls_numbers(packing, monkeypatch):
    """SFTLoop's fused LM head (loopkit/trl/fused.py) computes the log-probs, entropy and top-1 of the tokens whose
    label counts, where TRL's head on a CPU scores every position: SFTTrainer's logs and weights, and loopkit's head
    ran on every training micro-batch (TRL's trainer never reaches it)."""
    from loopkit.trl import fused

    scored = []
    original = fused.log_probs_and_metrics
    monkeypatch.setattr(fused, "log_probs_and_metrics",
                        lambda hidden, *rest, **options: scored.append(hidden.shape[0])
                        or original(hidden, *rest, **options))
    with tempfile.TemporaryDirectory() as tmp:
        trl_run = run(SFTTrainer, os.path.join(tmp, "trl"), packing=packing)
        assert scored == []
        loop_run = run(SFTLoop, os.path.join(tmp, "loopkit"), packing=packing)
    assert_same_run(trl_run, loop_run, "packed" if packing else "plain")
    batches = loop_run["batches"]
    assert len(scored) == len(batches) == 4
    for count, batch in zip(scored, batches):
        positions = batch["rows"] * (batch["length"] - 1)  # TRL's CPU head: logits for each of these
        assert 0 < count <= positions if packing else 0 < count < positions, (count, batch)


def test_lora_adapter_from_peft_config():
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    with tempfile.TemporaryDirectory() as tmp:
        trl_run, loop_run = both(tmp, peft_config=lora, after=lambda t: sorted(
            name for name, p in t.model.named_parameters() if p.requires_grad))
    assert loop_run["extra"] == trl_run["extra"] and all("lora_" in name for name in loop_run["extra"])
    assert_same_run(trl_run, loop_run, "LoRA")


def test_evaluation_during_and_after_training():
    """`eval_strategy="steps"` (steps 2 and 4): TRL logs eval_loss, eval_entropy, eval_mean_token_accuracy,
    eval_num_tokens; and
    `evaluate(raw_dataset)` after training, which TRL's `evaluate` tokenises first."""
    def evaluate_raw(trainer):
        return trainer.evaluate(reviews("text", 6, skip=40))

    with tempfile.TemporaryDirectory() as tmp:
        trl_run, loop_run = both(tmp, eval_n=8, eval_strategy="steps", eval_steps=2, after=evaluate_raw)
    evaluated = [entry for entry in trl_run["logs"] if "eval_loss" in entry]
    assert len(evaluated) == 3 and {"eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"} <= set(
        evaluated[0])
    assert_same_run(trl_run, loop_run, "evaluation")
    compare_logs([loop_run["extra"]], [trl_run["extra"]], "evaluate() after training")


def test_model_from_a_folder_and_named_eval_sets():
    """`model=` a folder (TRL loads it), and `eval_dataset` a dict of two sets in two forms (TRL prepares each and
    logs `eval_<name>_loss` beside its own `eval_entropy`, `eval_mean_token_accuracy`, `eval_num_tokens`)."""
    def train(trainer_class, folder, model_path):
        trainer = trainer_class(model=model_path, args=sft_config(folder, eval_strategy="steps", eval_steps=2),
                                train_dataset=reviews("text", 8), processing_class=chat_tokenizer(),
                                eval_dataset={"a": reviews("text", 4, skip=8),
                                              "b": reviews("prompt-completion", 4, skip=12)})
        trainer.train()
        return trainer.state.log_history, trainer.model.state_dict()

    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(0, vocab_size=len(chat_tokenizer())).save_pretrained(os.path.join(tmp, "model"))
        trl_logs, trl_weights = train(SFTTrainer, os.path.join(tmp, "trl"), os.path.join(tmp, "model"))
        loop_logs, loop_weights = train(SFTLoop, os.path.join(tmp, "loopkit"), os.path.join(tmp, "model"))
    assert {"eval_a_loss", "eval_b_loss"} <= {key for entry in trl_logs for key in entry}
    compare_logs(loop_logs, trl_logs, "named eval sets")
    compare_weights(loop_weights, trl_weights, "named eval sets")


def test_sftconfig_defaults_on_a_cpu_bf16_autocast_and_gradient_checkpointing():
    """SFTConfig's own defaults (use_cpu=True: bf16=True, gradient_checkpointing=True, learning_rate 2e-5) are
    taken by `Loop`'s construction checks and run as SFTTrainer runs them."""
    defaults = dict.fromkeys(("bf16", "gradient_checkpointing", "learning_rate"), SFTCONFIG_DEFAULT)
    with tempfile.TemporaryDirectory() as tmp:
        trl_run, loop_run = both(tmp, **defaults, after=lambda t: (t.args.bf16, t.args.learning_rate))
    assert trl_run["extra"] == (True, 2e-5)
    assert all(b["autocast"] and b["checkpointing"] for b in trl_run["batches"])
    assert_same_run(trl_run, loop_run, "SFTConfig's defaults")


# ---------------------------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------------------------
def test_resume_is_exact_where_sfttrainer_loses_its_token_count():
    """6 steps saved at 3, logged every 2: the run resumed from checkpoint-3 logs what the uninterrupted run logs
    (its summary's train_loss aside: the mean over the steps it ran, equal to TRL's resumed run's), `num_tokens`
    included (kept in loopkit's checkpoint) and step 4's averages over steps 3 and 4. TRL keeps
    `_total_train_tokens` and the metrics since the last log on the trainer object only: its resumed run counts
    tokens from zero again. Both numbers are checked here."""
    options = dict(n=32, max_steps=6, save_strategy="steps", save_steps=3, logging_steps=2)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, trainer_class in (("trl", SFTTrainer), ("loopkit", SFTLoop)):
            folder = os.path.join(tmp, name)
            runs[name] = run(trainer_class, folder, **options)
            runs[f"{name} resumed"] = run(trainer_class, folder, **options,
                                          resume=os.path.join(folder, "checkpoint-3"))
            assert os.path.exists(os.path.join(folder, "README.md"))  # TRL's model card, written at each save
    compare_logs(runs["loopkit"]["logs"], runs["trl"]["logs"], "uninterrupted")
    compare_weights(runs["loopkit"]["weights"], runs["trl"]["weights"], "uninterrupted")
    # train_loss is the mean over the steps this train() ran (4 to 6 when resumed), in TRL's trainer as here
    without_train_loss = [{k: v for k, v in entry.items() if k != "train_loss"} for entry in runs["loopkit"]["logs"]]
    resumed = runs["loopkit resumed"]["logs"]
    compare_logs([{k: v for k, v in entry.items() if k != "train_loss"} for entry in resumed], without_train_loss,
                 "resumed vs uninterrupted")
    compare_logs(resumed[-1:], runs["trl resumed"]["logs"][-1:], "resumed runs' summaries")
    compare_weights(runs["loopkit resumed"]["weights"], runs["loopkit"]["weights"], "resumed vs uninterrupted")

    def tokens(name):
        return [entry["num_tokens"] for entry in runs[name]["logs"] if "num_tokens" in entry]

    counted_before_checkpoint = sum(b["tokens"] for b in runs["trl"]["batches"][:3])
    assert tokens("loopkit resumed") == tokens("trl") == [133, 389, 645]
    assert tokens("trl resumed") == [133, 389 - counted_before_checkpoint, 645 - counted_before_checkpoint] == \
        [133, 132, 388]
    # step 4's accuracy: the mean over steps 3 and 4 uninterrupted and in SFTLoop's resumed run, over step 4 alone
    # in SFTTrainer's resumed run
    accuracy = {name: runs[name]["logs"][1]["mean_token_accuracy"] for name in runs}
    assert accuracy["loopkit resumed"] == accuracy["trl"] and abs(accuracy["trl resumed"] - accuracy["trl"]) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# Two processes
# ---------------------------------------------------------------------------------------------------------------
def test_two_processes_log_what_sfttrainer_logs_on_two_processes(tmp_path, forked):
    """DDP on 2 gloo CPU processes (forked ranks with torchrun's environment): on each rank, TRL's trainer and then
    `SFTLoop` (tests/scripts/trl_sft_ranks.py). TRL gathers entropy, accuracy and the token count over the ranks;
    the logs (rank 0 logs) and every rank's weights must match TRL's."""
    from safetensors.torch import load_file

    from helpers import wait_for

    script = os.path.join(os.path.dirname(__file__), "scripts", "trl_sft_ranks.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launch = forked.launch([script, tmp_path], 2, "the 2-process SFT launch", env=env)
    output = wait_for(launch, "the 2-process SFT launch")
    assert launch.returncode == 0, output[-4000:]
    import json

    def result(name, rank):
        with open(tmp_path / f"{name}_rank{rank}.json") as f:
            return {**json.load(f), "weights": load_file(str(tmp_path / f"{name}_rank{rank}.safetensors"))}

    for rank in (0, 1):
        trl_run, loop_run = result("trl", rank), result("loopkit", rank)
        assert trl_run["processes"] == loop_run["processes"] == 2
        assert loop_run["batches"] == trl_run["batches"], f"rank {rank}: other batches than under TRL"
        compare_weights(loop_run["weights"], trl_run["weights"], f"rank {rank}")
    trl_run, loop_run = result("trl", 0), result("loopkit", 0)
    compare_logs(loop_run["logs"], trl_run["logs"], "2 processes")
    assert [e["num_tokens"] for e in trl_run["logs"] if "num_tokens" in e][-1] == sum(  # both ranks' tokens
        b["tokens"] for rank in (0, 1) for b in result("trl", rank)["batches"])


# ---------------------------------------------------------------------------------------------------------------
# The example and the docs
# ---------------------------------------------------------------------------------------------------------------
def test_the_docs_example_runs(tmp_path, monkeypatch):
    """docs/trl.md's SFT block: prompt-completion reviews, two steps."""
    from test_docs import run_python_block

    monkeypatch.chdir(tmp_path)
    loop = run_python_block("docs/trl.md", "loop = SFTLoop(")["loop"]
    assert type(loop) is SFTLoop and loop.state.global_step == 2
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(loop.state.log_history[0])


def test_the_example_trains_a_conversation_at_a_tiny_size(capsys):
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "trl",
                        "sft_reviews.py")
    spec = importlib.util.spec_from_file_location("sft_reviews", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit):
        example.main(["--help"])
    assert "--form {text,prompt-completion,messages}" in capsys.readouterr().out
    with tempfile.TemporaryDirectory() as tmp:
        loop = example.main(["--form", "messages", "--steps", "2", "--samples", "16", "--max-length", "32",
                             "--output-dir", tmp])
        assert os.path.isdir(os.path.join(tmp, "checkpoint-2"))
    assert type(loop) is SFTLoop and loop.state.global_step == 2
    assert "SFTLoop: eval loss" in capsys.readouterr().out
