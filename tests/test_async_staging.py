"""An asynchronous save copies the model's and the optimizer's states to host memory on a staging thread, while the
next step's forward and backward run (loopkit/checkpoint/staging.py): the optimizer's next step waits for that copy,
and the buffers a forward writes are copied at the step boundary. With the staging thread slowed down, the checkpoint
still holds the weights, buffers and optimizer state of its own step, for both storages."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from helpers import regression_data
from loopkit import Loop, LoopArgs
from loopkit.checkpoint import staging
from loopkit.storage import DCPStorage, HFStorage
from transformers import TrainerCallback


class NormedRegression(nn.Module):
    """A linear regression behind a BatchNorm: its running statistics are buffers every training forward writes."""

    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.BatchNorm1d(2), nn.Linear(2, 1)

    def forward(self, x, labels=None):
        prediction = self.linear(self.norm(x)).squeeze(-1)
        return {"loss": nn.functional.mse_loss(prediction, labels), "logits": prediction}


class AtSave(TrainerCallback):
    """The model's and the optimizer's states at each step that saves, as the save begins (after the step, before
    the next one); `announced`: the steps `on_save` was fired for (an asynchronous save's fires once it is
    committed, after later steps ran: docs/events.md)."""

    def __init__(self):
        self.saved, self.position, self.announced = {}, None, []

    def on_save(self, args, state, control, **kwargs):
        self.announced.append(state.global_step)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if not control.should_save:
            return
        inner = getattr(optimizer, "optimizer", optimizer)
        params = [p for group in inner.param_groups for p in group["params"]]
        self.position = next(i for i, p in enumerate(params) if p is model.linear.weight)  # its number in optimizer.pt
        self.saved[state.global_step] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                                         {k: v.detach().clone() for k, v in inner.state[model.linear.weight].items()})


@pytest.fixture
def slow_staging(monkeypatch):
    """The staging thread's copies each take a while: without the hold, the optimizer would run ahead of them."""
    copy, nested = staging.copy_to_cpu, threading.local()

    def slow(obj):  # once per copy the thread starts, not again for each tensor inside it (copy_to_cpu recurses)
        if threading.current_thread().name == "loopkit-checkpoint-staging" and not getattr(nested, "depth", 0):
            time.sleep(0.3)
        nested.depth = getattr(nested, "depth", 0) + 1
        try:
            return copy(obj)
        finally:
            nested.depth -= 1

    monkeypatch.setattr(staging, "copy_to_cpu", slow)


def saved_states(storage, path, position):
    if isinstance(storage, DCPStorage):
        from loopkit.storage.dcp import read_whole_state

        whole = read_whole_state(path)
        return whole["model"], whole["optimizer"]["state"]["linear.weight"]
    from safetensors.torch import load_file

    from loopkit.checkpoint import safe_torch_load

    return load_file(os.path.join(path, "model.safetensors")), safe_torch_load(os.path.join(path, "optimizer.pt"))[
        "state"][position]


@pytest.mark.parametrize("make_storage", [HFStorage, DCPStorage], ids=["hf", "dcp"])
def test_a_staged_save_holds_its_own_steps_state(tmp_path, slow_staging, make_storage):
    storage, watch = make_storage(async_save=True), AtSave()
    args = LoopArgs(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, learning_rate=0.1,
                    save_steps=2, logging_steps=10, disable_tqdm=True, report_to="none", seed=3)
    torch.manual_seed(0)
    loop = Loop(model=NormedRegression(), args=args, train_dataset=regression_data(48), storage=storage,
                callbacks=[watch])
    loop.train()
    assert sorted(watch.saved) == [2, 4, 6] and watch.announced == [2, 4, 6]
    for step, (model, moments) in watch.saved.items():
        weights, optimizer = saved_states(storage, str(tmp_path / f"checkpoint-{step}"), watch.position)
        for name, value in model.items():
            assert torch.equal(weights[name], value), f"checkpoint-{step}: {name} is not its step's"
        assert torch.equal(optimizer["exp_avg"], moments["exp_avg"]), f"checkpoint-{step}: AdamW's moments moved on"
    # the weights did move between saves: the comparison above can tell one step's state from another's
    assert not torch.equal(watch.saved[2][0]["linear.weight"], watch.saved[4][0]["linear.weight"])
    assert not torch.equal(watch.saved[2][0]["norm.running_mean"], watch.saved[4][0]["norm.running_mean"])


