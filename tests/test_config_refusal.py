"""Nothing of a config is ignored (issue 42, item 3): a field of the training arguments that no part of the run reads
is refused by name when the `Loop` is built, before any work, with the fix. TRL's configs name the TRL loop to use
(`packing` is SFTConfig's: `loopkit.trl.SFTLoop`); a user's `TrainingArguments` (or `LoopArgs`) subclass names the
declaration that makes a `Loop` subclass read it (`args_class`); `Seq2SeqTrainingArguments` and plain
`TrainingArguments` are read as before. The configs are TRL's real classes (trl 1.16)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from transformers import Seq2SeqTrainingArguments, TrainingArguments

from loopkit import Loop, LoopArgs, LoopConfigError, Seq2SeqLoop

from helpers import IGNORE_PIN_MEMORY_WARNING, tiny_regression

trl = pytest.importorskip("trl")
pytestmark = IGNORE_PIN_MEMORY_WARNING

CPU = dict(bf16=False, use_cpu=True, report_to="none")  # TRL's configs turn bf16 on by default, which a CPU refuses


def test_the_issue_sft_config_on_a_plain_loop_is_refused_naming_each_field_and_sft_loop(tmp_path):
    """The issue's example trained silently unpacked on main; now each field it sets is named, and the loop."""
    args = trl.SFTConfig(str(tmp_path), packing=True, max_length=16, completion_only_loss=True,
                         assistant_only_loss=True, loss_type="dft", **CPU)
    with pytest.raises(LoopConfigError) as error:
        Loop(tiny_regression(), args=args)
    message = str(error.value)
    for setting in ("packing=True", "max_length=16", "completion_only_loss=True", "assistant_only_loss=True",
                    "loss_type='dft'"):
        assert setting in message
    assert "SFTConfig's fields are read by TRL's SFTTrainer" in message
    assert "they are SFTConfig's: use loopkit.trl.SFTLoop (SFTTrainer( becomes SFTLoop(" in message
    assert "at their defaults" in message  # SFTConfig's other fields, counted


@pytest.mark.parametrize("config, loop", [("SFTConfig", "SFTLoop"), ("DPOConfig", "DPOLoop"),
                                          ("RewardConfig", "RewardLoop"), ("GRPOConfig", "GRPOLoop")])
def test_each_trl_config_at_its_defaults_names_its_trl_loop(tmp_path, config, loop):
    """At its defaults too: TRL's trainers read them all (SFTConfig's max_length=1024 truncates)."""
    extra = {"num_generations": 2, "per_device_train_batch_size": 2} if config == "GRPOConfig" else {}
    args = getattr(trl, config)(str(tmp_path), **CPU, **extra)
    trainer = config.removesuffix("Config") + "Trainer"
    with pytest.raises(LoopConfigError, match=re.escape(f"{config}'s fields are read by TRL's {trainer}, and Loop "
                                                        f"does not read them") + ".*" +
                       re.escape(f"use loopkit.trl.{loop} ({trainer}( becomes {loop}(")):
        Loop(tiny_regression(), args=args)


@dataclasses.dataclass
class MyArgs(TrainingArguments):
    my_field: int = 0


class MyLoop(Loop):
    args_class = MyArgs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss = loss * self.args.my_field  # the field this loop declares, read
        return (loss, outputs) if return_outputs else loss


def test_a_users_subclass_field_is_refused_unless_the_loop_declares_its_class(tmp_path):
    args = MyArgs(str(tmp_path), my_field=3, report_to="none")
    with pytest.raises(LoopConfigError) as error:
        Loop(tiny_regression(), args=args)
    assert str(error.value).startswith("my_field=3: MyArgs's fields are read by your own code, and Loop does not "
                                       "read them (its args_class is None); it will not ignore them silently. Fix: ")
    assert "`class MyLoop(Loop): args_class = MyArgs`, then MyLoop(...) in place of Loop(...)" in str(error.value)
    assert MyLoop(tiny_regression(), args=args).args.my_field == 3  # declared: read
    # A Loop subclass of the user's that does not declare it is told to, by its own name.
    undeclared = type("Undeclared", (Loop,), {"__module__": "my_script"})
    with pytest.raises(LoopConfigError, match=re.escape("`args_class = MyArgs` in class Undeclared")):
        undeclared(model=tiny_regression(), args=args)


@dataclasses.dataclass
class MoreArgs(MyArgs):
    another: str = "x"


def test_a_field_beyond_the_declared_class_is_refused_and_the_value_check_still_runs(tmp_path):
    with pytest.raises(LoopConfigError, match=r"^another='y': MoreArgs's fields .* MyLoop does not read them "
                                              r"\(its args_class is MyArgs\)"):
        MyLoop(tiny_regression(), args=MoreArgs(str(tmp_path), another="y", report_to="none"))
    args = MyArgs(str(tmp_path), report_to="none")
    args.debug = ["tpu_metrics_debug"]  # refused on any args, declared class or not
    with pytest.raises(LoopConfigError, match="debug='tpu_metrics_debug'"):
        MyLoop(tiny_regression(), args=args)


