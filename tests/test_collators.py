"""The collators and batch types people use, end to end (issue 10).

HF's padding collators return `BatchEncoding`, a `Mapping` that is not a `dict`; a batch-size check on `dict` once
made every streaming metric skip every batch (`eval_accuracy: nan`, `eval_f1: 0.0`, no warning). For each collator
or batch type below, on a tiny model built from a config:
* training: every logged loss and `train_loss` equal to HF Trainer's, run live (fresh model and collator per runner);
* evaluation: `evaluate()`'s streaming metrics equal the same metrics computed with numpy from `predict()`, on the
  map-style eval set and on the same rows as an iterable eval set, with `num_samples` equal to the number of rows.
Labels are -100 in places in every case (padding, special tokens, unmasked tokens, or set so in the data).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset
from helpers import (IGNORE_PIN_MEMORY_WARNING, assert_close, hf_args, minilm_tokenizer, numpy_accuracy,
                     numpy_perplexity, numpy_prf1, rotten_tomatoes)

from loopkit import Loop
from loopkit.metrics import Accuracy, Perplexity, PrecisionRecallF1, TokenAccuracy

pytestmark = IGNORE_PIN_MEMORY_WARNING

RTOL = 1e-6
N_TRAIN, N_EVAL = 12, 10  # train batch 4: 3 steps; eval batch 3: batches of 3, 3, 3 and 1
WORDS = ("the a movie film plot actor scene story ending music good bad great awful dull funny slow long short "
         "boring clever warm cold").split()


# ---------------------------------------------------------------------------------------------------------------
# A tiny word-level tokenizer (fast, offline), tiny models, and the eval sets
# ---------------------------------------------------------------------------------------------------------------
def tiny_tokenizer():
    """A `PreTrainedTokenizerFast` over WORDS with BERT's special tokens ([CLS] text [SEP]): every collator's needs
    (padding, [MASK]) in a 27-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: i for i, token in enumerate(specials + list(WORDS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                          special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def sentences(n: int, seed: int) -> list[tuple[str, int]]:
    """`n` (sentence, label) pairs of 2 to 9 words: varying lengths, so padding collators pad."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(2, 10, (1,), generator=g))
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=g)]
        rows.append((" ".join(words), int(torch.randint(0, 2, (1,), generator=g))))
    return rows


def tiny_bert(kind: str, vocab_size: int, num_labels: int = 2):
    from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification,
                              BertForTokenClassification)

    torch.manual_seed(0)
    config = BertConfig(vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=64, num_labels=num_labels, initializer_range=0.5,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return {"sequence": BertForSequenceClassification, "token": BertForTokenClassification,
            "masked": BertForMaskedLM}[kind](config)


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64, pad_token_id=0))


def tiny_t5(vocab_size: int):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=vocab_size, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                               num_heads=2, dropout_rate=0.0, pad_token_id=0,
                                               decoder_start_token_id=0, use_cache=False))


class MeanEmbeddingClassifier(nn.Module):
    """A plain nn.Module taking positional input ids: what a tuple batch feeds."""

    def __init__(self, vocab_size: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab_size, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids).mean(1))


def tuple_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """The same override for Trainer and Loop: both call `model(**inputs)` by default, which a tuple cannot feed."""
    input_ids, labels = inputs
    logits = model(input_ids)
    loss = nn.functional.cross_entropy(logits, labels)
    return (loss, {"logits": logits}) if return_outputs else loss


class Stream(IterableDataset):
    """The eval rows as an iterable dataset: no `__len__`, so the sample count must come from the batches."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


# ---------------------------------------------------------------------------------------------------------------
# The same metrics with numpy, over predict()'s padded arrays
# ---------------------------------------------------------------------------------------------------------------
def classification_reference(logits, labels):
    return {"accuracy": numpy_accuracy(logits, labels), **numpy_prf1(logits, labels, 2, per_class=False)}


def token_reference(shift):
    return lambda logits, labels: {"accuracy" if not shift else "token_accuracy": numpy_accuracy(logits, labels, shift),
                                   "perplexity": numpy_perplexity(logits, labels, shift)}


# ---------------------------------------------------------------------------------------------------------------
# The cases
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    make_model: Callable
    train_rows: object
    eval_rows: object  # a list or a `datasets.Dataset`
    make_collator: Callable | None  # (tokenizer, model) -> collator; None: Loop/Trainer pick the default
    make_metrics: Callable
    reference: Callable  # (logits, labels) -> {metric key: value}
    tokenizer: object = None
    processing_class: bool = False  # pass the tokenizer as processing_class
    compute_loss: Callable | None = None
    eval_labels: np.ndarray | None = None  # when predict() has no label_ids (tuple batches)
    extra_args: dict = field(default_factory=dict)  # more TrainingArguments


def padding_case():
    """DataCollatorWithPadding on a `datasets.Dataset` tokenized with `.map` (the real MiniLM tokenizer, real
    reviews), HF's `label` column, the raw `text` column removed by remove_unused_columns."""
    datasets = pytest.importorskip("datasets")
    from transformers import DataCollatorWithPadding

    tokenizer = minilm_tokenizer()
    reviews = rotten_tomatoes(N_TRAIN + N_EVAL)

    def dataset(rows):
        ds = datasets.Dataset.from_dict({"text": [t for t, _ in rows], "label": [label for _, label in rows]})
        return ds.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=24), batched=True)

    return Case(lambda: tiny_bert("sequence", tokenizer.vocab_size), dataset(reviews[:N_TRAIN]),
                dataset(reviews[N_TRAIN:]), lambda tok, model: DataCollatorWithPadding(tok),
                lambda: [Accuracy(), PrecisionRecallF1(2, per_class=False)], classification_reference, tokenizer)


