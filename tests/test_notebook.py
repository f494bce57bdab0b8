"""Notebook friendliness (issue 16, item 5): in a Jupyter kernel `Loop` shows HF's notebook progress display, as
`Trainer` does, with the same table; `Loop` has a readable `repr`; the run report renders as Markdown.
One kernel, many runs (issue 45, item 5): FSDP or DeepSpeed without a launcher is refused when the `Loop` is built,
by name, leaving the process as it was; a variable an earlier Trainer left (`ACCELERATE_USE_FSDP`) is named with its
fix; `log_level="error"` keeps `train()` quiet; `LoopArgs` refuses what `TrainingArguments` refuses.

No Jupyter here: a kernel is simulated by what HF's and loopkit's detection read (`IPython.get_ipython().config`
holding "IPKernelApp") and an `IPython.display` that records what would be displayed."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import types

import pytest
import torch
from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, regression_data, tiny_regression
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback

from loopkit import Loop, LoopArgs, StepStage
from loopkit import report as report_module
from loopkit.distributed import LAUNCHER_VARIABLES, DistributedSetupError


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


# ---------------------------------------------------------------------------------------------------------------
# One kernel, many runs: engines without a launcher, and what an earlier run left in the environment
# ---------------------------------------------------------------------------------------------------------------
DEEPSPEED_CONFIG = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                    "train_batch_size": "auto", "gradient_accumulation_steps": "auto"}


def process_globals() -> dict:
    """What a `Loop` may change in its process: the environment, transformers' verbosity, torch's deterministic
    mode, and Accelerate's shared states (copied)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers.utils import logging as hf_logging

    return {"environ": dict(os.environ), "verbosity": hf_logging.get_verbosity(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "accelerate": [dict(state._shared_state) for state in (PartialState, AcceleratorState, GradientState)]}


@contextlib.contextmanager
def environment_kept():
    """The environment and Accelerate's state as they were, after what runs inside (a Trainer changes both)."""
    from accelerate.state import AcceleratorState

    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def no_launcher(monkeypatch):
    """A notebook's process: no launcher's variables, no MPI for DeepSpeed to ask, no engine asked by the
    environment."""
    if importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("mpi4py") is not None:
        pytest.skip("needs DeepSpeed installed and mpi4py not (with mpi4py DeepSpeed finds one process by MPI)")
    for name in (*LAUNCHER_VARIABLES, "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)


def test_deepspeed_without_a_launcher_is_refused_by_name_at_construction_leaving_the_process_as_found(
        tmp_path, no_launcher):
    from transformers import TrainingArguments

    # HF Trainer in the same case: built, then train() fails inside deepspeed.initialize (DeepSpeed asks MPI), and
    # ACCELERATE_USE_DEEPSPEED=true stays behind.
    with environment_kept():
        trainer = Trainer(model=tiny_regression(), args=TrainingArguments(
            str(tmp_path / "hf"), deepspeed=DEEPSPEED_CONFIG, max_steps=2, report_to="none", disable_tqdm=True),
            train_dataset=regression_data(8))
        with pytest.raises(ModuleNotFoundError, match="mpi4py"):
            trainer.train()
        assert os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true"
    before = process_globals()
    with pytest.raises(DistributedSetupError) as refused:
        Loop(model=tiny_regression(), args=LoopArgs(str(tmp_path / "loop"), deepspeed=DEEPSPEED_CONFIG, max_steps=2),
             train_dataset=regression_data(8))
    message = str(refused.value)
    assert message.startswith("DeepSpeed was asked for by deepspeed={'zero_optimization': {'stage': 2}")
    assert "no launcher started this process (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in message
    assert "`torchrun --nproc_per_node N train.py`" in message and "python -m loopkit torchrun" in message
    assert ("os.environ.update(MASTER_ADDR='localhost', MASTER_PORT='29500', RANK='0', LOCAL_RANK='0', "
            "WORLD_SIZE='1')") in message
    assert process_globals() == before
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ


def test_fsdp_without_a_launcher_is_refused_by_field_and_value_leaving_the_environment_as_found(tmp_path,
                                                                                               no_launcher):
    before = process_globals()
    with pytest.raises(DistributedSetupError) as refused:
        Loop(model=tiny_regression(), args=LoopArgs(str(tmp_path), fsdp="full_shard"))
    message = str(refused.value)
    assert message.startswith("FSDP was asked for by fsdp='full_shard', but Accelerate runs distributed_type=NO")
    assert "drop the FSDP configuration (fsdp=..., fsdp_plugin=...)" in message
    assert "ACCELERATE_USE_FSDP" not in message  # not asked by the environment: no variable to unset
    assert process_globals() == before


def test_a_variable_left_by_trainers_fsdp_attempt_is_named_with_its_fix(tmp_path, no_launcher):
    from transformers import TrainingArguments

    with environment_kept():
        # HF Trainer refuses FSDP without a launcher, after its Accelerator exported ACCELERATE_USE_FSDP=true.
        with pytest.raises(ValueError, match="Using fsdp only works in distributed training"):
            Trainer(model=tiny_regression(), args=TrainingArguments(str(tmp_path / "hf"), fsdp=True,
                                                                     report_to="none"))
        assert os.environ["ACCELERATE_USE_FSDP"] == "true"
        before = process_globals()
        with pytest.raises(DistributedSetupError) as refused:
            Loop(model=tiny_regression(), args=LoopArgs(str(tmp_path / "loop")))
        message = str(refused.value)
        assert message.startswith("FSDP was asked for by os.environ['ACCELERATE_USE_FSDP']='true', but")
        assert "remove it: del os.environ['ACCELERATE_USE_FSDP']" in message
        assert process_globals() == before  # the variable stays the user's to remove
        del os.environ["ACCELERATE_USE_FSDP"]  # the fix the message names
        loop = Loop(model=tiny_regression(), args=LoopArgs(str(tmp_path / "loop"), max_steps=1, disable_tqdm=True,
                                                           save_strategy="no"), train_dataset=regression_data(4))
        assert loop.train().global_step == 1


# ---------------------------------------------------------------------------------------------------------------
# A quiet train(): log_level="error" (above WARNING) prints neither bars, nor logs, nor the run summary
# ---------------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def verbosity_kept():
    """transformers' verbosity as it was: a Loop's log_level stays set until the next Loop takes it back."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def evaluated_run(tmp_path, **fields) -> Loop:
    loop = Loop(model=tiny_regression(), train_dataset=regression_data(16), eval_dataset=regression_data(8, seed=1),
                args=LoopArgs(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=1,
                              eval_strategy="steps", eval_steps=2, save_steps=2, **fields))
    loop.train()
    loop.evaluate()
    return loop


@IGNORE_PIN_MEMORY_WARNING
@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_log_level_error_keeps_train_quiet_and_the_summary_prints_without_it(tmp_path, capfd, disable_tqdm):
    with verbosity_kept():
        evaluated_run(tmp_path / "shown", disable_tqdm=disable_tqdm)
        shown = capfd.readouterr()
        loop = evaluated_run(tmp_path / "quiet", disable_tqdm=disable_tqdm, log_level="error")
        quiet = capfd.readouterr()
    assert "{'loss': " in shown.out  # each log printed, by the bars (tqdm.write) or the printer, as under Trainer
    assert f"loopkit run report: completed  ({tmp_path / 'shown'})" in shown.out
    assert ("it/s]" in shown.err) != disable_tqdm  # tqdm's bars
    assert (quiet.out, quiet.err) == ("", "")
    # Nothing lost but the printing: the logs, the report's files and the report.
    assert [entry["step"] for entry in loop.state.log_history if "loss" in entry] == [1, 2, 3, 4]
    assert loop.report["status"] == "completed" and (tmp_path / "quiet" / "run_report.md").is_file()
    assert [type(cb).__name__ for cb in loop.callback_handler.callbacks] == ["DefaultFlowCallback"]


def test_a_search_with_log_level_error_prints_nothing_per_trial(tmp_path, capfd):
    optuna = pytest.importorskip("optuna", reason="optuna is optional (pip install optuna)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # optuna's own line per trial (as under Trainer)
    with verbosity_kept():
        loop = Loop(model_init=lambda: tiny_regression(), train_dataset=regression_data(16),
                    eval_dataset=regression_data(8, seed=1),
                    args=LoopArgs(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                  eval_strategy="steps", eval_steps=2, save_strategy="no", log_level="error"))
        best = loop.hyperparameter_search(n_trials=2, direction="minimize",
                                          hp_space=lambda trial: {"learning_rate": trial.suggest_float(
                                              "learning_rate", 1e-3, 1e-1, log=True)})
        printed = capfd.readouterr()
    assert best.run_id in ("0", "1") and (tmp_path / "run-1" / "run_report.json").is_file()
    assert (printed.out, printed.err) == ("", "")
