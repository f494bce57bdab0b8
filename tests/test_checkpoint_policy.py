"""The checkpoint policy HOLDS its format (loopkit/checkpoint/policy.py): a format's helper methods, whatever their
names, change nothing in the policy; damaged checkpoints are named as damaged (which file, what is wrong) wherever
they are reported, and rotated; `python -m loopkit report` on a folder it cannot read names the `--storage` to pass
and never takes a report it cannot check as current."""

from __future__ import annotations

import json
import os
import re
import sys
import types
import warnings

import pytest
import torch

from loopkit import Loop, LoopArgs
from loopkit.storage import HFStorage
from loopkit.storage.base import RESERVED

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import dist_child  # noqa: E402

# The format's documented surface (loopkit/checkpoint/format.py): what the policy calls on a format.
FORMAT_SURFACE = {"recognises", "read_states", "checkpoint_problem", "write_checkpoint", "read_process_state",
                  "load_model_before_prepare", "load_optimizer_and_scheduler", "load_best_model", "states_to_save",
                  "read_loopkit_state", "check_launch", "before_async_saves"}
WEIGHTS = "model.safetensors"
NO_EVAL = dict(eval_strategy="no", load_best_model_at_end=False, metric_for_best_model=None, greater_is_better=None)


def make_loop(out, storage, **overrides):
    settings = dict(max_steps=6, per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1, save_steps=2,
                    save_total_limit=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                    metric_for_best_model="eval_loss", greater_is_better=True, disable_tqdm=True, report_to="none",
                    seed=7)
    args = LoopArgs(output_dir=str(out), **{**settings, **overrides})
    return Loop(model=dist_child.tiny_llama(), args=args, train_dataset=dist_child.lm_samples(12, 1),
                eval_dataset=dist_child.lm_samples(4, 2), storage=storage)


def policy_names() -> list[str]:
    """Every public name of the policy and its parts (methods and attributes, those set in `__init__` too), read
    from a live policy: what a format subclass shared one namespace with when the policy was its mixins."""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        policy = make_loop(out, HFStorage()).context.checkpointer
        objects = (policy, policy.lineage, policy.resuming, policy.rotation, policy.saves)
        return sorted({name for obj in objects for name in dir(obj) if not name.startswith("_")})


HELPER_CALLS: list = []


def helper(name):
    def method(self, *args, **kwargs):
        HELPER_CALLS.append(name)
        raise AssertionError(f"the policy called the format's helper {name!r}")

    return method


def helper_named_storage(base=HFStorage) -> type:
    """`base` with a helper method named like every policy name outside the format's surface (and the names the
    storage sets for the format, which a format cannot define: `RESERVED`)."""
    names = [n for n in policy_names() if n not in FORMAT_SURFACE and n not in RESERVED]
    return type("HelperNamedStorage", (base,), {name: helper(name) for name in names})


class FailingFourthSave:
    """A format whose write of checkpoint-4 fails half way (the atomic protocol must leave no trace of it)."""

    def write_checkpoint(self, checkpoint, folder):
        super().write_checkpoint(checkpoint, folder)
        if checkpoint.step == 4:
            raise OSError(28, "No space left on device (planted)")


def final_weights(loop) -> dict:
    return {k: v.clone() for k, v in loop.model.state_dict().items()}


def folders(out) -> list[str]:
    return sorted(os.listdir(out))


def test_the_policy_names_cover_what_the_issue_named():
    names = policy_names()
    assert {"write", "save", "delete", "record", "start", "wait", "rotate", "collect", "hub", "run_id",
            "writes_files"} <= set(names), names
    assert len(names) > 50, names
    for name in RESERVED:  # what the storage sets for its format: defining one is refused, naming the fix
        with pytest.raises(TypeError, match=rf"\.{name}: .*give your {name!r} another name"):
            type("Shadowing", (HFStorage,), {name: helper(name)})


def test_format_helpers_named_like_every_policy_name_change_nothing(tmp_path):
    HELPER_CALLS.clear()
    helper_named = helper_named_storage()
    # A whole run, with rotation (save_total_limit=2) and the best kept: the same folders and weights as HFStorage.
    reference = make_loop(tmp_path / "reference", HFStorage())
    reference.train()
    ours = make_loop(tmp_path / "ours", helper_named())
    ours.train()
    assert folders(tmp_path / "ours") == folders(tmp_path / "reference")
    assert [p for p in folders(tmp_path / "ours") if p.startswith("checkpoint-")] == ["checkpoint-2", "checkpoint-6"]
    for name, tensor in final_weights(reference).items():
        assert torch.equal(final_weights(ours)[name], tensor), name
    # Resume from checkpoint-2 through the helper-named format: the uninterrupted run's weights (load_best_model_at_end
    # off, so the final weights are the last step's).
    uninterrupted = make_loop(tmp_path / "straight", HFStorage(), load_best_model_at_end=False, save_total_limit=None)
    uninterrupted.train()
    resumed = make_loop(tmp_path / "ours", helper_named(), load_best_model_at_end=False, save_total_limit=None)
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-2"))
    assert resumed.state.global_step == 6
    for name, tensor in final_weights(uninterrupted).items():
        assert torch.equal(final_weights(resumed)[name], tensor), name
    assert HELPER_CALLS == []


