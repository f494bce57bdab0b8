"""`python -m benchmarks.report_time`: what the run report costs `train()`, loopkit beside HF Trainer, in one process.

Both train the same tiny BERT classifier (20 steps, logging every 2, evaluating and saving every 5) in turn:
loopkit, HF, loopkit, HF, ... The first round is a warm-up and is dropped; the table gives medians and min-max:

* after on_train_end: from the `on_train_end` callback to `train()` returning. loopkit builds and writes its run
  report there (its charts are drawn after `train()` returns, by a background thread); HF Trainer does little.
* loopkit only: the share of the wall time around `train()` that its report accounts for, and the share the report
  puts under "other" (the loop's own bookkeeping between phases).

These figures were assertions of tests/test_report_export.py (at most 0.05 s after on_train_end, at least 97%
accounted for, "other" under 5%), which failed at random on a busy machine. The tests now check the accounting with
a deterministic clock (`helpers.JumpingClock`); the time is measured here, where both contenders share the load.

    python -m benchmarks.report_time               # 6 rounds
    python -m benchmarks.report_time --rounds 11
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

CONTENDERS = ("loopkit", "hf")


def build(contender: str, output_dir: str, callback):
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from loopkit import Loop, LoopArgs

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=2,
                                                     max_position_embeddings=64))
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": i % 2} for i in range(32)]
    fields = dict(output_dir=output_dir, max_steps=20, per_device_train_batch_size=4, logging_steps=2,
                  eval_strategy="steps", eval_steps=5, save_steps=5, disable_tqdm=True, report_to="none")
    runner, args = (Loop, LoopArgs(**fields)) if contender == "loopkit" else (Trainer, TrainingArguments(**fields))
    return runner(model=model, args=args, train_dataset=data, eval_dataset=data[:8], callbacks=[callback])


def one_run(contender: str, output_dir: str) -> dict:
    from transformers import TrainerCallback

    class TrainEnd(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            self.at = time.perf_counter()

    end = TrainEnd()
    runner = build(contender, output_dir, end)
    start = time.perf_counter()
    runner.train()
    returned = time.perf_counter()
    run = {"wall_s": returned - start, "after_train_end_s": returned - end.at}
    if contender == "loopkit":
        with open(os.path.join(output_dir, "run_report.json")) as f:
            written = json.load(f)
        run["accounted_percent"] = 100 * written["total_seconds"] / run["wall_s"]
        run["other_percent"] = written["time_by_phase"]["percent"]["other"]
    return run


def measure(rounds: int) -> dict:
    """{contender: [run, ...]} over `rounds` alternated rounds, the warm-up round left out."""
    runs = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as folder:
        for index in range(rounds + 1):
            for name in CONTENDERS:
                run = one_run(name, os.path.join(folder, f"{name}-{index}"))
                if index > 0:
                    runs[name].append(run)
    return runs


def cell(runs: list[dict], key: str, scale: float = 1.0) -> str:
    values = [run[key] * scale for run in runs if key in run]
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(runs: dict) -> str:
    rows = [("train() wall, s", "wall_s", 1.0), ("after on_train_end, ms", "after_train_end_s", 1e3),
            ("report accounts for, % of train()", "accounted_percent", 1.0),
            ('report\'s "other", %', "other_percent", 1.0)]
    lines = ["| median (min-max) | loopkit | HF Trainer |", "|---|---:|---:|"]
    lines += [f"| {label} | {cell(runs['loopkit'], key, scale)} | {cell(runs['hf'], key, scale)} |"
              for label, key, scale in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds (after one warm-up round)")
    rounds = parser.parse_args(argv).rounds
    runs = measure(rounds)
    print(f"{rounds} rounds, loopkit and HF Trainer alternated, one process, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end\n")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
