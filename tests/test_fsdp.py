"""Sharded training (FSDP2) proven on CPU processes: Accelerate's FSDP2 path (its plugin, `prepare` ->
`fully_shard`, `clip_grad_norm_`, `save_fsdp_*` / `load_fsdp_*` with torch's distributed checkpoint) run by
`ACCELERATE_USE_CPU=1 torchrun` on gloo processes (loopkit.distributed.shard_on_cpu_processes), against the same
script run unsharded in one process with the same global batch (tests/scripts/fsdp_child.py).

Launches, at most 4 ranks at a time (all 11 at once peaked at 9.4 GB of resident memory, enough for two suites side
by side to run a 24 GB machine out of memory): the scenarios (2 processes), the kill during a sharded save (2
processes), and one optimizer step of a ~33 M-parameter model at 1, 2 and 4 processes for the memory per rank. The
scenarios are a real `torchrun` launch; the others fork their ranks from the session's fork server with torchrun's
worker environment (helpers.ForkServer.launch), which spares each rank ~5 s of imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from loopkit.checkpoint import checkpoint_dirs
from helpers import free_port, wait_for
from test_distributed import BIN, assert_same_losses, child_env, losses, worst_relative_difference
from test_distributed import finish as finish_launch

CHILD_PATH = os.path.join(os.path.dirname(__file__), "scripts", "fsdp_child.py")


def load_child():
    import importlib.util
    import sys

    sys.path.insert(0, os.path.dirname(CHILD_PATH))
    spec = importlib.util.spec_from_file_location("fsdp_child", CHILD_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = load_child()


# The one real `torchrun` launch of this file (a user's launch stays proven); the other launches start the same
# ranks as forks of the session's fork server, with torchrun's worker environment (helpers.ForkServer.launch).
REAL_TORCHRUN = "scenarios"


def launch(out, mode: str, processes: int = 2, *extra, forked=None):
    """`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node PROCESSES fsdp_child.py OUT MODE EXTRA...`, or its ranks
    forked from `forked` (a `helpers.ForkServer`)."""
    arguments = [CHILD_PATH, str(out), mode, *map(str, extra)]
    if forked is not None:
        return forked.launch(arguments, processes, f"the {processes}-process {mode} launch",
                             env=child_env(cpu_mode=True))
    command = [os.path.join(BIN, "torchrun"), "--nproc_per_node", str(processes), "--master_port", str(free_port()),
               *arguments]
    return subprocess.Popen(command, env=child_env(cpu_mode=True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(process, what: str, expect_success: bool = True) -> str:
    output = finish_launch(process, what)
    if expect_success:
        assert process.returncode == 0, f"{what} failed (rc {process.returncode}):\n{output[-6000:]}"
    return output


RANKS_AT_ONCE = 4


def run_launches(launches: dict, forked, may_fail: tuple = ()) -> dict:
    """Start the launches {what: (out, mode, processes, *extra)} in order, never more than RANKS_AT_ONCE ranks
    running, each forked but REAL_TORCHRUN; returns {what: output}. Each must exit 0 unless named in `may_fail`."""
    running, outputs = {}, {}  # what -> (process, ranks), oldest first

    def finish_oldest():
        what, (process, _) = next(iter(running.items()))
        del running[what]
        outputs[what] = finish(process, what, expect_success=what not in may_fail)

    try:
        for what, (out, mode, processes, *extra) in launches.items():
            while running and sum(ranks for _, ranks in running.values()) + processes > RANKS_AT_ONCE:
                finish_oldest()
            running[what] = (launch(out, mode, processes, *extra,
                                    forked=None if what == REAL_TORCHRUN else forked), processes)
        while running:
            finish_oldest()
    finally:  # one launch failed: the others stop now, not write into pytest's folders after the test
        for what, (process, _) in running.items():
            process.terminate()  # torchrun (and the forked agent) passes SIGTERM on; SIGKILL would orphan them
            wait_for(process, f"{what} (stopped: another launch failed)")
    return outputs


def result(folder, name: str, rank: int = 0) -> dict:
    with open(os.path.join(folder, f"{name}_rank{rank}.json")) as f:
        return json.load(f)


def weights(folder, name: str) -> dict:
    return load_file(os.path.join(folder, f"{name}.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, forked):
    """The one-process references here, then every launch (4 ranks at a time). Returns the folders."""
    two, one = tmp_path_factory.mktemp("sharded"), tmp_path_factory.mktemp("unsharded")
    start = time.time()
    child.run_training(str(one), "whole", 2, sharded=False, save_at=child.SAVE_AT)  # 1 x 2 = 2 x 1 per micro-batch
    child.run_training(str(one), "best", 2, sharded=False, **child.BEST)
    whole_checkpoint = os.path.join(one, "whole", f"checkpoint-{child.SAVE_AT}")
    launches = {"scenarios": (two, "all", 2, whole_checkpoint), "kill": (two, "kill", 2)}
    memory = {n: tmp_path_factory.mktemp(f"memory{n}") for n in (1, 2, 4)}
    launches.update({f"memory {n}": (memory[n], "memory+ram_efficient" if n == 2 else "memory", n) for n in memory})
    outputs = run_launches(launches, forked, may_fail=("kill",))
    # 2 -> 1: the sharded checkpoint resumed by one unsharded process; and the checkpoint the kill left.
    child.run_training(str(one), "from_sharded", 2, sharded=False,
                       resume_from=os.path.join(two, "sharded", f"checkpoint-{child.SAVE_AT}"))
    print(f"\nlaunches (2 + 2 + 1 + 2 + 4 processes) + 1-process references: {time.time() - start:.1f} s")
    return two, one, memory, outputs


def test_accelerate_runs_fsdp2_with_sharded_parameters(runs):
    two, _, _, _ = runs
    for name in ("sharded", "resume", "from_whole"):
        for rank in (0, 1):
            got = result(two, name, rank)
            assert got["distributed_type"] == "DistributedType.FSDP" and got["is_fsdp2"], (name, got)
            assert got["dtensor_params"] == got["params"] == 21  # every parameter is a DTensor
            assert got["local_rows_of_embedding"] == child.dist_child.VOCAB // 2  # each rank holds half the rows


def test_two_sharded_processes_match_one_process_with_the_same_global_batch(runs):
    """Gradient accumulation (2), clipping at 0.5 with the norm over both ranks' shards, and the loss normalised
    by the label tokens summed over ranks (ragged -100 labels): same losses, norms and weights as one process."""
    two, one, _, _ = runs
    sharded, reference = result(two, "sharded"), result(one, "whole")
    assert_same_losses(losses(sharded), losses(reference), "sharded vs one process")
    norms = {e["step"]: e["grad_norm"] for e in sharded["log_history"] if "grad_norm" in e}
    expected = {e["step"]: e["grad_norm"] for e in reference["log_history"] if "grad_norm" in e}
    assert norms.keys() == expected.keys() and len(norms) == child.MAX_STEPS
    for step, norm in norms.items():
        assert norm == pytest.approx(expected[step], rel=1e-5)
        assert norm > child.MAX_GRAD_NORM  # every step clipped
    measured = worst_relative_difference(weights(two, "sharded"), weights(one, "whole"))
    print(f"sharded 2 x 1 (x2 accumulation) vs 1 x 2: max|dw|/max|w| = {measured:.2e}")
    assert measured <= 1e-4
    initial = {k: v.detach() for k, v in child.dist_child.tiny_llama().state_dict().items()}
    assert worst_relative_difference(weights(two, "sharded"), initial) > 1e-2  # it did train
    for key in ("eval_gathered_accuracy", "eval_token_accuracy", "eval_perplexity"):
        assert sharded["eval_after"][key] == pytest.approx(reference["eval_after"][key], rel=1e-4), key


def test_sharded_checkpoint_layout_and_resume_on_two_processes_is_bit_exact(runs):
    two, _, _, _ = runs
    run_dir = os.path.join(two, "sharded")
    assert [os.path.basename(d) for d in checkpoint_dirs(run_dir)] == [f"checkpoint-{child.SAVE_AT}"]
    assert not [n for n in os.listdir(run_dir) if n.startswith(".")], "leftover temporary folders"
    checkpoint = checkpoint_dirs(run_dir)[0]
    files = set(os.listdir(checkpoint))
    assert {"pytorch_model_fsdp_0", "optimizer_0", "rng_state_0.pth", "rng_state_1.pth", "scheduler.pt"} <= files
    assert not files & {"model.safetensors", "optimizer.pt", "optimizer.bin"}  # nothing gathered
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch's distributed checkpoint: one file per rank
        assert sorted(os.listdir(os.path.join(checkpoint, folder))) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    resumed = result(two, "resume")
    assert resumed["global_step"] == child.MAX_STEPS
    assert losses(resumed) == losses(result(two, "sharded"))
    got, expected = weights(two, "resume"), weights(two, "sharded")
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


def test_checkpoints_move_between_sharded_and_unsharded_runs(runs):
    """2 -> 1: the sharded checkpoint resumed by one unsharded process (torch's distributed checkpoint reads every
    shard); 1 -> 2: an ordinary checkpoint (model.safetensors, optimizer.pt) resumed by 2 sharded processes. Both
    against the uninterrupted one-process run."""
    two, one, _, _ = runs
    reference = result(one, "whole")
    for folder, name in ((one, "from_sharded"), (two, "from_whole")):
        resumed = result(folder, name)
        assert resumed["global_step"] == child.MAX_STEPS
        assert_same_losses(losses(resumed), losses(reference), name)
        measured = worst_relative_difference(weights(folder, name), weights(one, "whole"))
        print(f"{name}: max|dw|/max|w| vs the uninterrupted one-process run = {measured:.2e}")
        assert measured <= 1e-4
    assert [w for w in result(one, "from_sharded")["warnings"] if "saved by 2 process(es) and is resumed by 1" in w]


def test_save_model_writes_one_safetensors_that_from_pretrained_loads(runs):
    from transformers import LlamaForCausalLM

    two, _, _, _ = runs
    folder = os.path.join(two, "sharded", "final")
    assert "model.safetensors" in os.listdir(folder)
    # The model's own class, not the one FSDP2's fully_shard swapped in (as Trainer's save_pretrained records it)
    assert result(two, "sharded")["model_class"] == "FSDPLlamaForCausalLM"
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    model = LlamaForCausalLM.from_pretrained(folder)
    expected = weights(two, "sharded")
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)


def test_a_sharded_checkpoint_converts_to_a_from_pretrained_folder(runs, tmp_path):
    """docs/checkpoints.md's recipe, in this plain process: checkpoint-4 of the 2-process sharded run (no
    model.safetensors), loaded from its shards into the model class and saved with `save_pretrained`, loads with
    `from_pretrained` and matches checkpoint-4 of the unsharded run."""
    from transformers import LlamaForCausalLM

    from loopkit.checkpoint import load_model_weights

    two, one, _, _ = runs
    model = child.dist_child.tiny_llama()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    load_model_weights(model, os.path.join(two, "sharded", f"checkpoint-{child.SAVE_AT}"))
    model.save_pretrained(tmp_path / "pretrained")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "pretrained").state_dict()
    expected = load_file(os.path.join(one, "whole", f"checkpoint-{child.SAVE_AT}", "model.safetensors"))
    measured = worst_relative_difference({k: reloaded[k] for k in expected}, expected)
    moved = worst_relative_difference({k: initial[k] for k in expected}, expected)
    print(f"converted sharded checkpoint vs the unsharded run's: max|dw|/max|w| = {measured:.2e} "
          f"(initial weights: {moved:.2e})")
    assert measured <= 1e-4 < moved


def test_load_best_model_at_end_from_sharded_checkpoints(runs):
    """Evaluation every 2 steps on 2 sharded processes, the best sharded checkpoint loaded back into the sharded
    model at the end: the same best step and weights as one unsharded process."""
    two, one, _, _ = runs
    sharded, reference = result(two, "best"), result(one, "best")
    best = os.path.basename(sharded["best_model_checkpoint"])
    assert best == os.path.basename(reference["best_model_checkpoint"]) != f"checkpoint-{child.MAX_STEPS}"
    assert "pytorch_model_fsdp_0" in os.listdir(os.path.join(two, "best", best))
    assert worst_relative_difference(weights(two, "best"), weights(one, "best")) <= 1e-4
    # (eval_loss weighs batch means by the per-device batch size, so 2 x 3 and 1 x 3 differ: perplexity is exact)
    assert sharded["eval_after"]["eval_perplexity"] == pytest.approx(reference["eval_after"]["eval_perplexity"],
                                                                     rel=1e-5)
    last = [e["eval_loss"] for e in sharded["log_history"] if e.get("step") == child.MAX_STEPS and "eval_loss" in e]
    assert last and sharded["eval_after"]["eval_loss"] < last[0]  # the model at the end is the best, not the last


def test_cpu_ram_efficient_loading_takes_rank_zero_weights(runs):
    """Rank 1 starts from other weights; with cpu_ram_efficient_loading Accelerate shards rank 0's (broadcast), so
    the run equals the ordinary sharded one."""
    two, _, memory, _ = runs
    assert result(memory[2], "ram_efficient")["is_fsdp2"]
    assert losses(result(memory[2], "ram_efficient")) == losses(result(two, "sharded"))
    measured = worst_relative_difference(weights(memory[2], "ram_efficient"), weights(two, "sharded"))
    assert measured <= 1e-6


def test_kill_during_a_sharded_save_leaves_the_previous_checkpoint_resumable(runs, tmp_path):
    """Rank 1 is SIGKILLed while writing checkpoint-4's optimizer shards: checkpoint-2 is intact and resumable,
    checkpoint-4 never got its name."""
    two, _, _, outputs = runs
    run_dir = os.path.join(two, "kill")
    assert "Signal 9" in outputs["kill"] or "SIGKILL" in outputs["kill"], outputs["kill"][-3000:]
    assert [os.path.basename(d) for d in checkpoint_dirs(run_dir)] == ["checkpoint-2"]
    # The half-written `.tmp-checkpoint-4` is gone or left aside (rank 0 removes it when its collective fails, else
    # the next start does); either way no folder is named checkpoint-4.
    loop = child.build_loop(run_dir, 2, sharded=False, save_steps=2)
    loop.train(resume_from_checkpoint=True)
    assert loop.state.global_step == child.MAX_STEPS
    assert [os.path.basename(d) for d in checkpoint_dirs(run_dir)][-1] == f"checkpoint-{child.MAX_STEPS}"


def test_memory_per_rank_falls_with_the_number_of_processes(runs):
    """Bytes of parameters + gradients + AdamW state that a rank holds (local shards), at 1, 2 and 4 processes."""
    _, _, memory, _ = runs
    table = {}
    for n, folder in memory.items():
        ranks = [result(folder, "memory", r) for r in range(n)]
        assert all(r["is_fsdp2"] and r["num_processes"] == n for r in ranks)
        table[n] = max(ranks, key=lambda r: r["total"])
    print(f"\nper-rank memory, {table[1]['model_parameters'] / 1e6:.1f} M parameters (MB: parameters, gradients, "
          f"optimizer, total)")
    for n, r in table.items():
        print(f"  N={n}: {r['parameters'] / 2**20:8.1f} {r['gradients'] / 2**20:8.1f} {r['optimizer'] / 2**20:8.1f} "
              f"{r['total'] / 2**20:8.1f}  ({r['total'] / table[1]['total']:.3f} of N=1)")
    assert table[1]["total"] >= 16 * table[1]["model_parameters"] * 0.99  # fp32 weights, grads, exp_avg, exp_avg_sq
    assert table[2]["total"] <= 0.55 * table[1]["total"]
    assert table[4]["total"] <= 0.3 * table[1]["total"]


@pytest.fixture(scope="module")
def planted(tmp_path_factory, forked):
    """A 2-process sharded checkpoint, two copies with a malicious `.metadata` (model folder, optimizer folder),
    each resumed by 2 sharded processes (tests/scripts/fsdp_child.py, mode planted). Returns the launch's folder
    and the file the payload would create."""
    out = tmp_path_factory.mktemp("planted")
    marker = os.path.join(tmp_path_factory.mktemp("marker"), "payload-ran")
    finish(launch(out, "planted", 2, marker, forked=forked), "the planted-metadata launch")
    return out, marker


def planted_checkpoint(out, folder: str) -> str:
    return os.path.join(out, "planted", folder, f"checkpoint-{child.SAVE_AT}")


@pytest.mark.parametrize("folder", ["pytorch_model_fsdp_0", "optimizer_0"])
def test_a_planted_metadata_is_refused_when_two_sharded_processes_resume(planted, folder):
    """Resuming the planted checkpoint fails on both ranks with the file named; the payload never ran."""
    out, marker = planted
    metadata = os.path.join(planted_checkpoint(out, folder), folder, ".metadata")
    for rank in (0, 1):
        error = result(out, f"planted_{folder}", rank)["error"]
        assert error is not None, f"rank {rank} resumed from {metadata}"
        assert error.startswith("UnsafeCheckpointError: Refusing to load") and metadata in error, error
        assert "posix.system" in error
    assert not os.path.exists(marker)


def test_a_planted_metadata_is_refused_by_one_process_and_by_the_best_model_load(planted, tmp_path):
    """The other readers of a sharded checkpoint: an unsharded run resuming it (model before `prepare`, optimizer
    resharded) and `load_model_weights`, which `load_best_model_at_end` calls."""
    from loopkit.checkpoint import load_model_weights
    from loopkit.dcp_reading import UnsafeCheckpointError

    out, marker = planted
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        checkpoint = planted_checkpoint(out, folder)
        metadata = os.path.join(checkpoint, folder, ".metadata")
        with pytest.raises(UnsafeCheckpointError, match="Refusing to load") as refused:
            child.run_training(str(tmp_path), f"unsharded_{folder}", 2, sharded=False, resume_from=checkpoint)
        assert metadata in str(refused.value)
    with pytest.raises(UnsafeCheckpointError, match="Refusing to load"):
        load_model_weights(child.dist_child.tiny_llama(), planted_checkpoint(out, "pytorch_model_fsdp_0"))
    assert not os.path.exists(marker)
