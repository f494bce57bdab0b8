"""transformers' example scripts as proof: tests/scripts/run_text_classification.py and tests/scripts/run_clm.py
(condensed from transformers' run_classification.py and run_clm.py) run end to end from command-line arguments on
local files, once as written (HF Trainer) and once with only the Trainer import line changed to loopkit's `Loop`.
Every result file is compared: equal metrics for text classification; for the causal LM the documented
difference (loopkit normalises GPT-2's training loss by the shifted label tokens, Trainer by all of them).
"""

import csv
import json
import math
import os
import types

import pytest
import torch

from test_trainer_api import assert_same_result_files
from helpers import IGNORE_PIN_MEMORY_WARNING, minilm_tokenizer, rotten_tomatoes

pytestmark = IGNORE_PIN_MEMORY_WARNING

HERE = os.path.dirname(__file__)
HF_IMPORT = "from transformers import Trainer\n"
LOOPKIT_IMPORT = "from loopkit import Loop as Trainer\n"


def load_script(name: str, use_loopkit: bool) -> types.ModuleType:
    """The script as a module, with the Trainer import line swapped for loopkit's when `use_loopkit`."""
    with open(os.path.join(HERE, "scripts", name)) as f:
        source = f.read()
    assert source.count(HF_IMPORT) == 1
    if use_loopkit:
        source = source.replace(HF_IMPORT, LOOPKIT_IMPORT)
    module = types.ModuleType(name[:-3])
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def run_both(script: str, tmp_path, argv: list[str]) -> dict:
    trainers = {}
    for name in ("hf", "loopkit"):
        module = load_script(script, use_loopkit=name == "loopkit")
        # the same folder name: the model card is named after it
        trainers[name] = module.main(argv + ["--output_dir", str(tmp_path / name / "output")])
    assert type(trainers["loopkit"]).__name__ == "Loop" and type(trainers["hf"]).__name__ == "Trainer"
    return trainers


def common_args(tmp_path, model_dir) -> list[str]:
    return ["--model_name_or_path", str(model_dir), "--cache_dir", str(tmp_path / "cache"), "--do_train",
            "--do_eval", "--report_to", "none", "--disable_tqdm", "true", "--seed", "7", "--logging_steps", "3",
            "--eval_strategy", "epoch", "--num_train_epochs", "2", "--learning_rate", "3e-3"]


def model_card_text(folder) -> list[str]:
    """The model card without its results table (timings) and its framework versions."""
    with open(os.path.join(folder, "README.md")) as f:
        return [line for line in f.read().splitlines() if "|" not in line and not line.startswith("- ")]


def test_text_classification_script(tmp_path):
    reviews = rotten_tomatoes(110)  # 64 train, 30 validation, 16 test: uneven last batches everywhere
    for split, rows in (("train", reviews[:64]), ("validation", reviews[64:94]), ("test", reviews[94:])):
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])
            writer.writerows(rows)
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = minilm_tokenizer()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")

    argv = common_args(tmp_path, tmp_path / "model") + [
        "--do_predict", "--train_file", str(tmp_path / "train.csv"), "--validation_file",
        str(tmp_path / "validation.csv"), "--test_file", str(tmp_path / "test.csv"), "--max_seq_length", "64",
        "--per_device_train_batch_size", "12", "--per_device_eval_batch_size", "8"]
    trainers = run_both("run_text_classification.py", tmp_path, argv)

    hf, lk = tmp_path / "hf" / "output", tmp_path / "loopkit" / "output"
    assert trainers["hf"].state.global_step == 12  # 64 samples in batches of 12: 6 steps an epoch, 2 epochs
    assert_same_result_files(lk, hf, rtol=1e-5)
    with open(hf / "predict_results.txt") as f:
        hf_predictions = f.read()
    with open(lk / "predict_results.txt") as f:
        assert f.read() == hf_predictions
    assert hf_predictions.count("\n") == 17
    assert model_card_text(lk) == model_card_text(hf)


def test_causal_lm_script(tmp_path):
    """GPT-2's loss: Trainer divides the summed token loss by all label tokens of the batch (loss_type is None for
    GPT2LMHeadModel), loopkit by the tokens the shifted loss actually predicts, in training and in evaluation
    (Trainer's prediction_step passes its count too). With blocks of T=32 tokens and no padding, Trainer's training
    loss, gradients (hence the pre-clip grad_norm) and eval_loss are (T-1)/T of loopkit's, and its perplexity is
    loopkit's to the power (T-1)/T. AdamW's updates hardly depend on the gradients' scale, so both train the same
    model: accuracy agrees, and every ratio holds to 1e-4."""
    reviews = rotten_tomatoes(120)
    for split, rows in (("train", reviews[:96]), ("validation", reviews[96:])):
        with open(tmp_path / f"{split}.txt", "w") as f:
            f.write("\n".join(text for text, _ in rows) + "\n")
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = minilm_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")

    block = 32
    argv = common_args(tmp_path, tmp_path / "model") + [
        "--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "validation.txt"),
        "--block_size", str(block), "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8"]
    trainers = run_both("run_clm.py", tmp_path, argv)

    hf, lk = tmp_path / "hf" / "output", tmp_path / "loopkit" / "output"
    assert trainers["hf"].state.global_step > 6
    shifted = block / (block - 1)  # loopkit / Trainer, for every quantity normalised by the label-token count
    assert_same_result_files(lk, hf, rtol=1e-4, expected_ratio={
        "train_loss": shifted, "loss": shifted, "grad_norm": shifted, "eval_loss": shifted},
        expected_log_ratio={"perplexity": shifted})
    # loopkit's is the right one: the mean loss over every predicted token of the eval set, computed here by hand.
    loop = trainers["loopkit"]
    data = loop.eval_dataset.with_format("torch")[:]  # every block: a dict of tensors
    with torch.no_grad():
        inputs = {k: data[k].to(loop.model.device) for k in ("input_ids", "attention_mask", "token_type_ids")}
        logits = loop.model(**inputs).logits[:, :-1].cpu()
        token_mean = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                                                       data["labels"][:, 1:].reshape(-1)).item()
    with open(lk / "eval_results.json") as f:
        results = json.load(f)
    assert results["eval_loss"] == pytest.approx(token_mean, rel=1e-5)
    assert results["perplexity"] == pytest.approx(math.exp(token_mean), rel=1e-4)
    assert model_card_text(lk) == model_card_text(hf)
