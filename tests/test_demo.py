"""The README's demo (`make demo`) runs end to end at a tiny size: the real MiniLM on real reviews, through `Loop`.

It runs as a user runs it, in its own interpreter, and is checked by what it prints and leaves on disk.
"""

import json
import os
import re
import sys

from helpers import run_process

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "finetune_minilm.py")


def test_demo_trains_evaluates_each_epoch_and_keeps_only_the_best_checkpoint(tmp_path):
    output_dir = tmp_path / "run"
    # 32 reviews at batch 16: 2 optimizer steps per epoch, 2 epochs, so 2 evaluations and 2 checkpoints are made.
    command = [sys.executable, DEMO, "--train-size", "32", "--val-size", "32", "--test-size", "24", "--epochs", "2",
               "--output-dir", str(output_dir)]
    result = run_process(command, "examples/finetune_minilm.py",
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    accuracy = re.search(r"^test accuracy: ([0-9.]+) on (\d+) held-out reviews$", result.stdout, re.MULTILINE)
    assert accuracy, result.stdout[-3000:]
    assert 0.0 <= float(accuracy.group(1)) <= 1.0
    assert int(accuracy.group(2)) == 24

    best = re.search(r"^best checkpoint: (\S+) ", result.stdout, re.MULTILINE)
    assert best, result.stdout[-3000:]
    best_dir = best.group(1)
    assert os.path.isfile(os.path.join(best_dir, "model.safetensors"))
    # save_total_limit=1 with load_best_model_at_end: only the best checkpoint is left at the end.
    checkpoints = sorted(name for name in os.listdir(output_dir) if name.startswith("checkpoint-"))
    assert checkpoints == [os.path.basename(best_dir)]

    # One evaluation per epoch, each logged above the progress bar.
    assert result.stdout.count("'eval_accuracy'") == 2, result.stdout[-3000:]
    with open(os.path.join(best_dir, "trainer_state.json")) as f:
        state = json.load(f)
    assert state["best_model_checkpoint"] == best_dir
    assert state["best_metric"] == max(entry["eval_accuracy"] for entry in state["log_history"]
                                       if "eval_accuracy" in entry)
