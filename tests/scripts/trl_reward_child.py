"""Reward modelling runs shared by tests/test_trl_reward.py and its 2-process launch: the tokenizer, the tiny reward
model, the Rotten Tomatoes preference pairs and one run of a trainer class (TRL's `RewardTrainer` or loopkit's
`RewardLoop`), built the same way for both.

Usage (under a launcher): python trl_reward_child.py OUT_DIR: for each of `LAUNCH_SCENARIOS`, TRL's RewardTrainer,
then RewardLoop, in the same processes, each writing `<scenario>_<trainer>_rank<r>.json` (log history, evaluate())
and `<scenario>_<trainer>_rank<r>.safetensors` (final weights); then `plain_gathers`: transformers' `Trainer` and a
plain `Loop`, each recording what `accelerator.gather_for_metrics` returns in its `compute_loss`, into
`plain_<trainer>_rank<r>.json`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForSequenceClassification

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers import minilm_tokenizer, rotten_tomatoes  # noqa: E402

# A small chat template (the MiniLM tokenizer has none) for the conversational format.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }} [SEP] {% endfor %}"
PROMPT = "Write a short review of the film."
LOG_2 = 0.6931471805599453  # RewardTrainer's loss when the chosen and rejected rewards are equal


def reward_tokenizer():
    """The real MiniLM WordPiece tokenizer, with `[SEP]` as its end-of-sequence token and a chat template."""
    tokenizer = minilm_tokenizer()
    tokenizer.eos_token = "[SEP]"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def reward_model(tokenizer, seed: int = 0) -> LlamaForSequenceClassification:
    """A 2-layer Llama (hidden 16) with a one-output score head: a reward model over the tokenizer's vocabulary."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         attention_dropout=0.0, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    return LlamaForSequenceClassification(config)


def preference_pairs(n: int, form: str = "implicit", margin: bool = False, skip: int = 0) -> Dataset:
    """`n` pairs of real reviews, chosen = a fresh one, rejected = a rotten one (after the first `skip` of each).
    `form`: "implicit" (chosen/rejected texts), "explicit" (a shared prompt column) or "conversational" (messages).
    `margin`: a `margin` column (how much longer, in hundreds of characters, the fresh review is than the rotten)."""
    rows = rotten_tomatoes(6 * (n + skip))
    fresh = [text for text, label in rows if label == 1][skip:skip + n]
    rotten = [text for text, label in rows if label == 0][skip:skip + n]
    assert len(fresh) == len(rotten) == n, "not enough reviews of each kind"
    if form == "implicit":
        columns = {"chosen": fresh, "rejected": rotten}
    elif form == "explicit":
        columns = {"prompt": [PROMPT + " "] * n, "chosen": fresh, "rejected": rotten}
    elif form == "conversational":
        def said(text):
            return [{"role": "assistant", "content": text}]
        columns = {"prompt": [[{"role": "user", "content": PROMPT}]] * n,
                   "chosen": [said(text) for text in fresh], "rejected": [said(text) for text in rotten]}
    else:
        raise ValueError(f"form={form!r}: implicit, explicit or conversational")
    if margin:
        columns["margin"] = [(len(f) - len(r)) / 100 for f, r in zip(fresh, rotten)]
    return Dataset.from_dict(columns)


def reward_config(output_dir, **overrides):
    from trl import RewardConfig

    fields = dict(output_dir=str(output_dir), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  max_steps=4, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True, seed=0, bf16=False, dataset_num_proc=None)
    fields.update(overrides)
    return RewardConfig(**fields)


def train(trainer_class, output_dir, train_dataset, eval_dataset=None, resume_from=None, peft_config=None, **config):
    """Build `trainer_class` on a fresh model and tokenizer and train it; returns the trainer."""
    tokenizer = reward_tokenizer()
    trainer = trainer_class(model=reward_model(tokenizer), args=reward_config(output_dir, **config),
                            train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
                            peft_config=peft_config)
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


