"""`LoopArgs` follows the installed `TrainingArguments` (issue 44): its fields, defaults and help are read from
transformers' source when loopkit/args/loop_args.py is imported, never imported from `transformers.training_args`
(which imports peft, torchao and bitsandbytes). Each is compared here with the imported class. A field a new release
adds (simulated by a patched copy of the installed source) is a `LoopArgs` field at once, and refused by name when it
is changed until loopkit's tables (loopkit/args/fields.py) list it."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import sys

import pytest
from transformers import TrainingArguments

from helpers import regression_data, run_process, tiny_regression
from loopkit import Loop, LoopArgs, LoopConfigError
from loopkit.args import DICT_FIELDS, fields
from loopkit.args.loop_args import loop_args_class

SOURCE = fields.training_arguments_source()


def derived(source: str = SOURCE) -> list[tuple[str, str, dataclasses.Field | None]]:
    return fields.training_arguments_fields(fields.training_arguments_class(source))


def declared_default(f: dataclasses.Field):
    return fields.declared_default(f) if f.init else dataclasses.MISSING


def test_every_field_and_default_is_the_installed_training_arguments_own():
    """Every field of the installed release, in its order, with its default, help, `init` and `repr`, read from the
    source alone: no field needs the imported class (`imported_field`)."""
    theirs = [f for f in dataclasses.fields(TrainingArguments) if not f.name.startswith("_")]
    read = derived()
    assert [name for name, _, _ in read] == [f.name for f in theirs]
    assert [name for name, _, declared in read if declared is None] == []
    ours = {f.name: f for f in dataclasses.fields(LoopArgs)}
    assert list(ours) == [f.name for f in theirs]
    for f in theirs:
        mine = ours[f.name]
        assert declared_default(mine) == declared_default(f), f.name
        assert type(declared_default(mine)) is type(declared_default(f)), f.name
        assert mine.metadata.get("help") == f.metadata.get("help"), f.name
        assert mine.init == f.init, f.name
    assert LoopArgs.trainer_fields == {f.name for f in theirs}
    assert DICT_FIELDS == tuple(TrainingArguments._VALID_DICT_FIELDS)


def test_the_computed_default_of_optim_is_transformers_rule(monkeypatch):
    """`optim`'s default is computed in the class body from torch's version: loopkit's copy of the rule gives
    transformers' value here, the older one on torch 2.7, and is not applied once the code that computes it
    changes (the field then comes from the imported class)."""
    from transformers.pytorch_utils import is_torch_greater_or_equal_than_2_8

    assert LoopArgs().optim == TrainingArguments().optim
    assert fields.default_optim() == ("adamw_torch_fused" if is_torch_greater_or_equal_than_2_8 else "adamw_torch")
    import torch

    monkeypatch.setattr(torch, "__version__", "2.7.1+cpu")
    assert fields.default_optim() == "adamw_torch"
    monkeypatch.undo()
    changed = SOURCE.replace("default_optim = \"adamw_torch_fused\"", "default_optim = \"adamw_torch\"")
    assert changed != SOURCE
    assert dict((name, declared) for name, _, declared in derived(changed))["optim"] is None


def test_a_default_the_source_does_not_say_literally_is_taken_from_the_imported_class():
    changed = SOURCE.replace("learning_rate: float = field(default=5e-5,", "learning_rate: float = field(default=5 * "
                             "1e-5,")
    assert changed != SOURCE
    read = derived(changed)
    assert [name for name, _, declared in read if declared is None] == ["learning_rate"]
    variant = loop_args_class(read)
    assert variant().learning_rate == TrainingArguments().learning_rate == 5e-5


NEW_FIELDS = '''
    new_option: int = field(default=0, metadata={"help": "An option of the next release."})
    new_list_option: list[str] = field(default_factory=list, metadata={"help": "A list option."})
'''


def next_release():
    """`LoopArgs` as loopkit builds it on a release whose `TrainingArguments` has two new fields."""
    anchor = SOURCE.index("\n", SOURCE.index("    # --- Output ---"))
    return loop_args_class(derived(SOURCE[:anchor + 1] + NEW_FIELDS + SOURCE[anchor + 1:]))


def test_a_field_a_new_release_adds_is_a_field_refused_by_name_when_changed(tmp_path, monkeypatch):
    args_class = next_release()
    names = [f.name for f in dataclasses.fields(args_class)]
    assert names[:2] == ["new_option", "new_list_option"]
    assert names[2:] == [f.name for f in dataclasses.fields(LoopArgs)]
    new_option = dataclasses.fields(args_class)[0]
    assert new_option.default == 0 and new_option.metadata == {"help": "An option of the next release."}
    at_defaults = args_class(output_dir=str(tmp_path), new_option=0, new_list_option=[])
    assert at_defaults.new_option == 0 and at_defaults.learning_rate == 5e-5
    with pytest.raises(LoopConfigError, match=r"^new_option=3: loopkit does not support this TrainingArguments "
                                              r"field, and will not ignore it silently. Fix: leave new_option at its "
                                              r"default \(0\), or train with transformers.Trainer\.$"):
        args_class(output_dir=str(tmp_path), new_option=3)
    with pytest.raises(LoopConfigError, match=r"^new_list_option=\['x'\]: .* leave new_list_option at its default "
                                              r"\(\[\]\)"):
        args_class(output_dir=str(tmp_path), new_list_option=["x"])
    with pytest.raises(TypeError, match="did you mean new_option"):
        args_class(output_dir=str(tmp_path), new_optio=3)
    # Once loopkit's tables list it, it is taken.
    monkeypatch.setattr(fields, "SUPPORTED_FIELDS", fields.SUPPORTED_FIELDS | {"new_option"})
    assert args_class(output_dir=str(tmp_path), new_option=3).new_option == 3


def test_a_field_outside_the_tables_changed_after_construction_is_refused_by_the_loop(tmp_path, monkeypatch):
    """On the installed release, as if `seed` were new: refused when it is built with a changed value, and when it
    is changed afterwards (`Loop` checks again); at its default it trains."""
    monkeypatch.setattr(fields, "SUPPORTED_FIELDS", fields.SUPPORTED_FIELDS - {"seed"})
    with pytest.raises(LoopConfigError, match=r"^seed=7: loopkit does not support .* leave seed at its default "
                                              r"\(42\)"):
        LoopArgs(output_dir=str(tmp_path), seed=7)
    args = LoopArgs(output_dir=str(tmp_path), max_steps=1, disable_tqdm=True, report_to="none")
    assert Loop(tiny_regression(), args=args, train_dataset=regression_data(8)).train().global_step == 1
    args.seed = 7
    with pytest.raises(LoopConfigError, match=r"^seed=7: loopkit does not support"):
        Loop(tiny_regression(), args=args, train_dataset=regression_data(8))


def test_without_the_source_the_fields_come_from_the_imported_class(monkeypatch):
    """An installation that ships compiled files only: the same fields and defaults, from the imported class."""
    from loopkit.args import loop_args

    def no_source():
        raise FileNotFoundError("training_args.py")

    monkeypatch.setattr(loop_args, "training_arguments_source", no_source)
    args_class, dict_fields = loop_args.installed_loop_args()
    assert dict_fields == DICT_FIELDS
    ours = [(f.name, declared_default(f), f.metadata.get("help")) for f in dataclasses.fields(args_class)]
    assert ours == [(f.name, declared_default(f), f.metadata.get("help")) for f in dataclasses.fields(LoopArgs)]


def test_loop_args_pickles_copies_and_hides_its_token(tmp_path):
    args = LoopArgs(output_dir=str(tmp_path), learning_rate=1e-3, hub_token="secret-token", report_to="none")
    for twin in (pickle.loads(pickle.dumps(args)), copy.deepcopy(args), copy.copy(args)):
        assert twin == args and type(twin) is LoopArgs
    assert "secret-token" not in repr(args) and "learning_rate=0.001" in repr(args)
    assert json.loads(args.to_json_string())["hub_token"] == "<HUB_TOKEN>"
    assert LoopArgs.__module__ == "loopkit.args.loop_args" and LoopArgs.__qualname__ == "LoopArgs"


def test_building_loop_args_reads_the_source_and_imports_no_training_args():
    """In a fresh interpreter: `LoopArgs` with transformers' defaults, and `transformers.training_args` (and what it
    imports: `transformers.trainer_utils`, peft) not imported."""
    code = ("import json, sys\n"
            "from loopkit import LoopArgs\n"
            "args = LoopArgs(output_dir='out')\n"
            "print(json.dumps([args.optim, args.learning_rate, sorted(m for m in sys.modules if m.startswith("
            "('transformers.train', 'peft'))), sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')]))")
    result = run_process([sys.executable, "-c", code], "a fresh interpreter building LoopArgs")
    assert result.returncode == 0, result.stderr
    optim, learning_rate, heavy, imported = json.loads(result.stdout.strip().splitlines()[-1])
    assert [optim, learning_rate] == [TrainingArguments().optim, 5e-5]
    assert heavy == [] and imported == [], imported

