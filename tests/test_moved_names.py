"""Names that moved answer with their new place (issue 35): every old module path imports the module that now holds
its code, with a `DeprecationWarning` naming it at the user's line; `loopkit.stages.base.base_model` likewise; a
stage written before the run context existed (`self.run.accelerator`) is told to use `self.context.accelerator`.
And the imports users write today still work, with no warning."""

import importlib
import re
import sys
import warnings

import pytest
import torch

import loopkit
from loopkit.moved import MOVED_MODULES
from loopkit.run_state import CONTEXT_FIELDS, RunContext, RunState
from loopkit.stages.base import Stage


@pytest.mark.parametrize("old, new", sorted(MOVED_MODULES.items()))
def test_an_old_module_path_imports_the_new_module_and_names_it(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported once, a module is cached: warn as a first import
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")) as record:
        __import__(old)  # what `import loopkit.hub` runs, from this line
    assert sys.modules[old] is importlib.import_module(new)  # the same module: a name patched through either path is patched
    assert [w.filename for w in record if issubclass(w.category, DeprecationWarning)] == [__file__]  # the user's line


def test_from_the_old_package_path_and_attribute_access_warn_too(monkeypatch):
    monkeypatch.delitem(sys.modules, "loopkit.run", raising=False)
    monkeypatch.delattr(loopkit, "run", raising=False)  # an earlier import of loopkit.run set the attribute
    with pytest.warns(DeprecationWarning, match="loopkit.run moved to loopkit.run_state"):
        from loopkit import run
    assert run.RunState is RunState and run.RunContext is RunContext


def test_base_model_answers_at_its_old_place_with_its_new_one():
    from loopkit.models import base_model

    with pytest.warns(DeprecationWarning, match=re.escape("loopkit.models.base_model")) as record:
        from loopkit.stages.base import base_model as old
    assert old is base_model and record[0].filename == __file__
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        getattr(importlib.import_module("loopkit.stages.base"), "no_such_name")


class StageBeforeTheContext(Stage):
    """A stage as written before `RunContext` existed: the accelerator was a run-state field."""

    def device(self):
        return self.run.accelerator.device


def test_a_stage_reading_a_moved_run_state_field_is_told_where_it_is():
    stage = StageBeforeTheContext().bind(RunState(args=None), RunContext())
    with pytest.raises(AttributeError, match=re.escape("'RunState' object has no attribute 'accelerator': it moved "
                                                       "to the run context; use self.context.accelerator")):
        stage.device()


@pytest.mark.parametrize("name", sorted(CONTEXT_FIELDS))
def test_every_field_that_moved_to_the_context_names_its_replacement(name):
    run = RunState(args=None)
    with pytest.raises(AttributeError, match=re.escape(f"use self.context.{name} ")) as error:
        getattr(run, name)
    assert error.value.name == name and not hasattr(run, name)
    assert name in {"events", "clock", "checkpointer", "preemption", "accelerator", "gather_function", "memory", "log",
                    "compute_loss", "compute_loss_context_manager", "count_loss_items", "get_eval_dataloader",
                    "get_test_dataloader"}  # the RunState fields of before the context (git log -S RunContext)


def test_a_name_run_state_never_had_stays_a_plain_attribute_error():
    run = RunState(args=None)
    with pytest.raises(AttributeError, match=r"^'RunState' object has no attribute 'acelerator'$"):
        run.acelerator
    assert getattr(run, "acelerator", None) is None


def test_the_imports_users_write_today_work_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in loopkit.__all__:
            assert getattr(loopkit, name) is not None, name
        importlib.import_module("loopkit.observers")
        importlib.import_module("loopkit.storage")
        from loopkit.callbacks import EarlyStopping  # noqa: F401
        from loopkit.observers import StepObserver  # noqa: F401
        from loopkit.observers.throughput import Throughput  # noqa: F401
        from loopkit.stages.base import Stage as BaseStage
        from loopkit.stages.chunked_loss import ChunkedLossStep
        from loopkit.stages.data import DataStage
        from loopkit.stages.evaluation import EvalStage
        from loopkit.stages.packing import PackingDataStage
        from loopkit.stages.seq2seq import Seq2SeqEvalStage
        from loopkit.stages.setup import SetupStage
        from loopkit.stages.step import StepStage
        from loopkit.stages.teardown import TeardownStage
        from loopkit.storage import CheckpointStorage, DCPStorage, HFStorage  # noqa: F401
    assert (BaseStage, SetupStage, DataStage, StepStage, EvalStage, TeardownStage, PackingDataStage, ChunkedLossStep,
            Seq2SeqEvalStage) == (loopkit.Stage, loopkit.SetupStage, loopkit.DataStage, loopkit.StepStage,
                                  loopkit.EvalStage, loopkit.TeardownStage, loopkit.PackingDataStage,
                                  loopkit.ChunkedLossStep, loopkit.Seq2SeqEvalStage)


class SGDStep(loopkit.StepStage):
    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        return torch.optim.SGD, {"lr": args.learning_rate}


def test_get_optimizer_cls_and_kwargs_asks_the_step_stage_in_use(tmp_path):
    """HF's staticmethod, on a `Loop` with its own step stage, answers with that stage's rule (it named the default
    `StepStage` before); on the class, the class's step stage answers."""
    from helpers import hf_args, tiny_regression

    args = hf_args(tmp_path)
    loop = loopkit.Loop(tiny_regression(), args, step=SGDStep())
    assert loop.get_optimizer_cls_and_kwargs(args) == (torch.optim.SGD, {"lr": args.learning_rate})
    assert loopkit.Loop.get_optimizer_cls_and_kwargs(args) == loopkit.StepStage.get_optimizer_cls_and_kwargs(args)
    assert loopkit.Loop.get_optimizer_cls_and_kwargs(args)[0] is torch.optim.AdamW
