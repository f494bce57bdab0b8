"""No column the data collator reads is removed by `remove_unused_columns` (issue 42, item 3). HF Trainer keeps the
model forward's arguments only, so a plain `Loop` given the dataset and collator an `SFTTrainer` prepared with
`packing=True` dropped `seq_lengths`: TRL's collator then marked one sequence start per row, and packed samples
attended across their boundaries. loopkit collates the first row once, without the columns it would drop, and keeps
each one the collator asks for by name (loopkit/columns.py, `columns_the_collator_reads`). Tested with TRL's real
collators (SFT padding-free, DPO and reward preference collators), HF's (which return `BatchEncoding`), a user's,
on `datasets.Dataset`s, lists of dicts and an iterable dataset; the packed SFT run against `SFTTrainer`, live."""

from __future__ import annotations

import random
import threading

import datasets
import numpy as np
import pytest
import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, Trainer, TrainingArguments
from transformers import default_data_collator

from loopkit import Loop
from loopkit.columns import columns_the_collator_reads

from helpers import IGNORE_PIN_MEMORY_WARNING, minilm_tokenizer, rotten_tomatoes, tiny_llama

trl = pytest.importorskip("trl")
pytestmark = IGNORE_PIN_MEMORY_WARNING


def first_batch(loop: Loop) -> dict:
    return next(iter(loop.get_train_dataloader()))


def plain_args(tmp_path, **fields) -> TrainingArguments:
    return TrainingArguments(str(tmp_path), report_to="none", disable_tqdm=True, use_cpu=True, **fields)


# ---------------------------------------------------------------------------------------------------------------
# TRL's packed SFT data on a plain Loop: the same losses as SFTTrainer
# ---------------------------------------------------------------------------------------------------------------
def test_a_plain_loop_on_sft_trainers_packed_data_keeps_seq_lengths_and_matches_sft_trainer(tmp_path):
    tok = minilm_tokenizer()
    tok.eos_token = "[SEP]"
    texts = datasets.Dataset.from_dict({"text": [text for text, _ in rotten_tomatoes(32)]})
    common = dict(per_device_train_batch_size=2, max_steps=5, learning_rate=1e-2, logging_steps=1, seed=0,
                  save_strategy="no", disable_tqdm=True, report_to="none", use_cpu=True)
    sft = trl.SFTTrainer(tiny_llama(vocab_size=len(tok)), processing_class=tok, train_dataset=texts,
                         args=trl.SFTConfig(str(tmp_path / "trl"), packing=True, max_length=64, bf16=False,
                                            gradient_checkpointing=False, **common))
    packed, collator = sft.train_dataset, sft.data_collator
    assert "seq_lengths" in packed.column_names and collator.padding_free
    sft.train()
    expected = [h["loss"] for h in sft.state.log_history if "loss" in h]
    losses = {}
    for name, dataset in (("as prepared", packed), ("seq_lengths removed", packed.remove_columns("seq_lengths"))):
        loop = Loop(tiny_llama(vocab_size=len(tok)), args=TrainingArguments(str(tmp_path / name), **common),
                    train_dataset=dataset, data_collator=collator)
        loop.train()
        losses[name] = [h["loss"] for h in loop.state.log_history if "loss" in h]
    assert len(expected) == 5
    assert losses["as prepared"] == pytest.approx(expected, rel=1e-5)
    # The control: what main did (the column dropped) is outside that tolerance, so the comparison can fail.
    assert losses["seq_lengths removed"] != pytest.approx(expected, rel=1e-5)


def packed_rows() -> list[dict]:
    """Rows as TRL's packing makes them: several sequences per row, their lengths in `seq_lengths`; plus a text
    column that no one reads."""
    return [{"input_ids": list(range(1, 10)), "seq_lengths": [3, 4, 2], "text": "a"},
            {"input_ids": list(range(1, 7)), "seq_lengths": [2, 2, 2], "text": "b"},
            {"input_ids": list(range(1, 9)), "seq_lengths": [5, 3], "text": "c"}]


class PackedStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(packed_rows())


