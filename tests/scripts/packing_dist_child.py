"""Packed training launched by tests/test_packing.py with `torchrun --nproc_per_node 2` (and run in one process
there for the reference): each batch of the same global batch packed on its own (`pack="batch"`), SGD, gradient
accumulation 2. Samples carry different numbers of tokens, so the loss is right only if the token count of each
window is summed across ranks.

Usage: python packing_dist_child.py OUT_DIR  (writes weights_rank<r>.safetensors and losses_rank<r>.json)
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from loopkit import Loop, LoopArgs, PackingDataStage

GLOBAL_BATCH, STEPS = 8, 4


def samples(n: int = 64) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(n):
        ids = torch.randint(1, 64, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g).tolist()
        data.append({"input_ids": ids, "labels": ids})
    return data


def train(out_dir: str) -> Loop:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = LoopArgs(output_dir=out_dir, per_device_train_batch_size=GLOBAL_BATCH // world,
                    gradient_accumulation_steps=2, max_steps=STEPS, optim="sgd", learning_rate=0.5, logging_steps=1,
                    save_strategy="no", report_to="none", disable_tqdm=True)
    loop = Loop(model, args, train_dataset=samples(), data=PackingDataStage(row_tokens=24, pack="batch"))
    loop.train()
    rank = int(os.environ.get("RANK", "0"))
    # With save_strategy="no" only rank 0 creates out_dir (for its run report), and on a busy machine rank 1 can
    # get here first.
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in loop.model.named_parameters()},
              os.path.join(out_dir, f"weights_rank{rank}.safetensors"))
    with open(os.path.join(out_dir, f"losses_rank{rank}.json"), "w") as f:
        json.dump([h["loss"] for h in loop.state.log_history if "loss" in h], f)
    return loop


if __name__ == "__main__":
    train(sys.argv[1])
