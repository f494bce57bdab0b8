"""The run report (summary, time by phase, slow steps, charts, the run record, the CLI), export with
dynamic shapes, and resource release."""

import json
import os
import signal
import sys
import warnings

import pytest
import torch
from transformers import (AutoModelForSequenceClassification, BatchEncoding, BertConfig,
                          BertForSequenceClassification, TrainerCallback)

from helpers import IGNORE_PIN_MEMORY_WARNING, PROCESS_WAIT_S, JumpingClock, hf_args, run_process
from loopkit import Loop, LoopArgs, report
from loopkit.export import ExportError, export_model

HERE = os.path.dirname(__file__)
PNG = b"\x89PNG\r\n\x1a\n"
CHARTS = ("loss.png", "learning_rate.png", "eval_metrics.png", "throughput.png")


def tiny_classifier(layers=2):
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=layers,
                                                    num_attention_heads=2, intermediate_size=32, num_labels=2,
                                                    max_position_embeddings=64))


def classification_data(n=32):
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": int(i % 2)} for i in range(n)]


def small_run(output_dir, callbacks=(), teardown=None, **kwargs):
    kwargs = {"max_steps": 10, "per_device_train_batch_size": 4, "logging_steps": 2, "eval_strategy": "steps",
              "eval_steps": 5, "save_steps": 5, "disable_tqdm": True, **kwargs}
    return Loop(model=tiny_classifier(), args=LoopArgs(output_dir=str(output_dir), **kwargs),
                train_dataset=classification_data(), eval_dataset=classification_data(8), callbacks=list(callbacks),
                teardown=teardown)


def is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG


class SlowAt(TrainerCallback):
    """Step `step`'s `on_step_end` takes `seconds` on `clock` (a JumpingClock): slow by construction, not by sleeping,
    so no step of a busy machine's run can look slower."""

    def __init__(self, step, seconds, clock):
        self.step, self.seconds, self.clock = step, seconds, clock

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.clock.jump(self.seconds)


def test_run_report_summary_phases_slow_steps_and_charts(tmp_path, capsys, monkeypatch):
    clock = JumpingClock().install(monkeypatch)
    args = LoopArgs(output_dir=str(tmp_path), max_steps=30, per_device_train_batch_size=4, logging_steps=5,
                    eval_strategy="steps", eval_steps=10, save_steps=15, disable_tqdm=True)
    slow_callback = SlowAt(25, 1000.0, clock)
    loop = Loop(model=tiny_classifier(), args=args, train_dataset=classification_data(),
                eval_dataset=classification_data(8), callbacks=[slow_callback])
    loop.train()
    written = json.load(open(tmp_path / "run_report.json"))
    assert written["status"] == "completed" and written["global_step"] == 30
    assert written["final_metrics"]["step"] == 30 and "eval_loss" in written["final_metrics"]
    assert written["samples_per_second"] > 0 and written["input_tokens"] == 30 * 4 * 8
    assert written["peak_host_memory_mb"] > 0
    seconds = written["time_by_phase"]["seconds"]
    for phase in report.PHASES:
        assert seconds[phase] > 0 or phase == "compile", phase
    assert seconds["compile"] == 0 and written["compile"] is None  # nothing compiled (tests/test_compile.py does)
    assert sum(seconds.values()) == pytest.approx(written["total_seconds"], rel=1e-4)
    assert seconds["callbacks"] >= slow_callback.seconds  # the slow callback's time is where it belongs
    slow = [s for s in written["slow_steps"] if s["step"] == 25]
    assert slow and max(slow[0]["phases"], key=slow[0]["phases"].get) == "callbacks"
    printed = capsys.readouterr().out
    assert "loopkit run report: completed" in printed and "slow step 25" in printed
    assert "time by phase" in open(tmp_path / "run_report.md").read()
    # The charts: none written by train(); the command the summary names draws them all.
    assert written["charts"] == [] and not list(tmp_path.glob("*.png"))
    assert f"python -m loopkit report {tmp_path} draws them" in printed
    assert report.main(["report", str(tmp_path)]) == 0
    assert f"  charts: {', '.join(CHARTS)}" in capsys.readouterr().out.splitlines()
    for chart in CHARTS:
        assert is_png(tmp_path / chart), chart


