"""The script tests/test_parallelism.py launches with `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 4`: a user's
`TrainingArguments(parallelism_config=ParallelismConfig(...), fsdp=..., fsdp_config=...)` with `Trainer` swapped
for `Loop`, on the tiny Llama and ragged causal-LM data of tests/scripts/dist_child.py. The same `run_training`
runs in the pytest process for the one-process reference.

Usage (under a launcher): python parallelism_child.py OUT_DIR TP_MODEL_DIR

One launch, in this order (a process keeps Accelerate's state from one run to the next, so the runs without FSDP
come before the sharded ones):
* `trainer_hsdp`, `trainer_tp`: HF Trainer with the HSDP arguments, and with the tensor-parallel model; each writes
  `<name>_rank<r>.json` with the error it raised (Accelerate refuses a mesh on MULTI_CPU) or its losses.
* `replicate`: ParallelismConfig(dp_replicate_size=4): 4 DDP replicas.
* `tp`: the 4-head Llama in TP_MODEL_DIR loaded with `from_pretrained(..., tp_plan="auto")` (transformers' tp_plan,
  4 ways), no parallelism_config: Trainer's rule makes one (tp_size=4) from the model. Its last checkpoint is loaded
  back with `tp_plan="auto"` (rank 0 writes `tp_checkpoint.safetensors`); resuming it, and an evaluation with
  streaming metrics, are refused (`tp_checkpoint_rank<r>.json`).
* `hsdp`: ParallelismConfig(dp_replicate_size=2, dp_shard_size=2) with FSDP2: 2 replicas of a model sharded 2 ways,
  a checkpoint at SAVE_AT; `hsdp_resume` resumes it.
* `shard`: ParallelismConfig(dp_shard_size=4) with FSDP2.
Each run evaluates after training (13 samples, batch 1, compute_metrics counting the rows it gets). Each Loop run
writes `<name>_rank<r>.json` (log history, evaluation, the mesh, placements of two weights) and rank 0
`<name>.safetensors` (the whole trained model).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import dist_child  # noqa: E402

MAX_STEPS, MAX_GRAD_NORM, SAVE_AT = 6, 0.5, 3
CONFIGS = {"replicate": dict(dp_replicate_size=4), "hsdp": dict(dp_replicate_size=2, dp_shard_size=2),
           "shard": dict(dp_shard_size=4)}


def training_args(output_dir: str, per_device_batch: int, sizes: dict | None):
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    sharded = sizes is not None and sizes.get("dp_shard_size", 1) > 1
    return TrainingArguments(
        output_dir=output_dir, max_steps=MAX_STEPS, per_device_train_batch_size=per_device_batch,
        gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=2, weight_decay=0.01,
        max_grad_norm=MAX_GRAD_NORM, logging_steps=1, optim="adamw_torch", save_strategy="no", report_to="none",
        per_device_eval_batch_size=1, disable_tqdm=True, seed=7,
        parallelism_config=ParallelismConfig(**sizes) if sizes else None,
        fsdp="full_shard" if sharded else "", fsdp_config={"version": 2} if sharded else None)


def whole_weights(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone().contiguous()
            for k, v in model.state_dict().items()}


def mesh_evidence(loop) -> dict:
    from torch.distributed.tensor import DTensor

    acc = loop.accelerator
    config, mesh = acc.parallelism_config, acc.torch_device_mesh
    model = acc.unwrap_model(loop.model_wrapped)
    weight = model.get_input_embeddings().weight
    query = model.model.layers[0].self_attn.q_proj.weight
    return {"distributed_type": str(acc.distributed_type), "num_processes": acc.num_processes,
            "sizes": None if config is None else [config.dp_replicate_size, config.dp_shard_size, config.tp_size],
            "mesh_dims": None if mesh is None else list(mesh.mesh_dim_names),
            "embedding_mesh_dims": list(weight.device_mesh.mesh_dim_names) if isinstance(weight, DTensor) else None,
            "embedding_placements": [str(p) for p in weight.placements] if isinstance(weight, DTensor) else None,
            "embedding_local_rows": int(weight.to_local().shape[0]) if isinstance(weight, DTensor)
            else int(weight.shape[0]),
            "query_placements": [str(p) for p in query.placements] if isinstance(query, DTensor) else None,
            "query_local_rows": int((query.to_local() if isinstance(query, DTensor) else query).shape[0])}


def tp_llama():
    """A Llama with 4 attention heads (the tiny one has 2), so that tensor parallelism splits it 4 ways."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=dist_child.VOCAB, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=32, attention_dropout=0.0))


def rows_and_accuracy(prediction) -> dict:
    """compute_metrics: the samples it was given (each once, whatever the mesh) and next-token accuracy."""
    return {"rows": int(prediction.label_ids.shape[0]), **dist_child.token_accuracy(prediction)}


