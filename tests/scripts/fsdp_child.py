"""The sharded (FSDP2) training script that tests/test_fsdp.py launches with `ACCELERATE_USE_CPU=1 torchrun`: the
scenarios of tests/scripts/dist_child.py (same tiny Llama, same ragged causal-LM data) with an FSDP2 plugin, run by
Accelerate on gloo processes. The same functions run unsharded in the pytest process for the references.

Usage (under a launcher): python fsdp_child.py OUT_DIR MODE [ARG]

* all: `sharded` (gradient accumulation 2, clipping, a sharded checkpoint at SAVE_AT, `save_model`, evaluation),
  `resume` (from that checkpoint), `from_whole` (from ARG, an ordinary 1-process checkpoint) and `best`
  (load_best_model_at_end from sharded checkpoints); each writes
  `<name>_rank<r>.json` and rank 0 the gathered weights `<name>.safetensors`.
* memory: one optimizer step of a ~33 M-parameter Llama; writes `memory_rank<r>.json` (bytes of the local shards).
* memory+ram_efficient: first `ram_efficient` (`sharded` with cpu_ram_efficient_loading, rank 1 starting from
  other weights), then memory. (A process keeps the FSDP plugin of its first Accelerator, hence its own launch.)
* kill: saves every 2 steps; rank 1 SIGKILLs itself while writing the optimizer shards of checkpoint-4.
* planted MARKER: `sharded`, then two copies of its checkpoint, one with a malicious `.metadata` in
  `pytorch_model_fsdp_0/`, one in `optimizer_0/` (`plant_payload`: unpickling it creates the file MARKER), each
  resumed; writes `planted_<folder>_rank<r>.json` with the error the resume raised (null if it resumed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import dist_child  # noqa: E402  (the scenarios and data shared with the DDP tests)

from loopkit import Loop, LoopArgs  # noqa: E402
from loopkit.memory import ShardBytes  # noqa: E402
from loopkit.stages.setup import SetupStage  # noqa: E402

SAVE_AT, MAX_STEPS = dist_child.SAVE_AT, dist_child.MAX_STEPS
# Evaluated and saved every 2 steps, the best of 4 checkpoints loaded at the end (a larger learning rate makes the
# evaluation loss rise again, so the best is not the last).
BEST = dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
            metric_for_best_model="eval_loss", learning_rate=3e-2)
MAX_GRAD_NORM = 0.5  # below the norms of this run (1.3-3.4): every step clips


def sharding_plugin(cpu_ram_efficient_loading: bool = False):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                          reshard_after_forward=True,
                                          cpu_ram_efficient_loading=cpu_ram_efficient_loading)


def build_loop(output_dir: str, per_device_batch: int, *, sharded: bool, save_steps: int | None = None,
               callbacks=(), model=None, plugin=None, **overrides) -> Loop:
    from loopkit.metrics import Perplexity, TokenAccuracy

    settings = dict(max_steps=MAX_STEPS, per_device_train_batch_size=per_device_batch, gradient_accumulation_steps=2,
                    per_device_eval_batch_size=3, learning_rate=3e-3, warmup_steps=2, weight_decay=0.01,
                    max_grad_norm=MAX_GRAD_NORM, logging_steps=1, optim="adamw_torch", disable_tqdm=True, seed=7,
                    save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
    args = LoopArgs(output_dir=output_dir, **{**settings, **overrides})
    setup = SetupStage(fsdp_plugin=plugin or sharding_plugin()) if sharded else SetupStage()
    return Loop(model=model or dist_child.tiny_llama(), args=args, train_dataset=dist_child.lm_samples(24, 1),
                eval_dataset=dist_child.lm_samples(dist_child.EVAL_SAMPLES, 2),
                compute_metrics=dist_child.token_accuracy, metrics=[TokenAccuracy(), Perplexity()],
                callbacks=list(callbacks), setup=setup)


def full_weights(loop: Loop) -> dict:
    """The whole model on every rank (a collective under FSDP), detached CPU copies."""
    model = loop.accelerator.unwrap_model(loop.model_wrapped)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone().contiguous()
            for k, v in model.state_dict().items()}


def engine_evidence(loop: Loop) -> dict:
    from torch.distributed.tensor import DTensor

    acc, model = loop.accelerator, loop.accelerator.unwrap_model(loop.model_wrapped)
    params = list(model.parameters())
    return {"distributed_type": str(acc.distributed_type), "is_fsdp2": bool(acc.is_fsdp2),
            "dtensor_params": sum(isinstance(p, DTensor) for p in params), "params": len(params),
            "model_class": type(model).__name__,
            "local_rows_of_embedding": int(model.get_input_embeddings().weight.to_local().shape[0])
            if isinstance(model.get_input_embeddings().weight, DTensor) else None}


def run_training(out: str, name: str, per_device_batch: int, *, sharded: bool, save_at: int | None = None,
                 resume_from=None, save_model: bool = False, model=None, plugin=None, **overrides) -> Loop:
    callbacks = [dist_child.SaveOnceAt(save_at)] if save_at else []
    loop = build_loop(os.path.join(out, name), per_device_batch, sharded=sharded, callbacks=callbacks, model=model,
                      plugin=plugin, **overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.train(resume_from_checkpoint=resume_from)
    after = loop.evaluate()
    if save_model:
        loop.save_model(os.path.join(out, name, "final"))
    weights = full_weights(loop)
    rank = loop.accelerator.process_index
    if rank == 0:
        save_file(weights, os.path.join(out, f"{name}.safetensors"))
    result = {"num_processes": loop.accelerator.num_processes, "global_step": loop.state.global_step,
              "best_model_checkpoint": loop.state.best_model_checkpoint,
              "log_history": loop.state.log_history, "eval_after": after, **engine_evidence(loop),
              "warnings": [str(w.message) for w in caught]}
    with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return loop


def memory_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64))


def measure_memory(out: str) -> None:
    """One optimizer step of a ~33 M-parameter model; the bytes this rank holds in parameters, gradients and AdamW
    state (local shards of the DTensors, not process RSS). Gradients are counted before the step zeroes them."""
    shards = ShardBytes()
    model = memory_llama()
    args = LoopArgs(output_dir=os.path.join(out, "memory"), max_steps=1, per_device_train_batch_size=1,
                    save_strategy="no", optim="adamw_torch", disable_tqdm=True, report_to="none")
    samples = [{"input_ids": torch.arange(16) % 97, "labels": torch.arange(16) % 97}] * 8
    loop = Loop(model=model, args=args, train_dataset=samples, callbacks=[shards],
                setup=SetupStage(fsdp_plugin=sharding_plugin(cpu_ram_efficient_loading=True)))
    loop.train()
    counts = dict(shards.bytes)
    counts.update(total=sum(counts.values()), num_processes=loop.accelerator.num_processes,
                  model_parameters=sum(p.numel() for p in memory_llama().parameters()), **engine_evidence(loop))
    with open(os.path.join(out, f"memory_rank{loop.accelerator.process_index}.json"), "w") as f:
        json.dump(counts, f, indent=1)


def run_ram_efficient(out: str) -> None:
    """`sharded` with cpu_ram_efficient_loading, rank 1 starting from other weights: only rank 0's may count."""
    model = dist_child.tiny_llama()
    if int(os.environ["RANK"]) != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    run_training(out, "ram_efficient", 1, sharded=True, model=model,
                 plugin=sharding_plugin(cpu_ram_efficient_loading=True))