@pytest.mark.parametrize("kind", ["datasets.Dataset", "list of dicts", "iterable"])
def test_trls_padding_free_collator_sees_seq_lengths(tmp_path, kind):
    """Sequence starts (position 0) in the batch: 8, one per packed sequence, as TRL's collator makes them from
    `seq_lengths`; 3 (one per row) if the column were dropped. `text` is dropped as in Trainer."""
    collator = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    dataset = {"datasets.Dataset": datasets.Dataset.from_list(packed_rows()), "list of dicts": packed_rows(),
               "iterable": PackedStream()}[kind]
    loop = Loop(tiny_llama(), args=plain_args(tmp_path, per_device_train_batch_size=3, max_steps=1),
                train_dataset=dataset, data_collator=collator)
    batch = first_batch(loop)
    assert int((batch["position_ids"] == 0).sum()) == 8
    assert "seq_lengths" not in batch and "text" not in batch
    if kind == "datasets.Dataset":
        assert loop.data.train_source.column_names == ["input_ids", "seq_lengths"]


# ---------------------------------------------------------------------------------------------------------------
# TRL's preference collators (DPO with precomputed reference log-probs, reward with margins)
# ---------------------------------------------------------------------------------------------------------------
def test_trls_preference_collators_get_every_column_they_read(tmp_path):
    rows = [{"prompt_ids": [1, 2], "chosen_ids": [3, 4], "rejected_ids": [5], "ref_chosen_logps": -1.5,
             "ref_rejected_logps": -2.5, "margin": 0.5, "source": "forum"},
            {"prompt_ids": [6], "chosen_ids": [7], "rejected_ids": [8, 9, 10], "ref_chosen_logps": -0.5,
             "ref_rejected_logps": -3.0, "margin": 1.0, "source": "web"}]
    dpo = trl.trainer.dpo_trainer.DataCollatorForPreference(pad_token_id=0)
    reward = trl.trainer.reward_trainer.DataCollatorForPreference(pad_token_id=0)
    for collator, expected in ((dpo, {"input_ids", "attention_mask", "completion_mask", "ref_chosen_logps",
                                      "ref_rejected_logps"}),
                               (reward, {"input_ids", "attention_mask", "margin"})):
        for dataset in (datasets.Dataset.from_list(rows), rows):
            loop = Loop(tiny_llama(), args=plain_args(tmp_path, per_device_train_batch_size=2, max_steps=1),
                        train_dataset=dataset, data_collator=collator)
            batch = first_batch(loop)
            assert set(batch) == expected
            assert batch["input_ids"].shape[0] == 4  # chosen and rejected, each row
            if collator is reward:
                assert sorted(batch["margin"].tolist()) == [0.5, 1.0]
            else:
                assert sorted(batch["ref_rejected_logps"].tolist()) == [-3.0, -2.5]


# ---------------------------------------------------------------------------------------------------------------
# HF's collators keep Trainer's columns; a user's collator gets the column it reads
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("collator_name", ["DataCollatorWithPadding", "default_data_collator",
                                           "DataCollatorForLanguageModeling"])
def test_hf_collators_get_the_columns_trainer_gives_them(tmp_path, collator_name):
    """Collators that take every key they are given (stacking or padding it) ask for none by name: the unused
    columns (`idx`, an int the model's forward would refuse; `text`) are dropped, exactly as by Trainer, live."""
    tok = minilm_tokenizer()
    texts = [text for text, _ in rotten_tomatoes(4)]
    encoded = tok(texts, truncation=True, max_length=12, padding="max_length")
    dataset = datasets.Dataset.from_dict({**encoded, "idx": list(range(4)), "text": texts})
    collator = {"DataCollatorWithPadding": DataCollatorWithPadding(tok), "default_data_collator":
                default_data_collator, "DataCollatorForLanguageModeling": DataCollatorForLanguageModeling(
                    tok, mlm=False)}[collator_name]
    keys = {}
    for name, runner in (("hf", Trainer), ("loopkit", Loop)):
        trainer = runner(tiny_llama(vocab_size=len(tok)), args=plain_args(tmp_path / name, max_steps=1,
                                                                          per_device_train_batch_size=2),
                         train_dataset=dataset, data_collator=collator)
        batch = first_batch(trainer)
        keys[name] = set(batch)
    assert keys["loopkit"] == keys["hf"]
    assert "idx" not in keys["loopkit"] and "input_ids" in keys["loopkit"]


