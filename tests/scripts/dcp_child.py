"""The training script of tests/test_dcp_storage.py: the tiny Llama and ragged causal-LM data of dist_child.py,
checkpointed by `DCPStorage`. The same functions run in the pytest process (one process, no launcher).

Usage: python dcp_child.py OUT_DIR MODE [ARG ...]

* kill MOMENT sync|async (one process, no launcher): trains 8 steps saving every 2 and resuming from the newest
  usable checkpoint in OUT_DIR/run; SIGKILLs itself at MOMENT of the save of checkpoint-4: `data` (the shards are
  written, one of them then half truncated), `metadata` (DCP's `.metadata` written, the folder not yet renamed),
  `rename` (just before the rename). Without MOMENT (`kill - sync`) it runs to the end. Writes
  OUT_DIR/final.safetensors.
* fsdp2 CHECKPOINT (2 processes): `sharded` (FSDP2, synchronous DCP saves every 2 steps), `resumed` (from its
  checkpoint-4, asynchronous saves: 2 -> 2), `from_one` (from CHECKPOINT, a 1-process checkpoint: 1 -> 2).
* fsdp2-from CHECKPOINT (any number of processes, 4 in the test): `from_two` (2 -> 4).
* ddp (2 processes): `ddp` (asynchronous saves every 2 steps) and `ddp_resumed` (from its checkpoint-4).

Every run writes `<name>.safetensors` (final whole weights, rank 0), `<name>_loaded.safetensors` (when resumed: the
whole weights and AdamW moments right after loading, at on_train_begin) and `<name>_rank<r>.json`; a sharded run
also `<name>_logits.safetensors` (rank 0): the trained sharded model's logits on `logits_inputs()`.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(__file__))
import dist_child  # noqa: E402

from loopkit import Loop, LoopArgs  # noqa: E402
from loopkit.stages.setup import SetupStage  # noqa: E402
from loopkit.storage import DCPStorage  # noqa: E402

MAX_STEPS, GLOBAL_BATCH = 8, 4


def whole_state(loop: Loop) -> dict:
    """The whole model and AdamW moments (a collective under FSDP), keyed as DCP saves them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, \
        get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    model, optimizer = loop.model_wrapped, getattr(loop.optimizer, "optimizer", loop.optimizer)
    state = {f"model.{k}": v for k, v in get_model_state_dict(model, options=options).items()}
    for name, moments in get_optimizer_state_dict(model, optimizer, options=options)["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            state[f"optimizer.state.{name}.{key}"] = moments[key]
    return {k: v.detach().cpu().clone().contiguous() for k, v in state.items()}


class RecordLoaded(TrainerCallback):
    """The state right after a resume loaded it (on_train_begin follows the loading)."""

    def __init__(self, path: str):
        self.path, self.loop = path, None

    def on_train_begin(self, args, state, control, **kwargs):
        loaded = whole_state(self.loop)
        if self.loop.accelerator.is_main_process:
            save_file(loaded, self.path)


def build_loop(out: str, name: str, *, sharded: bool, async_save: bool = False, resume: bool = False,
               callbacks=()) -> Loop:
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    per_device = max(1, GLOBAL_BATCH // (2 * processes))
    args = LoopArgs(output_dir=os.path.join(out, name), max_steps=MAX_STEPS, per_device_train_batch_size=per_device,
                    gradient_accumulation_steps=GLOBAL_BATCH // (per_device * processes), learning_rate=3e-3,
                    warmup_steps=2, weight_decay=0.01, max_grad_norm=0.5, logging_steps=1, optim="adamw_torch",
                    disable_tqdm=True, seed=7, save_steps=2, report_to="none")
    setup = SetupStage(fsdp_plugin=fsdp_plugin()) if sharded else SetupStage()
    recorder = RecordLoaded(os.path.join(out, f"{name}_loaded.safetensors")) if resume else None
    loop = Loop(model=dist_child.tiny_llama(), args=args, train_dataset=dist_child.lm_samples(24, 1), setup=setup,
                callbacks=[*callbacks, *([recorder] if recorder else [])], storage=DCPStorage(async_save=async_save))
    if recorder:
        recorder.loop = loop
    return loop


def fsdp_plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                          reshard_after_forward=True)


def run(out: str, name: str, *, sharded: bool = False, async_save: bool = False, resume_from=None,
        callbacks=()) -> Loop:
    loop = build_loop(out, name, sharded=sharded, async_save=async_save, resume=resume_from is not None,
                      callbacks=callbacks)
    loop.train(resume_from_checkpoint=resume_from)
    final = {k: v for k, v in whole_state(loop).items() if k.startswith("model.")}
    logits = sharded_logits(loop) if sharded else None
    rank = loop.accelerator.process_index
    if rank == 0:
        save_file(final, os.path.join(out, f"{name}.safetensors"))
        if logits is not None:
            save_file({"logits": logits}, os.path.join(out, f"{name}_logits.safetensors"))
    with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump({"num_processes": loop.accelerator.num_processes, "distributed_type": str(
            loop.accelerator.distributed_type), "global_step": loop.state.global_step,
            "log_history": loop.state.log_history}, f, indent=1, default=str)
    return loop


def logits_inputs() -> torch.Tensor:
    return torch.stack([sample["input_ids"] for sample in dist_child.lm_samples(3, 5)])


def sharded_logits(loop: Loop) -> torch.Tensor:
    """The trained model's logits, computed by the sharded model itself (a collective: every rank runs it)."""
    model = loop.model_wrapped
    model.eval()
    with torch.no_grad():
        return model(input_ids=logits_inputs()).logits.detach().cpu().contiguous()


def install_kill(moment: str) -> None:
    """SIGKILL at `moment` of the second save (checkpoint-4), on whichever thread writes it."""
    from torch.distributed.checkpoint import FileSystemWriter

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def in_second_save(path) -> bool:
        return ".tmp-checkpoint-4" in str(path)

    write_data, finish, replace = FileSystemWriter.write_data, FileSystemWriter.finish, os.replace

    def write_data_then_die(self, plan, planner):
        result = write_data(self, plan, planner)
        if moment == "data" and in_second_save(self.path):
            result.wait()
            shard = next(os.path.join(self.path, n) for n in sorted(os.listdir(self.path)) if n.endswith(".distcp"))
            with open(shard, "r+b") as f:
                f.truncate(os.path.getsize(shard) // 2)
            die()
        return result

    def finish_then_die(self, metadata, results):
        finish(self, metadata, results)
        if moment == "metadata" and in_second_save(self.path):
            die()

    def replace_or_die(src, dst, *args, **kwargs):
        if moment == "rename" and in_second_save(src):
            die()
        return replace(src, dst, *args, **kwargs)

    FileSystemWriter.write_data, FileSystemWriter.finish, os.replace = write_data_then_die, finish_then_die, \
        replace_or_die


def run_killed(out: str, moment: str, mode: str) -> None:
    from loopkit.checkpoint import last_checkpoint

    if moment != "-":
        install_kill(moment)
    run_dir = os.path.join(out, "run")
    resume = True if last_checkpoint(run_dir) else None
    loop = build_loop(out, "run", sharded=False, async_save=mode == "async")
    loop.train(resume_from_checkpoint=resume)
    save_file({k: v.contiguous() for k, v in loop.model.state_dict().items()}, os.path.join(out, "final.safetensors"))


def main() -> None:
    out, mode, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "kill":
        run_killed(out, *extra)
    elif mode == "fsdp2":
        run(out, "sharded", sharded=True)
        run(out, "resumed", sharded=True, async_save=True,
            resume_from=os.path.join(out, "sharded", "checkpoint-4"))
        run(out, "from_one", sharded=True, resume_from=extra[0])
    elif mode == "fsdp2-from":
        run(out, "from_two", sharded=True, resume_from=extra[0])
    elif mode == "ddp":
        run(out, "ddp", async_save=True)
        run(out, "ddp_resumed", async_save=True, resume_from=os.path.join(out, "ddp", "checkpoint-4"))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
    dist_child.leave()
