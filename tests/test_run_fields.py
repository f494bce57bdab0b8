"""The TrainingArguments fields of issue 12 (part 2) that change how a run is built, each against HF Trainer live or,
where a field only changes plumbing, checked where it lands (the DataLoader, the Accelerator, the DDP wrapper).

group_by_length (HF's LengthGroupedSampler order, and an exact mid-epoch resume), the ddp_* fields (a 2-process gloo
launch of two "nodes", with save_on_each_node), accelerator_config, dataloader_multiprocessing_context /
dataloader_in_order, auto_find_batch_size (a model that raises Accelerate's out-of-memory error above a batch size),
enable_jit_checkpoint (loopkit's preemption save).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import BatchEncoding, TrainerCallback

from loopkit import Loop, LoopArgs, LoopConfigError, TrainingInterrupted
from loopkit.checkpoint import checkpoint_problem

from helpers import (IGNORE_PIN_MEMORY_WARNING, TinyRegression, assert_same_weights, free_port, hf_args,
                     regression_data, runners, tiny_llama, tiny_regression, wait_for)

datasets = pytest.importorskip("datasets")
pytestmark = IGNORE_PIN_MEMORY_WARNING


# ---------------------------------------------------------------------------------------------------------------
# train_sampling_strategy="group_by_length"
# ---------------------------------------------------------------------------------------------------------------
def ragged_lm_dataset(n: int = 40, vocab: int = 64, seed: int = 1) -> "datasets.Dataset":
    """Causal-LM samples of 3 to 14 tokens (a `datasets.Dataset`, with a `length` column the model does not take)."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "labels": [], "length": []}
    for _ in range(n):
        ids = torch.randint(0, vocab, (int(torch.randint(3, 15, (1,), generator=g)),), generator=g).tolist()
        rows["input_ids"].append(ids)
        rows["labels"].append(ids[:-1] + [-100])
        rows["length"].append(len(ids))
    return datasets.Dataset.from_dict(rows)


class PaddingCollator:
    """Right-pads input_ids (0) and labels (-100), returns a `BatchEncoding` as HF collators do, and records the
    order the samples came in."""

    def __init__(self):
        self.seen = []

    def __call__(self, features):
        self.seen.append([tuple(f["input_ids"]) for f in features])
        width = max(len(f["input_ids"]) for f in features)
        pad = lambda values, fill: [list(v) + [fill] * (width - len(v)) for v in values]
        ids = torch.tensor(pad([f["input_ids"] for f in features], 0))
        return BatchEncoding({"input_ids": ids, "attention_mask": (torch.arange(width) < torch.tensor(
            [[len(f["input_ids"])] for f in features])).long(), "labels": torch.tensor(pad([f["labels"] for f in
                                                                                            features], -100))})


def grouped_run(runner, output_dir, collator, resume_from=None, **overrides):
    kwargs = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2,
                  learning_rate=1e-2, logging_steps=1, save_steps=5, train_sampling_strategy="group_by_length",
                  seed=3, use_cpu=True)
    kwargs.update(overrides)
    trainer = runner(model=tiny_llama(), args=hf_args(output_dir, **kwargs), train_dataset=ragged_lm_dataset(),
                     data_collator=collator)
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


