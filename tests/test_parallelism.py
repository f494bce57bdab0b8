"""`parallelism_config` (Accelerate's `ParallelismConfig`) taken as Trainer takes it and handed to Accelerate,
proven on CPU processes (gloo): one `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 4` launch of
tests/scripts/parallelism_child.py trains, from a user's `TrainingArguments`,

* 4 DDP replicas (`dp_replicate_size=4`), FSDP2 over 4 ranks (`dp_shard_size=4`) and HSDP, 2 replicas of a model
  sharded 2 ways (`dp_replicate_size=2, dp_shard_size=2`, with `fsdp` / `fsdp_config`);
* tensor parallelism 4 ways: a 4-head Llama loaded with transformers' `from_pretrained(..., tp_plan="auto")`, from
  which Trainer's rule builds `ParallelismConfig(tp_size=4)`;

each against one process with the same global batch (and an HSDP checkpoint resumed, a tensor-parallel one loaded
back), and HF Trainer with the same arguments, live, which Accelerate
refuses on CPU processes (its check accepts a mesh only under FSDP2, an accelerator process group or DeepSpeed, and
FSDP is not set on MULTI_CPU when it checks). On one process Trainer runs a `ParallelismConfig`, and the Loop matches
it. What cannot run on the user's machine is refused at construction, naming what it needs (loopkit/parallelism.py).

Tolerance of the 4-process runs against one process, measured (`pytest -s` prints it): losses within 4.8e-7 of
~4.2 (tensor parallel: equal), grad norms within 1.4e-7 relative, weights within 4.8e-7 of their largest value after
6 AdamW steps. float32 sums taken in another order (per-rank partial sums reduced over gloo, gradients
reduce-scattered across shards, tensor-parallel matmuls split along heads) differ by a few units in the last place,
which Adam's normalisation carries into the weights; the bounds (1e-5) leave 20x of headroom and stay far below what
a wrong normalisation, a missed shard or a doubled batch gives (the loss moves by ~1e-2 per step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import free_port, hf_args, wait_for
from test_distributed import BIN, child_env, worst_relative_difference

CHILD_PATH = os.path.join(os.path.dirname(__file__), "scripts", "parallelism_child.py")
sys.path.insert(0, os.path.dirname(CHILD_PATH))
import parallelism_child as child  # noqa: E402

ACCELERATE_REFUSAL = "ParallelismConfig is only compatible DistributedType.FSDP (version 2)"


def result(folder, name: str, rank: int = 0) -> dict:
    with open(os.path.join(folder, f"{name}_rank{rank}.json")) as f:
        return json.load(f)


def logged(run: dict, key: str) -> dict:
    return {e["step"]: e[key] for e in run["log_history"] if key in e}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 4-rank launch, and meanwhile the one-process references here. Returns (launch folder, reference folder)."""
    four, one = tmp_path_factory.mktemp("four_processes"), tmp_path_factory.mktemp("one_process")
    tp_folder = str(tmp_path_factory.mktemp("tp_model"))
    child.tp_llama().save_pretrained(tp_folder)
    command = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "4", "--master_port", str(free_port()),
               CHILD_PATH, str(four), tp_folder]
    launch = subprocess.Popen(command, env=child_env(cpu_mode=True), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:  # 1 process x 4 samples = 4 processes x 1 sample (the data-parallel runs) = 4 ranks sharing 4 (tensor)
        child.run_training(str(one), "whole", 4, None)
        child.run_training(str(one), "tp_whole", 4, None, model=child.load_llama(tp_folder, tensor_parallel=False))
    finally:
        output = wait_for(launch, "the 4-process parallelism_config launch")
    assert launch.returncode == 0, f"the launch failed (rc {launch.returncode}):\n{output[-6000:]}"
    return four, one


def test_trainer_refuses_the_mesh_on_cpu_processes(runs):
    """HF Trainer live, same arguments: Accelerate's ValueError on every rank (loopkit goes past it, as it does
    for FSDP2 on CPU processes)."""
    four, _ = runs
    for name in ("trainer_hsdp", "trainer_tp"):
        for rank in range(4):
            attempt = result(four, name, rank)
            assert attempt["log_history"] is None and attempt["error"].startswith("ValueError: " + ACCELERATE_REFUSAL)


# name -> (the one-process reference, the evidence of the mesh on every rank)
MESHES = {
    "replicate": ("whole", dict(distributed_type="DistributedType.MULTI_CPU", sizes=[4, 1, 1],
                                mesh_dims=["dp_replicate"], embedding_local_rows=child.dist_child.VOCAB)),
    "shard": ("whole", dict(distributed_type="DistributedType.FSDP", sizes=[1, 4, 1], mesh_dims=["dp_shard"],
                            embedding_mesh_dims=["dp_shard_cp"], embedding_placements=["S(0)"],
                            embedding_local_rows=child.dist_child.VOCAB // 4)),
    "hsdp": ("whole", dict(distributed_type="DistributedType.FSDP", sizes=[2, 2, 1],
                           mesh_dims=["dp_replicate", "dp_shard"], embedding_mesh_dims=["dp_replicate", "dp_shard_cp"],
                           embedding_placements=["R", "S(0)"], embedding_local_rows=child.dist_child.VOCAB // 2)),
    "tp": ("tp_whole", dict(distributed_type="DistributedType.MULTI_CPU", sizes=[1, 1, 4], mesh_dims=["tp"],
                            query_placements=["S(0)"], query_local_rows=16 // 4)),
}


@pytest.mark.parametrize("name", MESHES)
def test_each_mesh_runs_as_asked_and_trains_as_one_process(runs, name):
    four, one = runs
    reference_name, evidence = MESHES[name]
    reference = result(one, reference_name)
    ranks = [result(four, name, rank) for rank in range(4)]
    for got in ranks:
        assert {key: got[key] for key in evidence} == evidence, name
        assert got["num_processes"] == 4 and got["global_step"] == child.MAX_STEPS
        assert logged(got, "loss") == logged(ranks[0], "loss")  # every rank logs the same mean
    losses, expected = logged(ranks[0], "loss"), logged(reference, "loss")
    assert losses.keys() == expected.keys() and len(losses) == child.MAX_STEPS
    worst_loss = max(abs(losses[s] - expected[s]) for s in expected)
    norms, expected_norms = logged(ranks[0], "grad_norm"), logged(reference, "grad_norm")
    worst_norm = max(abs(norms[s] - expected_norms[s]) / expected_norms[s] for s in expected_norms)
    weights = worst_relative_difference(load_file(os.path.join(four, f"{name}.safetensors")),
                                        load_file(os.path.join(one, f"{reference_name}.safetensors")))
    print(f"{name} vs one process: losses {worst_loss:.1e}, grad norms (rel) {worst_norm:.1e}, weights {weights:.1e}")
    assert worst_loss <= 1e-5 and worst_norm <= 1e-5 and weights <= 1e-5
    evaluation, expected_evaluation = ranks[0]["eval_after"], reference["eval_after"]
    if name == "tp":  # one data-parallel group: the evaluation is one process's (eval_loss included)
        assert evaluation["eval_loss"] == pytest.approx(expected_evaluation["eval_loss"], abs=1e-5)
    # (with data-parallel ranks, Trainer's eval_loss divides each rank's token sum by the count over all ranks:
    # not comparable with one process, as tests/test_fsdp.py notes)
    # compute_metrics sees each evaluation sample once, on every mesh (not once per rank)
    assert evaluation["eval_rows"] == expected_evaluation["eval_rows"] == child.dist_child.EVAL_SAMPLES
    assert evaluation["eval_gathered_accuracy"] == pytest.approx(expected_evaluation["eval_gathered_accuracy"],
                                                                 abs=1e-9)
    assert all(norm > child.MAX_GRAD_NORM for norm in expected_norms.values())  # every step clipped


def test_an_hsdp_checkpoint_resumes_bit_exactly(runs):
    """HSDP (2 x 2) saved at step 3 and resumed by the same mesh: the log history (steps 1-3 from the checkpoint,
    4-6 trained again) and the weights are those of the uninterrupted run."""
    four, _ = runs
    whole, resumed = result(four, "hsdp"), result(four, "hsdp_resume")
    assert logged(resumed, "loss") == logged(whole, "loss") and len(logged(whole, "loss")) == child.MAX_STEPS
    got, expected = (load_file(os.path.join(four, f"{name}.safetensors")) for name in ("hsdp_resume", "hsdp"))
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


def test_a_tensor_parallel_checkpoint_loads_with_tp_plan_and_its_resume_is_refused(runs):
    """The checkpoint's model.safetensors is the whole model: `from_pretrained(checkpoint, tp_plan="auto")` gives
    back the trained weights exactly. Resuming is refused on every rank (its optimizer.pt holds rank 0's shards,
    as Trainer writes it), naming the way out."""
    four, _ = runs
    loaded, trained = (load_file(os.path.join(four, f"{name}.safetensors")) for name in ("tp_checkpoint", "tp"))
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
    for rank in range(4):
        errors = result(four, "tp_checkpoint", rank)
        assert errors["resume"].startswith("LoopConfigError: resume_from_checkpoint=") and "tp_plan='auto'" in \
            errors["resume"], errors
        # streaming metrics would reduce over ranks that share their batches: refused before a wrong number
        assert errors["streaming_metrics"].startswith("LoopConfigError: metrics=['TokenAccuracy']") and \
            "compute_metrics" in errors["streaming_metrics"], errors


# ---------------------------------------------------------------------------------------------------------------
# One process: Trainer live; refusals at construction
# ---------------------------------------------------------------------------------------------------------------
def one_process_run(runner, tmp_path, **sizes):
    from accelerate import ParallelismConfig

    from helpers import lm_data, tiny_llama

    args = hf_args(tmp_path, parallelism_config=ParallelismConfig(**sizes), max_steps=3, logging_steps=1,
                   per_device_train_batch_size=2, save_strategy="no", optim="adamw_torch", use_cpu=True)
    trainer = runner(model=tiny_llama(), args=args, train_dataset=lm_data(8))
    trainer.train()
    return trainer


def test_one_process_with_a_parallelism_config_trains_as_trainer(tmp_path):
    """ParallelismConfig() on one process: Accelerate gets it (and builds no mesh), the same losses as Trainer."""
    from loopkit import Loop
    from transformers import Trainer

    hf, loop = (one_process_run(runner, tmp_path / name) for name, runner in (("hf", Trainer), ("loopkit", Loop)))
    assert loop.accelerator.parallelism_config is loop.args.parallelism_config
    assert loop.accelerator.torch_device_mesh is None and loop.get_tp_size() == 1
    losses = {name: logged({"log_history": t.state.log_history}, "loss") for name, t in (("hf", hf), ("loopkit", loop))}
    assert losses["loopkit"] == losses["hf"] and len(losses["hf"]) == 3


def test_a_mesh_on_a_process_without_a_launcher_gets_the_error_trainer_gets(tmp_path):
    """dp_replicate_size=2 in a plain `python script.py`: Accelerate builds the mesh, and torch's rendezvous fails
    for both, with the same words."""
    from loopkit import Loop
    from transformers import Trainer

    errors = {}
    for name, runner in (("hf", Trainer), ("loopkit", Loop)):
        with pytest.raises(ValueError) as raised:
            one_process_run(runner, tmp_path / name, dp_replicate_size=2)
        errors[name] = str(raised.value)
    assert errors["loopkit"] == errors["hf"] and "environment variable RANK expected" in errors["hf"]


@pytest.mark.parametrize("sizes, fields, named", [
    (dict(cp_size=2, dp_shard_size=1), {}, ("parallelism_config.cp_size=2", "loopkit does not implement",
                                             "CUDA GPUs, and this run's processes have none", "cp_size=1")),
    (dict(sp_size=2), {}, ("parallelism_config.sp_size=2", "loopkit does not implement", "DeepSpeed", "sp_size=1")),
    (dict(dp_shard_size=2), {}, ("parallelism_config.dp_shard_size=2", "plain DDP", "fsdp='full_shard'")),
    (dict(tp_size=2, dp_shard_size=2), dict(fsdp="full_shard", fsdp_config={"version": 2}),
     ("parallelism_config.tp_size=2", "ReplicateParallel", "without FSDP")),
])
def test_what_cannot_run_is_refused_at_construction(tmp_path, sizes, fields, named):
    """Context and sequence parallelism (not implemented; on this machine there is no CUDA GPU and no DeepSpeed
    either), dp_shard without FSDP, and tensor parallelism with FSDP2 where Accelerate's preparation fails."""
    from accelerate import ParallelismConfig

    from helpers import tiny_llama
    from loopkit import Loop, LoopConfigError

    args = hf_args(tmp_path, parallelism_config=ParallelismConfig(**sizes), use_cpu=True, **fields)
    with pytest.raises(LoopConfigError) as refused:
        Loop(model=tiny_llama(), args=args)
    message = str(refused.value)
    assert all(part in message for part in named), message
    assert "Fix:" in message and "this machine" not in message


def test_a_parallelism_config_of_another_type_is_refused(tmp_path):
    from loopkit import Loop, LoopArgs, LoopConfigError

    with pytest.raises(LoopConfigError, match=r"parallelism_config='dict'.*Accelerate's ParallelismConfig"):
        Loop(model=torch.nn.Linear(2, 1), args=LoopArgs(output_dir=str(tmp_path), parallelism_config={"tp_size": 2}))
