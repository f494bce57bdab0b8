"""The errors users hit first are raised at their cause, before the first batch where that is possible (issue 16,
item 4): each message names the field or column, the value, and the fix. Where HF Trainer accepts the same input and
fails later, the test runs it live and checks that it does fail (so refusing early rejects nothing HF could train)."""

from __future__ import annotations

import pytest
import torch
from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, minilm_tokenizer, regression_data, tiny_regression
from torch.utils.data import IterableDataset
from transformers import Trainer

from loopkit import Loop, LoopArgs, LoopConfigError
from loopkit.args import check_args

VOCAB = 64
pytestmark = IGNORE_PIN_MEMORY_WARNING  # HF Trainer runs here too


def loop_args(tmp_path, **kwargs) -> LoopArgs:
    kwargs.setdefault("disable_tqdm", True)
    kwargs.setdefault("per_device_train_batch_size", 4)
    return LoopArgs(output_dir=str(tmp_path), **kwargs)


def tiny_bert(num_labels: int = 2):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=num_labels))


def token_rows(n: int, ids_column: str = "input_ids", mask_column: str = "attention_mask", label=None) -> list:
    """Tokenized rows of uneven length (2 to 7 tokens), label i % 2 unless `label(i)` says otherwise."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = 2 + i % 6
        rows.append({ids_column: torch.randint(1, VOCAB, (length,), generator=g).tolist(),
                     mask_column: [1] * length, "label": label(i) if label else i % 2})
    return rows


def assert_names(error, *parts):
    message = str(error.value)
    for part in parts:
        assert part in message, f"{part!r} missing from: {message}"
    assert "Fix:" in message, f"no fix in: {message}"


def hf_fails(tmp_path, model, dataset, **kwargs) -> str:
    """HF Trainer, live, on the same input: the message it fails with (the test asserts it does fail)."""
    trainer = Trainer(model=model, args=hf_args(tmp_path / "hf", max_steps=2, per_device_train_batch_size=4),
                      train_dataset=dataset, **kwargs)
    with pytest.raises(Exception) as error:
        trainer.train()
    return str(error.value)


# ---------------------------------------------------------------------------------------------------------------
# Columns that remove_unused_columns would drop by mistake
# ---------------------------------------------------------------------------------------------------------------
def test_misspelt_column_of_a_datasets_dataset_names_the_near_match(tmp_path):
    import datasets

    rows = token_rows(8, ids_column="input_idz")
    dataset = datasets.Dataset.from_list(rows)
    # HF drops the column silently and the collator blames the wrong thing (the report).
    assert "input_ids" in hf_fails(tmp_path, tiny_bert(), dataset, processing_class=minilm_tokenizer())
    loop = Loop(model=tiny_bert(), args=loop_args(tmp_path), train_dataset=dataset,
                processing_class=minilm_tokenizer())
    with pytest.raises(LoopConfigError) as error:
        loop.get_train_dataloader()  # before the first batch: building the loader refuses
    assert_names(error, "remove_unused_columns=True", "'input_idz'", "train_dataset", "'input_ids'",
                 "rename_column('input_idz', 'input_ids')")


@pytest.mark.parametrize("misspelt, meant", [("input_idz", "input_ids"), ("attention_maks", "attention_mask")])
def test_misspelt_key_of_list_rows_names_the_near_match(tmp_path, misspelt, meant):
    columns = {"ids_column": misspelt} if meant == "input_ids" else {"mask_column": misspelt}
    loop = Loop(model=tiny_bert(), args=loop_args(tmp_path), train_dataset=token_rows(8, **columns),
                processing_class=minilm_tokenizer())
    with pytest.raises(LoopConfigError) as error:
        loop.get_train_dataloader()
    assert_names(error, repr(misspelt), repr(meant), "BertForSequenceClassification.forward",
                 "remove_unused_columns=False")


class Rows(IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


class CountedRows(torch.utils.data.Dataset):
    """A map-style dataset that counts its reads (as one with random augmentation would draw from the RNG)."""

    def __init__(self, rows):
        self.rows, self.reads = rows, 0

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        self.reads += 1
        return self.rows[index]


@pytest.mark.parametrize("kind", [Rows, CountedRows])
def test_misspelt_key_of_another_dataset_is_caught_at_its_first_batch(tmp_path, kind):
    dataset = kind(token_rows(8, ids_column="input_idz"))
    loop = Loop(model=tiny_bert(), args=loop_args(tmp_path, max_steps=2), train_dataset=dataset,
                processing_class=minilm_tokenizer())
    loader = loop.get_train_dataloader()  # its keys are known only from the rows the loader reads
    assert getattr(dataset, "reads", 0) == 0  # building the loader read nothing
    with pytest.raises(LoopConfigError) as error:
        next(iter(loader))
    assert_names(error, "'input_idz'", "'input_ids'")


def test_missing_column_that_the_forward_requires(tmp_path):
    rows = [{"features": r["x"], "labels": r["labels"]} for r in regression_data(8)]
    loop = Loop(model=tiny_regression(), args=loop_args(tmp_path), train_dataset=rows)
    with pytest.raises(LoopConfigError) as error:
        loop.get_train_dataloader()
    assert_names(error, "train_dataset columns=['features', 'labels']", "TinyRegression.forward", "'x'",
                 "give train_dataset a 'x' column")


def test_missing_column_that_the_padding_collator_needs(tmp_path):
    import datasets

    dataset = datasets.Dataset.from_dict({"text": ["a good film", "a bad one"] * 4, "label": [1, 0] * 4})
    assert "input_ids" in hf_fails(tmp_path, tiny_bert(), dataset, processing_class=minilm_tokenizer())
    loop = Loop(model=tiny_bert(), args=loop_args(tmp_path), train_dataset=dataset,
                processing_class=minilm_tokenizer())
    with pytest.raises(LoopConfigError) as error:
        loop.get_train_dataloader()
    assert_names(error, "train_dataset columns=['text', 'label']", "DataCollatorWithPadding", "'input_ids'",
                 "map the tokenizer over it")


def test_correct_columns_pass_the_checks_and_extra_columns_are_still_dropped(tmp_path):
    rows = [{**row, "idx": i, "text": "unused"} for i, row in enumerate(token_rows(8))]
    loop = Loop(model=tiny_bert(), args=loop_args(tmp_path, max_steps=2), train_dataset=rows,
                processing_class=minilm_tokenizer())
    assert loop.train().global_step == 2


# ---------------------------------------------------------------------------------------------------------------
# Arguments and datasets, at construction
# ---------------------------------------------------------------------------------------------------------------
def test_unknown_loop_args_keyword_suggests_the_nearest_field(tmp_path):
    with pytest.raises(TypeError) as error:  # Python's error type for it, and a LoopConfigError
        LoopArgs(output_dir=str(tmp_path), learning_rat=1e-3)
    assert isinstance(error.value, LoopConfigError)
    assert_names(error, "learning_rat=0.001", "no field 'learning_rat'", "did you mean learning_rate?",
                 "LoopArgs(learning_rate=0.001)")
    with pytest.raises(TypeError) as error:
        LoopArgs(per_device_batch_size=4)
    assert_names(error, "per_device_eval_batch_size or per_device_train_batch_size")


@pytest.mark.parametrize("where", ["train", "eval", "eval_dict"])
def test_empty_dataset_is_refused_at_construction(tmp_path, where):
    datasets = {"train": dict(train_dataset=[]), "eval": dict(train_dataset=regression_data(4), eval_dataset=[]),
                "eval_dict": dict(train_dataset=regression_data(4),
                                  eval_dataset={"a": regression_data(4), "b": []})}[where]
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=loop_args(tmp_path), **datasets)
    field = {"train": "train_dataset", "eval": "eval_dataset", "eval_dict": "eval_dataset['b']"}[where]
    assert_names(error, f"{field}='<empty list>'", "no example", "at least one example")
    if where == "train":  # HF: a sampler's complaint, at train()
        assert "num_samples=0" in hf_fails(tmp_path, tiny_regression(), [])


def test_eval_dataset_without_labels_while_metric_for_best_model_needs_them(tmp_path):
    unlabelled = [{"x": row["x"]} for row in regression_data(4)]
    args = loop_args(tmp_path, eval_strategy="steps", eval_steps=1, save_steps=1, load_best_model_at_end=True)
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_regression(), args=args, train_dataset=regression_data(8), eval_dataset=unlabelled)
    assert_names(error, "metric_for_best_model='loss'", "eval_dataset has no label column", "columns: x",
                 "label_names=['labels']", "add the labels to eval_dataset")
    # HF accepts it and fails at the first evaluation, after training.
    trainer = Trainer(model=tiny_regression(), args=hf_args(tmp_path / "hf", eval_strategy="steps", eval_steps=1,
                                                            save_steps=1, load_best_model_at_end=True, max_steps=2),
                      train_dataset=regression_data(8), eval_dataset=unlabelled)
    with pytest.raises(KeyError, match="metric_for_best_model"):
        trainer.train()
    # With labels it is accepted.
    Loop(model=tiny_regression(), args=args, train_dataset=regression_data(8), eval_dataset=regression_data(4))


def test_tokenizer_without_pad_token(tmp_path):
    tokenizer = minilm_tokenizer()
    tokenizer.pad_token = None
    loop = Loop(model=tiny_bert(), args=loop_args(tmp_path), train_dataset=token_rows(8), processing_class=tokenizer)
    with pytest.raises(LoopConfigError) as error:
        loop.get_train_dataloader()
    assert_names(error, "processing_class.pad_token=None", "DataCollatorWithPadding", "BertTokenizer",
                 "tokenizer.pad_token = tokenizer.eos_token")


# ---------------------------------------------------------------------------------------------------------------
# The first micro-batch's labels, against the model's loss
# ---------------------------------------------------------------------------------------------------------------
def test_float_labels_for_a_single_label_classifier(tmp_path):
    rows = token_rows(8, label=lambda i: float(i % 3))
    assert hf_fails(tmp_path, tiny_bert(num_labels=3), rows, processing_class=minilm_tokenizer())
    loop = Loop(model=tiny_bert(num_labels=3), args=loop_args(tmp_path, max_steps=2), train_dataset=rows,
                processing_class=minilm_tokenizer())
    with pytest.raises(LoopConfigError) as error:
        loop.train()
    assert loop.state.global_step == 0
    assert_names(error, "labels='<float32 tensor of shape (4,)>'", "takes class ids", "labels.long()",
                 "num_labels=1")


def test_labels_out_of_range_for_num_labels(tmp_path):
    rows = token_rows(8, label=lambda i: i % 4)  # 4 classes, and a model built with the default num_labels=2
    assert "out of bounds" in hf_fails(tmp_path, tiny_bert(), rows, processing_class=minilm_tokenizer())
    loop = Loop(model=tiny_bert(), args=loop_args(tmp_path, max_steps=2), train_dataset=rows,
                processing_class=minilm_tokenizer())
    with pytest.raises(LoopConfigError) as error:
        loop.train()
    assert_names(error, "labels='<int64 tensor of shape (4,)>'", "from 0 to 3", "config.num_labels=2",
                 "num_labels=4")


def test_label_check_runs_once_per_train_and_accepts_ignored_positions(tmp_path, monkeypatch):
    import loopkit.stages.step as step_module

    calls = []
    original = step_module.check_labels
    monkeypatch.setattr(step_module, "check_labels", lambda *a: calls.append(1) or original(*a))
    rows = token_rows(8, label=lambda i: -100 if i % 4 == 0 else i % 2)  # -100: ignored, always allowed
    loop = Loop(model=tiny_bert(), args=loop_args(tmp_path, max_steps=4, per_device_train_batch_size=2,
                                                  gradient_accumulation_steps=2),
                train_dataset=rows, processing_class=minilm_tokenizer())
    assert loop.train().global_step == 4
    assert len(calls) == 1  # 8 micro-batches, one check: the hot path only tests a flag
    loop.train()
    assert len(calls) == 2  # once per train()


# ---------------------------------------------------------------------------------------------------------------
# A collator that cannot stack the examples it gets (issue 34, item 10)
# ---------------------------------------------------------------------------------------------------------------
def reviews_tokenized(n: int) -> list[dict]:
    """Real reviews through the real MiniLM tokenizer, unpadded (as `dataset.map(tokenize)` leaves them)."""
    from helpers import rotten_tomatoes

    tokenizer = minilm_tokenizer()
    return [dict(tokenizer(text, truncation=True, max_length=64), label=label) for text, label in rotten_tomatoes(n)]


def minilm_vocab_bert():
    """A small BERT classifier over the real MiniLM tokenizer's vocabulary (30,522 ids, 64 positions)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=minilm_tokenizer().vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=64, num_labels=2))


