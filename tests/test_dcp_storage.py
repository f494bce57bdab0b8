"""`DCPStorage` (loopkit/storage/dcp.py): checkpoints through torch.distributed.checkpoint, behind the storage
interface.

* one process, in this process: the layout; bit-exact resume (1 -> 1) with synchronous and asynchronous saves; a
  planted pickle in the DCP metadata is refused with the file named and never runs (the same through the FSDP
  sharded resume path of `HFStorage`: tests/test_fsdp.py and tests/test_planted_checkpoints.py); conversion to a
  `save_pretrained` folder and to an HF checkpoint that HF Trainer resumes (live);
* SIGKILL inside a synchronous and an asynchronous save (children forked from the session's fork server,
  tests/scripts/dcp_child.py): the previous checkpoint stays the newest complete one and the resumed run ends
  bit-exactly as an uninterrupted one;
* launches (started together; the first a real torchrun, the others forked with torchrun's worker environment by
  helpers.ForkServer.launch): FSDP2 on 2 processes (2 -> 2 bit-exact with asynchronous saves, 1 -> 2), then 4
  processes (2 -> 4), DDP on 2 (asynchronous, bit-exact resume), and 2 -> 1 here: the state right after loading
  equals the checkpoint's, and the run ends as the 2-process reference within tolerance.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file

from loopkit.checkpoint import checkpoint_dirs
from loopkit.dcp_reading import UnsafeCheckpointError
from loopkit.storage import DCPStorage
from loopkit.storage.dcp import DCP_FOLDER, convert, read_whole_state
from test_distributed import BIN, child_env, worst_relative_difference
from test_distributed import finish as finish_launch
from helpers import free_port, run_process

CHILD = os.path.join(os.path.dirname(__file__), "scripts", "dcp_child.py")
sys.path.insert(0, os.path.dirname(CHILD))
import dcp_child  # noqa: E402


def weights(folder, name: str) -> dict:
    return load_file(os.path.join(folder, f"{name}.safetensors"))


def assert_equal_tensors(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key in expected:
        assert torch.equal(actual[key], expected[key]), f"{what}: {key} differs"


def losses(loop) -> dict:
    return {h["step"]: h["loss"] for h in loop.state.log_history if "loss" in h}


# ---------------------------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The 1-process run with synchronous saves every 2 steps (also the source of 1 -> 2)."""
    out = tmp_path_factory.mktemp("one")
    loop = dcp_child.run(str(out), "plain")
    return out, loop


def test_layout_holds_one_dcp_folder_and_the_hf_states(one_process):
    out, _ = one_process
    run_dir = os.path.join(out, "plain")
    assert [os.path.basename(d) for d in checkpoint_dirs(run_dir)] == ["checkpoint-2", "checkpoint-4",
                                                                        "checkpoint-6", "checkpoint-8"]
    files = sorted(os.listdir(os.path.join(run_dir, "checkpoint-4")))
    # loopkit_tensors.safetensors: the batch read ahead at this mid-epoch step (loopkit/checkpoint/stage_tensors.py)
    assert files == ["config.json", DCP_FOLDER, "loopkit_state.json", "loopkit_tensors.safetensors", "rng_state.pth",
                     "scheduler.pt", "trainer_state.json"]
    assert ".metadata" in os.listdir(os.path.join(run_dir, "checkpoint-4", DCP_FOLDER))
    assert not [n for n in os.listdir(run_dir) if n.startswith(".")], "a temporary folder was left"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_one_process_resume_is_bit_exact(tmp_path, one_process, async_save):
    out, reference = one_process
    checkpoint = os.path.join(out, "plain", "checkpoint-4")
    resumed = dcp_child.run(str(tmp_path), "resumed", async_save=async_save, resume_from=checkpoint)
    assert_equal_tensors(weights(tmp_path, "resumed"), weights(out, "plain"), "1 -> 1 resume")
    assert losses(resumed) == losses(reference)  # steps 1-4 from the checkpoint's log history, 5-8 trained again
    # What was loaded is the checkpoint's, exactly (model and AdamW moments).
    saved = read_whole_state(checkpoint)
    loaded = weights(tmp_path, "resumed_loaded")
    for key, value in loaded.items():
        parts = key.split(".")
        source = saved["model"][".".join(parts[1:])] if parts[0] == "model" else \
            saved["optimizer"]["state"][".".join(parts[2:-1])][parts[-1]]
        assert torch.equal(value, source), key
    if async_save:  # the asynchronous saves of the resumed run are complete checkpoints too
        names = [os.path.basename(d) for d in checkpoint_dirs(os.path.join(tmp_path, "resumed"))]
        assert names == ["checkpoint-6", "checkpoint-8"]
        assert all(DCPStorage().checkpoint_problem(d) is None for d in checkpoint_dirs(os.path.join(tmp_path,
                                                                                                 "resumed")))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_one_process_saves_and_resumes_without_torchs_single_process_notice(tmp_path, one_process, async_save):
    """torch warns "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to save in
    a single process" at every DCP save and load without a process group: loopkit knows it is one process, so the
    user sees nothing. A resume (a load) followed by two saves, synchronous and asynchronous (the writer thread's
    warnings are recorded too)."""
    out, _ = one_process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp_child.run(str(tmp_path), "quiet", async_save=async_save,
                      resume_from=os.path.join(out, "plain", "checkpoint-4"))
    assert [os.path.basename(d) for d in checkpoint_dirs(os.path.join(tmp_path, "quiet"))][-2:] == \
        ["checkpoint-6", "checkpoint-8"]
    notices = [str(w.message) for w in caught if "torch.distributed is" in str(w.message)]
    assert notices == []