# name -> pairs: 16 fill every micro-batch of 2 ranks x 2 pairs; 13 leave the epoch's last one short (padded by
# Accelerate with pairs from the start of the epoch)
LAUNCH_SCENARIOS = {"even": 16, "uneven": 13}
# 9 evaluation pairs at 4 a batch on 2 ranks: the last batch's gathered rows hold 1 real pair (Accelerate's
# `remainder`), fewer than the ranks, so `gather_for_metrics` drops a rank's per-process value there
EVAL_PAIRS = 9


class GatheredInLoss:
    """A `compute_loss` that records what `accelerator.gather_for_metrics` returns for each micro-batch's rows (their
    token counts) and for one value per process (the rows' mean label), as a user's or TRL's code gathers metrics."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            rows = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum(-1))
            per_process = self.accelerator.gather_for_metrics(inputs["labels"].float().mean())
            self.gathered.append([rows.tolist(), per_process.tolist()])
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def review_rows(n: int, skip: int = 0) -> list[dict]:
    """`n` tokenized reviews (after the first `skip`), labelled 1.0 (fresh) or 0.0 (rotten): a regression target."""
    tokenizer = reward_tokenizer()
    rows = rotten_tomatoes(n + skip)[skip:]
    encoded = [tokenizer(text, truncation=True, max_length=24) for text, _ in rows]
    return [{"input_ids": row["input_ids"], "attention_mask": row["attention_mask"], "labels": float(label)}
            for row, (_, label) in zip(encoded, rows)]


def mean_squared_error(prediction) -> dict:
    predictions = prediction.predictions.reshape(-1)
    return {"mse": float(((predictions - prediction.label_ids) ** 2).mean()), "rows": len(predictions)}


def plain_gathers(out_dir: str, rank: int) -> None:
    """transformers' Trainer, then a plain Loop, each subclassed with `GatheredInLoss`: 13 training rows (the epoch's
    last micro-batch short) and 9 evaluation rows with `compute_metrics`."""
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from loopkit import Loop

    tokenizer = reward_tokenizer()
    for name, base in (("trainer", Trainer), ("loop", Loop)):
        runner_class = type(f"Gathered{name.title()}", (GatheredInLoss, base), {})
        with tempfile.TemporaryDirectory() as output_dir:
            args = TrainingArguments(output_dir, per_device_train_batch_size=2, per_device_eval_batch_size=4,
                                     gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=1e-3,
                                     logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                                     seed=0, use_cpu=True)
            runner = runner_class(model=reward_model(tokenizer), args=args, train_dataset=review_rows(13),
                                  eval_dataset=review_rows(EVAL_PAIRS, skip=13), compute_metrics=mean_squared_error,
                                  data_collator=DataCollatorWithPadding(tokenizer))
            runner.gathered = []
            runner.train()
            metrics = runner.evaluate()
        with open(os.path.join(out_dir, f"plain_{name}_rank{rank}.json"), "w") as f:
            json.dump({"gathered": runner.gathered, "log_history": runner.state.log_history, "evaluate": metrics}, f)


def main(out_dir: str) -> None:
    from trl import RewardTrainer

    from loopkit.trl import RewardLoop

    rank = int(os.environ.get("RANK", 0))
    eval_pairs = preference_pairs(EVAL_PAIRS, "explicit", skip=16)
    for scenario, n in LAUNCH_SCENARIOS.items():
        pairs = preference_pairs(n, "explicit", margin=True)
        for name, trainer_class in (("trl", RewardTrainer), ("loopkit", RewardLoop)):
            with tempfile.TemporaryDirectory() as output_dir:
                trainer = train(trainer_class, output_dir, pairs, eval_pairs, per_device_train_batch_size=2,
                                gradient_accumulation_steps=2, max_steps=3, eval_strategy="steps", eval_steps=2)
                metrics = trainer.evaluate()
            with open(os.path.join(out_dir, f"{scenario}_{name}_rank{rank}.json"), "w") as f:
                json.dump({"log_history": trainer.state.log_history, "evaluate": metrics}, f)
            model = trainer.accelerator.unwrap_model(trainer.model)
            weights = {key: value.detach().contiguous() for key, value in model.state_dict().items()}
            save_file(weights, os.path.join(out_dir, f"{scenario}_{name}_rank{rank}.safetensors"))
    plain_gathers(out_dir, rank)


if __name__ == "__main__":
    main(sys.argv[1])
