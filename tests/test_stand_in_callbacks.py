"""loopkit's quiet stand-ins for HF's default callbacks (loopkit/default_callbacks.py) do exactly what HF's classes do,
and become HF's classes as soon as user code can see them.

In a fresh interpreter (tests/scripts/stand_in_child.py) that has not imported `transformers.trainer_utils` (nor HF's
callback module), `Loop`s built with `LoopArgs` get the stand-ins; the same configurations then run on `Loop` with
HF's classes and on HF `Trainer` (live), and the three must agree on every event, control flag, log, printed line and
progress-bar call (the log history with Trainer: to float32 precision, see `assert_as_trainer`). Then what user code
finds after `from transformers import DefaultFlowCallback, ...` (isinstance, class equality, add / pop / remove) must
be what it finds on `Trainer`, also when a callback looks mid-training.
"""

import inspect
import json
import os
import sys

import pytest
import transformers.trainer_callback as hf_callbacks

import loopkit.default_callbacks as default_callbacks
from loopkit.events import HF_EVENTS, is_noop

from helpers import run_process

TESTS = os.path.dirname(os.path.abspath(__file__))
STAND_INS = ["loopkit.default_callbacks.DefaultFlowCallback", "__main__.Recorder"]
HF = "transformers.trainer_callback."


def child(what: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    result = run_process([sys.executable, os.path.join(TESTS, "scripts", "stand_in_child.py"), what, TESTS],
                         f"a fresh interpreter comparing the stand-ins ({what})", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> dict:
    return child("runs")


@pytest.fixture(scope="module")
def handles() -> dict:
    return child("handles")


def without_classes(run: dict) -> dict:
    """A run's record but the callback classes at construction (which differ on purpose)."""
    return {key: value for key, value in run.items() if key != "classes at construction"}


def assert_as_trainer(loop: dict, trainer: dict):
    """Everything the callbacks saw and printed is Trainer's; the log history too, its evaluation losses to float32
    precision (loopkit averages them in float64: docs/differences.md)."""
    mine, theirs = without_classes(loop), without_classes(trainer)
    mine_history, their_history = mine.pop("log history"), theirs.pop("log history")
    assert mine == theirs
    assert [list(logs) for logs in mine_history] == [list(logs) for logs in their_history]
    assert mine_history == [pytest.approx(logs, rel=1e-6) for logs in their_history]


def test_the_stand_in_runs_imported_no_trainer_module(runs):
    assert runs["noisy after the stand-in runs"] == []


@pytest.mark.parametrize("config", ["steps, printer", "steps, bars", "epochs, printer", "epochs, bars"])
def test_stand_ins_do_what_hfs_classes_do(runs, config):
    found = runs[config]
    progress = "PrinterCallback" if "printer" in config else "ProgressCallback"
    assert found["stand-ins"]["classes at construction"] == STAND_INS + [f"loopkit.default_callbacks.{progress}"]
    assert found["hf classes"]["classes at construction"] == \
        [HF + "DefaultFlowCallback", "__main__.Recorder", HF + progress]
    theirs = without_classes(found["trainer"])
    assert theirs["events"] and theirs["log history"] and theirs["printed"]  # the comparison has something in it
    if "bars" in config:  # a training bar, an evaluation bar per evaluation, the logs written above the bar
        assert theirs["bar"][0] == ["open", 6 if "steps" in config else 8, True]
        assert theirs["bar"][-1] == ["close"] and any(call[0] == "write" for call in theirs["bar"])
    else:
        assert theirs["bar"] == []
    assert without_classes(found["stand-ins"]) == without_classes(found["hf classes"])
    assert_as_trainer(found["stand-ins"], found["trainer"])


@pytest.mark.parametrize("disable_tqdm", ["False", "True"])
def test_after_importing_hfs_classes_user_code_finds_what_it_finds_on_trainer(handles, disable_tqdm):
    assert handles["noisy before HF's classes are imported"] == []
    progress = ["loopkit.default_callbacks.ProgressCallback", "loopkit.default_callbacks.PrinterCallback"]
    assert handles["stand-ins at construction"] == [STAND_INS + [progress[0]], STAND_INS + [progress[1]]] * 2
    found = handles[f"disable_tqdm={disable_tqdm}"]
    loop_grid, trainer_grid = found["isinstance"]
    assert [row[0] for row in trainer_grid] == \
        ["DefaultFlowCallback", "Recorder", "PrinterCallback" if disable_tqdm == "True" else "ProgressCallback"]
    assert loop_grid == trainer_grid
    loop_operations, trainer_operations = found["operations"]
    assert "DefaultFlowCallback" in trainer_operations
    assert loop_operations == trainer_operations


def test_a_callback_reading_the_list_mid_training_finds_hfs_classes_and_the_run_goes_on(handles):
    """The stand-ins become HF's classes inside `on_step_end` of step 2; the progress bar carries on, and the
    events, logs, printed lines and bar calls are Trainer's."""
    loop, trainer = handles["mid-run swap"]["loop"], handles["mid-run swap"]["trainer"]
    assert loop["classes at construction"] == STAND_INS + ["__main__.Peeker",
                                                           "loopkit.default_callbacks.ProgressCallback"]
    assert trainer["peeked"] == [["DefaultFlowCallback", True, True, False], ["Recorder", False, False, False],
                                 ["Peeker", False, False, False], ["ProgressCallback", False, False, True]]
    assert trainer["bar"][0] == ["open", 6, True] and trainer["bar"][-1] == ["close"]
    assert_as_trainer(loop, trainer)


def test_a_report_to_integration_makes_every_default_hfs_class_from_the_start():
    """The integration's module imports HF's callback module after the progress bar was made: that stand-in becomes
    HF's class at once, and the list is Trainer's."""
    found = child("integration")
    assert found["loop"] == found["trainer"]
    assert found["trainer"] == [HF + "DefaultFlowCallback", "transformers.integrations.integration_utils."
                                "TensorBoardCallback", "__main__.Recorder", HF + "ProgressCallback"]


def parameters(method) -> list[tuple]:
    """A signature as (name, kind, default) per parameter: what a caller relies on (HF annotates, loopkit not)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(method).parameters.values()]


@pytest.mark.parametrize("name", sorted(default_callbacks.STAND_INS))
def test_each_stand_in_has_hfs_attributes_and_event_methods(name):
    """What `become_hf_class` relies on: a new stand-in has the attributes a new HF instance has, and handles the
    events HF's class handles, with the same signatures (HF's other events are `TrainerCallback`'s no-ops)."""
    ours, theirs = default_callbacks.STAND_INS[name](), getattr(hf_callbacks, name)()
    assert vars(ours) == vars(theirs)
    handled = [event for event in HF_EVENTS if not is_noop(getattr(theirs, event))]
    assert handled and [event for event in HF_EVENTS if hasattr(ours, event)] == handled
    for event in handled:
        assert parameters(getattr(ours, event)) == parameters(getattr(theirs, event)), event
