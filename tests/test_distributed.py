"""Distributed training through Accelerate, proven on CPU: 2 gloo processes with a launcher's environment against the
same script run in one process with the same global batch (tests/scripts/dist_child.py), the launch trap, and the
FSDP / DeepSpeed configuration handed to Accelerate (sharded FSDP2 runs: tests/test_fsdp.py). The 2 processes are
forks of the session's fork server with torchrun's worker environment (helpers.ForkServer.launch); the trap is a
real `accelerate launch`.

One launch of 2 processes runs four scenarios (AdamW with one checkpoint, SGD with gradient accumulation, a resume
from that checkpoint, a SIGTERM to one rank) while the one-process references run here; a second launch, without
CPU mode, must be refused. The comparisons: weights per tensor max|dw| / max|w| (AdamW divides by sqrt(v), which
amplifies the rounding differences of the reduction order; SGD does not), logged losses, evaluation metrics.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from loopkit import Loop, LoopArgs, LoopConfigError
from loopkit.checkpoint import checkpoint_dirs
from loopkit.distributed import DistributedSetupError
from loopkit.stages.setup import SetupStage

from helpers import free_port, run_process, wait_for

CHILD_PATH = os.path.join(os.path.dirname(__file__), "scripts", "dist_child.py")
BIN = os.path.dirname(sys.executable)


def load_child():
    spec = importlib.util.spec_from_file_location("dist_child", CHILD_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = load_child()


def child_env(cpu_mode: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    if cpu_mode:
        env["ACCELERATE_USE_CPU"] = "1"
    return env


def start_launch(forked, out, mode: str):
    """What `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 dist_child.py OUT MODE` (the documented CPU launch)
    starts, as forks of the session's fork server (helpers.ForkServer.launch: the ranks skip ~5 s of imports each).
    The real launchers are proven by test_two_processes_without_cpu_mode_are_refused (`accelerate launch`),
    tests/test_process_exit.py (torchrun, a user's script) and the real torchrun launch of each engine's file."""
    return forked.launch([CHILD_PATH, out, mode], 2, f"the 2-process {mode} launch", env=child_env(cpu_mode=True))


def finish(process, what: str = "the 2-process launch") -> str:
    """The output of a launch (a `subprocess.Popen` of torchrun, or a `helpers.ForkedChild` of a forked one)."""
    return wait_for(process, what)


def result(folder, name: str, rank: int = 0) -> dict:
    with open(os.path.join(folder, f"{name}_rank{rank}.json")) as f:
        return json.load(f)


def weights(folder, name: str, rank: int = 0) -> dict:
    return load_file(os.path.join(folder, f"{name}_rank{rank}.safetensors"))


def worst_relative_difference(a: dict, b: dict) -> float:
    """max over tensors of max|a - b| / max|b|."""
    assert a.keys() == b.keys()
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12)).item()
               for k in a)


def losses(run: dict) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in run["log_history"] if "loss" in entry}


def assert_same_losses(actual: dict, expected: dict, what: str):
    assert actual.keys() == expected.keys() and actual, f"{what}: logged steps {sorted(actual)} vs {sorted(expected)}"
    worst = max(abs(actual[s] - expected[s]) for s in expected)
    assert worst <= 1e-5, f"{what}: logged losses differ by up to {worst:.3g}: {actual} vs {expected}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, forked):
    """The 2-process launch, and meanwhile the one-process runs with the same global batch (here, in pytest)."""
    two, one = tmp_path_factory.mktemp("two_processes"), tmp_path_factory.mktemp("one_process")
    start = time.time()
    launch = start_launch(forked, two, "all")
    child.run_training(str(one), "adamw", 4, eval_batch=6)  # 1 x 4 = 2 x 2 samples per optimizer step
    child.run_training(str(one), "sgd", 2, accumulation=2, sgd=True, eval_batch=6)
    child.run_training(str(one), "iterable", 4, iterable=True, eval_batch=6)
    output = finish(launch)
    assert launch.returncode == 0, f"the 2-process launch failed (rc {launch.returncode}):\n{output[-6000:]}"
    checkpoint = os.path.join(two, "adamw", f"checkpoint-{child.SAVE_AT}")
    child.run_training(str(one), "resume", 4, eval_batch=6, resume_from=checkpoint)  # 2 x 2 -> 1 x 4
    print(f"\n2-process launch + 1-process references: {time.time() - start:.1f} s")
    return two, one


def test_every_rank_ends_with_the_same_weights(runs):
    two, _ = runs
    for name in ("adamw", "sgd", "iterable", "resume", "preempt"):
        rank0, rank1 = weights(two, name, 0), weights(two, name, 1)
        different = [k for k in rank0 if not torch.equal(rank0[k], rank1[k])]
        assert not different, f"{name}: ranks 0 and 1 differ in {different}"
        assert result(two, name)["num_processes"] == 2


def test_only_the_main_process_logs_even_before_training(runs):
    """`state.is_world_process_zero` (what the printer, progress bar and reporting callbacks check) is right from
    construction, so an evaluate() before train() is logged once, not once per process."""
    two, _ = runs
    assert [result(two, "adamw", r)["main_before_training"] for r in (0, 1)] == [True, False]


def test_two_processes_match_one_process_with_the_same_global_batch(runs):
    two, one = runs
    for name, tolerance in (("adamw", 1e-4), ("sgd", 1e-6), ("iterable", 1e-4)):
        measured = worst_relative_difference(weights(two, name), weights(one, name))
        print(f"{name}: per-tensor max|dw|/max|w| between 2 x b and 1 x 2b = {measured:.2e}")
        assert measured <= tolerance, f"{name}: weights differ by {measured:.3g} (> {tolerance})"
        assert result(two, name)["global_step"] == result(one, name)["global_step"] == child.MAX_STEPS
        assert_same_losses(losses(result(two, name)), losses(result(one, name)), name)
    # The runs did train: the final weights are far from the initial ones (else the comparison proves nothing).
    initial = {k: v.detach() for k, v in child.tiny_llama().state_dict().items()}
    assert worst_relative_difference(weights(two, "adamw"), initial) > 1e-2


def test_evaluation_matches_one_process_on_an_uneven_eval_set(runs):
    """13 eval samples over 2 processes x 3: Accelerate repeats samples to fill the last batch; gathered predictions
    (compute_metrics) and streaming metrics (loopkit.metrics, reduced across ranks) must count each sample once.
    `eval_loss` is not compared: as in HF Trainer it weighs each batch's mean loss by the per-device batch size, so
    a short last batch weighs differently on 1 and on 2 processes (Perplexity is the exact global figure)."""
    two, one = runs
    for name in ("adamw", "sgd", "iterable"):
        for when, tolerance in (("eval_before", 1e-6), ("eval_after", 1e-4)):
            got, expected = result(two, name)[when], result(one, name)[when]
            assert got["eval_gathered_samples"] == expected["eval_gathered_samples"] == child.EVAL_SAMPLES
            for key in ("eval_gathered_accuracy", "eval_token_accuracy", "eval_perplexity"):
                assert got[key] == pytest.approx(expected[key], rel=tolerance), f"{name} {when} {key}"
            assert got["eval_token_accuracy"] == pytest.approx(got["eval_gathered_accuracy"], rel=1e-12)


def test_one_checkpoint_folder_resumable_by_two_and_by_one_process(runs):
    two, one = runs
    run_dir = os.path.join(two, "adamw")
    assert [os.path.basename(d) for d in checkpoint_dirs(run_dir)] == [f"checkpoint-{child.SAVE_AT}"]
    assert not [n for n in os.listdir(run_dir) if n.startswith(".")], "leftover temporary folders"
    files = set(os.listdir(checkpoint_dirs(run_dir)[0]))
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "model.safetensors"} <= files
    assert "rng_state.pth" not in files
    uninterrupted = losses(result(two, "adamw"))  # a resumed log_history holds the checkpoint's entries too
    # Resumed on 2 processes: the same run as the uninterrupted one.
    resumed = result(two, "resume")
    assert resumed["global_step"] == child.MAX_STEPS
    assert worst_relative_difference(weights(two, "resume"), weights(two, "adamw")) <= 1e-6
    assert_same_losses(losses(resumed), uninterrupted, "resumed on 2 processes")
    assert not [w for w in resumed["warnings"] if "process(es)" in w]
    # Resumed on 1 process with batch 4: same data from the same position, RNG files per rank, and a warning.
    resumed_one = result(one, "resume")
    assert resumed_one["global_step"] == child.MAX_STEPS
    measured = worst_relative_difference(weights(one, "resume"), weights(two, "adamw"))
    print(f"resume 2 x 2 -> 1 x 4: max|dw|/max|w| vs the uninterrupted 2-process run = {measured:.2e}")
    assert measured <= 1e-4
    assert_same_losses(losses(resumed_one), uninterrupted, "resumed on 1 process")
    assert [w for w in resumed_one["warnings"] if "saved by 2 process(es) and is resumed by 1" in w]


def test_input_tokens_seen_are_summed_over_processes_at_logging_points(runs):
    """include_num_input_tokens_seen="non_padding": each rank counts its attention masks on its device, and the
    count summed over ranks reaches the state at each log: 4 samples x 8 tokens per step, on 2 processes as on 1, and
    a resumed run continues the checkpoint's count."""
    two, one = runs
    per_step = 4 * child.SEQ_LEN
    for name in ("adamw", "sgd", "iterable", "resume"):
        counts = [result(two, name, 0), result(two, name, 1), result(one, name)]
        assert [c["num_input_tokens_seen"] for c in counts] == [child.MAX_STEPS * per_step] * 3, name
    logged = [e["num_input_tokens_seen"] for e in result(two, "resume")["log_history"] if "loss" in e]
    assert logged == [per_step * step for step in range(1, child.MAX_STEPS + 1)]


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(runs):
    """Rank 1 alone gets SIGTERM after step 3; the ranks agree one step behind, so both stop after step 4, write one
    checkpoint together and leave with 143."""
    two, _ = runs
    ranks = [result(two, "preempt", r) for r in (0, 1)]
    assert [r["global_step"] for r in ranks] == [4, 4]
    assert [r["exit_code"] for r in ranks] == [143, 143]
    run_dir = os.path.join(two, "preempt")
    assert [os.path.basename(d) for d in checkpoint_dirs(run_dir)] == ["checkpoint-4"]
    with open(os.path.join(run_dir, "checkpoint-4", "trainer_state.json")) as f:
        assert json.load(f)["global_step"] == 4
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(os.path.join(run_dir, "checkpoint-4")))