def batch_encoding_case():
    """Rows that are the tokenizer's own `BatchEncoding`s, and the tokenizer as processing_class: the default
    collator (DataCollatorWithPadding) returns `BatchEncoding` batches."""
    tokenizer = tiny_tokenizer()

    def rows(seed, n):
        encoded = []
        for text, label in sentences(n, seed):
            encoding = tokenizer(text)
            encoding["labels"] = label
            encoded.append(encoding)
        return encoded

    return Case(lambda: tiny_bert("sequence", len(tokenizer)), rows(1, N_TRAIN), rows(2, N_EVAL), None,
                lambda: [Accuracy(), PrecisionRecallF1(2, per_class=False)], classification_reference, tokenizer,
                processing_class=True)


def plain_dict_case():
    """A user's function that pads by hand and returns a plain dict; some labels are -100 (ignored by the loss and
    the metrics)."""
    tokenizer = tiny_tokenizer()

    def collate(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
        return {"input_ids": ids, "attention_mask": (ids != 0).long(),
                "labels": torch.tensor([f["labels"] for f in features])}

    def rows(seed, n):
        data = [{"input_ids": tokenizer(text)["input_ids"], "labels": label} for text, label in sentences(n, seed)]
        for i in range(0, n, 4):
            data[i]["labels"] = -100
        return data

    return Case(lambda: tiny_bert("sequence", len(tokenizer)), rows(21, N_TRAIN), rows(22, N_EVAL),
                lambda tok, model: collate, lambda: [Accuracy(), PrecisionRecallF1(2, per_class=False)],
                classification_reference, tokenizer)


def tuple_case():
    """A user's function returning (input_ids, labels), with the same compute_loss override in both runners; the
    streaming metric reads the labels by position."""
    tokenizer = tiny_tokenizer()

    def rows(seed, n):
        return [(torch.tensor(tokenizer(text, padding="max_length", max_length=12)["input_ids"]), torch.tensor(label))
                for text, label in sentences(n, seed)]

    def collate(features):
        return torch.stack([ids for ids, _ in features]), torch.stack([label for _, label in features])

    eval_rows = rows(6, N_EVAL)
    return Case(lambda: MeanEmbeddingClassifier(len(tokenizer)), rows(5, N_TRAIN), eval_rows,
                lambda tok, model: collate, lambda: [Accuracy(label_key=1)],
                lambda logits, labels: {"accuracy": numpy_accuracy(logits, labels)}, tokenizer,
                compute_loss=tuple_compute_loss, eval_labels=np.array([int(label) for _, label in eval_rows]),
                extra_args={"remove_unused_columns": False})


def causal_lm_case():
    """DataCollatorForLanguageModeling(mlm=False): labels are the input ids with padding set to -100."""
    from transformers import DataCollatorForLanguageModeling

    tokenizer = tiny_tokenizer()
    rows = lambda seed, n: [{"input_ids": tokenizer(text)["input_ids"]} for text, _ in sentences(n, seed)]  # noqa
    return Case(lambda: tiny_llama(len(tokenizer)), rows(7, N_TRAIN), rows(8, N_EVAL),
                lambda tok, model: DataCollatorForLanguageModeling(tok, mlm=False),
                lambda: [TokenAccuracy(), Perplexity()], token_reference(shift=True), tokenizer)


def masked_lm_case():
    """DataCollatorForLanguageModeling(mlm=True): random masks from the global RNG, every unmasked label -100."""
    from transformers import DataCollatorForLanguageModeling

    tokenizer = tiny_tokenizer()
    rows = lambda seed, n: [{"input_ids": tokenizer(text)["input_ids"]} for text, _ in sentences(n, seed)]  # noqa
    return Case(lambda: tiny_bert("masked", len(tokenizer)), rows(9, N_TRAIN), rows(10, N_EVAL),
                lambda tok, model: DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.5),
                lambda: [Accuracy(), Perplexity(shift=False)], token_reference(shift=False), tokenizer)


