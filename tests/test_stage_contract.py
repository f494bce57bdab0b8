"""The stage contract: each stage works on a small `RunState` and `RunContext` without a `Loop`, stages touch no
`Loop` or other stage, every shared field has the one writer `loopkit/run_state.py` declares, every context field is made
and assigned where it declares (never by a stage), and overrides take one path."""

import ast
import os
import re

import pytest
import torch
from torch import nn

import loopkit
from loopkit import Loop, LoopArgs, LoopConfigError, StepStage
from loopkit.events import EventHandler
from loopkit.trainer.overridable import CONTEXT_VIEWS, OWNERS, RUN_VIEWS
from loopkit.memory import MemoryTracker
from loopkit.run_state import RunContext, RunState
from loopkit.stages.data import DataStage, Window
from loopkit.stages.evaluation import EvalStage
from loopkit.stages.setup import SetupStage
from loopkit.stages.teardown import TeardownStage

from helpers import TinyRegression, regression_data, small_run, tiny_regression

PACKAGE = os.path.dirname(loopkit.__file__)


# A stage's own test builds a small run state and context (tests/helpers.py: `small_run`), never a `Loop`.
def test_setup_stage_alone_makes_the_accelerator_and_builds_the_model(tmp_path):
    from accelerate import Accelerator

    setup = SetupStage()
    run, context = small_run(tmp_path, [setup], model_init=lambda: tiny_regression(3))
    given = context.accelerator
    accelerator, gather = setup.create_accelerator_and_gather()
    memory = setup.track_memory()
    # Made and returned, not assigned: the context still holds what it was given.
    assert isinstance(accelerator, Accelerator) and gather == accelerator.gather_for_metrics
    assert isinstance(memory, MemoryTracker) and context.accelerator is given and context.memory is not memory
    setup.build(None)
    assert isinstance(run.model, TinyRegression)
    assert torch.equal(run.model.linear.weight, tiny_regression(3).linear.weight)
    assert run.model_accepts_loss_kwargs is False  # TinyRegression.forward(x, labels): no **kwargs


def test_data_stage_alone_plans_and_windows_the_epoch(tmp_path):
    data = DataStage()
    args = LoopArgs(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=3,
                    num_train_epochs=1, report_to="none")
    run, _ = small_run(tmp_path, [data], args=args, train_dataset=regression_data(10), model=tiny_regression())
    run.label_names = ["labels"]
    run.train_dataloader = data.get_train_dataloader()
    plan = data.plan(run.train_dataloader)
    assert (plan.steps_in_epoch, plan.num_update_steps_per_epoch, plan.max_steps) == (5, 2, 2)
    windows = list(data.windows(0, plan, None))
    assert [len(w.batches) for w in windows] == [3, 2]  # the short last window
    assert [w.first_index for w in windows] == [0, 3]
    seen = torch.cat([b["labels"] for w in windows for b in w.batches])
    assert sorted(seen.tolist()) == sorted(s["labels"].item() for s in regression_data(10))
    assert data.state_dict() == {"position": {"epoch": 0, "micro_batches": 5, "samples": 10}}