def logged_losses(trainer) -> dict:
    """{step: logged loss} (logging_steps=1: every step)."""
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_group_by_length_gives_trainers_order_losses_and_weights(tmp_path):
    results = {}
    for name, runner in runners():
        collator = PaddingCollator()
        results[name] = grouped_run(runner, tmp_path / name, collator), collator.seen
    (hf, hf_order), (loop, loop_order) = results["hf"], results["loopkit"]
    assert len(loop_order) == 40 // 2 * 2 and loop_order == hf_order  # both epochs, sample by sample
    # Trainer groups evaluation batches by length too (with a seeded generator): same order, same predictions
    hf_predicted, loop_predicted = (t.predict(ragged_lm_dataset(10, seed=2)) for t in (hf, loop))
    assert (loop_predicted.label_ids == hf_predicted.label_ids).all()
    assert loop_predicted.metrics["test_loss"] == pytest.approx(hf_predicted.metrics["test_loss"], rel=1e-5)
    assert loop.data_collator.seen[-2:] == hf.data_collator.seen[-2:]
    eval_samples = ragged_lm_dataset(10, seed=2)
    assert len(loop.data_collator.seen[-2][0]) == max(eval_samples["length"]) != eval_samples["length"][0]
    lengths = [max(map(len, batch)) for batch in loop_order]
    assert lengths[0] == 14 and lengths != sorted(lengths, reverse=True)  # longest first, then megabatches
    assert logged_losses(loop) == pytest.approx(logged_losses(hf), rel=1e-5)
    assert_same_weights(loop.model, hf.model, rtol=1e-5)


def test_group_by_length_resumes_mid_epoch_exactly(tmp_path):
    full_collator, resumed_collator = PaddingCollator(), PaddingCollator()
    full = grouped_run(Loop, tmp_path / "full", full_collator)
    checkpoint = tmp_path / "full" / "checkpoint-15"  # 10 optimizer steps per epoch: step 15 is mid-epoch 2
    assert checkpoint.is_dir()
    resumed = grouped_run(Loop, tmp_path / "resumed", resumed_collator, resume_from=str(checkpoint))
    # The rest of epoch 2, in the same order; the first of its batches was collated before the save (read ahead,
    # as under Trainer) and comes from the checkpoint.
    assert resumed_collator.seen == full_collator.seen[15 * 2 + 1:]
    assert logged_losses(resumed) == logged_losses(full)
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after the resume"


def test_group_by_length_without_lengths_names_the_column(tmp_path):
    args = LoopArgs(output_dir=str(tmp_path), train_sampling_strategy="group_by_length", max_steps=1)
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(8))
    with pytest.raises(LoopConfigError, match="'length' column or each sample's 'input_ids'"):
        loop.train()


# ---------------------------------------------------------------------------------------------------------------
# ddp_* fields
# ---------------------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------------------
# accelerator_config
# ---------------------------------------------------------------------------------------------------------------
def test_accelerator_config_builds_the_accelerator_as_trainer(tmp_path):
    config = {"split_batches": True, "even_batches": False, "use_seedable_sampler": False, "non_blocking": True,
              "gradient_accumulation_kwargs": {"sync_each_batch": True}}
    built = {}
    for name, runner in runners():  # Trainer adds num_steps=1 to the dict it gets: each runner gets its own
        args = hf_args(tmp_path / name, accelerator_config=copy.deepcopy(config), data_seed=5)
        accelerator = runner(model=tiny_regression(), args=args).accelerator
        loader = accelerator.dataloader_config
        built[name] = (loader.split_batches, loader.dispatch_batches, loader.even_batches,
                       loader.use_seedable_sampler, loader.non_blocking, loader.data_seed,
                       accelerator.gradient_state.plugin_kwargs)
    assert built["loopkit"] == built["hf"] == (True, None, False, False, True, 5,
                                               built["hf"][-1])
    assert built["hf"][-1]["sync_each_batch"] is True and built["hf"][-1]["num_steps"] == 1