def test_the_report_counts_all_of_train_and_its_charts_are_there_when_it_returns(tmp_path):
    """Three train() calls in one process, as in a hyper-parameter search: every run's report is there when its
    train() returns, and with `TeardownStage(charts=True)` its charts too, drawn in the "report" phase. (That each
    report counts every second of its train() once: tests/test_report_clock.py, on a deterministic clock; how long
    the report takes: `python -m benchmarks.profiles.report_time`.)"""
    from loopkit.stages.teardown import TeardownStage

    for trial in range(3):
        teardown = TeardownStage(charts=True) if trial < 2 else None  # the third: the default, no charts
        small_run(tmp_path / f"trial-{trial}", teardown=teardown, max_steps=20,
                  learning_rate=1e-4 * (trial + 1)).train()
        written = json.load(open(tmp_path / f"trial-{trial}" / "run_report.json"))
        for chart in CHARTS:
            path = tmp_path / f"trial-{trial}" / chart
            assert is_png(path) if trial < 2 else not path.exists(), (trial, chart)
        assert written["charts"] == (list(CHARTS) if trial < 2 else [])
        seconds = written["time_by_phase"]["seconds"]
        assert written["global_step"] == 20 and seconds["setup"] > 0 and seconds["report"] > 0


def test_without_matplotlib_the_report_says_how_to_get_charts(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    small_run(tmp_path, max_steps=4).train()
    assert json.load(open(tmp_path / "run_report.json"))["charts"] == report.CHARTS_HINT
    assert "pip install 'loopkit[charts]'" in open(tmp_path / "run_report.md").read()
    assert "pip install 'loopkit[charts]'" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))


def test_a_crashed_run_reports_its_failure(tmp_path):
    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        small_run(tmp_path, [Crash()], save_steps=2).train()
    written, own = report.report_from_files(str(tmp_path))  # it covers checkpoint-4: the run's own report
    assert own and written["end"] == "failed"
    assert written["status"].startswith("failed: RuntimeError") and written["global_step"] == 5
    assert written["total_seconds"] > 0 and written["segments"][0]["to_step"] == 5


def bracket(events, step):
    """The seconds the run record of `step`'s checkpoint can hold: its clock starts inside train(), before
    on_train_begin (the child's times count from just before train()), and it is read after that step's
    on_step_end, before its on_save. Exact bounds, whatever the machine's load; 1e-6: the record's rounding."""
    train_begin = next(e["t"] for e in events if "train_begin" in e)
    return (next(e["t"] for e in events if e.get("step_end") == step) - train_begin - 1e-6,
            next(e["t"] for e in events if e.get("saved") == step) + 1e-6)


def test_killed_run_rebuilt_from_its_run_record_and_resumed_report_covers_the_whole_run(tmp_path, forked):
    sys.path.insert(0, os.path.join(HERE, "scripts"))
    try:
        import report_child
    finally:
        sys.path.pop(0)
    out = tmp_path / "run"
    # Both children fork from the session's fork server (conftest.forked: one intra-op thread, unbuffered).
    result = forked.run([sys.executable, report_child.__file__, str(out), "8"],
                        "the run killed at step 8")  # SIGKILL at step 8: checkpoint-6 is the newest
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    killed = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"')]
    # The CLI rebuilds the report from checkpoint-6, charts included.
    cli = forked.run([sys.executable, "-m", "loopkit", "report", str(out)], "python -m loopkit report")
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert all(is_png(out / chart) for chart in CHARTS)
    rebuilt = json.load(open(out / "run_report.json"))
    earliest, latest = bracket(killed, 6)
    assert rebuilt["status"] == "incomplete: the run stopped without reaching its end (killed?), rebuilt from " \
        "checkpoint-6" and rebuilt["global_step"] == 6
    assert earliest <= rebuilt["total_seconds"] <= latest, (earliest, rebuilt["total_seconds"], latest)
    assert rebuilt["metric_for_best_model"] == "eval_loss" and rebuilt["greater_is_better"] is False
    assert sum(rebuilt["time_by_phase"]["seconds"].values()) == pytest.approx(rebuilt["total_seconds"], rel=1e-4)
    assert rebuilt["time_by_phase"]["seconds"]["setup"] > 0
    assert report.seconds_text(rebuilt["total_seconds"]) in cli.stdout and "best eval_loss=" in cli.stdout

    resumed = report_child.train(out)  # from checkpoint-6 to the end, in this process
    final = json.load(open(out / "run_report.json"))
    assert [(s["from_step"], s["to_step"]) for s in final["segments"]] == [(0, 6), (6, 20)]
    assert final["segments"][0] == rebuilt["segments"][0]
    assert final["total_seconds"] == pytest.approx(rebuilt["total_seconds"] + final["this_run_seconds"], abs=1e-5)
    assert final["time_by_phase"]["seconds"]["setup"] > rebuilt["time_by_phase"]["seconds"]["setup"]
    summary = report.summary_text(final)
    assert "2 segments:" in summary and "resumed at step 6: steps 6-20 in" in summary
    record = json.load(open(out / "checkpoint-18" / "loopkit_state.json"))["run_record"]
    earliest, latest = bracket(resumed.events, 18)
    assert [(s["from_step"], s["to_step"]) for s in record["segments"]] == [(0, 6), (6, 18)]
    assert earliest <= record["segments"][1]["seconds"] <= latest
    assert record["elapsed_seconds"] == pytest.approx(sum(s["seconds"] for s in record["segments"]), abs=1e-5)


