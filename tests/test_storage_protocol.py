"""The checkpoint storage interface (loopkit/storage/base.py): every part of a run reaches checkpoints through the
storage the user picked (`Loop(..., storage=...)`), and the checkpoint options live on the storage, with
`EvalStage(async_save=..., ...)` still accepted for the default one."""

from __future__ import annotations

import os
import sys

import pytest

from loopkit import EvalStage, Loop, LoopArgs
from loopkit.storage import HFStorage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import dist_child  # noqa: E402

# What the run calls on its checkpoint policy (`context.checkpointer`), and what the policy calls on the format.
POLICY_CALLS = ("start", "load_model_before_prepare", "load_optimizer_and_scheduler", "read_rng",
                "read_trainer_state", "read_stage_states", "load_best_model", "keep_only_best", "wait",
                "finish_uploads", "save")
FORMAT_CALLS = ("check_launch", "states_to_save", "write_checkpoint", "load_model_before_prepare",
                "load_optimizer_and_scheduler", "load_best_model", "recognises", "read_states", "read_process_state",
                "checkpoint_problem")


class RecordingStorage(HFStorage):
    """The default storage, recording which of its format methods the policy calls."""

    def __init__(self, **options):
        super().__init__(**options)
        self.calls = []


def recording(name):
    def method(self, *args, **kwargs):
        self.calls.append(name)
        return getattr(HFStorage, name)(self, *args, **kwargs)

    return method


for _name in FORMAT_CALLS:
    setattr(RecordingStorage, _name, recording(_name))


def record_policy_calls(loop) -> list:
    """The names of the policy methods the run calls, in order (each wrapped on the `Loop`'s policy object)."""
    policy, calls = loop.context.checkpointer, []
    for name in POLICY_CALLS:
        def method(*args, _name=name, _real=getattr(policy, name), **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        setattr(policy, name, method)
    return calls


def make_loop(out, storage=None, evaluation=None, **overrides):
    settings = dict(max_steps=4, per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1, save_steps=2,
                    eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, disable_tqdm=True,
                    report_to="none", seed=7)
    args = LoopArgs(output_dir=str(out), **{**settings, **overrides})
    return Loop(model=dist_child.tiny_llama(), args=args, train_dataset=dist_child.lm_samples(8, 1),
                eval_dataset=dist_child.lm_samples(4, 2), storage=storage, evaluation=evaluation)


def test_setup_step_data_loop_and_teardown_reach_checkpoints_through_the_storage(tmp_path):
    first = RecordingStorage()
    loop = make_loop(tmp_path / "run", first)
    first_policy_calls = record_policy_calls(loop)
    loop.train()
    assert loop.context.checkpointer.format is first
    assert {"check_launch", "states_to_save", "write_checkpoint", "load_best_model"} <= set(first.calls), first.calls
    assert {"start", "save", "load_best_model", "keep_only_best", "wait", "finish_uploads"} <= set(
        first_policy_calls), first_policy_calls
    resumed = RecordingStorage()
    loop = make_loop(tmp_path / "run", resumed)
    policy_calls = record_policy_calls(loop)
    loop.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert set(FORMAT_CALLS) <= set(resumed.calls), sorted(set(FORMAT_CALLS) - set(resumed.calls))
    assert set(POLICY_CALLS) <= set(policy_calls), sorted(set(POLICY_CALLS) - set(policy_calls))
    # Resuming reads in the run's order: which checkpoint, the model before `prepare`, the states, then what loads
    # into prepared objects.
    order = [policy_calls.index(name) for name in ("start", "load_model_before_prepare", "read_trainer_state",
                                                    "load_optimizer_and_scheduler")]
    assert order == sorted(order), policy_calls


def test_checkpoint_options_given_to_the_evaluation_stage_go_to_the_default_storage(tmp_path):
    loop = make_loop(tmp_path, evaluation=EvalStage(async_save=True, on_save_error="continue", best_total_limit=2))
    storage = loop.context.checkpointer.format
    assert isinstance(storage, HFStorage)
    assert storage.options() == dict(async_save=True, on_save_error="continue", best_total_limit=2)


def test_options_in_two_places_and_a_storage_serving_two_loops_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"async_save.*HFStorage\(async_save=True\)"):
        make_loop(tmp_path, storage=HFStorage(), evaluation=EvalStage(async_save=True))
    shared = HFStorage()
    make_loop(tmp_path / "a", shared)
    with pytest.raises(ValueError, match="already serves another Loop"):
        make_loop(tmp_path / "b", shared)
    with pytest.raises(ValueError, match="CheckpointStorage"):
        make_loop(tmp_path, storage="dcp")
    with pytest.raises(ValueError, match="on_save_error"):
        HFStorage(on_save_error="ignore")