def test_step_stage_alone_takes_one_exact_sgd_step(tmp_path):
    step = StepStage()
    args = LoopArgs(output_dir=str(tmp_path), learning_rate=0.1, max_grad_norm=0.0, report_to="none")
    model = tiny_regression()
    run, _ = small_run(tmp_path, [step], args=args, model=model,
                    optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
    step.prepare(max_steps=1, checkpoint=None)
    batches = [{"x": torch.randn(4, 2), "labels": torch.randn(4)} for _ in range(2)]
    expected = tiny_regression()  # the same start, trained by hand: mean of the two micro-batch losses, one SGD step
    loss = sum(nn.functional.mse_loss(expected.linear(b["x"]).squeeze(-1), b["labels"]) for b in batches) / 2
    loss.backward()
    with torch.no_grad():
        for p in expected.parameters():
            p -= 0.1 * p.grad
    result = step.run_step(Window(batches, 0), epoch=0, steps_in_epoch=2)
    assert result.completed and run.state.global_step == 1 and run.state.epoch == 1.0
    assert torch.allclose(sum(result.losses), loss.detach(), rtol=1e-6)
    assert torch.allclose(result.grad_norm, torch.cat([p.grad.flatten() for p in expected.parameters()]).norm())
    for mine, theirs in zip(model.parameters(), expected.parameters()):
        assert torch.allclose(mine, theirs, rtol=1e-6, atol=1e-7)


def test_eval_stage_alone_streams_the_loss(tmp_path):
    evaluation, data = EvalStage(), DataStage()
    samples = regression_data(7)
    model = tiny_regression()
    args = LoopArgs(output_dir=str(tmp_path), per_device_eval_batch_size=3, report_to="none")
    run, context = small_run(tmp_path, [evaluation, data], args=args, model=model, eval_dataset=samples)
    run.label_names = ["labels"]
    context.get_eval_dataloader = data.get_eval_dataloader
    context.count_loss_items = lambda batches: None
    context.compute_loss_context_manager = torch.no_grad
    context.compute_loss = lambda model, inputs, return_outputs=False, num_items_in_batch=None: (
        (lambda out: (out["loss"], out) if return_outputs else out["loss"])(model(**inputs)))
    metrics = evaluation.evaluate()
    with torch.no_grad():  # HF's eval_loss: each batch's mean loss weighted by its size (3, 3 and 1 samples)
        losses = [model(**{k: torch.stack([s[k] for s in samples[i:i + 3]]) for k in ("x", "labels")})["loss"]
                  for i in range(0, 7, 3)]
    expected = (losses[0] * 3 + losses[1] * 3 + losses[2] * 1).item() / 7
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert run.state.log_history[-1]["eval_loss"] == metrics["eval_loss"]


def test_teardown_stage_alone_summarises_and_fires_train_end(tmp_path):
    from loopkit.stages.data import TrainingPlan

    teardown, heard = TeardownStage(), []

    class Listener:
        def on_train_end(self, args, state, control, **kwargs):
            heard.append(state.global_step)

    run, context = small_run(tmp_path, [teardown], model=tiny_regression())
    context.events = EventHandler([Listener()], [teardown], run)
    run.state.global_step = run.state.max_steps = 4
    plan = TrainingPlan(1, 4, 8, 8.0, 2, 4, 4)
    output = teardown.finish_training(plan, start_time=0.0, train_loss=0.5, steps_run=4)
    assert output.global_step == 4 and output.training_loss == 0.5 and heard == [4]
    assert run.state.log_history[-1]["train_loss"] == 0.5


# ---------------------------------------------------------------------------------------------------------------
# Nobody reaches into the Loop or another stage; each shared field has its one declared writer
# ---------------------------------------------------------------------------------------------------------------
def source_files():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PACKAGE), ast.parse(open(path, encoding="utf-8").read())


def test_no_stage_reads_the_loop_or_another_stage():
    stage_names = {"setup", "data", "step", "evaluation", "teardown", "schedule"}
    for rel, tree in source_files():
        if not rel.startswith("stages"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "loop":
                pytest.fail(f"{rel}:{node.lineno} reads `.loop`")
            if isinstance(node, ast.Name) and node.id == "loop":
                pytest.fail(f"{rel}:{node.lineno} uses a name `loop`")
            if isinstance(node, ast.Attribute) and node.attr in stage_names and \
                    isinstance(node.value, ast.Attribute) and node.value.attr in ("run", "context"):
                pytest.fail(f"{rel}:{node.lineno} reaches another stage through the run state or context")


def declared_writers(header: str, column: int = -1) -> dict:
    """Parse a table of `loopkit/run_state.py`'s docstring: field -> the file named in `column` (the last: its writer)."""
    doc = ast.get_docstring(ast.parse(open(os.path.join(PACKAGE, "run_state.py")).read()))
    table = doc.split(header, 1)[1].split("\n\n", 1)[0]
    writers, writer = {}, None
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        found = re.search(r"[\w/]+\.py", cells[column])
        writer = found.group(0) if found else writer  # a row with an empty writer cell continues the one above
        writers.update(dict.fromkeys((name.strip() for name in cells[0].split(",") if name.strip()), writer))
    return writers


def assignment_targets(node):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    for target in targets:
        yield from (target.elts if isinstance(target, ast.Tuple) else [target])


def is_run(node) -> bool:
    return (isinstance(node, ast.Name) and node.id == "run") or (isinstance(node, ast.Attribute) and node.attr == "run")


def is_state(node) -> bool:
    return (isinstance(node, ast.Name) and node.id == "state") or \
        (isinstance(node, ast.Attribute) and node.attr == "state" and is_run(node.value))


LOOP_CLASSES = {"Loop", "HFMethods", "TrainerAPI", "Seq2SeqLoop"}  # where `self` is a Loop


def loop_selves(tree) -> set[int]:
    """The ids of the `self` names inside the Loop's own classes (their writes go through its attribute views)."""
    selves = set()
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef) and (cls.name in LOOP_CLASSES or
                                              any(getattr(b, "id", None) in LOOP_CLASSES for b in cls.bases)):
            selves |= {id(n) for n in ast.walk(cls) if isinstance(n, ast.Name) and n.id == "self"}
    return selves


