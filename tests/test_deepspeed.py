"""DeepSpeed ZeRO-2 and ZeRO-3 proven with the real engine on CPU processes, against HF Trainer live: each config is
one `torchrun --nproc_per_node 2` launch of tests/scripts/deepspeed_child.py (DS_ACCELERATOR=cpu, gloo), which runs
Trainer and Loop in the same processes on the same tiny Llama and data (gradient accumulation 2, clipping at every
step, a checkpoint at step 4, evaluation, `save_model()`), then four resumes: Loop from Loop's and from Trainer's
checkpoint, Trainer from Loop's and from its own; then each with `load_best_model_at_end`; under ZeRO-2 also the
engine asked by the launcher's environment (both) and by a plugin object with `LoopArgs`.

Configs: ZeRO-2, ZeRO-3 with DeepSpeed's defaults (no 16-bit weights gathered at save: no `model.safetensors`, the
engine's `global_step*/` holds the weights) and ZeRO-3 with `stage3_gather_16bit_weights_on_model_save: true`. The
ZeRO-2 launch is a real torchrun; the others start the same ranks as forks of the session's fork server, with
torchrun's worker environment (helpers.ForkServer.launch).

Cost: DeepSpeed's shared-memory communication op is compiled once with g++ (minutes; then cached under
~/.cache/torch_extensions), done first here in a process of its own so that the launches do not race for it; the
three launches then run two at a time (at most 4 ranks, as tests/test_fsdp.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import free_port, run_process, wait_for
from test_distributed import BIN, child_env
from test_distributed import child as dist_child

CHILD_PATH = os.path.join(os.path.dirname(__file__), "scripts", "deepspeed_child.py")
CONFIGS = ("zero2", "zero3", "zero3_gather")
LAUNCHES_AT_ONCE = 2  # x 2 ranks
RESUMES = {"loop_from_loop": "loop", "loop_from_trainer": "loop", "trainer_from_loop": "trainer",
           "trainer_from_trainer": "trainer"}  # resumed run -> the uninterrupted run it must equal
SAVE_AT, MAX_STEPS, MAX_GRAD_NORM = 4, 6, 0.5  # as in the child
# The documented differences of the checkpoint folder (docs/checkpoints.md): loopkit's state (data position, pending
# log) and the batch each rank had read ahead. Both write `training_args.bin` (the arguments are TrainingArguments).
ONLY_TRAINER = set()
ONLY_LOOP = {"loopkit_state.json", "loopkit_tensors_0.safetensors", "loopkit_tensors_1.safetensors"}


def deepspeed_env() -> dict:
    """The launch environment: DeepSpeed's CPU accelerator, and no ACCELERATE_USE_CPU (it turns DeepSpeed off)."""
    return {**child_env(cpu_mode=False), "DS_ACCELERATOR": "cpu"}


def build_comm_op() -> float:
    """DeepSpeed's shared-memory communication op, compiled (first time) or loaded from the cache; returns seconds."""
    start = time.time()
    code = ("from deepspeed.accelerator import get_accelerator\n"
            "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    done = run_process([sys.executable, "-c", code], "building DeepSpeed's shared-memory op", env=deepspeed_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return time.time() - start


# The one real `torchrun` launch of this file (a user's launch stays proven); the other configs' ranks are forks of
# the session's fork server with torchrun's worker environment (helpers.ForkServer.launch: ~5 s of imports spared
# per rank).
REAL_TORCHRUN = "zero2"


def launch(out, config: str, forked):
    if config != REAL_TORCHRUN:
        return forked.launch([CHILD_PATH, out, config], 2, f"the {config} launch", env=deepspeed_env())
    command = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
               CHILD_PATH, str(out), config]
    return subprocess.Popen(command, env=deepspeed_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, forked):
    """{config: folder of its launch's results}."""
    op_seconds = build_comm_op()
    folders = {config: tmp_path_factory.mktemp(config) for config in CONFIGS}
    start, running = time.time(), {}
    try:
        for config in CONFIGS:
            while len(running) >= LAUNCHES_AT_ONCE:
                finish(running)
            running[config] = launch(folders[config], config, forked)
        while running:
            finish(running)
    finally:  # one launch failed: the others stop now (torchrun and the forked agent pass SIGTERM on to the ranks)
        for config, process in running.items():
            process.terminate()
            wait_for(process, f"the {config} launch (stopped: another launch failed)")
    print(f"\nDeepSpeed shared-memory op (build or cache): {op_seconds:.1f} s; 3 launches of 2 ranks, two at a "
          f"time: {time.time() - start:.1f} s")
    return folders


def finish(running: dict) -> None:
    config, process = next(iter(running.items()))
    del running[config]
    output = wait_for(process, f"the {config} launch")
    assert process.returncode == 0, f"{config} launch failed (rc {process.returncode}):\n{output[-8000:]}"