def test_accelerator_config_without_seedable_sampler_trains_as_trainer(tmp_path):
    """use_seedable_sampler=False: the epoch order comes from the global RNG (torch's RandomSampler), as in HF."""
    trained = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, accelerator_config={"use_seedable_sampler": False}, num_train_epochs=2,
                       per_device_train_batch_size=4, learning_rate=0.05, logging_steps=1, save_strategy="no")
        trainer = runner(model=tiny_regression(), args=args, train_dataset=regression_data(24))
        trainer.train()
        trained[name] = trainer
    assert logged_losses(trained["loopkit"]) == pytest.approx(logged_losses(trained["hf"]), rel=1e-6)
    assert_same_weights(trained["loopkit"].model, trained["hf"].model, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# dataloader_multiprocessing_context, dataloader_in_order
# ---------------------------------------------------------------------------------------------------------------
def test_dataloader_context_and_order_reach_the_dataloader_as_in_trainer(tmp_path):
    seen = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, dataloader_num_workers=1, dataloader_multiprocessing_context="spawn",
                       dataloader_in_order=False)
        trainer = runner(model=tiny_regression(), args=args, train_dataset=regression_data(8),
                         eval_dataset=regression_data(4))
        for loader in (trainer.get_train_dataloader(), trainer.get_eval_dataloader()):
            base = getattr(loader, "base_dataloader", loader)
            seen.setdefault(name, []).append((base.multiprocessing_context.get_start_method(), base.in_order))
    assert seen["loopkit"] == seen["hf"] == [("spawn", False), ("spawn", False)]


def test_multiprocessing_context_without_workers_is_refused(tmp_path):
    args = LoopArgs(output_dir=str(tmp_path), dataloader_multiprocessing_context="spawn", max_steps=1)
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(8))
    with pytest.raises(LoopConfigError, match="dataloader_multiprocessing_context='spawn'.*dataloader_num_workers"):
        loop.train()


# ---------------------------------------------------------------------------------------------------------------
# auto_find_batch_size
# ---------------------------------------------------------------------------------------------------------------
class FitsFiveSamples(TinyRegression):
    """Raises the out-of-memory error Accelerate's `should_reduce_batch_size` recognises above 5 samples a batch."""

    def __init__(self):
        super().__init__()
        self.tried = []

    def forward(self, x, labels=None):
        self.tried.append(len(x))
        if len(x) > 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return super().forward(x, labels)


def test_auto_find_batch_size_retries_smaller_batches_as_trainer(tmp_path):
    trained = {}
    for name, runner in runners():
        torch.manual_seed(0)
        args = hf_args(tmp_path / name, auto_find_batch_size=True, per_device_train_batch_size=8, max_steps=6,
                       learning_rate=0.05, logging_steps=1, save_steps=3)
        trainer = runner(model=FitsFiveSamples(), args=args, train_dataset=regression_data(30))
        trainer.train()
        trained[name] = trainer
    hf, loop = trained["hf"], trained["loopkit"]
    assert loop.model.tried == hf.model.tried and loop.model.tried[:4] == [8, 7, 6, 5]  # x 0.9 each time
    assert loop.state.train_batch_size == hf.state.train_batch_size == 5
    assert loop.get_total_train_batch_size(loop.args) == hf.get_total_train_batch_size(hf.args) == 5
    assert logged_losses(loop) == pytest.approx(logged_losses(hf), rel=1e-6)
    assert_same_weights(loop.model, hf.model, rtol=1e-6)
    # A resume starts from the batch size the checkpoint found, without retrying the larger ones.
    torch.manual_seed(0)
    resumed = Loop(model=FitsFiveSamples(), args=hf_args(tmp_path / "resumed", auto_find_batch_size=True,
                                                         per_device_train_batch_size=8, max_steps=6,
                                                         learning_rate=0.05, logging_steps=1),
                   train_dataset=regression_data(30))
    resumed.train(resume_from_checkpoint=str(tmp_path / "loopkit" / "checkpoint-3"))
    assert set(resumed.model.tried) == {5}
    assert_same_weights(resumed.model, loop.model, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# enable_jit_checkpoint
# ---------------------------------------------------------------------------------------------------------------
class SigtermAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_enable_jit_checkpoint_is_loopkits_preemption_save(tmp_path):
    """Trainer's JIT checkpoint on SIGTERM is loopkit's preemption save: checkpoint of the step, then (outside a
    launcher, as here) `TrainingInterrupted` naming it; under a launcher the process exits 143
    (tests/test_interrupt.py)."""
    args = hf_args(tmp_path, enable_jit_checkpoint=True, max_steps=8, save_strategy="no", learning_rate=0.05)
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32), callbacks=[SigtermAt(3)])
    with pytest.raises(TrainingInterrupted) as stopped:
        loop.train()
    assert stopped.value.saved and stopped.value.checkpoint.endswith("checkpoint-3")
    assert loop.state.global_step == 3
    assert checkpoint_problem(str(tmp_path / "checkpoint-3")) is None
    saved = load_file(tmp_path / "checkpoint-3" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in loop.model.state_dict().items())