def test_default_collator_on_unpadded_examples_names_the_collator_the_field_and_the_fix(tmp_path):
    from transformers import default_data_collator

    rows = reviews_tokenized(8)
    assert len({len(r["input_ids"]) for r in rows[:4]}) > 1  # the first batch is uneven
    # Trainer, live: torch's words, naming neither the collator nor the fix.
    assert "expected sequence of length" in hf_fails(tmp_path, minilm_vocab_bert(), rows,
                                                     data_collator=default_data_collator)
    loop = Loop(model=minilm_vocab_bert(), args=loop_args(tmp_path, max_steps=2), train_dataset=rows,
                data_collator=default_data_collator)
    with pytest.raises(LoopConfigError) as error:
        loop.train()
    assert loop.state.global_step == 0
    assert_names(error, "data_collator='default_data_collator'",
                 "'input_ids', 'token_type_ids', 'attention_mask' of different lengths",
                 "DataCollatorWithPadding(tokenizer)", "DataCollatorForLanguageModeling", "processing_class=tokenizer",
                 "expected sequence of length")  # torch's own words kept, for whoever searches them
    assert isinstance(error.value, ValueError) and "expected sequence of length" in str(error.value.__cause__)
    # The fix named works: the same rows, padded by DataCollatorWithPadding, train.
    from transformers import DataCollatorWithPadding

    fixed = Loop(model=minilm_vocab_bert(), args=loop_args(tmp_path / "fixed", max_steps=2), train_dataset=rows,
                 data_collator=DataCollatorWithPadding(minilm_tokenizer()))
    fixed.train()
    assert fixed.state.global_step == 2


def test_padding_collator_with_unpadded_token_labels_names_the_labels(tmp_path):
    from transformers import BertConfig, BertForTokenClassification, DataCollatorWithPadding

    rows = [dict(r, labels=[i % 2] * len(r["input_ids"])) for i, r in enumerate(token_rows(8))]
    for r in rows:
        del r["label"]
    torch.manual_seed(0)
    model = BertForTokenClassification(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=32,
                                                  max_position_embeddings=32, num_labels=2))
    loop = Loop(model=model, args=loop_args(tmp_path, max_steps=2), train_dataset=rows,
                data_collator=DataCollatorWithPadding(minilm_tokenizer()))
    with pytest.raises(LoopConfigError) as error:
        loop.train()
    assert_names(error, "data_collator='DataCollatorWithPadding'", "'labels' of different lengths",
                 "DataCollatorForTokenClassification(tokenizer)")