def is_loop(node, selves: set[int]) -> bool:
    """A `Loop`: `self` in its classes, or a name `loop` (a function handed the Loop, e.g. loopkit/trainer/search.py)."""
    return isinstance(node, ast.Name) and (node.id == "loop" or id(node) in selves)


def actual_writers() -> tuple[dict, dict]:
    """Who writes each run-state and state field: through `run.<field>`, and through the Loop's attribute views
    (`self.is_in_train = True` in the Loop, `loop.model = ...`)."""
    run_fields, state_fields = {}, {}
    for rel, tree in source_files():
        selves = loop_selves(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RunState":
                for keyword in node.keywords:
                    run_fields.setdefault(keyword.arg, set()).add(rel)
            if not isinstance(node, (ast.Assign, ast.AugAssign)):
                continue
            for target in assignment_targets(node):
                if not isinstance(target, ast.Attribute):
                    continue
                if is_run(target.value) or (target.attr in RUN_VIEWS and is_loop(target.value, selves)):
                    run_fields.setdefault(target.attr, set()).add(rel)
                view = target.value
                if is_state(view) or (isinstance(view, ast.Attribute) and view.attr == "state" and
                                      is_loop(view.value, selves)):
                    state_fields.setdefault(target.attr, set()).add(rel)
    return run_fields, state_fields


def test_every_shared_field_has_its_declared_single_writer():
    run_declared = declared_writers("| field ")
    state_declared = declared_writers("| state field ")
    run_actual, state_actual = actual_writers()
    from dataclasses import fields

    assert set(run_declared) == {f.name for f in fields(RunState)}, "run.py's table and RunState's fields differ"
    for field, files in run_actual.items():
        assert field in run_declared, f"run.{field} is written in {sorted(files)} but RunState has no such field"
        assert files == {run_declared[field]}, f"run.{field} is written in {sorted(files)}, declared: " \
                                               f"{run_declared[field]}"
    for field, files in state_actual.items():
        assert field in state_declared, f"state.{field} is written in {sorted(files)} but has no declared writer"
        assert files == {state_declared[field]}, f"state.{field} is written in {sorted(files)}, declared: " \
                                                 f"{state_declared[field]}"
    assert run_actual["optimizer"] == {"stages/step.py"} and state_actual["global_step"] == {"stages/step.py"}
    assert run_actual["is_in_train"] == {"loop.py"}  # written only as `self.is_in_train`: a view write is seen


def test_writes_through_the_loops_attribute_views_are_seen():
    """A write through a view (`self.model = ...` in the Loop's classes, `loop.optimizer = ...` in a function handed
    the Loop) counts as a write of the run-state field, wherever it is."""
    code = ("class Loop(HFMethods):\n    def f(self):\n        self.model = None\n"
            "def g(loop):\n    loop.optimizer = None\n\n\nclass Stage:\n    def h(self):\n        self.model = None\n")
    tree = ast.parse(code)
    selves = loop_selves(tree)
    targets = [t for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in assignment_targets(node)]
    seen = sorted(t.attr for t in targets if t.attr in RUN_VIEWS and is_loop(t.value, selves))
    assert seen == ["model", "optimizer"]  # the stage's own `self.model` is no view


def is_context(node) -> bool:
    """`context`, or `<anything>.context` (a stage's `self.context`, the Loop's, `loop.context`)."""
    return (isinstance(node, ast.Name) and node.id == "context") or \
        (isinstance(node, ast.Attribute) and node.attr == "context")


def context_assignments(files) -> dict:
    """Each context field -> [(file, the value assigned)], over `files` ((path, tree) pairs): `context.<field> = ...`
    (`self.context.<field>`, `loop.context.<field>`), `RunContext(<field>=...)`, and writes through the Loop's views
    (`self.accelerator = ...` in its classes, `loop.checkpointer = ...`)."""
    found = {}
    for rel, tree in files:
        selves = loop_selves(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "RunContext":
                for keyword in node.keywords:
                    found.setdefault(keyword.arg, []).append((rel, keyword.value))
            if not isinstance(node, (ast.Assign, ast.AugAssign)):
                continue
            for target in assignment_targets(node):
                if isinstance(target, ast.Attribute) and (is_context(target.value) or (
                        target.attr in CONTEXT_VIEWS and is_loop(target.value, selves))):
                    found.setdefault(target.attr, []).append((rel, node.value))
    return found


STAGE_NAMES = ("setup", "data", "step", "evaluation", "teardown")


def made_by_stage(value, stage: str) -> bool:
    """The value comes from `stage`: `self.<stage>.<method>(...)`, or the Loop's own `self.<method>` for a method
    the stage owns (`loopkit.trainer.overridable.OWNERS`), which reaches the stage's implementation or an override of it."""
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
        owner = value.func.value
        return isinstance(owner, ast.Attribute) and owner.attr == stage
    return isinstance(value, ast.Attribute) and OWNERS.get(value.attr) == stage


def test_every_context_field_is_made_and_assigned_where_run_py_declares():
    from dataclasses import fields

    assigned_by = declared_writers("| context field ")
    made_by = declared_writers("| context field ", column=-2)
    assert set(assigned_by) == {f.name for f in fields(RunContext)}, "run.py's context table and RunContext differ"
    assert not set(assigned_by) & {f.name for f in fields(RunState)}, "a field is both state and context"
    found = context_assignments(source_files())
    assert set(found) == set(assigned_by), f"never assigned: {sorted(set(assigned_by) - set(found))}"
    for field, sites in found.items():
        files = {rel for rel, _ in sites}
        assert field in assigned_by, f"context.{field} is assigned in {sorted(files)} but RunContext has no such field"
        assert not any(rel.startswith("stages") for rel in files), f"a stage assigns context.{field}: {sorted(files)}"
        assert files == {assigned_by[field]}, f"context.{field} is assigned in {sorted(files)}, declared: " \
                                              f"{assigned_by[field]}"
        maker = made_by[field]
        for rel, value in sites:
            if maker.startswith("stages/"):
                stage = maker[len("stages/"):-len(".py")]
                assert made_by_stage(value, stage), f"{rel}:{value.lineno}: context.{field} is not the {stage} stage's"
            else:
                assert not any(made_by_stage(value, s) for s in STAGE_NAMES), \
                    f"{rel}:{value.lineno}: context.{field} comes from a stage, declared: {maker}"
    assert made_by["accelerator"] == made_by["memory"] == "stages/setup.py"


def test_a_stage_assigning_a_context_field_is_seen():
    """However a stage (or the Loop, through a view) assigns a context field, the contract test sees it."""
    code = ("class Mine(SetupStage):\n    def build(self, model):\n        self.context.accelerator = None\n"
            "        context = self.context\n        context.memory = None\n"
            "class Loop(HFMethods):\n    def f(self):\n        self.checkpointer = None\n"
            "        self.model = None\n")
    found = context_assignments([("stages/mine.py", ast.parse(code))])
    assert sorted(found) == ["accelerator", "checkpointer", "memory"]  # `self.model` is the run state's view


def test_no_function_in_loopkit_is_over_60_lines_and_loop_py_is_under_300():
    long = [f"{rel}:{node.name} ({node.end_lineno - node.lineno + 1} lines)" for rel, tree in source_files()
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long
    with open(os.path.join(PACKAGE, "loop.py")) as f:
        assert len(f.read().splitlines()) < 300


# ---------------------------------------------------------------------------------------------------------------
# One override path
# ---------------------------------------------------------------------------------------------------------------
class HalfLossStep(StepStage):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        return (loss / 2, outputs) if return_outputs else loss / 2


class DoubleLossLoop(Loop):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        return (loss * 2, outputs) if return_outputs else loss * 2


def test_a_loop_override_and_a_stage_override_of_one_method_refuse_at_construction(tmp_path):
    args = LoopArgs(output_dir=str(tmp_path), report_to="none")
    with pytest.raises(LoopConfigError, match="both DoubleLossLoop.compute_loss and HalfLossStep.compute_loss"):
        DoubleLossLoop(tiny_regression(), args, step=HalfLossStep())


def test_a_loop_override_runs_with_the_loop_as_self_and_super_reaches_the_stage(tmp_path):
    args = LoopArgs(output_dir=str(tmp_path), report_to="none", per_device_eval_batch_size=4)
    samples = regression_data(8)
    plain = Loop(tiny_regression(), args, eval_dataset=samples).evaluate()["eval_loss"]
    doubled_loop = DoubleLossLoop(tiny_regression(), args, eval_dataset=samples)
    halved = Loop(tiny_regression(), args, eval_dataset=samples, step=HalfLossStep()).evaluate()["eval_loss"]
    assert doubled_loop.evaluate()["eval_loss"] == pytest.approx(2 * plain, rel=1e-6)
    assert halved == pytest.approx(plain / 2, rel=1e-6)
    # The override is on the owning stage, bound to the Loop: the stage calls it, `self` is the Loop.
    assert doubled_loop.step.compute_loss.__self__ is doubled_loop


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints written before the redesign resume exactly
# ---------------------------------------------------------------------------------------------------------------
def test_a_checkpoint_from_before_the_redesign_resumes_where_todays_run_ends(tmp_path):
    """`tests/fixtures/pre_redesign_checkpoint/checkpoint-6` was written by the code before the stage-contract
    redesign (running loss under "step", last logged step under "evaluation"); resuming it must end exactly where
    an uninterrupted run of today's code ends, with the same log history (the first log after the resume included).
    Bit-exact resume on one machine is tests/test_resume_exact.py's."""
    import importlib.util
    import shutil

    from helpers import hf_args, lm_data, tiny_llama

    here = os.path.dirname(__file__)
    spec = importlib.util.spec_from_file_location("fixture", os.path.join(here, "fixtures",
                                                                          "make_pre_redesign_checkpoint.py"))
    fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixture)
    full = Loop(tiny_llama(), hf_args(tmp_path / "full", **fixture.RUN), train_dataset=lm_data(40))
    full.train()
    shutil.copytree(os.path.join(here, "fixtures", "pre_redesign_checkpoint"), tmp_path / "resumed")
    resumed = Loop(tiny_llama(), hf_args(tmp_path / "resumed", **fixture.RUN), train_dataset=lm_data(40))
    resumed.train(resume_from_checkpoint=True)
    # The fixture's first 6 steps ran on another machine, whose CPU kernels round differently (its step-6 weights are
    # 1.6e-6 from this code's on an AVX2-only CPU), so the runs agree to float precision, not bit for bit; a lost
    # running loss or logging step would be off by far more (the step-8 log is checked to 1e-5).
    for name, tensor in full.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], tensor, rtol=1e-4, atol=1e-5)
    logs = [{k: v for k, v in entry.items() if not k.startswith("train_")} for entry in full.state.log_history]
    resumed_logs = [{k: v for k, v in entry.items() if not k.startswith("train_")}
                    for entry in resumed.state.log_history]
    assert [sorted(entry) for entry in resumed_logs] == [sorted(entry) for entry in logs]
    for got, expected in zip(resumed_logs, logs):
        assert got == pytest.approx(expected, rel=1e-5)
    assert any(entry.get("step") == 8 and "loss" in entry for entry in logs)  # the log right after the resume