def test_two_processes_without_cpu_mode_are_refused(tmp_path):
    """The silent trap: on a machine without CUDA, `accelerate launch --multi_gpu` without ACCELERATE_USE_CPU=1
    starts 2 processes that Accelerate sees as 2 single-process runs. loopkit must refuse, on every rank."""
    if torch.cuda.is_available():
        pytest.skip("the trap needs a machine without CUDA (with GPUs this launch is a correct one)")
    command = [os.path.join(BIN, "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
               "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
               CHILD_PATH, str(tmp_path), "trap"]
    done = run_process(command, "accelerate launch --multi_gpu without ACCELERATE_USE_CPU",
                       env=child_env(cpu_mode=False))
    assert done.returncode != 0
    for rank in (0, 1):
        path = tmp_path / f"trap_rank{rank}.txt"
        assert path.exists(), f"rank {rank} was not refused:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        message = path.read_text()
        assert "launcher started 2 processes" in message and "Accelerate runs 1 process" in message
        assert "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2" in message


# ---------------------------------------------------------------------------------------------------------------
# FSDP and DeepSpeed: the configuration handed to Accelerate, and the refusal when it is not active (one process
# without a launcher: Accelerate drops FSDP silently here). Sharded runs on CPU processes: tests/test_fsdp.py.
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def accelerator_kwargs(monkeypatch):
    """Records the keyword arguments of every `Accelerator(...)`; restores the variables Accelerate exports when it
    is given a plugin (ACCELERATE_USE_FSDP / _DEEPSPEED), so later tests see a clean environment."""
    import accelerate

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        monkeypatch.setenv(name, "false")
    seen, real = [], accelerate.Accelerator

    def recording(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(accelerate, "Accelerator", recording)
    return seen


def tiny_regression():
    return torch.nn.Sequential(torch.nn.Linear(2, 1))


def test_fsdp_from_training_arguments_is_handed_to_accelerate_and_refused_when_inactive(tmp_path, accelerator_kwargs):
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path), report_to="none", fsdp=True,
                             fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                          "state_dict_type": "SHARDED_STATE_DICT"})
    with pytest.raises(DistributedSetupError, match=r"FSDP was asked for .* distributed_type=NO .*--use_fsdp"):
        Loop(model=child.tiny_llama(), args=args)
    plugin = accelerator_kwargs[-1]["fsdp_plugin"]
    assert plugin.fsdp_version == 2
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    assert "deepspeed_plugin" not in accelerator_kwargs[-1]


