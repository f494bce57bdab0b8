"""`HFStorage(async_save=True)` under FSDP2 on 2 CPU processes (gloo), with both of Accelerate's state-dict types
(loopkit/checkpoint/staged_shards.py; the script: tests/scripts/hf_async_child.py, its ranks forked from the
session's fork server with torchrun's worker environment, helpers.ForkServer.launch).

* every asynchronous checkpoint holds exactly the files of the synchronous one of the same step (Accelerate's
  `pytorch_model_fsdp_0/` + `optimizer_0/`, or `model.safetensors` + `optimizer.bin`), with the same tensors;
* a run resumed from an asynchronous checkpoint ends bit-identical (weights and AdamW moments, tensor by tensor) to
  the uninterrupted run, which ends as the synchronous one;
* `load_best_model_at_end` from asynchronous checkpoints loads the best one, as from synchronous ones;
* a rank SIGKILLed on the writer thread in the middle of checkpoint-4 leaves checkpoint-2 complete and no folder
  named checkpoint-4; the run resumed from there (2 processes, asynchronous saves) ends bit-identical to the
  uninterrupted run.

* a model on a mesh of more than one dimension (HSDP, tensor parallelism) is refused with the field and the fix named
  (one process, a gloo group of one).

Launches: the two layouts together (4 ranks), then the two kills, then the two resumes after the kill; then the two
layouts again on one process each (FSDP2 on one process: the same files, resume and best-model load).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from loopkit.checkpoint import checkpoint_dirs
from loopkit.storage import HFStorage
from helpers import wait_for
from test_distributed import child_env

CHILD = os.path.join(os.path.dirname(__file__), "scripts", "hf_async_child.py")
TYPES = ["SHARDED_STATE_DICT", "FULL_STATE_DICT"]


def launch_both(forked, folders: dict, mode: str, processes: int = 2) -> dict:
    """One launch of `mode` per state-dict type, both at once; returns {type: (returncode, output)}."""
    what = f"the {processes}-process {mode} launch"
    started = {kind: forked.launch([CHILD, folders[kind, processes], mode, kind], processes, f"{what} ({kind})",
                                   env=child_env(cpu_mode=True)) for kind in TYPES}
    outputs = {kind: wait_for(process, f"{what} ({kind})") for kind, process in started.items()}
    return {kind: (started[kind].returncode, output) for kind, output in outputs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, forked):
    """The launches (module docstring); what the kill left is recorded before the resume changes it."""
    folders = {(kind, n): str(tmp_path_factory.mktemp(f"{kind.split('_')[0].lower()}{n}")) for kind in TYPES
               for n in (1, 2)}
    for kind, (code, output) in launch_both(forked, folders, "layout").items():
        assert code == 0, f"the {kind} layout launch failed (rc {code}):\n{output[-6000:]}"
    killed = launch_both(forked, folders, "kill")
    left = {kind: {"returncode": killed[kind][0], "output": killed[kind][1],
                   "checkpoints": [os.path.basename(d) for d in checkpoint_dirs(os.path.join(folders[kind, 2],
                                                                                              "killed"))],
                   "problems": {os.path.basename(d): HFStorage().checkpoint_problem(d)
                                for d in checkpoint_dirs(os.path.join(folders[kind, 2], "killed"))}}
            for kind in TYPES}
    resumed = launch_both(forked, folders, "after-kill")
    for kind, (code, output) in launch_both(forked, folders, "layout", processes=1).items():
        assert code == 0, f"the 1-process {kind} layout launch failed (rc {code}):\n{output[-6000:]}"
    return folders, left, resumed


def relative_files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names)


def assert_equal_tensors(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{what}: {key} differs"


def assert_same_optimizer_state(actual: dict, expected: dict, what: str) -> None:
    assert actual["param_groups"] == expected["param_groups"], what
    assert actual["state"].keys() == expected["state"].keys(), what
    for name, moments in expected["state"].items():
        assert_equal_tensors(actual["state"][name], moments, f"{what}: {name}")


@pytest.mark.parametrize("processes", [2, 1])
@pytest.mark.parametrize("kind", TYPES)
def test_async_checkpoints_hold_the_files_and_tensors_of_the_synchronous_ones(runs, kind, processes):
    folders, _, _ = runs
    sync, asynchronous = (os.path.join(folders[kind, processes], name) for name in ("sync", "async"))
    names = [os.path.basename(d) for d in checkpoint_dirs(asynchronous)]
    assert names == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert names == [os.path.basename(d) for d in checkpoint_dirs(sync)]
    for name in names:
        files = relative_files(os.path.join(asynchronous, name))
        assert files == relative_files(os.path.join(sync, name)), f"{kind} {name}: not the synchronous save's files"
        expected = ({f"{part}/__{rank}_0.distcp" for part in ("pytorch_model_fsdp_0", "optimizer_0")
                     for rank in range(processes)} if kind == "SHARDED_STATE_DICT"
                    else {"model.safetensors", "config.json", "optimizer.bin"})
        assert expected <= set(files), (kind, name, files)
        for path in files:  # the shards and the weights byte for byte, the whole optimizer state tensor by tensor
            if path.endswith((".distcp", "model.safetensors")):
                with open(os.path.join(sync, name, path), "rb") as a, open(os.path.join(asynchronous, name, path),
                                                                             "rb") as b:
                    assert a.read() == b.read(), f"{kind} {name}/{path} differs from the synchronous save's"
            elif path == "optimizer.bin":
                assert_same_optimizer_state(
                    torch.load(os.path.join(asynchronous, name, path), weights_only=True),
                    torch.load(os.path.join(sync, name, path), weights_only=True), f"{kind} {name}/optimizer.bin")
        assert HFStorage().checkpoint_problem(os.path.join(asynchronous, name)) is None


@pytest.mark.parametrize("processes", [2, 1])
@pytest.mark.parametrize("kind", TYPES)
def test_a_resume_from_an_async_checkpoint_is_bit_identical_to_the_uninterrupted_run(runs, kind, processes):
    folders, _, _ = runs
    final = {name: load_file(os.path.join(folders[kind, processes], f"{name}.safetensors")) for name in ("sync", "async",
                                                                                              "resumed")}
    assert any(key.startswith("optimizer.state.") for key in final["async"])  # the AdamW moments are compared too
    assert_equal_tensors(final["async"], final["sync"], f"{kind}: asynchronous saves against synchronous ones")
    assert_equal_tensors(final["resumed"], final["async"], f"{kind}: resumed from async/checkpoint-4")


@pytest.mark.parametrize("processes", [2, 1])
@pytest.mark.parametrize("kind", TYPES)
def test_load_best_model_at_end_from_async_checkpoints_loads_what_the_synchronous_run_loads(runs, kind, processes):
    import json

    folders = {kind: runs[0][kind, processes]}
    records = {name: json.load(open(os.path.join(folders[kind], f"{name}.json"))) for name in ("best_sync",
                                                                                               "best_async")}
    best = records["best_async"]["best_model_checkpoint"]
    assert os.path.basename(best) == os.path.basename(records["best_sync"]["best_model_checkpoint"])
    assert os.path.basename(best) != f"checkpoint-{records['best_async']['global_step']}"  # not the last: a load
    assert_equal_tensors(load_file(os.path.join(folders[kind], "best_async.safetensors")),
                         load_file(os.path.join(folders[kind], "best_sync.safetensors")),
                         f"{kind}: the model after load_best_model_at_end")
    if kind == "FULL_STATE_DICT":  # the whole weights of model.safetensors, loaded into each rank's shards
        final = load_file(os.path.join(folders[kind], "best_async.safetensors"))
        saved = load_file(os.path.join(best, "model.safetensors"))
        assert_equal_tensors({key: final[f"model.{key}"] for key in saved}, saved, "the best checkpoint's weights")


@pytest.mark.parametrize("kind", TYPES)
def test_sigkill_during_the_background_write_keeps_earlier_checkpoints_and_resumes_exactly(runs, kind):
    folders, left, resumed = {kind: runs[0][kind, 2]}, runs[1], runs[2]
    killed, dying = left[kind], 1 if kind == "SHARDED_STATE_DICT" else 0  # the rank the script kills
    assert killed["returncode"] != 0, killed["output"][-3000:]
    assert f"rank {dying} " in killed["output"] and "failed first, Signal 9 (SIGKILL)" in killed["output"], \
        killed["output"][-3000:]
    assert killed["checkpoints"] == ["checkpoint-2"], f"{kind}: after the kill {killed['checkpoints']}"
    assert killed["problems"] == {"checkpoint-2": None}
    code, output = resumed[kind]
    assert code == 0, f"the {kind} resume after the kill failed (rc {code}):\n{output[-6000:]}"
    assert "resumed at step 2" in output, output[-3000:]
    run_dir = os.path.join(folders[kind], "killed")
    assert not [n for n in os.listdir(run_dir) if n.startswith(".")], "the killed save's folder was left"
    assert [os.path.basename(d) for d in checkpoint_dirs(run_dir)] == [f"checkpoint-{n}" for n in (2, 4, 6, 8)]
    assert_equal_tensors(load_file(os.path.join(folders[kind], "killed.safetensors")),
                         load_file(os.path.join(folders[kind], "async.safetensors")),
                         f"{kind}: killed during an asynchronous save, then resumed")



def test_a_mesh_of_more_than_one_dimension_is_refused_with_the_fix_named(tmp_path, forked):
    import json

    env = dict(child_env(cpu_mode=False), PYTHONUNBUFFERED="1")
    result = forked.run([sys.executable, CHILD, str(tmp_path), "mesh", "-"], "the mesh check", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    refusal = json.load(open(os.path.join(tmp_path, "mesh.json")))["refusal"]
    assert refusal is not None and refusal.startswith("LoopConfigError: async_save=True"), refusal
    for words in ("hybrid.weight", "2-dimensional mesh", "DCPStorage(async_save=True)", "HFStorage(async_save=False)"):
        assert words in refusal, refusal
