"""Recipe 8: preference training with DPO on chosen/rejected pairs against a frozen reference policy, optionally
weighting each pair by an external reward model's margin.

Pairs from real data: prompt `Review of <movie>:`, chosen = a *fresh* Rotten Tomatoes review of that movie,
rejected = a *rotten* review of the same movie. The policy is a small Llama over UTF-8 bytes, first fine-tuned for a
few steps as a plain language model on reviews (SFT, an ordinary `Loop` run); the reference is a frozen copy of it.

DPO (Rafailov et al., 2023), per pair, with log-probabilities summed over the response bytes only:

    margin = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
    loss   = -log sigmoid(beta * margin) * weight

The optional weight comes from an external reward model (here a bag-of-words sentiment scorer trained on other
reviews): `weight = 2 * sigmoid(r(chosen) - r(rejected))`, normalised to mean 1, so pairs the reward model finds
clear-cut count more and likely mislabelled ones less. The weights are constants computed once: the reward model is
never trained and needs no gradient.

Why the seed's snippet trained nothing: it computed `r_c, r_r = reward_model(chosen), reward_model(rejected)` under
`torch.no_grad()` and returned `-logsigmoid(r_c - r_r).mean()` as the loss. That number depends only on a frozen
model's outputs, computed without an autograd graph: it has no path to the policy's parameters, so `backward()`
either raises ("element 0 of tensors does not require grad") or, made to run, leaves every policy gradient `None` and
AdamW skips every parameter. A preference loss must be built from the *policy's* log-probabilities, as here; the
reward model can only decide how much each pair counts.

Style: the step stage `PreferenceStep` from `examples/stages/dpo_step.py` (here also named `DPOStep`) replaces
`compute_loss` and keeps the reference model; it is written against the stage contract only. An HF-style `Loop`
subclass overriding `compute_loss` works the same way. `remove_unused_columns=False`, since the pair columns are not
arguments of the model's `forward`.
"""

from __future__ import annotations

import copy
import os
import random
import sys
from collections import defaultdict

import torch
from torch import nn
from torch.utils.data import Dataset

from common import (BOS_ID, FRESH, PAD_ID, Size, byte_ids, cli, loop_args, output_folder, review_records,
                    tiny_llama, tokenizer)
from loopkit import Loop

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "stages"))
from dpo_step import PreferenceStep, dpo_margin, pair_logprobs, response_logprob  # noqa: E402,F401


# ----------------------------------------------------------------------------------------------------------------
# Data: preference pairs, and reviews for the SFT warm-up
# ----------------------------------------------------------------------------------------------------------------
def preference_pairs(count: int, seed: int = 0, skip: int = 0) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected): a fresh and a rotten review of the same movie."""
    by_movie = defaultdict(lambda: ([], []))
    for text, label, movie in review_records():
        by_movie[movie][0 if label == FRESH else 1].append(text)
    pairs = [(f"Review of {movie}: ", fresh, rotten) for movie, (fresh_list, rotten_list) in sorted(by_movie.items())
             for fresh, rotten in zip(fresh_list, rotten_list)]
    random.Random(seed).shuffle(pairs)
    return pairs[skip:skip + count]


def encode(prompt: str, response: str, max_length: int):
    """Byte ids (BOS + prompt + response, cut and right-padded), attention mask, and the response-byte mask."""
    prompt_ids, response_ids = [BOS_ID] + byte_ids(prompt), byte_ids(response)
    ids = (prompt_ids + response_ids)[:max_length]
    response_mask = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_length]
    pad = max_length - len(ids)
    return ids + [PAD_ID] * pad, [1] * len(ids) + [0] * pad, response_mask + [0] * pad


class PairDataset(Dataset):
    def __init__(self, pairs, max_length: int, weights=None):
        self.items = []
        for i, (prompt, chosen, rejected) in enumerate(pairs):
            item = {}
            for side, response in (("chosen", chosen), ("rejected", rejected)):
                ids, attention, response_mask = encode(prompt, response, max_length)
                item[f"{side}_ids"], item[f"{side}_attention_mask"] = torch.tensor(ids), torch.tensor(attention)
                item[f"{side}_response_mask"] = torch.tensor(response_mask, dtype=torch.float)
            item["weight"] = torch.tensor(1.0 if weights is None else float(weights[i]))
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


class ReviewLMDataset(Dataset):
    """Prompt + review as a language-modelling example (labels = ids, padding ignored)."""

    def __init__(self, pairs, max_length: int):
        self.items = []
        for prompt, chosen, rejected in pairs:
            for response in (chosen, rejected):
                ids, attention, _ = encode(prompt, response, max_length)
                labels = [i if a else -100 for i, a in zip(ids, attention)]
                self.items.append({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(attention),
                                   "labels": torch.tensor(labels)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


# ----------------------------------------------------------------------------------------------------------------
# The external reward model: bag-of-words sentiment, trained on reviews the pairs do not use
# ----------------------------------------------------------------------------------------------------------------
class BagOfWordsSentiment(nn.Module):
    """The mean of learnt per-word scores: a logistic regression on MiniLM's WordPiece tokens."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.words = nn.EmbeddingBag(vocab_size, 1, mode="mean")
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, flat_tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.words(flat_tokens, offsets).squeeze(1) + self.bias


