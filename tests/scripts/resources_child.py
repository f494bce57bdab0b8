"""Counts open file descriptors and child processes before and after a run that uses dataloader workers (persistent
ones), TensorBoard, evaluation and checkpoints; prints both counts as JSON."""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from loopkit import Loop, LoopArgs


def open_fds() -> dict:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used
            pass
    return fds


def children() -> int:
    me, count = str(os.getpid()), 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                count += f.read().rsplit(")", 1)[1].split()[1] == me
        except OSError:
            pass
    return count


def main():
    out = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (x := torch.randint(0, 64, (8,), generator=g)), "labels": x.clone()} for _ in range(32)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    args = LoopArgs(output_dir=out, max_steps=6, per_device_train_batch_size=4, logging_steps=2, save_steps=3,
                    eval_strategy="steps", eval_steps=3, dataloader_num_workers=2,
                    dataloader_persistent_workers=True, report_to=["tensorboard"], disable_tqdm=True)
    before = {"fds": open_fds(), "children": children()}
    loop = Loop(model=model, args=args, train_dataset=data, eval_dataset=data[:8])
    loop.train()
    during = {"tensorboard_files": sum(len(f) for _, _, f in os.walk(os.path.join(out, "runs")))}
    after = {"fds": open_fds(), "children": children()}
    leaked = {fd: target for fd, target in after["fds"].items() if before["fds"].get(fd) != target}
    print(json.dumps({"before": len(before["fds"]), "after": len(after["fds"]), "leaked_fds": leaked,
                      "children_before": before["children"], "children_after": after["children"], **during}))


if __name__ == "__main__":
    main()