def test_asynchronous_saves_through_a_helper_named_format(tmp_path):
    HELPER_CALLS.clear()
    reference = make_loop(tmp_path / "reference", HFStorage(async_save=True))
    reference.train()
    ours = make_loop(tmp_path / "ours", helper_named_storage()(async_save=True))
    ours.train()
    assert folders(tmp_path / "ours") == folders(tmp_path / "reference")
    for name, tensor in final_weights(reference).items():
        assert torch.equal(final_weights(ours)[name], tensor), name
    assert HELPER_CALLS == []


def test_a_format_written_to_extend_a_policy_method_is_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"Old\.start calls super\(\)\.start\(\), which no base class has.*"
                                        r"check_launch\(\)"):
        class Old(HFStorage):
            def start(self, resume_from_checkpoint):
                return super().start(resume_from_checkpoint)

    class Extending(HFStorage):  # extending a format method stays allowed
        def write_checkpoint(self, checkpoint, folder):
            return super().write_checkpoint(checkpoint, folder)


def test_a_failed_save_is_atomic_through_a_helper_named_format(tmp_path):
    HELPER_CALLS.clear()
    outcomes = []
    for name, base in (("reference", HFStorage), ("ours", helper_named_storage())):
        storage = type("Failing", (FailingFourthSave, base), {})(on_save_error="continue")
        with pytest.warns(UserWarning, match=r"Saving checkpoint-4 failed \(OSError.*planted.*still .*checkpoint-2"):
            make_loop(tmp_path / name, storage, load_best_model_at_end=False, save_total_limit=None).train()
        outcomes.append(folders(tmp_path / name))
    assert outcomes[0] == outcomes[1]
    assert [p for p in outcomes[1] if "checkpoint" in p] == ["checkpoint-2", "checkpoint-6"], outcomes[1]
    assert HELPER_CALLS == []


def truncate(path: str, size: int | None = None) -> int:
    size = os.path.getsize(path) // 2 if size is None else size
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def test_damaged_checkpoints_are_named_and_rotated_when_resuming(tmp_path):
    out = tmp_path / "run"
    make_loop(out, HFStorage(), max_steps=8, save_total_limit=3, **NO_EVAL).train()
    assert [p for p in folders(out) if p.startswith("checkpoint-")] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    run_id = json.load(open(out / "checkpoint-8" / "loopkit_state.json"))["checkpoint"]["run_id"]
    truncate(out / "checkpoint-8" / WEIGHTS, 20480)  # the newest: weights damaged, its record readable
    truncate(out / "checkpoint-6" / "loopkit_state.json", 10)  # its record unreadable
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop = make_loop(out, HFStorage(), max_steps=10, save_total_limit=3, **NO_EVAL)
        loop.train(resume_from_checkpoint=True)
    messages = [str(w.message) for w in caught]
    pick = next(m for m in messages if m.startswith("resume_from_checkpoint=True: resuming from checkpoint-4"))
    assert re.search(rf"Passed over as damaged: checkpoint-6 \(damaged: its run record cannot be read: "
                     rf"loopkit_state.json: 10 bytes, not valid JSON \(.*\)\), checkpoint-8 \(damaged: {WEIGHTS}: "
                     rf"20,480 bytes, its header promises [\d,]+; run {run_id}, save #4", pick), pick
    assert "from other runs" not in pick and "no run recorded" not in pick, pick
    # checkpoint-6 records no save number now, so it ranks below the numbered ones: resolving never reaches it.
    assert any(re.search(rf"Not resuming from .*checkpoint-8: it is damaged \({WEIGHTS}: 20,480 bytes, its header "
                         rf"promises", m) for m in messages), messages
    removed = next(m for m in messages if m.startswith("Removed"))
    assert re.search(r"Removed 1 checkpoint folder\(s\) of runs older than the previous one or damaged "
                     r"\(checkpoint-6-of-run-unrecorded \(damaged: its run record cannot be read", removed), removed
    # The resumed run saved 6, 8 (over its own damaged one) and 10; rotation kept 3 of this run's, nothing damaged.
    assert folders(out) == ["checkpoint-10", "checkpoint-6", "checkpoint-8", "run_report.json", "run_report.md",
                            "run_status.json"], folders(out)
    for name in ("checkpoint-6", "checkpoint-8", "checkpoint-10"):
        assert loop.context.checkpointer.checkpoint_problem(str(out / name)) is None, name