def result(folder, name: str, rank: int = 0) -> dict:
    with open(os.path.join(folder, f"{name}_rank{rank}.json")) as f:
        return json.load(f)


def weights(folder, name: str) -> dict:
    return load_file(os.path.join(folder, f"{name}.safetensors"))


def assert_equal_weights(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    different = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not different, f"{what}: {len(different)} tensors differ, e.g. {different[:3]}"


def logged_steps(run: dict) -> list[tuple]:
    return [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in run["log_history"] if "loss" in e]


@pytest.mark.parametrize("config", CONFIGS)
def test_both_run_the_real_engine_on_two_cpu_processes_with_the_same_config(runs, config):
    folder = runs[config]
    for rank in (0, 1):
        trainer, loop = result(folder, "trainer", rank), result(folder, "loop", rank)
        for run in (trainer, loop):
            assert run["distributed_type"] == "DistributedType.DEEPSPEED" and run["num_processes"] == 2, run
            assert run["zero_stage"] == (2 if config == "zero2" else 3)
        # What DeepSpeed was given, "auto" values filled: 2 processes x 2 samples x 2 accumulated micro-batches.
        assert loop["engine_config"] == trainer["engine_config"]
        assert loop["engine_config"]["train_batch_size"] == 8
        assert loop["engine_config"]["gradient_accumulation_steps"] == 2


@pytest.mark.parametrize("config", CONFIGS)
def test_losses_grad_norms_and_weights_equal_trainers(runs, config):
    """Item 1 of issue 33: without `scale_wrt_gas=False` the engine divided the accumulated loss a second time and
    Loop's grad norms were 0.5 x Trainer's."""
    folder = runs[config]
    trainer, loop = result(folder, "trainer"), result(folder, "loop")
    steps = logged_steps(loop)
    assert steps == logged_steps(trainer) and len(steps) == MAX_STEPS
    assert all(grad_norm > MAX_GRAD_NORM for _, _, grad_norm, _ in steps)  # every step clipped
    assert_equal_weights(weights(folder, "loop"), weights(folder, "trainer"), f"{config}: final weights")
    initial = {k: v.detach() for k, v in dist_child.tiny_llama().state_dict().items()}
    assert any(not torch.equal(weights(folder, "loop")[k], initial[k]) for k in initial)  # it trained
    # loopkit sums the evaluation loss in float64 (docs/differences.md), Trainer in float32.
    assert loop["evaluation"]["eval_loss"] == pytest.approx(trainer["evaluation"]["eval_loss"], rel=1e-6)


@pytest.mark.parametrize("config", CONFIGS)
def test_checkpoints_hold_the_same_files_as_trainers(runs, config):
    folder = runs[config]
    for rank in (0, 1):
        trainer, loop = result(folder, "trainer", rank), result(folder, "loop", rank)
        trainer_files, loop_files = set(trainer["checkpoint_files"]), set(loop["checkpoint_files"])
        assert trainer_files - loop_files == ONLY_TRAINER and loop_files - trainer_files == ONLY_LOOP
    engine_files = {f"global_step{SAVE_AT}/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}
    assert engine_files <= loop_files and {"latest", "scheduler.pt", "trainer_state.json", "config.json"} <= loop_files
    checkpoint = f"checkpoint-{SAVE_AT}"
    if config == "zero3":  # DeepSpeed's default: the engine's folder is the only copy of the weights (as Trainer)
        assert "model.safetensors" not in loop_files
    else:
        assert_equal_weights(load_file(os.path.join(folder, "loop", checkpoint, "model.safetensors")),
                             load_file(os.path.join(folder, "trainer", checkpoint, "model.safetensors")),
                             f"{config}: {checkpoint}/model.safetensors")


@pytest.mark.parametrize("config", CONFIGS)
def test_resumes_of_either_checkpoint_by_either_are_exact(runs, config):
    """Loop resumes Loop's and Trainer's checkpoints (item 3: ZeRO-3's have no model.safetensors, and the engine
    loads the weights after `prepare`), Trainer resumes Loop's: the same steps and weights as without a stop."""
    folder = runs[config]
    for name, uninterrupted in RESUMES.items():
        assert logged_steps(result(folder, name)) == logged_steps(result(folder, uninterrupted)), name
        assert_equal_weights(weights(folder, name), weights(folder, uninterrupted), f"{config}: {name}")


@pytest.mark.parametrize("config", CONFIGS)
def test_save_model_writes_what_trainers_writes(runs, config):
    """Item 2: under ZeRO-3 without the gather flag `save_model()` writes the config and the engine's checkpoint
    (no model file), as Trainer; with it, and under ZeRO-2, the whole model in model.safetensors."""
    folder = runs[config]
    trainer, loop = result(folder, "trainer"), result(folder, "loop")
    assert set(trainer["saved_files"]) - set(loop["saved_files"]) == ONLY_TRAINER
    assert set(loop["saved_files"]) - set(trainer["saved_files"]) == set()
    final = weights(folder, "loop")
    if config == "zero3":
        assert "model.safetensors" not in loop["saved_files"]
        assert f"global_step{MAX_STEPS}/zero_pp_rank_1_mp_rank_00_model_states.pt" in loop["saved_files"]
        # DeepSpeed's zero_to_fp32 on each save_model() folder gives back the trained weights.
        assert_equal_weights(weights(folder, "loop_recovered"), final, "zero_to_fp32 of Loop's save_model()")
        assert_equal_weights(weights(folder, "trainer_recovered"), final, "zero_to_fp32 of Trainer's save_model()")
    else:
        saved = load_file(os.path.join(folder, "loop", "saved", "model.safetensors"))
        assert_equal_weights(saved, load_file(os.path.join(folder, "trainer", "saved", "model.safetensors")),
                             f"{config}: save_model()")
        assert saved.keys() <= final.keys()
        assert_equal_weights(saved, {k: final[k] for k in saved}, f"{config}: saved vs trained")



@pytest.mark.parametrize("config", CONFIGS)
def test_load_best_model_at_end_loads_the_engine_checkpoint_as_trainer(runs, config):
    """Evaluated and saved every 2 steps: the best checkpoint (not the last) is loaded through the engine, as
    Trainer's `_load_best_model` does (ZeRO-3's default checkpoints have no model file)."""
    folder = runs[config]
    trainer, loop = result(folder, "trainer_best"), result(folder, "loop_best")
    best = os.path.basename(loop["best_model_checkpoint"])
    assert best == os.path.basename(trainer["best_model_checkpoint"]) and best != f"checkpoint-{MAX_STEPS}"
    at_best = [e["eval_loss"] for e in loop["log_history"] if e.get("step") == int(best.split("-")[1])
               and "eval_loss" in e]
    assert loop["evaluation"]["eval_loss"] == at_best[0]  # the final evaluation sees the best checkpoint's model
    assert_equal_weights(weights(folder, "loop_best"), weights(folder, "trainer_best"), f"{config}: best model")


@pytest.mark.parametrize("name", ["trainer_launcher", "loop_launcher", "loop_plugin"])
def test_the_engine_configured_by_the_launcher_or_a_plugin_trains_as_the_config_file(runs, name):
    """ZeRO-2 asked by the environment `accelerate launch --use_deepspeed` exports (no `deepspeed=` argument), and by
    a `DeepSpeedPlugin` passed to the setup stage with `LoopArgs`: the plugin's "auto" values are filled from the
    arguments (HF's `propagate_args_to_deepspeed`), and both train exactly as Trainer with the config."""
    folder = runs["zero2"]
    run, trainer = result(folder, name), result(folder, "trainer")
    assert run["distributed_type"] == "DistributedType.DEEPSPEED" and run["num_processes"] == 2
    assert run["zero_stage"] == 2 and run["engine_config"]["train_batch_size"] == 8
    assert logged_steps(run) == logged_steps(trainer)
    assert_equal_weights(weights(folder, name), weights(folder, "trainer"), name)


def test_a_checkpoint_without_the_engine_state_is_refused_before_anything_loads(runs):
    """A full checkpoint without `global_step*/` (written without DeepSpeed, or its engine folder removed) would
    restart the optimizer: refused on both ranks with Trainer's words (`deepspeed_load_checkpoint`) and the fix."""
    for rank in (0, 1):
        refused = result(runs["zero2"], "stripped", rank)
        assert refused["global_step"] == 0
        assert refused["error"].startswith("LoopConfigError: Can't find a valid checkpoint at ")
        assert "holds no DeepSpeed engine state" in refused["error"] and "Fix: resume it without DeepSpeed" in \
            refused["error"]


def test_total_flos_counts_every_parameter_under_zero3(runs):
    """ZeRO-3 partitions the parameters before the first forward, leaving each rank empty placeholders: loopkit
    counts their full size (loopkit/work.py), so its FLOP estimate equals ZeRO-2's for the same work; Trainer counts
    after the first forward and gets only the parameters ZeRO-3 keeps whole (docs/differences.md)."""
    def total_flos(run: dict) -> float:
        return next(entry["total_flos"] for entry in run["log_history"] if "total_flos" in entry)

    zero2 = total_flos(result(runs["zero2"], "loop"))
    assert zero2 == total_flos(result(runs["zero2"], "trainer")) > 0
    for config in ("zero3", "zero3_gather"):
        assert total_flos(result(runs[config], "loop")) == zero2, config
        assert 0 < total_flos(result(runs[config], "trainer")) < zero2, config  # Trainer's undercount
