"""A user's script launched on several processes exits 0 (loopkit/process_exit.py): the waiting rule on fake thread
states, and tests/scripts/user_script.py (no process-group teardown, no early exit of its own) launched with
`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2`, each launch exiting 0. docs/distributed.md has the counts of
many launches, quiet and under load, and the command that produced them."""

from __future__ import annotations

import json
import os

import pytest

from loopkit import process_exit
from helpers import free_port, run_process
from test_distributed import BIN, child_env

USER_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "user_script.py")


def fake_states(*sequence):
    """`states` for settle_collective_threads: each poll returns the next entry (the last one repeats)."""
    polls = iter(sequence)
    last = [sequence[-1]]

    def states():
        last[0] = next(polls, last[0])
        return last[0]
    return states


def test_waits_until_every_worker_is_blocked_several_polls_in_a_row():
    slept = []
    states = fake_states(["R", "S"], ["S", "S"], ["S", "R"], *[["S", "S"]] * process_exit.SETTLED_POLLS)
    polls = process_exit.settle_collective_threads(states, sleep=slept.append)
    # 1 poll with a runnable worker, 1 settled, 1 runnable again (the count restarts), then SETTLED_POLLS settled
    assert polls == 3 + process_exit.SETTLED_POLLS
    assert len(slept) == polls - 1


def test_returns_at_once_without_gloo_workers_and_gives_up_at_the_limit():
    assert process_exit.settle_collective_threads(fake_states([]), sleep=lambda s: None) == 1
    polls = process_exit.settle_collective_threads(fake_states(["R"]), sleep=lambda s: None, limit_s=0.5)
    assert polls == round(0.5 / process_exit.POLL_S)


def test_thread_states_are_read_from_the_task_folder(tmp_path):
    for tid, name, state in ((11, "python", "R"), (12, "pt_gloo_runloop", "S"), (13, "pt_gloo_runloop", "R"),
                             (14, "odd) name (", "R")):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "stat").write_text(f"{tid} ({name}) {state} 1 2 3 4\n")
    assert sorted(process_exit.worker_thread_states(str(tmp_path))) == ["R", "S"]
    assert process_exit.worker_thread_states(str(tmp_path / "missing")) == []


LAUNCHES = 3


@pytest.mark.parametrize("launch", range(LAUNCHES))
def test_a_user_script_on_two_processes_exits_0(tmp_path, launch, forked):
    """Launch 0 is a real torchrun; the others start the same two ranks as forks of the session's fork server with
    torchrun's worker environment (helpers.ForkServer.launch), which exit through the interpreter's exit as well
    (the moment the gloo threads are settled), and fail the launch as torchrun would if one does not exit 0."""
    arguments = [USER_SCRIPT, "--output_dir", str(tmp_path), "--report_to", "none", "--disable_tqdm", "true"]
    if launch == 0:
        command = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                   *arguments]
        result = run_process(command, "the user script's 2-process launch", env=child_env(cpu_mode=True))
    else:
        result = forked.launch(arguments, 2, "the user script's 2-process launch",
                               env=child_env(cpu_mode=True)).wait()
    output = result.stdout + (result.stderr or "")
    assert result.returncode == 0, output[-4000:]
    assert "terminate called" not in output
    with open(os.path.join(tmp_path, "result.json")) as f:
        metrics = json.load(f)
    assert metrics["eval_13"]["eval_in_order"] and metrics["predict_7"]["test_in_order"]
    assert metrics["train"]["train_loss"] > 0