@IGNORE_PIN_MEMORY_WARNING
def test_a_report_rebuilt_from_an_hf_trainer_checkpoint_says_unknown(tmp_path):
    from transformers import Trainer

    args = hf_args(tmp_path, max_steps=4, per_device_train_batch_size=4, save_steps=4, eval_strategy="steps",
                   eval_steps=4, metric_for_best_model="eval_loss", use_cpu=True)
    Trainer(model=tiny_classifier(), args=args, train_dataset=classification_data(),
            eval_dataset=classification_data(8)).train()
    rebuilt, own = report.report_from_files(str(tmp_path))
    assert not own and rebuilt["total_seconds"] is None and rebuilt["time_by_phase"] is None
    assert rebuilt["metric_for_best_model"] is None  # trainer_state.json does not name it
    text = report.summary_text(rebuilt)
    assert "time unknown (steps 0-4 ran without a run record)" in text and "0.0 s" not in text

    with pytest.warns(UserWarning, match="not written by loopkit"):
        small_run(tmp_path, max_steps=8, save_steps=100, eval_steps=100).train(resume_from_checkpoint=True)
    resumed = json.load(open(tmp_path / "run_report.json"))
    assert resumed["total_seconds"] is None and resumed["this_run_seconds"] > 0
    assert resumed["segments"][0] == {"from_step": 0, "to_step": 4, "seconds": None, "phase_seconds": None}
    assert resumed["time_by_phase"]["covers_steps"] == [[4, 8]]
    text = report.summary_text(resumed)
    assert "time unknown (steps 0-4 ran without a run record)" in text and "time by phase (steps 4-8): " in text


