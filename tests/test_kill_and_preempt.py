"""Nothing lost, nothing half-written: SIGKILL at listed moments (inside each phase of a save, inside an accumulation
window, during evaluation) and real SIGTERMs, each followed by `resume_from_checkpoint=True`, end with the same
weights as an uninterrupted run."""

import os
import random
import sys

import pytest
import torch
from safetensors.torch import load_file

from loopkit.checkpoint import checkpoint_dirs, checkpoint_problem

CHILD = os.path.join(os.path.dirname(__file__), "scripts", "train_child.py")
# Every phase of a save, then training and evaluation. Which arrival is hit is drawn from a seeded RNG.
MOMENTS = ["weights", "optimizer", "scheduler", "rng", "trainer_state", "loopkit_state", "fsync", "rename",
           "rotate", "substep", "evaluate"]


def run_child(forked, out, *moment, launcher=False):
    """train_child.py, forked from the session's fork server (conftest.forked: one intra-op thread, unbuffered)."""
    # As under a scheduler: an interrupted run exits 128 + signal (loopkit/guards.py).
    env = dict(forked.env, SLURM_JOB_ID="1") if launcher else None
    return forked.run([sys.executable, CHILD, str(out), *map(str, moment)],
                      f"scripts/train_child.py {' '.join(map(str, moment))}", env=env)


def final_weights(out):
    return load_file(os.path.join(out, "final.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, forked):
    out = tmp_path_factory.mktemp("reference")
    result = run_child(forked, out)
    assert result.returncode == 0, result.stderr[-3000:]
    return final_weights(out)


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs from the uninterrupted run"


def test_sigkill_at_every_moment_then_resume(tmp_path, reference, forked):
    rng = random.Random(2024)
    out = tmp_path / "run"
    for moment in MOMENTS:
        occurrence = rng.randint(1, 2)
        result = run_child(forked, out, moment, occurrence)
        assert result.returncode == -9, f"{moment}#{occurrence} was not reached: {result.stderr[-2000:]}"
        # Whatever the moment, every folder named like a checkpoint is complete: resume never picks a broken one.
        for path in checkpoint_dirs(str(out)):
            assert checkpoint_problem(path) is None, f"after a kill at {moment}: {path} is broken"
    result = run_child(forked, out)
    assert result.returncode == 0, result.stderr[-3000:]
    leftovers = [p for p in os.listdir(out) if p.startswith(".")]
    assert leftovers == [], f"leftovers of killed saves were not cleaned: {leftovers}"
    assert_same(final_weights(out), reference)


def test_sigterm_during_training_checkpoints_and_exits_143(tmp_path, reference, forked):
    out = tmp_path / "run"
    result = run_child(forked, out, "sigterm-step", 3, launcher=True)  # global step 3: not a save step (saves every 2)
    assert result.returncode == 143, result.stderr[-2000:]
    assert (out / "checkpoint-3").is_dir() and checkpoint_problem(str(out / "checkpoint-3")) is None
    result = run_child(forked, out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same(final_weights(out), reference)


def test_sigterm_during_evaluation_runs_the_evaluation_on_resume(tmp_path, reference, forked):
    import json

    out = tmp_path / "run"
    result = run_child(forked, out, "sigterm-eval", 2, launcher=True)  # the 2nd batch of the first evaluation (step 4)
    assert result.returncode == 143, result.stderr[-2000:]
    state = json.load(open(out / "checkpoint-4" / "trainer_state.json"))
    assert not any("eval_loss" in h for h in state["log_history"]), "the abandoned evaluation was logged"
    assert json.load(open(out / "checkpoint-4" / "loopkit_state.json"))["schedule"]["pending_evaluation"]
    result = run_child(forked, out)
    assert result.returncode == 0, result.stderr[-3000:]
    final_state = json.load(open(sorted(checkpoint_dirs(str(out)))[-1] + "/trainer_state.json"))
    eval_steps = [h["step"] for h in final_state["log_history"] if "eval_loss" in h]
    assert eval_steps[0] == 4, eval_steps
    assert_same(final_weights(out), reference)
