"""A fresh process (nothing of a save imported yet): loopkit's own unwrap for a save, then short runs of an HF model
with `DCPStorage(async_save=True)` and `HFStorage(async_save=True)`, recording every module imported on a thread
other than the training thread.
Prints one JSON line: DeepSpeed installed, DeepSpeed imported by loopkit's unwrap, the modules the staging and writer
threads imported (an import holds the GIL: training stalls beside it), and the checkpoints written."""

import builtins
import json
import os
import sys
import tempfile
import threading

import importlib.util
import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(__file__))
import dist_child  # noqa: E402

from loopkit import Loop, LoopArgs  # noqa: E402
from loopkit.distributed import unwrap_model  # noqa: E402
from loopkit.storage import DCPStorage, HFStorage  # noqa: E402

unwrap_model(Accelerator(cpu=True), torch.nn.Linear(2, 1))
report = {"deepspeed_installed": importlib.util.find_spec("deepspeed") is not None,
          "deepspeed_imported_by_unwrap": "deepspeed" in sys.modules, "imported_off_the_training_thread": []}

original_import = builtins.__import__


def recording_import(name, *args, **kwargs):
    new = name not in sys.modules
    module = original_import(name, *args, **kwargs)
    if new and name in sys.modules and threading.current_thread() is not threading.main_thread():
        report["imported_off_the_training_thread"].append(f"{name} ({threading.current_thread().name})")
    return module


builtins.__import__ = recording_import
for storage in (DCPStorage, HFStorage):  # DCP first: it imports no DeepSpeed, which HFStorage must then do itself
    with tempfile.TemporaryDirectory() as out:
        args = LoopArgs(output_dir=out, max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3, save_steps=2,
                        logging_steps=100, disable_tqdm=True, report_to="none", seed=3)
        Loop(model=dist_child.tiny_llama(), args=args, train_dataset=dist_child.lm_samples(12, 1),
             storage=storage(async_save=True)).train()
        report.setdefault("checkpoints", []).append(
            sorted(name for name in os.listdir(out) if name.startswith("checkpoint-")))
builtins.__import__ = original_import
print(json.dumps(report))
