"""Reruns into the same `output_dir` lose nothing (issue 12, item 6): each checkpoint records its run and save
number; rotation deletes only the current run's checkpoints; `resume_from_checkpoint=True` takes the most recently
saved checkpoint (not the highest step, not the newest mtime) and names it. The disk stays bounded (issue 34, item
8): with `save_total_limit`, a run's first save removes the runs older than the previous one, in one short line; a
fresh run says what it found in one short line.

File modification times are set explicitly, against the order of the saves (as a copy or a backup restore leaves
them), so no test depends on the clock and each shows that mtimes do not decide."""

import hashlib
import json
import logging
import os
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, regression_data, tiny_regression

from loopkit import Loop
from loopkit.checkpoint import RECORD_KEY

YEAR_2000, YEAR_2100 = 946684800, 4102444800  # mtimes far before and after any real save


def args(out, **overrides):
    fields = dict(max_steps=8, per_device_train_batch_size=2, save_steps=2, save_total_limit=2, logging_steps=1,
                  learning_rate=0.05, lr_scheduler_type="constant", seed=0)  # constant: max_steps may grow
    fields.update(overrides)
    return hf_args(out, **fields)


def make_loop(out, **overrides):
    return Loop(model=tiny_regression(), args=args(out, **overrides), train_dataset=regression_data(16))


