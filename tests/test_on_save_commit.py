"""`on_save` fires once its checkpoint is committed (written, fsynced, renamed into place, rotated), under every
storage, synchronous and asynchronous: a callback that opens, at `on_save`, the newest checkpoint folder (as HF's
callbacks find it: Ray Train's `RayTrainReportCallback` reads `get_last_checkpoint(output_dir)`) finds the one it is
told of and reads it whole, with the weights of its step; a SIGKILL during a save leaves no `on_save` for the lost
checkpoint (docs/events.md, "When on_save fires"). The same on 2 ranks (DDP, gloo) with asynchronous DCP saves: every
rank opens, at each `on_save`, the complete checkpoint it is told of, and a SIGKILL of rank 0 during a save leaves
no `on_save` for the lost checkpoint on either rank."""

import json
import os
import sys

import pytest

import loopkit.checkpoint as ckpt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import on_save_child  # noqa: E402

CHILD = on_save_child.__file__
STORAGES = ["hf", "hf-async", "dcp", "dcp-async"]


@pytest.fixture
def slow_writes(monkeypatch):
    """Each save's fsync takes 0.2 s longer: an asynchronous save then commits after later steps have run, so its
    `on_save` is a late one."""
    import time

    original = ckpt.fsync_tree

    def fsync_tree(path):
        time.sleep(0.2)
        original(path)

    monkeypatch.setattr(ckpt, "fsync_tree", fsync_tree)


def check_records(records: list, steps: list) -> None:
    """One `on_save` per save, in order, each having opened its own checkpoint whole."""
    assert [r["step"] for r in records] == steps
    for record in records:
        step = record["step"]
        assert record["opened"] == f"checkpoint-{step}", record  # the newest folder is the one announced
        assert record["trainer_state_step"] == step and record["weights_equal"], record
        assert record["optimizer_states"] > 0, record  # AdamW's moments, read back
        assert record["logged_up_to"] <= step, record  # metrics of the checkpoint's own steps (Ray's report)


@pytest.mark.parametrize("storage", STORAGES)
def test_on_save_opens_its_own_complete_checkpoint(tmp_path, slow_writes, storage):
    watch = on_save_child.OpenAtSave(storage)
    on_save_child.train(str(tmp_path), storage, watch)
    check_records(watch.records, [4, 8, 12])
    late = [r["late"] for r in watch.records]
    if storage.endswith("-async"):  # announced after later steps ran, with the checkpoint's own state
        assert any(late[:-1]), late
    else:
        assert not any(late), late
    # the last checkpoint is committed and announced before the summary log and on_train_end
    assert watch.events[-3:] == ["on_save", "summary_log", "on_train_end"], watch.events[-6:]


@pytest.mark.parametrize("storage", ["hf-async", "dcp-async"])
def test_a_checkpoint_killed_mid_save_gets_no_on_save(tmp_path, forked, storage):
    record_path = tmp_path / "on_save.jsonl"
    result = forked.run([sys.executable, CHILD, str(tmp_path), storage, "8"], f"on_save_child.py {storage} 8")
    assert result.returncode == -9, result.stderr[-3000:]
    killed = [json.loads(line) for line in record_path.read_text().splitlines()]
    check_records(killed, [4])  # no on_save at 8: checkpoint-8 never existed
    assert not (tmp_path / "checkpoint-8").exists() and (tmp_path / ".tmp-checkpoint-8").exists()
    result = forked.run([sys.executable, CHILD, str(tmp_path), storage], f"on_save_child.py {storage} (resumed)")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = [json.loads(line) for line in record_path.read_text().splitlines()]
    check_records(resumed, [4, 8, 12])


def launch_two_ranks(forked, out, *arguments):
    """on_save_child.py OUT dcp-async ARGUMENTS on 2 DDP ranks (CPU, gloo), forked with torchrun's worker
    environment (helpers.ForkServer.launch)."""
    from test_distributed import child_env

    return forked.launch([CHILD, str(out), "dcp-async", *arguments], 2, "on_save_child.py dcp-async on 2 ranks",
                         env=child_env(cpu_mode=True)).wait()


def rank_records(out) -> list[list]:
    return [[json.loads(line) for line in (out / f"on_save_rank{rank}.jsonl").read_text().splitlines()]
            for rank in (0, 1)]


def test_two_ranks_each_open_the_complete_async_checkpoint_at_on_save(tmp_path, forked):
    """Every rank's `on_save` finds the checkpoint it names renamed into place and whole (DCP's shards of both ranks,
    read back as one state), at the same step on both ranks (Ray Train's report is a collective there)."""
    result = launch_two_ranks(forked, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    for records in rank_records(tmp_path):
        check_records(records, [4, 8, 12])
        # with several processes a save is announced once every process waited for it: at the next save, or the end
        assert [r["late"] for r in records] == [True, True, False], records


def test_two_ranks_killed_mid_async_save_get_no_on_save_for_it(tmp_path, forked):
    result = launch_two_ranks(forked, tmp_path, "8")
    assert result.returncode != 0 and "rank 0" in result.stdout and "SIGKILL" in result.stdout, result.stdout[-3000:]
    for records in rank_records(tmp_path):
        check_records(records, [4])  # neither rank announced checkpoint-8, which never existed
    assert not (tmp_path / "checkpoint-8").exists() and (tmp_path / ".tmp-checkpoint-8").exists()
    result = launch_two_ranks(forked, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    for records in rank_records(tmp_path):
        check_records(records, [4, 8, 12])


def test_the_events_page_example_runs():
    """docs/events.md's "When on_save fires" example (asynchronous DCP saves; it asserts what each on_save found)."""
    import re

    page = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "events.md")).read()
    (block,) = re.findall(r"^```python\n(.*?)^```$", page, re.DOTALL | re.MULTILINE)
    exec(compile(block, "docs/events.md", "exec"), {})
