"""The run report (summary, time by phase, slow steps, charts, the CLI), export, and resource release."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import (AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification,
                          TrainerCallback)

from loopkit import Loop, LoopArgs
from loopkit.export import ExportError

HERE = os.path.dirname(__file__)




def tiny_classifier():
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=32, num_labels=2))


def classification_data(n=32):
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": int(i % 2)} for i in range(n)]


class SlowAt(TrainerCallback):
    def __init__(self, step, seconds):
        self.step, self.seconds = step, seconds

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            time.sleep(self.seconds)


def test_run_report_summary_phases_slow_steps_and_charts(tmp_path, capsys):
    args = LoopArgs(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=4, logging_steps=5,
                    eval_strategy="steps", eval_steps=10, save_steps=15, disable_tqdm=True)
    loop = Loop(model=tiny_classifier(), args=args, train_dataset=classification_data(),
                eval_dataset=classification_data(8), callbacks=[SlowAt(25, 0.5)])
    loop.train()
    report = json.load(open(tmp_path / "run_report.json"))
    assert report["status"] == "completed" and report["global_step"] == 30
    assert report["final_metrics"]["step"] == 30 and "eval_loss" in report["final_metrics"]
    assert report["samples_per_second"] > 0 and report["input_tokens"] == 30 * 4 * 8
    assert report["peak_host_memory_mb"] > 0
    seconds = report["time_by_phase"]["seconds"]
    for phase in ("data", "forward", "backward", "optimizer", "callbacks", "evaluation", "checkpoint"):
        assert seconds[phase] > 0, phase
    assert sum(seconds.values()) == pytest.approx(report["total_seconds"], rel=0.05)
    assert seconds["callbacks"] >= 0.5  # the sleeping callback's time is where it belongs
    slow = [s for s in report["slow_steps"] if s["step"] == 25]
    assert slow and max(slow[0]["phases"], key=slow[0]["phases"].get) == "callbacks"
    for chart in ("loss.png", "learning_rate.png", "eval_metrics.png"):
        with open(tmp_path / chart, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", chart
    printed = capsys.readouterr().out
    assert "loopkit run report: completed" in printed and "slow step 25" in printed
    assert "time by phase" in open(tmp_path / "run_report.md").read()


def test_report_cli_rebuilds_a_crashed_run(tmp_path):
    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise RuntimeError("crash")

    args = LoopArgs(output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=4, logging_steps=1,
                    save_steps=2, disable_tqdm=True)
    with pytest.raises(RuntimeError):
        Loop(model=tiny_classifier(), args=args, train_dataset=classification_data(), callbacks=[Crash()]).train()
    assert json.load(open(tmp_path / "run_report.json"))["status"].startswith("failed: RuntimeError")
    os.remove(tmp_path / "run_report.json")  # as if killed before the teardown: only checkpoints remain
    os.remove(tmp_path / "loss.png")
    result = subprocess.run([sys.executable, "-m", "loopkit", "report", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "incomplete (rebuilt from checkpoint-4)" in result.stdout
    assert (tmp_path / "loss.png").is_file()
    assert json.load(open(tmp_path / "run_report.json"))["global_step"] == 4


def test_export_formats_reproduce_the_trained_model(tmp_path):
    args = LoopArgs(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, save_strategy="no",
                    disable_tqdm=True, learning_rate=1e-2)
    loop = Loop(model=tiny_classifier(), args=args, train_dataset=classification_data())
    loop.train()
    example = {"input_ids": torch.randint(0, 100, (3, 8)), "attention_mask": torch.ones(3, 8, dtype=torch.long)}
    formats = ["pretrained", "torch_export"]
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
        formats.append("onnx")
    except ImportError:
        pass
    results = loop.export(str(tmp_path / "export"), example, formats=formats)
    for fmt, (path, diff) in results.items():
        assert os.path.exists(path) and diff < 1e-5, (fmt, diff)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    untrained = tiny_classifier().eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**example).logits, loop.model.eval()(**example).logits)
        assert not torch.allclose(untrained(**example).logits, reloaded(**example).logits)


def test_export_without_onnx_says_how_to_get_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_onnxruntime(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'", name="onnxruntime")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_onnxruntime)
    from loopkit.export import export_model

    with pytest.raises(ExportError, match="pip install onnx onnxscript onnxruntime"):
        export_model(tiny_classifier(), str(tmp_path), {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
                     formats=["onnx"])


def test_resources_are_released_after_a_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, os.path.join(HERE, "scripts", "resources_child.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["tensorboard_files"] >= 1  # the writer really ran (and must have been closed)
    assert counts["leaked_fds"] == {} and counts["children_after"] == counts["children_before"], counts
