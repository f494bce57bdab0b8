"""The 2-process FSDP2 script of tests/test_hf_async_fsdp2.py: the tiny Llama and ragged causal-LM data of
dist_child.py, checkpointed by `HFStorage` (Accelerate's FSDP2 layout) every 2 of 8 steps.

Usage (2 processes, torchrun's worker environment): python hf_async_child.py OUT_DIR MODE STATE_DICT_TYPE

* layout: `sync` (synchronous saves), `async` (asynchronous saves: the uninterrupted reference) and `resumed`
  (asynchronous saves, resumed from `async/checkpoint-4`), then `best_sync` and `best_async` (evaluated every 2
  steps, `load_best_model_at_end`; synchronous and asynchronous saves);
* kill: asynchronous saves into OUT_DIR/killed; a rank SIGKILLs itself on the writer thread while checkpoint-4 is
  being written, after the model's part (SHARDED_STATE_DICT: rank 1, before its `optimizer_0/` shards;
  FULL_STATE_DICT: rank 0, before `optimizer.bin`);
* mesh (one process, no launcher): the check that refuses a mesh of more than one dimension (`check_meshes`);
* after-kill: asynchronous saves, resumed from the newest complete checkpoint of OUT_DIR/killed (`resume=True`).

Every run writes (rank 0) `<name>.safetensors`: the whole weights and AdamW moments at the end
(dcp_child.whole_state), and `<name>.json`: its `best_model_checkpoint` and `global_step`.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import dcp_child  # noqa: E402
import dist_child  # noqa: E402

from loopkit import Loop, LoopArgs  # noqa: E402
from loopkit.stages.setup import SetupStage  # noqa: E402
from loopkit.storage import HFStorage  # noqa: E402

MAX_STEPS, SAVE_STEPS, KILLED_AT = 8, 2, 4


def plugin(state_dict_type: str):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type,
                                          reshard_after_forward=True)


# Evaluated and saved every 2 steps, the best checkpoint loaded at the end (the larger learning rate makes the
# evaluation loss rise again, so the best is not the last: fsdp_child.BEST).
BEST = dict(eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
            learning_rate=3e-2)


def run(out: str, name: str, state_dict_type: str, *, async_save: bool, resume_from=None, **overrides) -> Loop:
    settings = dict(max_steps=MAX_STEPS, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                    learning_rate=3e-3, warmup_steps=2, weight_decay=0.01, max_grad_norm=0.5, logging_steps=1,
                    optim="adamw_torch", disable_tqdm=True, seed=7, save_steps=SAVE_STEPS, report_to="none")
    args = LoopArgs(output_dir=os.path.join(out, name), **{**settings, **overrides})
    loop = Loop(model=dist_child.tiny_llama(), args=args, train_dataset=dist_child.lm_samples(24, 1),
                eval_dataset=dist_child.lm_samples(dist_child.EVAL_SAMPLES, 2),
                setup=SetupStage(fsdp_plugin=plugin(state_dict_type)), storage=HFStorage(async_save=async_save))
    loop.train(resume_from_checkpoint=resume_from)
    final = dcp_child.whole_state(loop)
    if loop.accelerator.process_index == 0:
        save_file(final, os.path.join(out, f"{name}.safetensors"))
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump({"best_model_checkpoint": loop.state.best_model_checkpoint,
                       "global_step": loop.state.global_step}, f)
    return loop


def install_kill(out: str, state_dict_type: str) -> None:
    """SIGKILL of one rank on the writer thread, in the middle of checkpoint-4's write (module docstring)."""
    from loopkit import checkpoint
    from loopkit.checkpoint import staged_shards

    rank = int(os.environ["RANK"])
    tmp = os.path.join(out, "killed", f".tmp-checkpoint-{KILLED_AT}")

    def die_in(function, dying_rank: int, part: str):
        def wrapped(state, path, *args, **kwargs):
            if rank == dying_rank and str(path).startswith(tmp) and os.path.basename(str(path)).startswith(part):
                os.kill(os.getpid(), signal.SIGKILL)
            return function(state, path, *args, **kwargs)
        return wrapped

    if state_dict_type == "SHARDED_STATE_DICT":
        staged_shards.save_on_group = die_in(staged_shards.save_on_group, 1, "optimizer_0")
    else:
        checkpoint.save_state_file = die_in(checkpoint.save_state_file, 0, "optimizer.bin")


def check_meshes(out: str) -> None:
    """One process (a gloo group of one): a DTensor on a 1-dimensional mesh passes the check of an asynchronous
    FSDP2 save, one on a 2-dimensional mesh (HSDP's layout) is refused; writes `mesh.json` with the refusal."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from loopkit.checkpoint.staged_shards import check_one_dimensional

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    flat = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
    check_one_dimensional({"flat.weight": flat})
    hybrid = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1, 1)), [Replicate(), Shard(0)])
    try:
        check_one_dimensional({"flat.weight": flat, "hybrid.weight": hybrid})
        refusal = None
    except ValueError as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, "mesh.json"), "w") as f:
        json.dump({"refusal": refusal}, f)
    dist.destroy_process_group()


def main() -> None:
    out, mode, state_dict_type = sys.argv[1:4]
    if mode == "layout":
        run(out, "sync", state_dict_type, async_save=False)
        run(out, "async", state_dict_type, async_save=True)
        run(out, "resumed", state_dict_type, async_save=True,
            resume_from=os.path.join(out, "async", f"checkpoint-{KILLED_AT}"))
        run(out, "best_sync", state_dict_type, async_save=False, **BEST)
        run(out, "best_async", state_dict_type, async_save=True, **BEST)
    elif mode == "kill":
        install_kill(out, state_dict_type)
        run(out, "killed", state_dict_type, async_save=True)
    elif mode == "mesh":
        check_meshes(out)
    elif mode == "after-kill":
        run(out, "killed", state_dict_type, async_save=True, resume_from=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
    dist_child.leave()