def checkpoints(out) -> list[str]:
    return sorted((p for p in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", p)), key=lambda p: int(p[11:]))


def record(out, name) -> dict:
    with open(os.path.join(out, name, "loopkit_state.json")) as f:
        return json.load(f)[RECORD_KEY]


def set_mtime(out, names, when) -> None:
    for name in names:
        os.utime(os.path.join(out, name), (when, when))


def digest(folder) -> str:
    """Hash of every file in a checkpoint folder: it is untouched if this does not change."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        h.update(name.encode())
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def test_rerun_keeps_the_other_runs_checkpoints_and_resume_takes_the_newest_save(tmp_path):
    out = tmp_path / "out"
    # Run A: 8 steps, saves at 2, 4, 6, 8, rotation to 2 leaves 6 and 8.
    make_loop(out).train()
    assert checkpoints(out) == ["checkpoint-6", "checkpoint-8"]
    run_a = record(out, "checkpoint-8")["run_id"]
    assert (record(out, "checkpoint-6")["run_id"], record(out, "checkpoint-6")["save_index"]) == (run_a, 3)
    assert record(out, "checkpoint-8")["save_index"] == 4  # saves 1 and 2 were rotated away
    set_mtime(out, ["checkpoint-6", "checkpoint-8"], YEAR_2100)  # A's folders look newer than anything B writes
    before = {name: digest(out / name) for name in checkpoints(out)}

    # Run B: a fresh rerun (another learning rate) for 4 steps into the same folder. It says what it found.
    with pytest.warns(UserWarning, match=r"holds other runs' checkpoints: ") as caught:
        make_loop(out, max_steps=4, learning_rate=0.2).train()
    message = next(str(w.message) for w in caught if "holds other runs'" in str(w.message))
    assert f"run {run_a} checkpoint-6, checkpoint-8 (previous run: kept)" in message
    assert len(message.replace(str(out), "")) < 250  # one short line (it was about 700 characters)
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert {name: digest(out / name) for name in ("checkpoint-6", "checkpoint-8")} == before  # A's untouched
    run_b = record(out, "checkpoint-4")["run_id"]
    assert run_b != run_a and record(out, "checkpoint-2")["run_id"] == run_b
    assert [record(out, n)["save_index"] for n in ("checkpoint-2", "checkpoint-4")] == [5, 6]
    set_mtime(out, ["checkpoint-2", "checkpoint-4"], YEAR_2000)  # B's look oldest: by mtime, HF would pick A's

    # resume_from_checkpoint=True (the rerun script, asked to continue to step 5): B's checkpoint-4 is the most
    # recently saved, although A's checkpoint-8 has the higher step and the newer mtime. It is named, and A's
    # checkpoints are named as passed over.
    resumed = make_loop(out, max_steps=5, learning_rate=0.2)
    with pytest.warns(UserWarning, match=rf"resuming from checkpoint-4 \(run {run_b}, save #6.*Not picked, from "
                                         rf"other runs: checkpoint-6 \(run {run_a}.*checkpoint-8 \(run {run_a}"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.initial_global_step == 4 and resumed.state.global_step == 5
    # The resumed run is run B continued: its saves carry B's id, rotation deleted only B's oldest.
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-5", "checkpoint-6", "checkpoint-8"]
    assert record(out, "checkpoint-5")["run_id"] == run_b and record(out, "checkpoint-5")["save_index"] == 7
    assert {name: digest(out / name) for name in ("checkpoint-6", "checkpoint-8")} == before
    # ... and it is exactly run B trained for 5 steps without interruption.
    straight = make_loop(tmp_path / "straight", max_steps=5, learning_rate=0.2)
    straight.train()
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_resume_names_its_pick_and_warns_when_it_is_another_runs(tmp_path, caplog):
    out = tmp_path / "out"
    mine = make_loop(out, max_steps=3, save_steps=3)
    mine.train()
    run_mine = record(out, "checkpoint-3")["run_id"]
    # Alone in the folder: named (INFO on the "loopkit.checkpoint" logger), no warning; it continues run "mine".
    with caplog.at_level(logging.INFO, logger="loopkit.checkpoint"), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        make_loop(out, max_steps=4, save_steps=3).train(resume_from_checkpoint=True)
    assert f"resuming from checkpoint-3 (run {run_mine}, save #1" in caplog.text
    assert (record(out, "checkpoint-4")["run_id"], record(out, "checkpoint-4")["save_index"]) == (run_mine, 2)
    # Another run then saves checkpoint-2 in the same folder; this Loop's resume=True takes that one, and says so.
    set_mtime(out, ["checkpoint-3", "checkpoint-4"], YEAR_2100)
    mine_saved = {name: digest(out / name) for name in ("checkpoint-3", "checkpoint-4")}
    with pytest.warns(UserWarning, match="holds other runs' checkpoints"):
        make_loop(out, max_steps=2, save_steps=2).train()
    run_other = record(out, "checkpoint-2")["run_id"]
    set_mtime(out, ["checkpoint-2"], YEAR_2000)
    mine.args.max_steps = 4
    with pytest.warns(UserWarning) as caught, caplog.at_level(logging.INFO, logger="loopkit.checkpoint"):
        mine.train(resume_from_checkpoint=True)
    messages = [str(w.message) for w in caught if "resume_from_checkpoint=True" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert f"resuming from checkpoint-2 (run {run_other}, save #3" in messages[0]
    assert f"belongs to another run than this Loop's previous train() (run {run_mine})" in messages[0]
    assert re.search(rf"Not picked, from other runs: checkpoint-3 \(run {run_mine}, save #1.*checkpoint-4 \(run "
                     rf"{run_mine}, save #2", messages[0])
    assert mine.initial_global_step == 2 and mine.state.global_step == 4
    # It continued the other run (save_steps=2, from its checkpoint), whose save at 4 took that name: "mine"'s
    # checkpoint-4 was renamed, not lost, and rotation (the other run's 2 and 4 now) deleted nothing.
    assert f"kept as {out / f'checkpoint-4-of-run-{run_mine}'}" in caplog.text  # announced at the start: INFO
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert record(out, "checkpoint-4")["run_id"] == run_other
    assert digest(out / f"checkpoint-4-of-run-{run_mine}") == mine_saved["checkpoint-4"]
    assert digest(out / "checkpoint-3") == mine_saved["checkpoint-3"]


@IGNORE_PIN_MEMORY_WARNING
def test_hf_trainer_folder_still_resumes_and_is_never_rotated_away(tmp_path):
    """HF Trainer's checkpoints record no run: they count as another run's (nothing says who wrote them, so this
    run never deletes them), rank below every numbered save, and among themselves go by folder mtime."""
    out = tmp_path / "out"
    Trainer(model=tiny_regression(), args=args(out, max_steps=4, save_total_limit=None),
            train_dataset=regression_data(16)).train()
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4"]
    set_mtime(out, ["checkpoint-2"], YEAR_2000)
    set_mtime(out, ["checkpoint-4"], YEAR_2000 + 60)
    hf_four = digest(out / "checkpoint-4")
    loop = make_loop(out, max_steps=8)
    with pytest.warns(UserWarning, match="not written by loopkit"):
        loop.train(resume_from_checkpoint=True)
    assert loop.initial_global_step == 4 and loop.state.global_step == 8
    hf_steps = [h["step"] for h in loop.state.log_history if "loss" in h]
    assert hf_steps == list(range(1, 9))  # HF's log history up to 4, then this run's
    # The resumed run has an id of its own; rotation to 2 kept its newest two and both of HF's folders.
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert digest(out / "checkpoint-4") == hf_four
    assert record(out, "checkpoint-6")["run_id"] == record(out, "checkpoint-8")["run_id"]
    # A fresh rerun names HF's folders as unrecorded.
    with pytest.warns(UserWarning, match=r"unrecorded checkpoint-2, checkpoint-4 \(no run recorded: kept\)"):
        make_loop(out, max_steps=1, save_steps=1).train()


def test_a_reruns_best_is_never_the_other_runs_folder(tmp_path):
    """Evaluation every 2 steps, saves every 4: this run's best (step 2) has no checkpoint of its own, but run A's
    checkpoint-2 lies in the folder. Taking it as the best would load A's weights at the end."""
    out = tmp_path / "out"
    make_loop(out, max_steps=2, learning_rate=0.2).train()  # run A: checkpoint-2, other weights than this run's
    scores, loop = {2: 0.9, 4: 0.1}, None
    loop = Loop(model=tiny_regression(), train_dataset=regression_data(16), eval_dataset=regression_data(4, seed=1),
                args=args(out, max_steps=4, eval_strategy="steps", eval_steps=2, save_steps=4,
                          metric_for_best_model="score", load_best_model_at_end=True),
                compute_metrics=lambda _: {"score": scores[loop.state.global_step]})
    with pytest.warns(UserWarning, match="holds other runs' checkpoints"):
        loop.train()
    assert loop.state.best_global_step == 2 and loop.state.best_model_checkpoint is None
    final = load_file(out / "checkpoint-4" / "model.safetensors")
    assert all(torch.equal(final[k], v) for k, v in loop.model.state_dict().items())
    assert not torch.equal(load_file(out / "checkpoint-2" / "model.safetensors")["linear.weight"],
                           final["linear.weight"])


class FailAtStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        raise RuntimeError("the user's code failed at step 1")


def test_a_rerun_keeps_the_previous_run_and_removes_older_ones_in_one_line(tmp_path):
    """The disk stays bounded: with save_total_limit, a run's first complete save removes the folders of the runs
    older than the previous one (checkpoints and set-aside ones); the previous run stays whole; a run that fails
    before its first save removes nothing; with save_total_limit=None nothing is removed."""
    out = tmp_path / "out"
    make_loop(out, max_steps=4).train()  # run A: checkpoint-2, checkpoint-4
    run_a = record(out, "checkpoint-4")["run_id"]
    with pytest.warns(UserWarning, match="holds other runs' checkpoints"):
        make_loop(out, max_steps=2).train()  # run B: its checkpoint-2 sets A's aside
    run_b = record(out, "checkpoint-2")["run_id"]
    assert sorted(os.listdir(out)).count(f"checkpoint-2-of-run-{run_a}") == 1
    b_saved = digest(out / "checkpoint-2")

    # Run C: says in one line what it found and what happens to it, then removes A's folders at its first save.
    with pytest.warns(UserWarning) as caught:
        make_loop(out, max_steps=2).train()
    messages = [str(w.message) for w in caught]
    found = next(m for m in messages if "holds other runs' checkpoints" in m)
    assert f"run {run_a} 2 folders (older: removed at the first save); run {run_b} checkpoint-2 (previous run: " \
           f"kept)" in found and len(found.replace(str(out), "")) < 250, found
    removed = next(m for m in messages if m.startswith("Removed"))
    assert removed.startswith(f"Removed 2 checkpoint folder(s) of runs older than the previous one (checkpoint-4, "
                              f"checkpoint-2-of-run-{run_a}) from output_dir: save_total_limit=2 keeps") and \
        "One output_dir per run keeps them all." in removed and len(removed) < 250, removed
    run_c = record(out, "checkpoint-2")["run_id"]
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == \
        ["checkpoint-2", f"checkpoint-2-of-run-{run_b}"]
    assert digest(out / f"checkpoint-2-of-run-{run_b}") == b_saved  # the previous run, untouched

    # A run that fails before its first save removes nothing (B is now older than the previous run, C).
    failing = Loop(model=tiny_regression(), args=args(out, max_steps=2), train_dataset=regression_data(16),
                   callbacks=[FailAtStep()])
    with pytest.warns(UserWarning, match="older: removed at the first save"), \
            pytest.raises(RuntimeError, match="failed at step 1"):
        failing.train()
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint")) == \
        ["checkpoint-2", f"checkpoint-2-of-run-{run_b}"]

    # save_total_limit=None keeps everything, and says so.
    with pytest.warns(UserWarning, match=r"older: kept, save_total_limit=None") as caught:
        make_loop(out, max_steps=2, save_total_limit=None).train()
    assert not [w for w in caught if str(w.message).startswith("Removed")]
    assert {p for p in os.listdir(out) if p.startswith("checkpoint")} == \
        {"checkpoint-2", f"checkpoint-2-of-run-{run_b}", f"checkpoint-2-of-run-{run_c}"}
