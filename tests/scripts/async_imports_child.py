"""A fresh process (nothing of a save imported yet): loopkit's own unwrap for a save, then short runs of an HF model
with `DCPStorage(async_save=True)` and `HFStorage(async_save=True)`, recording every module imported on a thread
other than the training thread. Prints one JSON line: DeepSpeed installed, DeepSpeed imported by loopkit's unwrap,
the modules the staging and writer threads imported (an import holds the GIL: training stalls beside it), and the
checkpoints written."""

import importlib.util
import json
import os
import sys
import tempfile
import threading

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

recording = True


def record_imports(event, args):
    """Python's "import" audit event: every module loaded, by an import statement or by importlib alike."""
    if recording and event == "import" and threading.current_thread() is not threading.main_thread():
        report["imported_off_the_training_thread"].append(f"{args[0]} ({threading.current_thread().name})")


sys.addaudithook(record_imports)  # an audit hook stays for the process: `recording` ends it
for storage in (DCPStorage, HFStorage):  # DCP first: it imports no DeepSpeed, which HFStorage must then do itself
    with tempfile.TemporaryDirectory() as out:
        args = LoopArgs(output_dir=out, max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3, save_steps=2,
                        logging_steps=100, disable_tqdm=True, report_to="none", seed=3)
        Loop(model=dist_child.tiny_llama(), args=args, train_dataset=dist_child.lm_samples(12, 1),
             storage=storage(async_save=True)).train()
        report.setdefault("checkpoints", []).append(
            sorted(name for name in os.listdir(out) if name.startswith("checkpoint-")))
recording = False
print(json.dumps(report))