def seq2seq_case():
    """DataCollatorForSeq2Seq with the model (it builds decoder_input_ids): targets padded with -100."""
    from transformers import DataCollatorForSeq2Seq

    tokenizer = tiny_tokenizer()

    def rows(seed, n):
        pairs = sentences(2 * n, seed)
        return [{"input_ids": tokenizer(source)["input_ids"], "labels": tokenizer(target)["input_ids"]}
                for (source, _), (target, _) in zip(pairs[::2], pairs[1::2])]

    return Case(lambda: tiny_t5(len(tokenizer)), rows(11, N_TRAIN), rows(12, N_EVAL),
                lambda tok, model: DataCollatorForSeq2Seq(tok, model=model),
                lambda: [Accuracy(), Perplexity(shift=False)], token_reference(shift=False), tokenizer)


def token_classification_case():
    """DataCollatorForTokenClassification: per-token labels, -100 on [CLS]/[SEP] and on the padding it adds."""
    from transformers import DataCollatorForTokenClassification

    tokenizer = tiny_tokenizer()

    def rows(seed, n):
        data = []
        for text, _ in sentences(n, seed):
            ids = tokenizer(text)["input_ids"]
            data.append({"input_ids": ids, "labels": [-100] + [i % 3 for i in ids[1:-1]] + [-100]})
        return data

    def reference(logits, labels):
        return {"accuracy": numpy_accuracy(logits, labels), **numpy_prf1(logits, labels, 3, per_class=False)}

    return Case(lambda: tiny_bert("token", len(tokenizer), num_labels=3), rows(13, N_TRAIN), rows(14, N_EVAL),
                lambda tok, model: DataCollatorForTokenClassification(tok),
                lambda: [Accuracy(), PrecisionRecallF1(3, per_class=False)], reference, tokenizer)


def default_collator_case():
    """default_data_collator on a `datasets.Dataset` of equal-length rows in torch format, labels -100 after each
    row's end."""
    datasets = pytest.importorskip("datasets")
    from transformers import default_data_collator

    tokenizer = tiny_tokenizer()

    def dataset(seed, n):
        ids = [tokenizer(text, padding="max_length", max_length=12)["input_ids"] for text, _ in sentences(n, seed)]
        labels = [[t if t != 0 else -100 for t in row] for row in ids]
        return datasets.Dataset.from_dict({"input_ids": ids, "labels": labels}).with_format("torch")

    return Case(lambda: tiny_llama(len(tokenizer)), dataset(15, N_TRAIN), dataset(16, N_EVAL),
                lambda tok, model: default_data_collator, lambda: [TokenAccuracy(), Perplexity()],
                token_reference(shift=True), tokenizer)


CASES = {"DataCollatorWithPadding": padding_case, "BatchEncoding": batch_encoding_case,
         "plain dict": plain_dict_case, "tuple": tuple_case, "LanguageModeling causal": causal_lm_case,
         "LanguageModeling masked": masked_lm_case, "Seq2Seq": seq2seq_case,
         "TokenClassification": token_classification_case, "default_data_collator": default_collator_case}


# ---------------------------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------------------------
def build(runner, case: Case, output_dir, metrics=None):
    from transformers import Trainer

    if case.compute_loss is not None:
        runner = type(f"TupleLoss{runner.__name__}", (runner,), {"compute_loss": case.compute_loss})
    model = case.make_model()
    args = hf_args(output_dir, per_device_train_batch_size=4, per_device_eval_batch_size=3, num_train_epochs=1,
                   learning_rate=1e-3, logging_steps=1, save_strategy="no", **case.extra_args)
    kwargs = {"processing_class": case.tokenizer} if case.processing_class else {}
    if case.make_collator is not None:
        kwargs["data_collator"] = case.make_collator(case.tokenizer, model)
    if metrics is not None and not issubclass(runner, Trainer):
        kwargs["metrics"] = metrics
    return runner(model, args, train_dataset=case.train_rows, **kwargs)


def first_array(predictions):
    return predictions[0] if isinstance(predictions, tuple) else predictions