class CompletionOnlyCollator:
    """A user's collator for prompt-completion rows (as TRL's completion-only collators were): HF's padding, then
    the prompt tokens masked out of the labels with the row's `completion_mask`."""

    def __init__(self, tokenizer):
        self.pad = DataCollatorWithPadding(tokenizer)

    def __call__(self, features):
        masks = [feature["completion_mask"] for feature in features]
        batch = self.pad([{k: feature[k] for k in ("input_ids", "attention_mask")} for feature in features])
        mask = torch.tensor([m + [0] * (batch["input_ids"].shape[1] - len(m)) for m in masks])
        batch["labels"] = batch["input_ids"].masked_fill(mask == 0, -100)
        return batch


def test_a_users_collator_reading_completion_mask_gets_it_where_trainer_drops_it(tmp_path):
    tok = minilm_tokenizer()
    rows = [{"input_ids": [101, 7, 8, 9, 102], "attention_mask": [1] * 5, "completion_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [101, 5, 6, 102], "attention_mask": [1] * 4, "completion_mask": [0, 1, 1, 1]}]
    args = plain_args(tmp_path, max_steps=1, per_device_train_batch_size=2)
    with pytest.raises(KeyError, match="completion_mask"):  # Trainer drops the column its collator needs
        first_batch(Trainer(tiny_llama(vocab_size=len(tok)), args=args, train_dataset=datasets.Dataset.from_list(rows),
                            data_collator=CompletionOnlyCollator(tok)))
    loop = Loop(tiny_llama(vocab_size=len(tok)), args=args, train_dataset=datasets.Dataset.from_list(rows),
                data_collator=CompletionOnlyCollator(tok))
    batch = first_batch(loop)
    assert type(batch).__name__ == "BatchEncoding"
    assert sorted(int((row != -100).sum()) for row in batch["labels"]) == [3, 3]


# ---------------------------------------------------------------------------------------------------------------
# The probe itself: randomness as it was, and only what the collator asks for
# ---------------------------------------------------------------------------------------------------------------
class DrawingCollator:
    """Draws from every global RNG and its own seeded generator, counts its calls, and reads `seq_lengths` if
    present. With a lock it cannot be copied, and is probed itself."""

    seed = 3

    def __init__(self, uncopyable: bool):
        self.generator, self.calls = None, []
        self.lock = threading.Lock() if uncopyable else None

    def __call__(self, features):
        self.calls.append(len(features))
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.seed)
        noise = (torch.rand(1), torch.rand(1, generator=self.generator), random.random(), np.random.rand())
        return {"input_ids": torch.tensor([f["input_ids"] for f in features]), "noise": noise,
                "lengths": [f["seq_lengths"] for f in features] if "seq_lengths" in features[0] else None}


@pytest.mark.parametrize("uncopyable", [False, True])
def test_the_probe_leaves_every_rng_and_the_collators_own_state_as_they_were(uncopyable):
    collator, row = DrawingCollator(uncopyable), {"input_ids": [1, 2], "seq_lengths": [1, 1], "idx": 0}

    def states():
        own = None if collator.generator is None else collator.generator.get_state()
        return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), own

    for calls in range(2):  # before the collator's first batch (no generator yet), then after it
        before = states()
        assert columns_the_collator_reads(collator, row, {"input_ids"}) == {"seq_lengths"}
        after = states()
        assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])
        assert (before[3] is None and after[3] is None) or torch.equal(before[3], after[3])
        assert len(collator.calls) == (calls if not uncopyable else 3 * calls + 2)  # probed: a copy, or itself
        collator([row])


def test_a_collator_that_records_what_it_sees_sees_the_batches_only(tmp_path):
    collator = DrawingCollator(uncopyable=False)
    rows = [{"input_ids": [1, 2], "seq_lengths": [1, 1], "idx": i} for i in range(4)]
    loop = Loop(tiny_llama(), args=plain_args(tmp_path, per_device_train_batch_size=2, max_steps=1),
                train_dataset=datasets.Dataset.from_list(rows), data_collator=collator)
    batch = first_batch(loop)
    # Batches of two rows only (Accelerate's loader reads one batch ahead); the probe's one-row call went to a copy.
    assert collator.calls in ([2], [2, 2]) and batch["lengths"] == [[1, 1], [1, 1]]


def test_an_mlm_collators_seeded_generator_is_not_created_by_the_probe():
    """HF's collator creates its generator at its first batch: still none after the probe."""
    mlm = DataCollatorForLanguageModeling(minilm_tokenizer(), mlm=True, seed=1)
    assert columns_the_collator_reads(mlm, {"input_ids": [101, 2, 3, 102], "idx": 1}, {"input_ids"}) == set()
    assert mlm.generator is None
