"""Peak host memory of one training step of a causal LM at vocabulary 128k and sequence 512, with the model's own
loss vs `ChunkedLossStep`: each in a fresh subprocess, the peak resident set (ru_maxrss) after the step minus the
one before it (the model and data built), read at the end of the step by a callback (the run report's charts
come later and are not counted).

    python -m benchmarks.chunked_loss_memory [--vocab 128256] [--seq 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def one_step(chunked: bool, vocab: int, seq: int) -> dict:
    import resource
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from transformers import TrainerCallback

    from loopkit import ChunkedLossStep, Loop, LoopArgs

    class PeakAtStepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=seq)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (seq,))
    data = [{"input_ids": ids, "labels": ids}]
    args = LoopArgs(output_dir=tempfile.mkdtemp(), max_steps=1, per_device_train_batch_size=1, report_to="none",
                    disable_tqdm=True, save_strategy="no", optim="sgd", logging_steps=1)
    peak = PeakAtStepEnd()
    loop = Loop(model, args, train_dataset=data, step=ChunkedLossStep() if chunked else None, callbacks=[peak])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loop.train()
    loss = [h["loss"] for h in loop.state.log_history if "loss" in h][0]
    return {"chunked": chunked, "step_peak_mb": (peak.peak - before) / 1024, "loss": loss}


def measure(vocab: int, seq: int) -> dict:
    results = {}
    for chunked in (False, True):
        command = [sys.executable, "-m", "benchmarks.chunked_loss_memory", "--child", str(int(chunked)),
                   "--vocab", str(vocab), "--seq", str(seq)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        done = subprocess.run(command, capture_output=True, text=True, cwd=root, check=True)
        results["chunked" if chunked else "unchunked"] = json.loads(done.stdout.strip().splitlines()[-1])
    results["ratio"] = results["chunked"]["step_peak_mb"] / results["unchunked"]["step_peak_mb"]
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--child", type=int, default=None)
    options = parser.parse_args()
    if options.child is not None:
        print(json.dumps(one_step(bool(options.child), options.vocab, options.seq)))
    else:
        print(json.dumps(measure(options.vocab, options.seq), indent=1))