@pytest.mark.parametrize("name", list(CASES))
def test_training_matches_trainer_and_streaming_metrics_match_numpy(tmp_path, name):
    from transformers import Trainer

    case = CASES[name]()
    runs = {}
    for runner_name, runner in (("hf", Trainer), ("loopkit", Loop)):  # build, then train: one runner at a time
        runs[runner_name] = build(runner, case, tmp_path / runner_name, case.make_metrics())
        runs[runner_name].train()
    losses = {key: [e["loss"] for e in run.state.log_history if "loss" in e] for key, run in runs.items()}
    assert len(losses["hf"]) == 3, f"HF logged {losses['hf']}: the case is misconfigured"
    assert_close(losses["loopkit"], losses["hf"], RTOL, f"{name}: logged training losses")
    train_loss = {key: run.state.log_history[-1]["train_loss"] for key, run in runs.items()}
    assert_close([train_loss["loopkit"]], [train_loss["hf"]], RTOL, f"{name}: train_loss")

    loop = runs["loopkit"]
    torch.manual_seed(1)  # random masks (MLM) drawn alike in predict() and each evaluate()
    prediction = loop.predict(case.eval_rows)
    labels = case.eval_labels if case.eval_labels is not None else prediction.label_ids
    expected = case.reference(first_array(prediction.predictions), labels)
    outputs = []
    evaluation_loop = loop.evaluation.evaluation_loop  # the evaluation stage owns evaluation_loop
    loop.evaluation.evaluation_loop = lambda *a, **k: outputs.append(evaluation_loop(*a, **k)) or outputs[-1]
    eval_sets = [("map-style", case.eval_rows), ("iterable", Stream(case.eval_rows))]
    if hasattr(case.eval_rows, "to_iterable_dataset"):  # a `datasets.Dataset`: its own iterable form too
        eval_sets.append(("datasets iterable", case.eval_rows.to_iterable_dataset()))
    for kind, eval_set in eval_sets:
        torch.manual_seed(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = loop.evaluate(eval_set)
        assert not [w for w in caught if "streaming metric" in str(w.message).lower()], \
            f"{name} ({kind}): {[str(w.message) for w in caught]}"
        assert outputs[-1].num_samples == N_EVAL, f"{name} ({kind}): num_samples"
        for key, value in expected.items():
            assert metrics[f"eval_{key}"] == pytest.approx(value, rel=1e-5), f"{name} ({kind}): eval_{key}"


# ---------------------------------------------------------------------------------------------------------------
# Metrics that receive no rows say so: never a silent NaN or 0
# ---------------------------------------------------------------------------------------------------------------
def test_metrics_without_labelled_batches_warn_and_report_nothing(tmp_path):
    """Labels under a name the model's forward does not take ("target"): column removal drops them, so no batch has
    labels (HF's compute_metrics would get none either)."""
    tokenizer = tiny_tokenizer()
    rows = [{**tokenizer(text), "target": label} for text, label in sentences(4, 17)]
    loop = Loop(tiny_bert("sequence", len(tokenizer)), hf_args(tmp_path), processing_class=tokenizer,
                metrics=[Accuracy(), PrecisionRecallF1(2)])
    with pytest.warns(UserWarning, match=r"\(accuracy, f1\) received no labelled batch.*label_names=\['labels'\] "
                                         r"\(the last batch has \['attention_mask', 'input_ids'\]\)"):
        metrics = loop.evaluate(rows)
    assert not [k for k in metrics if "accuracy" in k or "f1" in k]


def test_metric_that_counts_no_label_warns_and_is_nan(tmp_path):
    """Every label -100: 0 of 0 is undefined; the value is NaN (not 0.0) and a warning names the metric."""
    tokenizer = tiny_tokenizer()
    rows = [{**tokenizer(text), "labels": -100} for text, _ in sentences(4, 18)]
    loop = Loop(tiny_bert("sequence", len(tokenizer)), hf_args(tmp_path), processing_class=tokenizer,
                metrics=[Accuracy(), PrecisionRecallF1(2, per_class=False)])
    with pytest.warns(UserWarning) as caught:
        metrics = loop.evaluate(rows)
    messages = [str(w.message) for w in caught]
    for metric in ("Accuracy ('accuracy')", "PrecisionRecallF1 ('f1')"):
        assert any(m.startswith(f"Streaming metric {metric} counted no label") for m in messages), messages
    assert all(np.isnan(metrics[f"eval_{key}"]) for key in ("accuracy", "precision", "recall", "f1"))


def test_tuple_batch_without_override_and_metric_without_its_key_fail_clearly(tmp_path):
    tokenizer = tiny_tokenizer()
    case = tuple_case()
    loop = Loop(MeanEmbeddingClassifier(len(tokenizer)), hf_args(tmp_path, remove_unused_columns=False),
                data_collator=case.make_collator(None, None), metrics=[Accuracy()])
    with pytest.raises(TypeError, match=r"The batch is a tuple of 2 items.*override compute_loss"):
        loop.evaluate(case.eval_rows)
    loop.compute_loss = tuple_compute_loss.__get__(loop)
    with pytest.raises(KeyError, match=r"Accuracy\(label_key='labels'\) reads the labels from batch\['labels'\].*"
                                       r"it has 2 positions.*label_key=1"):
        loop.evaluate(case.eval_rows)