def test_fsdp_plugin_object_is_handed_to_accelerate_and_refused_when_inactive(tmp_path, accelerator_kwargs):
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    with pytest.raises(DistributedSetupError, match="FSDP was asked for"):
        Loop(model=tiny_regression(), args=LoopArgs(str(tmp_path)), setup=SetupStage(fsdp_plugin=plugin))
    assert accelerator_kwargs[-1]["fsdp_plugin"] is plugin
    with pytest.raises(LoopConfigError, match=r"fsdp_config\['version'\]=1"):
        Loop(model=tiny_regression(), args=LoopArgs(str(tmp_path)),
             setup=SetupStage(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)))


def test_fsdp_asked_by_the_launcher_environment_is_refused_when_inactive(tmp_path, accelerator_kwargs, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --use_fsdp` exports
    with pytest.raises(DistributedSetupError, match="FSDP was asked for"):
        Loop(model=tiny_regression(), args=LoopArgs(str(tmp_path)))


def test_fsdp_configured_twice_is_refused(tmp_path, accelerator_kwargs):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    args = TrainingArguments(str(tmp_path), report_to="none", fsdp=True)
    with pytest.raises(LoopConfigError, match="configure FSDP in one place"):
        Loop(model=tiny_regression(), args=args, setup=SetupStage(fsdp_plugin=FullyShardedDataParallelPlugin()))


def test_deepspeed_plugin_object_without_a_launcher_is_refused_by_name(tmp_path, accelerator_kwargs, monkeypatch):
    """Without a launcher DeepSpeed cannot join a process group (train() would fail inside deepspeed.initialize, as
    under HF Trainer): refused before any Accelerator, naming the plugin. The plugin object reaching the real engine
    under a launch: tests/test_deepspeed.py (ZeRO-2, `LoopArgs` with a plugin)."""
    from accelerate.utils import DeepSpeedPlugin

    from loopkit.distributed import LAUNCHER_VARIABLES

    if importlib.util.find_spec("mpi4py") is not None:
        pytest.skip("with mpi4py DeepSpeed finds its one process by MPI")
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DistributedSetupError, match=r"DeepSpeed was asked for by SetupStage\(deepspeed_plugin="
                                                    r"DeepSpeedPlugin\(...\)\), but no launcher"):
        Loop(model=tiny_regression(), args=LoopArgs(str(tmp_path)),
             setup=SetupStage(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2)))
    assert accelerator_kwargs == []