def test_unwrapping_for_a_save_matches_accelerate_and_the_writer_thread_imports_nothing():
    """`distributed.unwrap_model` (what the save path calls) returns what Accelerate's `unwrap_model` does, for a plain
    and a compiled module, and, in a fresh process where DeepSpeed is installed, does not import it (0.6 s that the
    first save of a run paid). Then, in that process, an HF model's asynchronous saves (`DCPStorage`, then
    `HFStorage`) import nothing on the staging or the writer thread: an import holds the GIL, and training stalled
    beside it (transformers' `save_pretrained` unwraps with Accelerate, which imports DeepSpeed where it is
    installed: the storage benchmark's 8 steps after an asynchronous save ran 27% slower before
    `HFStorage.before_async_saves` did it on the training thread)."""
    import json
    import sys

    from accelerate import Accelerator

    from helpers import run_process
    from loopkit.distributed import unwrap_model

    accelerator, plain = Accelerator(cpu=True), nn.Linear(2, 1)
    compiled = torch.compile(plain)
    for model in (plain, compiled):
        for keep in (True, False):
            assert unwrap_model(accelerator, model, keep_torch_compile=keep) is \
                accelerator.unwrap_model(model, keep_torch_compile=keep)
    child = os.path.join(os.path.dirname(__file__), "scripts", "async_imports_child.py")
    result = run_process([sys.executable, child], "asynchronous saves in a fresh process")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert not report["deepspeed_imported_by_unwrap"], report
    assert report["checkpoints"] == [["checkpoint-2", "checkpoint-4", "checkpoint-6"]] * 2, report
    assert report["imported_off_the_training_thread"] == [], report


@pytest.mark.parametrize("frozen_by_the_program", [False, True], ids=["heap-as-is", "program-froze-its-heap"])
def test_the_writer_freezes_the_heap_only_while_it_writes(tmp_path, monkeypatch, frozen_by_the_program):
    """The writer thread writes with the objects that existed when it started left out of full garbage collections
    (`gc.freeze`): a full collection that a write sets off scans the whole process holding the GIL (0.15-0.27 s under
    FSDP2 on 2 CPU processes, training stopped for all of it). After the write they are put back (`gc.unfreeze`),
    unless the program had frozen its heap itself: then loopkit leaves its freeze alone."""
    import gc

    from loopkit import checkpoint as files

    seen, fsync_tree = [], files.fsync_tree

    def watched(path):  # the writer's last step inside the write: the folder's fsync before the rename
        seen.append((threading.current_thread().name, gc.get_freeze_count()))
        return fsync_tree(path)

    monkeypatch.setattr(files, "fsync_tree", watched)
    args = LoopArgs(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, save_steps=2,
                    logging_steps=10, disable_tqdm=True, report_to="none")
    gc.unfreeze()  # the suite's own freeze (conftest.py), put back below
    try:
        if frozen_by_the_program:
            gc.freeze()
        before = gc.get_freeze_count()
        Loop(model=NormedRegression(), args=args, train_dataset=regression_data(16),
             storage=HFStorage(async_save=True)).train()
        after = gc.get_freeze_count()
    finally:
        gc.freeze()
    assert len(seen) == 2 and all(thread != threading.main_thread().name for thread, _ in seen), seen
    if frozen_by_the_program:  # nothing more frozen while writing (the run's own objects stay collectable)
        assert all(count <= before for _, count in seen) and after > 0, (before, seen, after)
    else:
        assert before == 0 and all(count > 1000 for _, count in seen) and after == 0, (seen, after)
