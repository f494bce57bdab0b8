"""Losing half the ranks: a 4-process run checkpointed by `DCPStorage` resumes on 2 processes and on 1 with the
4-process run's data order exactly (every sample id of every step: none repeated, none skipped) and its losses within
1e-6 (docs/checkpoints.md: the data position is in global samples; DCP reshards). The global batch stays 4 (4 x 1,
2 x 2, 1 x 4). The ranks are forks of the session's fork server with torchrun's worker environment
(helpers.ForkServer.launch); the script is tests/scripts/reshard_child.py."""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers import wait_for
from test_distributed import child_env

CHILD = os.path.join(os.path.dirname(__file__), "scripts", "reshard_child.py")
sys.path.insert(0, os.path.dirname(CHILD))
import reshard_child  # noqa: E402

RESUMED_AT = 2  # checkpoint-2 of the 4-process run


def launch(forked, out, processes: int, name: str, *checkpoint):
    what = f"the {processes}-process run {name}"
    if processes == 1:
        return forked.start([sys.executable, CHILD, str(out), name, *checkpoint], what, env=child_env(cpu_mode=False),
                            merge_stderr=True)
    return forked.launch([CHILD, str(out), name, *checkpoint], processes, what, env=child_env(cpu_mode=True))


def finish(process, what: str) -> None:
    output = wait_for(process, what)
    assert process.returncode == 0, f"{what} failed (rc {process.returncode}):\n{(output or '')[-6000:]}"


def read(out, name: str) -> tuple[dict, dict]:
    """Each step's sample ids over all ranks (as a sorted list, with repeats kept) and each step's logged loss."""
    ranks = [json.load(open(os.path.join(out, name_file))) for name_file in sorted(os.listdir(out))
             if name_file.startswith(f"{name}_rank")]
    assert ranks and len(ranks) == ranks[0]["num_processes"], f"{name}: {len(ranks)} rank results"
    ran = {len(rank["forwards"]) for rank in ranks}  # one forward per step (no accumulation), each rank alike
    assert len(ran) == 1, f"{name}: the ranks ran {ran} forwards"
    first_step = reshard_child.MAX_STEPS - ran.pop() + 1
    steps = {}
    for rank in ranks:
        for offset, ids in enumerate(rank["forwards"]):
            steps.setdefault(first_step + offset, []).extend(ids)
    losses = {entry["step"]: entry["loss"] for entry in ranks[0]["log_history"]
              if "loss" in entry and entry["step"] >= first_step}  # a resumed history starts with the checkpoint's
    return {step: sorted(ids) for step, ids in steps.items()}, losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory, forked):
    out = tmp_path_factory.mktemp("reshard")
    finish(launch(forked, out, 4, "four"), "the 4-process run")
    checkpoint = os.path.join(out, "four", f"checkpoint-{RESUMED_AT}")
    started = {processes: launch(forked, out, processes, f"from_four_on_{processes}", checkpoint)
               for processes in (2, 1)}
    for processes, process in started.items():
        finish(process, f"the resume on {processes} process(es)")
    return out


@pytest.mark.parametrize("processes", [2, 1], ids=["4->2", "4->1"])
def test_losing_ranks_resumes_the_four_process_data_order_and_losses(runs, processes):
    order, losses = read(runs, "four")
    assert sorted(order) == list(range(1, reshard_child.MAX_STEPS + 1))
    trained = [i for step in sorted(order) for i in order[step]]
    assert len(trained) == len(set(trained)) == reshard_child.MAX_STEPS * reshard_child.GLOBAL_BATCH  # one epoch's
    resumed_order, resumed_losses = read(runs, f"from_four_on_{processes}")
    expected = {step: ids for step, ids in order.items() if step > RESUMED_AT}
    assert resumed_order == expected, f"4 -> {processes}: the sample ids of each step differ"
    assert resumed_losses.keys() == {step for step in losses if step > RESUMED_AT}
    worst = max(abs(resumed_losses[step] - losses[step]) for step in resumed_losses)
    print(f"4 -> {processes}: steps {sorted(resumed_losses)}, the same sample ids; worst |loss difference| {worst:.2e}")
    assert worst <= 1e-6