def bag_of_tokens(texts) -> tuple[torch.Tensor, torch.Tensor]:
    """All texts' tokens in one flat tensor, and where each text starts (`EmbeddingBag`'s input)."""
    tok = tokenizer()
    lists = [ids or [tok.unk_token_id] for ids in tok(list(texts), add_special_tokens=False)["input_ids"]]
    offsets = torch.tensor([0] + [len(ids) for ids in lists[:-1]]).cumsum(0)
    return torch.tensor([i for ids in lists for i in ids]), offsets


def train_reward_model(texts_and_labels, steps: int = 100) -> BagOfWordsSentiment:
    flat, offsets = bag_of_tokens(text for text, _ in texts_and_labels)
    labels = torch.tensor([float(label) for _, label in texts_and_labels])
    torch.manual_seed(0)
    model = BagOfWordsSentiment(tokenizer().vocab_size)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(flat, offsets), labels).backward()
        optimizer.step()
    return model.eval()


@torch.no_grad()
def reward_weights(reward_model, pairs) -> torch.Tensor:
    """`2 * sigmoid(r(chosen) - r(rejected))`, normalised to mean 1: constants, no gradient anywhere."""
    margin = reward_model(*bag_of_tokens(c for _, c, _ in pairs)) - reward_model(*bag_of_tokens(r for _, _, r in pairs))
    weights = 2 * torch.sigmoid(margin)
    return weights / weights.mean()


# ----------------------------------------------------------------------------------------------------------------
# DPO: the step stage lives in examples/stages/dpo_step.py (written against the stage contract only)
# ----------------------------------------------------------------------------------------------------------------
DPOStep = PreferenceStep


def whole_batch(dataset: PairDataset) -> dict:
    return {k: torch.stack([item[k] for item in dataset.items]) for k in dataset.items[0]}


@torch.no_grad()
def mean_margin(policy, reference, dataset) -> float:
    return dpo_margin(policy.eval(), reference, whole_batch(dataset)).mean().item()


def main(tiny: bool = False, output_dir: str | None = None, weighted: bool = True, beta: float = 0.1):
    size = Size.pick(tiny)
    n_pairs, max_length = (32, 64) if tiny else (384, 160)
    output_dir = output_folder(output_dir, "dpo")
    pairs = preference_pairs(n_pairs)
    held_out = PairDataset(preference_pairs(n_pairs // 2, skip=n_pairs), max_length)

    # 1. SFT warm-up: the policy learns to write bytes of reviews; its copy becomes the frozen reference.
    policy = tiny_llama(hidden_size=32 if tiny else 64)
    sft_args = loop_args(f"{output_dir}/sft", size, learning_rate=3e-3, max_steps=8 if tiny else 120)
    Loop(model=policy, args=sft_args, train_dataset=ReviewLMDataset(pairs, max_length)).train()
    reference = copy.deepcopy(policy)

    # 2. The external reward model weights the pairs (trained on reviews outside the pairs).
    weights = None
    if weighted:
        in_pairs = {text for _, chosen, rejected in pairs for text in (chosen, rejected)}
        others = [(text, label) for text, label, _ in review_records() if text not in in_pairs]
        reward_model = train_reward_model(random.Random(1).sample(others, 3000))
        weights = reward_weights(reward_model, pairs)
        print(f"reward-model weights: min {weights.min():.2f}, max {weights.max():.2f}")
    train = PairDataset(pairs, max_length, weights)

    # 3. DPO.
    step = DPOStep(reference, beta=beta)
    args = loop_args(f"{output_dir}/dpo", size, learning_rate=1e-3, num_train_epochs=2 if tiny else 1,
                     remove_unused_columns=False, logging_steps=2 if tiny else 6)
    loop = Loop(model=policy, args=args, train_dataset=train, step=step)
    before = {"train": mean_margin(policy, reference, train), "held_out": mean_margin(policy, reference, held_out)}
    loop.train()
    after = {"train": mean_margin(policy, reference, train), "held_out": mean_margin(policy, reference, held_out)}
    print(f"policy margin over the reference, before -> after DPO: train {before['train']:.3f} -> "
          f"{after['train']:.3f}, held-out {before['held_out']:.3f} -> {after['held_out']:.3f}")
    return loop, step, before, after, weights


if __name__ == "__main__":
    cli(main, __doc__)
