"""Notebook friendliness (issue 16, item 5): in a Jupyter kernel `Loop` shows HF's notebook progress display, as
`Trainer` does, with the same table; `Loop` has a readable `repr`; the run report renders as Markdown.

No Jupyter here: a kernel is simulated by what HF's and loopkit's detection read (`IPython.get_ipython().config`
holding "IPKernelApp") and an `IPython.display` that records what would be displayed."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, regression_data, tiny_regression
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback

from loopkit import Loop, LoopArgs, StepStage
from loopkit import report as report_module


def fake_ipython(monkeypatch, config: dict) -> list:
    """Install an `IPython` whose shell has `config`; returns the list of HTML strings displayed."""
    shown = []

    class HTML:
        def __init__(self, data):
            self.data = data

    class Handle:
        def update(self, obj):
            shown.append(obj.data)

    def display(obj, display_id=None):
        shown.append(obj.data)
        return Handle()

    display_module = types.ModuleType("IPython.display")
    display_module.HTML, display_module.display = HTML, display
    ipython = types.ModuleType("IPython")
    ipython.display = display_module
    ipython.get_ipython = lambda: types.SimpleNamespace(config=config)
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display_module)
    monkeypatch.delitem(sys.modules, "transformers.utils.notebook", raising=False)  # imported against this IPython
    return shown


@pytest.fixture
def kernel(monkeypatch):
    shown = fake_ipython(monkeypatch, {"IPKernelApp": {}})
    yield shown
    sys.modules.pop("transformers.utils.notebook", None)


def keep_tables(monkeypatch) -> list:
    """The notebook callback drops its table at on_train_end: keep each one (its rows) there."""
    from transformers.utils.notebook import NotebookProgressCallback

    tables, on_train_end = [], NotebookProgressCallback.on_train_end

    def keeping(self, args, state, control, **kwargs):
        tables.append(self.training_tracker.inner_table)
        return on_train_end(self, args, state, control, **kwargs)

    monkeypatch.setattr(NotebookProgressCallback, "on_train_end", keeping)
    return tables


def notebook_table(runner, callbacks, tmp_path, tables, **arg_overrides):
    """Train a tiny regression with evaluation; the notebook callback's table rows and evaluate()'s keys."""
    settings = dict(max_steps=4, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=2,
                    logging_steps=2, save_strategy="no", learning_rate=0.05)
    args = hf_args(tmp_path, **settings) if runner is Trainer else \
        LoopArgs(output_dir=str(tmp_path), **settings, **arg_overrides)
    trainer = runner(model=tiny_regression(), args=args, train_dataset=regression_data(16),
                     eval_dataset=regression_data(8, seed=1), callbacks=callbacks)
    trainer.train()
    progress = [cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "NotebookProgressCallback"]
    assert len(progress) == 1
    return tables[-1], sorted(trainer.evaluate())


@IGNORE_PIN_MEMORY_WARNING
def test_in_a_notebook_kernel_loop_shows_hfs_notebook_table(tmp_path, kernel, monkeypatch):
    from transformers.utils.notebook import NotebookProgressCallback

    tables = keep_tables(monkeypatch)
    # HF chooses its notebook callback when transformers.trainer is imported (long done here), so it is passed.
    hf_table, hf_keys = notebook_table(Trainer, [NotebookProgressCallback], tmp_path / "hf", tables)
    hf_shown = len(kernel)
    table, keys = notebook_table(Loop, None, tmp_path / "loop", tables, disable_tqdm=False)
    assert table[0] == hf_table[0] == ["Step", "Training Loss", "Validation Loss"]
    assert [row[0] for row in table] == [row[0] for row in hf_table] and len(table) == 3  # evaluations at 2, 4
    for mine, theirs in zip(table[1:], hf_table[1:]):
        assert mine[1:] == pytest.approx(theirs[1:], rel=1e-5)
    assert keys == hf_keys and "eval_runtime" not in keys  # as under Trainer: the callback pops the runtimes
    assert any("Validation Loss" in html for html in kernel[hf_shown:])


def test_outside_a_kernel_the_progress_bars_are_tqdms(tmp_path, monkeypatch):
    fake_ipython(monkeypatch, {"TerminalIPythonApp": {}})  # the terminal IPython is no notebook (HF's rule)
    loop = Loop(model=tiny_regression(), args=LoopArgs(output_dir=str(tmp_path), disable_tqdm=False))
    assert isinstance(loop.callback_handler.callbacks[-1], ProgressCallback)
    assert "transformers.utils.notebook" not in sys.modules


def test_loop_repr_names_model_stages_arguments_data_and_progress(tmp_path):
    class ClippingStep(StepStage):
        pass

    loop = Loop(model=tiny_regression(), step=ClippingStep(), train_dataset=regression_data(12),
                eval_dataset={"a": regression_data(4), "b": regression_data(2)},
                args=LoopArgs(output_dir=str(tmp_path), learning_rate=0.1, max_steps=3, bf16=False,
                              disable_tqdm=True, save_strategy="no"))
    text = repr(loop)
    for part in ("Loop(", "TinyRegression (3 parameters, 3 trainable, on cpu)", "step=ClippingStep",
                 "data=DataStage", "learning_rate=0.1", "max_steps=3", f"output_dir={str(tmp_path)!r}",
                 "train_dataset=list(12 rows)", "eval_dataset={'a': list(4 rows), 'b': list(2 rows)}",
                 "callbacks: DefaultFlowCallback, PrinterCallback", "global_step=0"):
        assert part in text, f"{part!r} missing from:\n{text}"
    assert "num_train_epochs" not in text  # max_steps decides, so it is the one shown
    loop.train()
    assert "global_step=3/3" in repr(loop)


def test_run_report_renders_as_markdown(tmp_path):
    loop = Loop(model=tiny_regression(), train_dataset=regression_data(8),
                args=LoopArgs(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                              logging_steps=1, disable_tqdm=True, save_strategy="no"))
    assert loop.report is None  # before train()
    loop.train()
    report = loop.report
    with open(tmp_path / "run_report.json") as f:
        assert json.load(f) == json.loads(json.dumps(report, default=str))  # the report the run wrote
    markdown = report._repr_markdown_()
    assert markdown.startswith(f"**loopkit run report: completed  ({tmp_path})**")
    assert "- steps 2/2, epoch 1" in markdown
    assert "| phase | seconds | % |" in markdown and "| forward |" in markdown
    charts = report["charts"]
    if isinstance(charts, list):  # matplotlib installed: the images, drawn in memory when shown, written nowhere
        names = report_module.chart_names(report)
        assert charts == [] and names and not list(tmp_path.glob("*.png"))
        for chart in names:
            assert f"![{chart}](data:image/png;base64,iVBORw0KGgo" in markdown  # a PNG's first bytes, base64
        # Once drawn into the folder (`python -m loopkit report`), a report links the files.
        drawn = type(report)(report, charts=report_module.draw_charts(report, str(tmp_path)))
        assert drawn["charts"] == names
        for chart in names:
            assert f"![{chart}]({os.path.join(str(tmp_path), chart)})" in drawn._repr_markdown_()
            assert os.path.isfile(tmp_path / chart)