def kill_during_save(out: str) -> None:
    """Checkpoints at steps 2 and 4; rank 1 dies by SIGKILL in the middle of checkpoint-4's optimizer shards."""
    import torch.distributed.checkpoint as dcp

    save = dcp.save

    def dying_save(state_dict, *args, **kwargs):
        if "optimizer" in state_dict and os.path.isdir(os.path.join(out, "kill", ".tmp-checkpoint-4")) \
                and int(os.environ["RANK"]) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return save(state_dict, *args, **kwargs)

    dcp.save = dying_save  # accelerate's save_fsdp_optimizer calls dist_cp.save from this module
    build_loop(os.path.join(out, "kill"), 1, sharded=True, save_steps=2).train()


class Payload:
    """Unpickling it runs a shell command (pickle calls `os.system(command)`): what a planted file would do."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def plant_payload(metadata_path: str, marker: str) -> None:
    """Rewrite a real DCP `.metadata` with a payload inside (its `save_id`) that creates `marker` when unpickled.
    The rest stays valid, so a reader that unpickles it runs the payload and loads the checkpoint as if untouched."""
    import pickle

    with open(metadata_path, "rb") as f:
        metadata = pickle.load(f)  # written by this test's own run
    metadata.storage_meta.save_id = Payload(f"touch {marker}")
    with open(metadata_path, "wb") as f:
        pickle.dump(metadata, f)


def resume_planted(out: str, marker: str) -> None:
    import shutil

    import torch.distributed as dist

    from loopkit.checkpoint.engines import FSDP_MODEL_FOLDER, FSDP_OPTIMIZER_FOLDER

    run_training(out, "sharded", 1, sharded=True, save_at=SAVE_AT)
    rank = int(os.environ["RANK"])
    for folder in (FSDP_MODEL_FOLDER, FSDP_OPTIMIZER_FOLDER):
        planted = os.path.join(out, "planted", folder, f"checkpoint-{SAVE_AT}")
        if rank == 0:
            shutil.copytree(os.path.join(out, "sharded", f"checkpoint-{SAVE_AT}"), planted)
            plant_payload(os.path.join(planted, folder, ".metadata"), marker)
        dist.barrier()
        try:
            run_training(out, f"resumed_{folder}", 1, sharded=True, resume_from=planted)
            error = None
        except Exception as exc:  # the refusal, expected on every rank
            error = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(out, f"planted_{folder}_rank{rank}.json"), "w") as f:
            json.dump({"error": error}, f)


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "memory+ram_efficient":  # the plugin of a process's first Accelerator holds for all its runs
        run_ram_efficient(out)
        measure_memory(out)
    elif mode == "memory":
        measure_memory(out)
    elif mode == "kill":
        kill_during_save(out)
    elif mode == "planted":
        resume_planted(out, sys.argv[3])
    else:
        run_training(out, "sharded", 1, sharded=True, save_at=SAVE_AT, save_model=True)
        run_training(out, "resume", 1, sharded=True, resume_from=os.path.join(out, "sharded", f"checkpoint-{SAVE_AT}"))
        run_training(out, "from_whole", 1, sharded=True, resume_from=sys.argv[3])
        run_training(out, "best", 1, sharded=True, **BEST)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    dist_child.leave()