# ---------------------------------------------------------------------------------------------------------------
# ddp_* fields and save_on_each_node on two processes (launched when this file starts, checked last)
# ---------------------------------------------------------------------------------------------------------------
def test_ddp_find_unused_parameters_default_follows_trainer(tmp_path):
    cases = [(tiny_llama, {}), (tiny_llama, {"gradient_checkpointing": True}), (tiny_regression, {}),
             (tiny_regression, {"ddp_find_unused_parameters": False})]
    for build, overrides in cases:
        handlers = {}
        for name, runner in runners():
            trainer = runner(model=build(), args=hf_args(tmp_path / name, use_cpu=True, **overrides))
            handlers[name] = trainer.accelerator.ddp_handler.to_kwargs()  # the values that differ from torch's
        assert handlers["loopkit"] == handlers["hf"], (build.__name__, overrides)
        expected = not overrides  # True unless activation checkpointing is on or it is set
        assert handlers["hf"].get("find_unused_parameters", False) is expected, (build.__name__, overrides)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The 2-node launch (its own test, in the slow tier: not autouse, so the fast tier's tests of this file launch
    nothing)."""
    child = os.path.join(os.path.dirname(__file__), "scripts", "ddp_kwargs_child.py")
    out = tmp_path_factory.mktemp("two_nodes")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=os.path.dirname(os.path.dirname(__file__)),
               TRANSFORMERS_VERBOSITY="error")
    port = str(free_port())
    nodes = [subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nnodes", "2",
                               "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
                               "--master_port", port, child, str(out)], env=env, stderr=subprocess.STDOUT,
                              stdout=open(out / f"launch{node}.log", "w")) for node in (0, 1)]
    yield out, nodes
    for node in nodes:  # the test failed before waiting for both
        if node.poll() is None:
            node.kill()
            node.wait()


def test_ddp_fields_and_save_on_each_node_on_two_nodes(two_nodes):
    """Two one-process "nodes" (two torchrun launches, gloo), each writing into its own folder: the DDP wrapper got
    the ddp_* fields; with save_on_each_node both nodes hold a complete checkpoint, without it only node 0."""
    tmp_path, nodes = two_nodes
    for index, node in enumerate(nodes):
        wait_for(node, f"the torchrun launch of node {index} (output in {tmp_path / f'launch{index}.log'})")
        assert node.returncode == 0, (tmp_path / f"launch{index}.log").read_text()[-4000:]
    for rank in (0, 1):
        seen = json.load(open(tmp_path / f"ddp_rank{rank}.json"))
        assert seen == dict(wrapper="DistributedDataParallel", find_unused_parameters=True,
                            bucket_bytes_cap=7 * 1024 * 1024, broadcast_buffers=False, static_graph=True,
                            global_step=2)
    written = {}
    for folder in ("node0", "node1", "main_only_node0", "main_only_node1"):
        checkpoint = tmp_path / folder / "checkpoint-2"
        written[folder] = sorted(os.listdir(checkpoint)) if checkpoint.is_dir() else []
    assert "model.safetensors" in written["node0"] and "optimizer.pt" in written["node0"]
    # the same whole checkpoint on both disks, every process's RNG file included: each node resumes from its own
    # (tests/test_node_local_disks.py kills both and resumes)
    assert written["node1"] == written["node0"] and {"rng_state_0.pth", "rng_state_1.pth"} <= set(written["node1"])
    assert written["main_only_node1"] == [] and "trainer_state.json" in written["main_only_node0"]
    weights = [load_file(tmp_path / node / "checkpoint-2" / "model.safetensors") for node in ("node0", "node1")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