def test_fields_of_a_trl_config_and_of_the_users_subclass_are_named_in_one_error(tmp_path):
    @dataclasses.dataclass
    class MySFTArgs(trl.SFTConfig):
        curriculum: bool = False

    with pytest.raises(LoopConfigError) as error:
        Loop(tiny_regression(), args=MySFTArgs(str(tmp_path), packing=True, curriculum=True, **CPU))
    message = str(error.value)
    assert message.startswith("packing=True")
    assert "use loopkit.trl.SFTLoop" in message
    assert " Also: curriculum=True: MySFTArgs's fields are read by your own code" in message


class Prepares(Loop):
    """As a TRL trainer does: work (tokenising, loading) in its own __init__ before Loop.__init__."""

    prepared = False

    def __init__(self, model=None, args=None, **kwargs):
        type(self).prepared = True
        super().__init__(model, args, **kwargs)


class PassesEverything(Loop):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def test_the_refusal_comes_before_a_subclass_init_does_any_work(tmp_path):
    args = MyArgs(str(tmp_path), my_field=1, report_to="none")
    with pytest.raises(LoopConfigError, match="my_field=1"):
        Prepares(tiny_regression(), args)
    assert not Prepares.prepared
    for call in (lambda: PassesEverything(tiny_regression(), args), lambda: PassesEverything(args=args)):
        with pytest.raises(LoopConfigError, match="my_field=1"):  # *args: found by Loop.__init__
            call()


def test_a_trl_trainer_class_that_declares_its_config_refuses_a_users_field_before_trls_preparation(tmp_path):
    """TRL's `__init__` loads the model (a name: from the hub, offline here) and tokenises the datasets before it
    reaches `Loop.__init__`; the refusal comes first. The class is built here as loopkit.trl's loops are."""
    from loopkit.trl.base import TRLLoop

    class DeclaredSFT(trl.SFTTrainer, TRLLoop):
        args_class = trl.SFTConfig

    @dataclasses.dataclass
    class MySFTArgs(trl.SFTConfig):
        curriculum: bool = False

    with pytest.raises(LoopConfigError, match=re.escape("curriculum=True: MySFTArgs's fields are read by your own "
                                                        "code, and DeclaredSFT does not read them") + ".*" +
                       re.escape("`args_class = MySFTArgs` in class DeclaredSFT")):
        DeclaredSFT("no-such-org/no-such-model", args=MySFTArgs(str(tmp_path), curriculum=True, **CPU))


def test_a_trl_trainer_class_on_loopkit_that_does_not_declare_its_config_is_told_to(tmp_path):
    from loopkit.trl.base import TRLLoop

    class UndeclaredSFT(trl.SFTTrainer, TRLLoop):
        pass

    with pytest.raises(LoopConfigError, match=re.escape("UndeclaredSFT runs TRL's SFTTrainer, which reads them: "
                                                        "declare its config, `args_class = SFTConfig` in class "
                                                        "UndeclaredSFT")):
        UndeclaredSFT("no-such-org/no-such-model", args=trl.SFTConfig(str(tmp_path), **CPU))


def test_loop_args_subclass_and_a_non_dataclass_args_class(tmp_path):
    @dataclasses.dataclass
    class MyLoopArgs(LoopArgs):
        my_field: int = 0

    with pytest.raises(LoopConfigError, match=r"^my_field=0: MyLoopArgs's fields"):
        Loop(tiny_regression(), args=MyLoopArgs(str(tmp_path)))
    bad = type("Bad", (Loop,), {"args_class": "MyArgs", "__module__": "my_script"})
    with pytest.raises(LoopConfigError, match=r"Bad.args_class='MyArgs': .* no dataclass"):
        bad(tiny_regression(), args=LoopArgs(str(tmp_path)))


def test_what_loopkit_reads_is_accepted_as_before(tmp_path):
    Loop(tiny_regression(), args=TrainingArguments(str(tmp_path), report_to="none"))
    Loop(tiny_regression(), args=LoopArgs(str(tmp_path)))
    Loop(tiny_regression())
    seq2seq = Seq2SeqTrainingArguments(str(tmp_path), report_to="none", generation_max_length=8,
                                       generation_num_beams=2, predict_with_generate=True)
    Seq2SeqLoop(tiny_regression(), args=seq2seq)
    seq2seq.predict_with_generate = False  # generation fields read only when generating: a plain Loop takes them
    Loop(tiny_regression(), args=seq2seq)


# ---------------------------------------------------------------------------------------------------------------
# A field a later transformers adds (issue 44): run, or refused by name, never ignored
# ---------------------------------------------------------------------------------------------------------------
def test_a_field_a_later_transformers_adds_is_refused_by_name_in_training_arguments(tmp_path, monkeypatch):
    """The installed `TrainingArguments` gains a field (as 5.25 may): with a `TrainingArguments` it is read at its
    default and refused by name when changed. (`LoopArgs` on such a release: tests/test_args_derived.py;
    `tests/test_errors.py` checks that every field of today's release is run, inert or refused.)"""
    import transformers

    @dataclasses.dataclass
    class NextReleaseArguments(TrainingArguments):
        new_in_next_release: bool = False

    monkeypatch.setattr(transformers, "TrainingArguments", NextReleaseArguments)
    Loop(tiny_regression(), args=NextReleaseArguments(str(tmp_path), report_to="none"))
    with pytest.raises(LoopConfigError, match=r"^new_in_next_release=True: loopkit does not support this "
                                              r"TrainingArguments field, and will not ignore it silently"):
        Loop(tiny_regression(), args=NextReleaseArguments(str(tmp_path), report_to="none", new_in_next_release=True))
