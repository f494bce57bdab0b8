"""`HFStorage`, the default checkpoint storage: HF Trainer's layout, which HF Trainer resumes and loopkit resumes
from HF Trainer's (loopkit/checkpoint/__init__.py describes the folder and its guarantees).

`model.safetensors` (+ `config.json` through `save_pretrained`), `optimizer.pt`, `scheduler.pt`, `scaler.pt`,
`rng_state[_<rank>].pth`, `trainer_state.json`, `loopkit_state.json`; under FSDP and DeepSpeed, Accelerate's folders
(`pytorch_model_fsdp_0/`, `optimizer_0/`, `global_step*/`: loopkit/distributed.py), read through loopkit's reader
that unpickles nothing it did not write (loopkit/dcp_reading.py).

`async_save=True`: in one process, or with several under FSDP2 (the policy's staging and writer threads:
loopkit/checkpoint/writing.py). Under FSDP2 each process stages host copies of its own shards while the next step
runs, and the writer thread writes the same files the synchronous save writes (both state-dict types), every
collective on the writer's own gloo group (loopkit/checkpoint/staged_shards.py). Other launches with several
processes (DDP, FSDP1, DeepSpeed) are refused at each `train()`'s start (`check_launch`): use
`DCPStorage(async_save=True)` there.
"""

from __future__ import annotations

import os

from .. import checkpoint as files  # the file operations, looked up at call time (the kill tests wrap them there)
from ..checkpoint.durable import EarlyFlush, FlushWhileWriting, safe_torch_load
from ..checkpoint.engines import (check_deepspeed_resumable, full_state_dict_saved, load_deepspeed_checkpoint,
                                  load_engine_model, load_optimizer_state, model_loads_after_prepare,
                                  save_engine_state)
from ..checkpoint.format import Checkpoint, ProcessState
from ..checkpoint.lineage import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, WEIGHTS_NAME
from ..checkpoint.model_files import holds_model_weights, load_model_weights
from ..checkpoint.staged_shards import local_states, write_staged_shards
from ..checkpoint.state_files import (read_loopkit_state_file, read_process_files, read_state_files,
                                      write_state_files)
from ..checkpoint.validation import checkpoint_problem
from ..distributed import active_engine, unwrap_model
from ..errors import config_error
from .base import CheckpointStorage


def sharded_by_fsdp2(accelerator) -> bool:
    return active_engine(accelerator) == "FSDP" and bool(getattr(accelerator, "is_fsdp2", False))