def load_llama(folder: str, tensor_parallel: bool):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, **({"tp_plan": "auto"} if tensor_parallel else {}))


def run_training(out: str, name: str, per_device_batch: int, sizes: dict | None, runner=None, model=None,
                 save_at: int | None = None, resume_from: str | None = None) -> dict:
    """Train `name` with the Loop (or `runner`), with one checkpoint at `save_at`; write the result; returns it."""
    from loopkit import Loop

    runner = runner or Loop
    trainer = runner(model=model if model is not None else dist_child.tiny_llama(),
                     args=training_args(os.path.join(out, name), per_device_batch, sizes),
                     train_dataset=dist_child.lm_samples(dist_child.TRAIN_SAMPLES, 1),
                     eval_dataset=dist_child.lm_samples(dist_child.EVAL_SAMPLES, 2), compute_metrics=rows_and_accuracy,
                     callbacks=[dist_child.SaveOnceAt(save_at)] if save_at else [])
    trainer.train(resume_from_checkpoint=resume_from)
    after = trainer.evaluate()
    rank = trainer.accelerator.process_index
    weights = whole_weights(trainer.accelerator.unwrap_model(trainer.model_wrapped))
    if rank == 0:
        save_file(weights, os.path.join(out, f"{name}.safetensors"))
    result = {"log_history": trainer.state.log_history, "global_step": trainer.state.global_step, "eval_after": after,
              **mesh_evidence(trainer)}
    with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def trainer_attempt(out: str, name: str, per_device_batch: int, sizes: dict | None, model=None) -> None:
    """HF Trainer with these arguments on these CPU processes: what it does (it raises in Accelerate)."""
    from transformers import Trainer

    rank, environment = int(os.environ["RANK"]), dict(os.environ)
    try:
        losses = run_training(out, f"{name}_run", per_device_batch, sizes, runner=Trainer,
                              model=model)["log_history"]
        error = None
    except Exception as exc:
        losses, error = None, f"{type(exc).__name__}: {exc}"
    finally:  # the FSDP flags its Accelerator exported (ACCELERATE_USE_FSDP, FSDP_*) would ask the next runs for FSDP
        os.environ.clear()
        os.environ.update(environment)
    with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump({"error": error, "log_history": losses}, f)


def tensor_parallel_checkpoint(out: str, checkpoint: str) -> None:
    """A tensor-parallel run's checkpoint: `from_pretrained(checkpoint, tp_plan="auto")` loads its weights (the
    whole model, gathered), and resuming it is refused with loopkit's error. Writes `tp_checkpoint_rank<r>.json`."""
    from loopkit import Loop
    from loopkit.metrics import TokenAccuracy

    rank = int(os.environ["RANK"])
    model = load_llama(checkpoint, tensor_parallel=True)
    loaded = whole_weights(model)
    if rank == 0:
        save_file(loaded, os.path.join(out, "tp_checkpoint.safetensors"))
    errors = {}
    for what in ("resume", "streaming_metrics"):
        try:
            loop = Loop(model=model, args=training_args(os.path.join(out, f"tp_{what}"), 4, None),
                        train_dataset=dist_child.lm_samples(dist_child.TRAIN_SAMPLES, 1),
                        eval_dataset=dist_child.lm_samples(dist_child.EVAL_SAMPLES, 2),
                        metrics=[TokenAccuracy()] if what == "streaming_metrics" else None)
            loop.train(resume_from_checkpoint=checkpoint) if what == "resume" else loop.evaluate()
            errors[what] = None
        except Exception as exc:
            errors[what] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"tp_checkpoint_rank{rank}.json"), "w") as f:
        json.dump(errors, f)


def main() -> None:
    out, tp_folder = sys.argv[1], sys.argv[2]
    trainer_attempt(out, "trainer_hsdp", 1, CONFIGS["hsdp"])
    trainer_attempt(out, "trainer_tp", 4, None, model=load_llama(tp_folder, tensor_parallel=True))
    run_training(out, "replicate", 1, CONFIGS["replicate"])
    run_training(out, "tp", 4, None, model=load_llama(tp_folder, tensor_parallel=True), save_at=MAX_STEPS)
    tensor_parallel_checkpoint(out, os.path.join(out, "tp", f"checkpoint-{MAX_STEPS}"))
    run_training(out, "hsdp", 1, CONFIGS["hsdp"], save_at=SAVE_AT)
    run_training(out, "hsdp_resume", 1, CONFIGS["hsdp"], resume_from=os.path.join(out, "hsdp", f"checkpoint-{SAVE_AT}"))
    run_training(out, "shard", 1, CONFIGS["shard"])
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    dist_child.leave()