class Payload:
    """Unpickles as `os.system(command)`."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_planted_pickle_in_dcp_metadata_is_refused_and_never_runs(tmp_path, one_process):
    import shutil

    out, _ = one_process
    planted = os.path.join(tmp_path, "planted", "checkpoint-4")
    shutil.copytree(os.path.join(out, "plain", "checkpoint-4"), planted)
    metadata_path = os.path.join(planted, DCP_FOLDER, ".metadata")
    with open(metadata_path, "rb") as f:
        metadata = pickle.load(f)  # written by this test's own run
    marker = os.path.join(tmp_path, "payload-ran")
    metadata.storage_meta.save_id = Payload(f"touch {marker}")
    with open(metadata_path, "wb") as f:
        pickle.dump(metadata, f)
    # Through resolve (the problem check) and through the loader itself.
    with pytest.raises(ValueError, match=r"Refusing to load .*\.metadata"):
        dcp_child.run(str(tmp_path), "resumed", resume_from=planted)
    loop = dcp_child.build_loop(str(tmp_path), "direct", sharded=False)
    loop.run.model_wrapped = loop.model  # as at the end of training, where the best model is loaded
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
        loop.context.checkpointer.load_best_model(planted)
    assert not os.path.exists(marker), "the planted pickle ran"


def test_convert_to_save_pretrained_and_to_a_checkpoint_hf_trainer_resumes(tmp_path, one_process, forked):
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    out, _ = one_process
    checkpoint = os.path.join(out, "plain", "checkpoint-4")
    saved = read_whole_state(checkpoint)
    pretrained = os.path.join(tmp_path, "pretrained")
    result = forked.run([sys.executable, "-m", "loopkit", "convert-dcp", checkpoint, pretrained],
                        "python -m loopkit convert-dcp", env=child_env(cpu_mode=False))
    assert result.returncode == 0, result.stderr[-3000:]
    model = LlamaForCausalLM.from_pretrained(pretrained)
    assert_equal_tensors({k: v for k, v in model.state_dict().items()}, saved["model"], "save_pretrained folder")

    hf_checkpoint = convert(checkpoint, os.path.join(tmp_path, "hf", "checkpoint-4"), as_checkpoint=True)
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json"} <= set(os.listdir(hf_checkpoint))
    # HF Trainer resumes it and trains on; its result matches loopkit's uninterrupted run.
    args = TrainingArguments(output_dir=os.path.join(tmp_path, "hf"), max_steps=dcp_child.MAX_STEPS,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
                             warmup_steps=2, weight_decay=0.01, max_grad_norm=0.5, logging_steps=1,
                             optim="adamw_torch", disable_tqdm=True, seed=7, save_strategy="no", report_to="none",
                             use_cpu=True)
    import dist_child

    trainer = Trainer(model=dist_child.tiny_llama(), args=args, train_dataset=dist_child.lm_samples(24, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=hf_checkpoint)
    assert trainer.state.global_step == dcp_child.MAX_STEPS
    final = {f"model.{k}": v for k, v in trainer.model.state_dict().items()}
    assert_equal_tensors(final, weights(out, "plain"), "HF Trainer resumed from the converted checkpoint vs loopkit "
                                                       "uninterrupted")


# ---------------------------------------------------------------------------------------------------------------
# SIGKILL during a save
# ---------------------------------------------------------------------------------------------------------------
def run_child(forked, out, *arguments):
    """dcp_child.py OUT kill ARGUMENTS..., forked from the session's fork server (conftest.forked)."""
    env = dict(child_env(cpu_mode=False), PYTHONUNBUFFERED="1")
    return forked.run([sys.executable, CHILD, str(out), "kill", *arguments], "the DCP child killed during a save",
                      env=env)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, forked):
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run_child(forked, out, "-", "sync")
    assert result.returncode == 0, result.stderr[-3000:]
    return load_file(os.path.join(out, "final.safetensors"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_during_a_dcp_save_keeps_the_previous_checkpoint_and_resumes_exactly(tmp_path, uninterrupted, mode,
                                                                                     forked):
    for moment in ("data", "metadata", "rename"):
        result = run_child(forked, tmp_path, moment, mode)
        assert result.returncode == -9, f"{moment} was not reached: {result.stderr[-2000:]}"
        folders = [os.path.basename(d) for d in checkpoint_dirs(os.path.join(tmp_path, "run"))]
        assert "checkpoint-4" not in folders, f"after a kill at {moment}: a half-written checkpoint-4 is named"
        assert "checkpoint-2" in folders
        for path in checkpoint_dirs(os.path.join(tmp_path, "run")):
            assert DCPStorage().checkpoint_problem(path) is None, f"after a kill at {moment}: {path} is broken"
    result = run_child(forked, tmp_path, "-", mode)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [n for n in os.listdir(tmp_path / "run") if n.startswith(".")], "a killed save's folder was left"
    assert_equal_tensors(load_file(os.path.join(tmp_path, "final.safetensors")), uninterrupted,
                         f"killed during {mode} saves, then resumed")


# ---------------------------------------------------------------------------------------------------------------
# Several processes: FSDP2 and DDP, resharding
# ---------------------------------------------------------------------------------------------------------------
def launch(out, processes: int, *arguments, forked=None):
    """`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node PROCESSES dcp_child.py OUT ARGUMENTS...`, or its ranks forked
    from `forked` (helpers.ForkServer.launch: torchrun's worker environment, ~5 s of imports spared per rank)."""
    if forked is not None:
        return forked.launch([CHILD, out, *arguments], processes, f"the {processes}-process {arguments[0]} launch",
                             env=child_env(cpu_mode=True))
    command = [os.path.join(BIN, "torchrun"), "--nproc_per_node", str(processes), "--master_port", str(free_port()),
               CHILD, str(out), *map(str, arguments)]
    return subprocess.Popen(command, env=child_env(cpu_mode=True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finish(process, what: str) -> str:
    output = finish_launch(process, what)
    assert process.returncode == 0, f"{what} failed (rc {process.returncode}):\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def launches(tmp_path_factory, one_process, forked):
    """2 FSDP2 processes (sharded, resumed 2 -> 2, from_one 1 -> 2: a real torchrun launch) and 2 DDP processes
    together; then 4 FSDP2 processes (2 -> 4) and, here, one process (2 -> 1). The DDP and 4-process ranks are forks
    of the session's fork server."""
    one, _ = one_process
    two, ddp, four = (tmp_path_factory.mktemp(name) for name in ("fsdp2", "ddp", "four"))
    started = {"fsdp2": launch(two, 2, "fsdp2", os.path.join(one, "plain", "checkpoint-4")),
               "ddp": launch(ddp, 2, "ddp", forked=forked)}
    finish(started.pop("fsdp2"), "the FSDP2 launch")
    started["four"] = launch(four, 4, "fsdp2-from", os.path.join(two, "sharded", "checkpoint-4"), forked=forked)
    dcp_child.run(str(two), "from_two_in_one", resume_from=os.path.join(two, "sharded", "checkpoint-4"))
    for what, process in started.items():
        finish(process, f"the {what} launch")
    return two, ddp, four


def test_fsdp2_checkpoints_hold_shards_and_resume_bit_exactly_on_two_processes_with_async_saves(launches):
    two, _, _ = launches
    import json

    result = json.load(open(os.path.join(two, "sharded_rank0.json")))
    assert result["distributed_type"] == "DistributedType.FSDP" and result["num_processes"] == 2
    shards = [n for n in os.listdir(os.path.join(two, "sharded", "checkpoint-4", DCP_FOLDER)) if n.endswith(".distcp")]
    assert len(shards) == 2, shards  # each rank wrote its own shards
    assert_equal_tensors(weights(two, "resumed"), weights(two, "sharded"), "FSDP2 2 -> 2 resume")
    names = [os.path.basename(d) for d in checkpoint_dirs(os.path.join(two, "resumed"))]
    assert names == ["checkpoint-6", "checkpoint-8"]  # written asynchronously by both ranks
    assert all(DCPStorage().checkpoint_problem(d) is None for d in checkpoint_dirs(os.path.join(two, "resumed")))


def test_every_fsdp2_checkpoint_records_the_models_class_and_converts_to_what_from_pretrained_loads(launches,
                                                                                                     tmp_path):
    """FSDP2's `fully_shard` swaps the model's class for `FSDPLlamaForCausalLM`; each checkpoint's config.json
    names the model's own class (as `save_pretrained`, which Trainer uses, records it), so `convert-dcp` of the
    2-process checkpoint gives a folder that `from_pretrained` loads, with the trained sharded model's logits."""
    import json

    from transformers import LlamaForCausalLM

    two, _, four = launches
    assert json.load(open(os.path.join(two, "sharded_rank0.json")))["distributed_type"] == "DistributedType.FSDP"
    for run_dir in [os.path.join(two, name) for name in ("sharded", "resumed", "from_one")] + [
            os.path.join(four, "from_two")]:
        for checkpoint in checkpoint_dirs(run_dir):
            config = json.load(open(os.path.join(checkpoint, "config.json")))
            assert config["architectures"] == ["LlamaForCausalLM"], (checkpoint, config["architectures"])
    checkpoint = os.path.join(two, "sharded", f"checkpoint-{dcp_child.MAX_STEPS}")  # the trained model's state
    pretrained = os.path.join(tmp_path, "pretrained")
    result = run_process([sys.executable, "-m", "loopkit", "convert-dcp", checkpoint, pretrained],
                         "python -m loopkit convert-dcp", env=child_env(cpu_mode=False))
    assert result.returncode == 0, result.stderr[-3000:]
    model = LlamaForCausalLM.from_pretrained(pretrained).eval()
    with torch.no_grad():
        logits = model(input_ids=dcp_child.logits_inputs()).logits
    assert torch.equal(logits, weights(two, "sharded_logits")["logits"])


def test_ddp_asynchronous_saves_resume_bit_exactly(launches):
    _, ddp, _ = launches
    import json

    assert json.load(open(os.path.join(ddp, "ddp_rank0.json")))["distributed_type"] == "DistributedType.MULTI_CPU"
    assert_equal_tensors(weights(ddp, "ddp_resumed"), weights(ddp, "ddp"), "DDP 2 -> 2 resume")


@pytest.mark.parametrize("name, source", [("from_one", ("one", "plain")), ("from_two", ("two", "sharded")),
                                          ("from_two_in_one", ("two", "sharded"))],
                         ids=["1->2", "2->4", "2->1"])
def test_resharding_loads_the_checkpoint_exactly_and_trains_on(launches, one_process, name, source):
    two, _, four = launches
    folders = {"one": one_process[0], "two": two}
    checkpoint = os.path.join(folders[source[0]], source[1], "checkpoint-4")
    run_folder = four if name == "from_two" else two
    saved = read_whole_state(checkpoint)
    for key, value in weights(run_folder, f"{name}_loaded").items():
        parts = key.split(".")
        expected = saved["model"][".".join(parts[1:])] if parts[0] == "model" else \
            saved["optimizer"]["state"][".".join(parts[2:-1])][parts[-1]]
        assert torch.equal(value, expected), f"{name}: {key} was not loaded as saved"
    measured = worst_relative_difference(weights(run_folder, name), weights(folders[source[0]], source[1]))
    print(f"{name} vs the uninterrupted run it resumed: max|dw|/max|w| = {measured:.2e}")
    assert measured <= 1e-4