def token_inputs(batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, max(1, length * 3 // 4):] = 0  # a padded row (never all padding)
    return {"input_ids": torch.randint(0, 100, (batch, length), generator=g), "attention_mask": mask}


OTHER_SHAPES = [(2, 20), (1, 20), (1, 1), (5, 64)]  # the model's maximum positions is 64; the example is 3 x 48


def test_exports_take_other_batch_sizes_and_lengths_and_reproduce_the_trained_model(tmp_path):
    import onnxruntime

    args = LoopArgs(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4, save_strategy="no",
                    disable_tqdm=True, learning_rate=1e-2)
    loop = Loop(model=tiny_classifier(layers=1), args=args, train_dataset=classification_data())
    loop.train()
    example = BatchEncoding(token_inputs(3, 48))  # what a tokenizer returns: a Mapping, not a dict
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = loop.export(str(tmp_path / "export"), example, formats=["pretrained", "torch_export", "onnx"])
    assert not [w for w in caught if "Fell back" in str(w.message)]
    for fmt, (path, diff) in results.items():
        assert os.path.exists(path) and diff < 1e-5, (fmt, diff)
    model = loop.model.eval()
    program = torch.export.load(results["torch_export"][0]).module()
    session = onnxruntime.InferenceSession(results["onnx"][0])
    assert all(isinstance(d, str) for i in session.get_inputs() for d in i.shape), "ONNX axes are not dynamic"
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "export").eval()
    for batch, length in OTHER_SHAPES:
        inputs = token_inputs(batch, length, seed=batch * 100 + length)
        with torch.no_grad():
            expected = model(**inputs).logits
            torch.testing.assert_close(program(**inputs).logits, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(reloaded(**inputs).logits, expected, rtol=1e-5, atol=1e-5)
        onnx_logits = session.run(None, {k: v.numpy() for k, v in inputs.items()})[0]
        torch.testing.assert_close(torch.from_numpy(onnx_logits), expected, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        untrained = tiny_classifier(layers=1).eval()
        assert not torch.allclose(untrained(**token_inputs(2, 20)).logits, model(**token_inputs(2, 20)).logits)


def test_export_captured_from_a_single_row_takes_other_shapes(tmp_path):
    model = tiny_classifier(layers=1).eval()
    (path, diff), = export_model(model, str(tmp_path), token_inputs(1, 1), formats=["torch_export"]).values()
    program = torch.export.load(path).module()
    for batch, length in OTHER_SHAPES:
        inputs = token_inputs(batch, length)
        with torch.no_grad():
            torch.testing.assert_close(program(**inputs).logits, model(**inputs).logits)


class SizedForTheExample(torch.nn.Module):
    """A head over the flattened sequence (or batch and sequence): it only works at the example's length."""

    def __init__(self, flatten_batch=False):
        super().__init__()
        torch.manual_seed(0)
        self.flatten_batch = flatten_batch
        self.embed, self.head = torch.nn.Embedding(100, 4), torch.nn.Linear(4 * 8 * (3 if flatten_batch else 1), 2)

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        return {"logits": self.head(hidden.reshape(-1) if self.flatten_batch else hidden.flatten(1))}


@pytest.mark.parametrize("fmt", ["torch_export", "onnx"])
def test_export_falls_back_to_a_fixed_sequence_with_a_warning(tmp_path, fmt):
    import onnxruntime

    model = SizedForTheExample().eval()
    example = {"input_ids": torch.randint(0, 100, (3, 8))}
    with pytest.warns(UserWarning, match=r"with dynamic shapes \(dynamic batch and sequence: .*\)\. Fell back: the "
                                         r"export accepts any batch size, the sequence fixed \(input_ids 3 x 8\)"):
        (path, diff), = export_model(model, str(tmp_path), example, formats=[fmt]).values()
    assert diff < 1e-6
    if fmt == "torch_export":
        run = torch.export.load(path).module()
    else:
        session = onnxruntime.InferenceSession(path)
        run = lambda input_ids: {"logits": torch.from_numpy(session.run(None, {"input_ids": input_ids.numpy()})[0])}
    for batch in (1, 5):
        ids = torch.randint(0, 100, (batch, 8))
        with torch.no_grad():
            torch.testing.assert_close(run(input_ids=ids)["logits"], model(ids)["logits"])
    with pytest.raises(Exception):
        run(input_ids=torch.randint(0, 100, (2, 9)))


def test_export_falls_back_to_the_example_shape_with_a_warning(tmp_path):
    model = SizedForTheExample(flatten_batch=True).eval()
    example = {"input_ids": torch.randint(0, 100, (3, 8))}
    with pytest.warns(UserWarning, match=r"dynamic batch and sequence: .*; dynamic batch: .*\)\. Fell back: the "
                                         r"export accepts only the example's shape \(input_ids 3 x 8\)"):
        (path, diff), = export_model(model, str(tmp_path), example, formats=["torch_export"]).values()
    program = torch.export.load(path).module()
    with torch.no_grad():
        torch.testing.assert_close(program(**example)["logits"], model(**example)["logits"])
    with pytest.raises(Exception):
        program(input_ids=torch.randint(0, 100, (1, 8)))


def test_export_without_onnx_says_how_to_get_it(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_onnxruntime(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'", name="onnxruntime")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_onnxruntime)
    with pytest.raises(ExportError, match="pip install onnx onnxscript onnxruntime"):
        export_model(tiny_classifier(), str(tmp_path), {"input_ids": torch.zeros(1, 4, dtype=torch.long)},
                     formats=["onnx"])


def test_resources_are_released_after_a_run(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = run_process([sys.executable, os.path.join(HERE, "scripts", "resources_child.py"), str(tmp_path)],
                         "scripts/resources_child.py", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert counts["tensorboard_files"] >= 1  # the writer really ran (and must have been closed)
    assert counts["leaked_fds"] == {} and counts["children_after"] == counts["children_before"], counts
