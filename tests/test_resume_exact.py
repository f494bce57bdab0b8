"""Exact resume: a run resumed from a mid-training checkpoint ends bit-identical to the uninterrupted run.

Realistic data paths: a `datasets` map-style set, a `datasets.IterableDataset`, and a file-backed sharded iterable
read by two workers; a masked-LM collator that draws random numbers; dropout on; gradient accumulation.
"""

import json
import os
import warnings

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

from loopkit import Loop, LoopArgs

from helpers import minilm_tokenizer, regression_data, rotten_tomatoes, tiny_regression

datasets = pytest.importorskip("datasets")

SEQ = 24


def tokenized_reviews(n=24):
    tok = minilm_tokenizer()
    enc = tok([text for text, _ in rotten_tomatoes(n)], truncation=True, max_length=SEQ, padding="max_length")
    return tok, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def tiny_mlm(vocab_size):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=SEQ, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    return BertForMaskedLM(config)


class ShardedJsonlDataset(torch.utils.data.IterableDataset):
    """A file-backed iterable: one JSONL file per shard, shards split across dataloader workers."""

    def __init__(self, paths):
        self.paths = paths

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        paths = self.paths if info is None else self.paths[info.id::info.num_workers]
        for path in paths:
            with open(path) as f:
                for line in f:
                    yield json.loads(line)


def make_dataset(kind, columns, tmp_path):
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    if kind == "map":
        return datasets.Dataset.from_dict(columns)
    if kind == "hf_iterable":
        return datasets.Dataset.from_dict(columns).to_iterable_dataset(num_shards=4)
    paths = []
    for shard in range(4):
        path = tmp_path / f"shard-{shard}.jsonl"
        with open(path, "w") as f:
            for row in rows[shard::4]:
                f.write(json.dumps(row) + "\n")
        paths.append(str(path))
    return ShardedJsonlDataset(paths)


def run(tmp_path, kind, workers, ga, resume_from=None, out="run"):
    tok, columns = tokenized_reviews()
    iterable = kind != "map"
    args = LoopArgs(output_dir=str(tmp_path / out), per_device_train_batch_size=4, gradient_accumulation_steps=ga,
                    num_train_epochs=2, max_steps=8 if iterable else -1, learning_rate=1e-3, weight_decay=0.01,
                    warmup_steps=2, logging_steps=1, save_steps=3, save_strategy="steps",
                    dataloader_num_workers=workers, remove_unused_columns=False, disable_tqdm=True, seed=7)
    loop = Loop(model=tiny_mlm(tok.vocab_size), args=args, train_dataset=make_dataset(kind, columns, tmp_path),
                data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.3))
    loop.train(resume_from_checkpoint=resume_from)
    return loop


CASES = [("map", 0, 1), ("map", 0, 3), ("map", 2, 2), ("hf_iterable", 0, 2), ("files", 2, 1)]


@pytest.mark.parametrize("kind,workers,ga", CASES)
def test_interrupted_run_ends_identical(tmp_path, kind, workers, ga):
    full = run(tmp_path, kind, workers, ga)
    checkpoint = tmp_path / "run" / "checkpoint-3"  # mid-epoch for every case
    assert checkpoint.is_dir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = run(tmp_path, kind, workers, ga, resume_from=str(checkpoint), out="resumed")
    if kind == "files":  # cannot seek: the resumed epoch re-reads, and says so
        assert any("re-reading and discarding" in str(w.message) for w in caught)
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs after resume"
    losses = lambda loop: [(h["step"], h["loss"]) for h in loop.state.log_history if "loss" in h]
    assert losses(resumed) == losses(full)  # restored history up to step 3, then the resumed steps
    assert full.state.global_step == resumed.state.global_step


def test_first_log_after_resume_keeps_the_running_loss(tmp_path):
    """logging_steps=2, checkpoint at step 3: the log at step 4 covers steps 3 and 4 (HF restarts at 0)."""
    tok, columns = tokenized_reviews()

    def go(out, resume=None):
        args = LoopArgs(output_dir=str(tmp_path / out), per_device_train_batch_size=4, max_steps=6,
                        logging_steps=2, save_steps=3, learning_rate=1e-3, remove_unused_columns=False,
                        disable_tqdm=True)
        loop = Loop(model=tiny_mlm(tok.vocab_size), args=args, train_dataset=datasets.Dataset.from_dict(columns),
                    data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.3))
        return loop.train(resume_from_checkpoint=resume), loop

    (_, full) = go("a")
    out, resumed = go("b", str(tmp_path / "a" / "checkpoint-3"))
    full_logs = {h["step"]: h["loss"] for h in full.state.log_history if "loss" in h}
    resumed_logs = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h}
    assert resumed_logs[4] == full_logs[4] and resumed_logs[6] == full_logs[6]
    # train_loss covers only this call's steps (4, 5, 6), as HF defines it
    step3 = json.load(open(tmp_path / "a" / "checkpoint-3" / "loopkit_state.json"))["running_loss"]["tr_loss"]
    expected = (full_logs[4] * 2 - step3 + full_logs[6] * 2) / 3
    assert out.training_loss == pytest.approx(expected, rel=1e-6)
    assert os.path.isfile(tmp_path / "b" / "checkpoint-6" / "trainer_state.json")



class SkippingLoop(Loop):
    """A script's override of HF's `get_resumed_dataloader` (transformers 5.25), as its docs suggest for a stateful
    loader: here accelerate's `skip_first_batches`, recording each call."""

    calls = []

    def get_resumed_dataloader(self, dataloader, num_batches):
        from accelerate import skip_first_batches

        self.calls.append(num_batches)
        return skip_first_batches(dataloader, num_batches)


class Samples(torch.utils.data.IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


@pytest.mark.parametrize("iterable", [False, True])
def test_an_override_of_get_resumed_dataloader_positions_the_resumed_epoch(tmp_path, iterable):
    """Honoured as in Trainer: called once, for the resumed epoch, with every batch the interrupted run had read
    (its read-ahead batch too), and the run ends identical (the iterable cannot seek: the override's loader reads
    and discards the batches itself). The collator draws no random numbers: the override's loader is read as it is
    returned, so RNG exactness across a resume is the override's own business."""
    def go(cls, out, resume=None):
        args = LoopArgs(output_dir=str(tmp_path / out), per_device_train_batch_size=4, max_steps=6 if iterable else -1,
                        num_train_epochs=1, learning_rate=0.05, logging_steps=1, save_steps=3, disable_tqdm=True)
        rows = regression_data(24)
        loop = cls(model=tiny_regression(), args=args, train_dataset=Samples(rows) if iterable else rows)
        loop.train(resume_from_checkpoint=resume)
        return loop

    full = go(Loop, "run")
    SkippingLoop.calls.clear()
    resumed = go(SkippingLoop, "resumed", str(tmp_path / "run" / "checkpoint-3"))
    assert SkippingLoop.calls == [3 + 1]  # 3 steps of one micro-batch, and the batch read ahead
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs after resume"