def test_a_fresh_run_and_the_report_name_a_damaged_checkpoint(tmp_path, capsys):
    from loopkit import report

    out = tmp_path / "run"
    make_loop(out, HFStorage(), max_steps=4, save_total_limit=None, load_best_model_at_end=False).train()
    size = os.path.getsize(out / "checkpoint-4" / WEIGHTS)
    truncate(out / "checkpoint-4" / WEIGHTS, 20480)
    assert report.main(["report", str(out)]) == 0
    assert f"checkpoint-4 is damaged ({WEIGHTS}: 20,480 bytes, its header promises {size:,}): not read" in \
        capsys.readouterr().out
    with pytest.warns(UserWarning, match=rf"holds other runs' checkpoints: run \w+ checkpoint-2, checkpoint-4 "
                                         rf"\(previous run: kept\); checkpoint-4 \(damaged: {WEIGHTS}: "
                                         rf"20,480 bytes, its header promises {size:,}; run \w+"):
        make_loop(out, HFStorage(), max_steps=2, save_total_limit=None, load_best_model_at_end=False).train()


# -------------------------------------------------------------------------------------------------------------
# The report command on a storage of the user's
# -------------------------------------------------------------------------------------------------------------
def one_file_storage() -> type:
    """The one-file storage of docs/checkpoints.md ("Writing another storage"), as tests/test_one_file_storage.py
    takes it, importable as `lk_policy_formats:OneFileStorage` (for `--storage`)."""
    page = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "checkpoints.md")).read()
    start = page.index("```py\n", page.index("A format that writes one file")) + len("```py\n")
    module = types.ModuleType("lk_policy_formats")
    exec(compile(page[start:page.index("```", start)], "docs/checkpoints.md", "exec"), module.__dict__)
    sys.modules["lk_policy_formats"] = module
    return module.OneFileStorage


def report_exit(argv, capsys) -> tuple[int, str]:
    from loopkit import report

    try:
        code = report.main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_report_names_the_storage_to_pass_and_never_takes_an_unchecked_report_as_current(tmp_path, capsys):
    from loopkit.checkpoint.format import registered_formats

    out = str(tmp_path / "run")
    one_file = one_file_storage()
    make_loop(out, one_file(), max_steps=4, load_best_model_at_end=False).train()
    flag = "--storage lk_policy_formats:OneFileStorage"
    try:
        # The run's own report is there, but no known format reads the checkpoints: refused, the flag named.
        code, text = report_exit(["report", out], capsys)
        assert code == 2 and "Traceback" not in text, text
        assert "no checkpoint format loopkit knows (DCPStorage, HFStorage) reads checkpoint-2, checkpoint-4." in text
        assert f"python -m loopkit report {out} --storage mypackage.storages:MyStorage" in text, text
        assert report_exit(["report", out] + flag.split(), capsys)[0] == 0
        registered_formats.clear()
        # Rebuilt with --storage into run_report.json; a later call without it is refused again, not silently served.
        os.remove(os.path.join(out, "run_report.json"))
        code, text = report_exit(["report", out] + flag.split(), capsys)
        assert code == 0 and os.path.isfile(os.path.join(out, "run_report.json")), text
        registered_formats.clear()
        code, text = report_exit(["report", out], capsys)
        assert code == 2 and "--storage" in text and "Traceback" not in text, text
        # A damaged newest checkpoint of this format: named, and the report rebuilt from the newest good one.
        truncate(os.path.join(out, "checkpoint-4", "checkpoint.pt"), 20480)
        code, text = report_exit(["report", out, "--force"] + flag.split(), capsys)
        assert code == 0, text
        assert re.search(r"checkpoint-4 is damaged \(its run record cannot be read: .*checkpoint\.pt.*\): not read",
                         text), text
        rebuilt = json.load(open(os.path.join(out, "run_report.json")))
        assert "(rebuilt from checkpoint-2, step 2)" in rebuilt["status"], rebuilt["status"]
        assert list(rebuilt["damaged_checkpoints"]) == ["checkpoint-4"], rebuilt["damaged_checkpoints"]
        code, text = report_exit(["report", out, "--storage", "no_such_module:Storage"], capsys)
        assert code == 2 and "module:Class" in text and "Traceback" not in text, text
    finally:
        registered_formats.clear()


def test_resuming_past_a_damaged_one_file_checkpoint_names_it_and_removes_it(tmp_path):
    """The issue's case: the newest one-file checkpoint truncated to 20 KB. Its record is inside the damaged file,
    so nothing says whose it is: named as damaged (never "from other runs"), and removed at the first save."""
    out = tmp_path / "run"
    one_file = one_file_storage()
    make_loop(out, one_file(), max_steps=4, save_total_limit=2, **NO_EVAL).train()
    truncate(out / "checkpoint-4" / "checkpoint.pt", 20480)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_loop(out, one_file(), max_steps=6, save_total_limit=2, **NO_EVAL).train(resume_from_checkpoint=True)
    messages = [str(w.message) for w in caught]
    pick = next(m for m in messages if m.startswith("resume_from_checkpoint=True: resuming from checkpoint-2"))
    assert "Passed over as damaged: checkpoint-4 (damaged: " in pick and "from other runs" not in pick, pick
    assert any(m.startswith("Removed 1 checkpoint folder(s) of runs older than the previous one or damaged "
                            "(checkpoint-4-of-run-unrecorded (damaged:") for m in messages), messages
    assert [p for p in folders(out) if "checkpoint" in p] == ["checkpoint-4", "checkpoint-6"], folders(out)