class HFStorage(CheckpointStorage):
    """HF Trainer's checkpoint layout (module docstring). `async_save=True`: in one process, or with several under
    FSDP2 (the states are copied to host memory on a thread while the next step runs and written by a background
    thread: loopkit/checkpoint/staged_shards.py under FSDP2)."""

    def check_launch(self) -> None:
        acc = self.context.accelerator
        if self.async_save and acc.num_processes > 1 and not sharded_by_fsdp2(acc):
            raise config_error("async_save", True, "HFStorage's asynchronous saving with several processes supports "
                               "FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2)) only",
                               "use DCPStorage(async_save=True) under this launch, or async_save=False")

    def before_async_saves(self) -> None:
        """The first calls of what the writer thread runs import modules, here instead: transformers'
        `save_pretrained` unwraps the model with Accelerate's `extract_model_from_parallel`, whose first call imports
        DeepSpeed where it is installed (about 500 modules, 0.2-0.6 s with the GIL held: the step after the first
        save took that much longer), and the serialisers import a module each at their first write."""
        from accelerate.utils import extract_model_from_parallel

        extract_model_from_parallel(self.run.model)
        files.import_serialisers()

    # -- the format: any folder --
    def recognises(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)) or holds_model_weights(path)

    def read_states(self, path: str) -> tuple[dict, dict]:
        return read_state_files(path)

    def read_loopkit_state(self, path: str) -> dict:
        return read_loopkit_state_file(path)

    def checkpoint_problem(self, path: str) -> str | None:
        return checkpoint_problem(path)

    # -- the format: inside a run --
    def states_to_save(self) -> tuple[dict | None, dict | None]:
        """The optimizer's state (not under FSDP / DeepSpeed, whose own paths write it); the model's only for an
        asynchronous save (a synchronous one writes the live weights through `save_pretrained`). Asynchronous under
        FSDP2: this process's shards of both (staged_shards.py)."""
        run, acc = self.run, self.context.accelerator
        if self.async_save and sharded_by_fsdp2(acc):
            return local_states(run.model_wrapped, run.optimizer,
                                with_optimizer=not run.args.save_only_model and run.optimizer is not None)
        sharded = active_engine(acc) is not None  # FSDP / DeepSpeed: the optimizer is written by their own path
        with_optimizer = not run.args.save_only_model and self.writes_files and not sharded
        model = unwrap_model(acc, run.model_wrapped, keep_torch_compile=False).state_dict() if self.async_save \
            else None
        return model, run.optimizer.state_dict() if with_optimizer else None

    def write_checkpoint(self, checkpoint: Checkpoint, folder: str) -> None:
        run, acc = self.run, self.context.accelerator
        early = EarlyFlush(folder)
        try:
            if self.async_save and sharded_by_fsdp2(acc):  # the staged shards, on the writer thread's group
                write_staged_shards(checkpoint, folder, acc, run.model_wrapped, run.processing_class)
            else:
                self.write_model_and_optimizer(checkpoint, folder, early)
            write_state_files(checkpoint, folder, run.args)
        finally:
            early.wait()

    def write_model_and_optimizer(self, checkpoint: Checkpoint, folder: str, early: EarlyFlush) -> None:
        run, acc = self.run, self.context.accelerator
        if full_state_dict_saved(acc):  # all but FSDP's SHARDED_STATE_DICT: one model.safetensors
            files.save_model_files(run.model_wrapped, acc, folder, run.processing_class,
                                   state_dict=checkpoint.model_state, writer=checkpoint.writes_files)
        if active_engine(acc) is not None:  # FSDP / DeepSpeed: Accelerate's paths, on every process
            save_engine_state(run, self.context, folder, with_optimizer=not run.args.save_only_model)
        early.flush_new_files()  # the weights reach the disk while the optimizer state is serialised
        if checkpoint.optimizer_state is not None:
            path = os.path.join(folder, OPTIMIZER_NAME)
            with FlushWhileWriting(path):
                files.save_state_file(checkpoint.optimizer_state, path)

    def read_process_state(self, path: str) -> ProcessState:
        return read_process_files(path, self.context.accelerator)

    def load_model_before_prepare(self, model, checkpoint: str) -> None:
        check_deepspeed_resumable(self.context.accelerator, checkpoint)
        if not model_loads_after_prepare(self.context.accelerator, checkpoint):
            load_model_weights(model, checkpoint)  # whole: sharded (if FSDP runs) by `prepare`

    def load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        """After `prepare`, on every process: a sharded model's shards, then (as HF: when the checkpoint has a
        scheduler, i.e. not `save_only_model`) the optimizer in whichever layout it was saved, and the scheduler."""
        run, context = self.run, self.context
        sched_path = os.path.join(checkpoint, SCHEDULER_NAME)
        load_engine_model(run, self.context, checkpoint)
        if os.path.isfile(sched_path) and load_optimizer_state(run, self.context, checkpoint):
            run.lr_scheduler.load_state_dict(safe_torch_load(sched_path))
        scaler_path = os.path.join(checkpoint, SCALER_NAME)
        if os.path.isfile(scaler_path) and context.accelerator.scaler is not None:
            context.accelerator.scaler.load_state_dict(safe_torch_load(scaler_path))

    def load_best_model(self, checkpoint: str) -> None:
        run, context = self.run, self.context
        if model_loads_after_prepare(context.accelerator, checkpoint) and \
                active_engine(context.accelerator) == "DeepSpeed":  # the engine's checkpoint, as HF's _load_best_model
            load_deepspeed_checkpoint(run.model_wrapped, checkpoint)
            return
        whole = os.path.join(checkpoint, WEIGHTS_NAME)
        if sharded_by_fsdp2(context.accelerator) and os.path.isfile(whole):  # FULL_STATE_DICT's model.safetensors
            load_whole_weights_into_shards(run.model_wrapped, whole)
            return
        load_model_weights(unwrap_model(context.accelerator, run.model_wrapped), checkpoint)


def load_whole_weights_into_shards(model, path: str) -> None:
    """Whole weights (`model.safetensors`) into an FSDP2 model, every process: torch's `set_model_state_dict` keeps
    this rank's part of each tensor (a plain `load_state_dict` cannot copy a whole tensor into a DTensor shard).
    Non-strict, as `load_model_weights` (tied weights are saved once)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, load_file(path), options=StateDictOptions(full_state_dict=True, strict=False))


def Checkpointer(run, context, **options):
    """The default storage's policy for `run`: loopkit's earlier name for `HFStorage(**options).attach(run,
    context)`."""
    return HFStorage(**options).attach(run, context)
