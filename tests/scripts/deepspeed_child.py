"""The DeepSpeed script that tests/test_deepspeed.py launches with `torchrun --nproc_per_node 2` on CPU processes:
HF Trainer and loopkit's Loop, each run live on the real DeepSpeed engine (ZeRO-2 or ZeRO-3), in the same processes,
with the same tiny Llama and ragged causal-LM data as tests/scripts/dist_child.py.

Usage (under a launcher, with DS_ACCELERATOR=cpu): python deepspeed_child.py OUT_DIR CONFIG
CONFIG: zero2, zero3 (DeepSpeed's defaults: no 16-bit weights gathered at save) or zero3_gather
(`stage3_gather_16bit_weights_on_model_save: true`).

Runs, one after the other, each writing `<name>_rank<r>.json` (log history, evaluation, the files of its checkpoint
and of `save_model()`, the engine's configuration) and rank 0 `<name>.safetensors` (the final weights, gathered):
* trainer, loop: 6 optimizer steps of 2 processes x 2 samples x 2 accumulated micro-batches, clipping at 0.5 (every
  step clips), a checkpoint at step 4 (`save_steps=4`), an evaluation, then the user's `save_model(<name>/saved)`;
  where that holds no model file (ZeRO-3's default), rank 0 recovers the weights from the engine's files with
  DeepSpeed's zero_to_fp32 into `<name>_recovered.safetensors`.
* loop_from_loop, loop_from_trainer, trainer_from_loop, trainer_from_trainer: resumed from those checkpoint-4s.
* trainer_best, loop_best: evaluated and saved every 2 steps, `load_best_model_at_end` (through the engine).
* zero2 only: Loop resuming its checkpoint-4 less the engine's folder (refused: `stripped_rank<r>.json`);
  trainer_launcher, loop_launcher (no `deepspeed=` argument: the engine asked by the environment
  `accelerate launch --use_deepspeed --zero_stage 2` exports) and loop_plugin (`LoopArgs` and a `DeepSpeedPlugin`
  passed to the setup stage), each as `trainer` otherwise.

How each gets its processes: Accelerate hands DeepSpeed no backend on a machine without GPUs. Loop chooses gloo
itself (loopkit.distributed.deepspeed_on_cpu_processes); a Trainer user configures Accelerate's process state with
gloo and passes `accelerator_config={"use_configured_state": True}` (`trainer_process_state`).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))
import dist_child  # noqa: E402  (the model and data shared with the DDP tests)

MAX_STEPS, SAVE_AT, MAX_GRAD_NORM = 6, 4, 0.5
# Evaluated and saved every 2 steps, the best checkpoint loaded at the end (a larger learning rate makes the
# evaluation loss rise again, so the best is not the last).
BEST = dict(eval_strategy="steps", eval_steps=2, save_steps=2, load_best_model_at_end=True,
            metric_for_best_model="eval_loss", learning_rate=3e-2)
RESUMES = {"loop_from_loop": ("loop", "loop"), "loop_from_trainer": ("loop", "trainer"),
           "trainer_from_loop": ("trainer", "loop"), "trainer_from_trainer": ("trainer", "trainer")}


def deepspeed_config(config: str) -> dict:
    """A user's DeepSpeed config with HF's "auto" values (filled from the training arguments)."""
    zero = {"stage": 2 if config == "zero2" else 3}
    if config == "zero3_gather":
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_optimization": zero}


def trainer_process_state() -> None:
    """HF Trainer on CPU processes: Accelerate's process state set up with gloo for DeepSpeed, before the
    `TrainingArguments` that use it (`use_configured_state`). The state of an earlier run's Accelerator is dropped
    (a new one may not be handed a DeepSpeed plugin otherwise), as a new process would start."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=False)
    if PartialState._shared_state.get("backend") != "gloo":
        PartialState._reset_state()
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")


def training_args(who: str, output_dir: str, config: str, **overrides):
    from transformers import TrainingArguments

    extra = {"accelerator_config": {"use_configured_state": True}} if who == "trainer" else {}
    settings = dict(
        output_dir=output_dir, max_steps=MAX_STEPS, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        per_device_eval_batch_size=3, learning_rate=3e-3, warmup_steps=2, weight_decay=0.01,
        max_grad_norm=MAX_GRAD_NORM, logging_steps=1, save_strategy="steps", save_steps=SAVE_AT, optim="adamw_torch",
        disable_tqdm=True, seed=7, report_to="none", deepspeed=deepspeed_config(config), **extra)
    return TrainingArguments(**{**settings, **overrides})


def build(who: str, output_dir: str, config: str, **overrides):
    data = dict(train_dataset=dist_child.lm_samples(dist_child.TRAIN_SAMPLES, 1),
                eval_dataset=dist_child.lm_samples(dist_child.EVAL_SAMPLES, 2))
    if who == "loop_plugin":
        return loop_with_plugin(output_dir, data)
    if who == "trainer":
        from transformers import Trainer as cls

        trainer_process_state()
    else:
        from loopkit import Loop as cls
    return cls(model=dist_child.tiny_llama(), args=training_args(who, output_dir, config, **overrides), **data)


def loop_with_plugin(output_dir: str, data: dict):
    """LoopArgs with the same settings, and Accelerate's `DeepSpeedPlugin(zero_stage=2)` (its "auto" values filled
    from the arguments). The earlier runs' Accelerate state is dropped, as a new process would start."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    from loopkit import Loop, LoopArgs
    from loopkit.stages.setup import SetupStage

    AcceleratorState._reset_state(reset_partial_state=False)
    settings = training_args("loop", output_dir, "zero2").to_dict()
    args = LoopArgs(**{name: settings[name] for name in (
        "output_dir", "max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
        "per_device_eval_batch_size", "learning_rate", "warmup_steps", "weight_decay", "max_grad_norm",
        "logging_steps", "save_strategy", "save_steps", "optim", "disable_tqdm", "seed")})
    return Loop(model=dist_child.tiny_llama(), args=args, setup=SetupStage(deepspeed_plugin=DeepSpeedPlugin(
        zero_stage=2)), **data)


def full_weights(trainer) -> dict:
    """The whole model, on every rank (ZeRO-3: gathered from the partitions, a collective)."""
    import deepspeed

    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}


def weights_from_engine_checkpoint(folder: str) -> dict:
    """DeepSpeed's own recovery of the whole fp32 model from the ZeRO-3 partitions in `folder` (zero_to_fp32), with
    every torch.load it makes held to weights_only=True (loopkit's reader of DeepSpeed checkpoints)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from loopkit.checkpoint.engines import deepspeed_state_classes, weights_only_loads

    with weights_only_loads(deepspeed_state_classes()):
        state = get_fp32_state_dict_from_zero_checkpoint(folder)
    return {k: v.contiguous() for k, v in state.items()}


def files_under(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names)


def run(out: str, name: str, who: str, config: str, resume_from: str | None = None, **overrides) -> None:
    output_dir = os.path.join(out, name)
    trainer = build(who, output_dir, config, **overrides)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume_from)
    evaluation = trainer.evaluate()
    saved = os.path.join(output_dir, "saved")
    trainer.save_model(saved)
    weights = full_weights(trainer)
    acc, rank = trainer.accelerator, trainer.accelerator.process_index
    acc.wait_for_everyone()
    engine = trainer.model_wrapped
    result = {"who": who, "distributed_type": str(acc.distributed_type), "num_processes": acc.num_processes,
              "zero_stage": engine.zero_optimization_stage(), "engine_config": engine.config,
              "global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
              "best_model_checkpoint": trainer.state.best_model_checkpoint,
              "evaluation": evaluation, "checkpoint_files": files_under(os.path.join(output_dir,
                                                                                  f"checkpoint-{SAVE_AT}")),
              "saved_files": files_under(saved), "warnings": [str(w.message) for w in caught]}
    if rank == 0:
        save_file(weights, os.path.join(out, f"{name}.safetensors"))
        if not os.path.isfile(os.path.join(saved, "model.safetensors")):  # ZeRO-3's default: the engine's files
            save_file(weights_from_engine_checkpoint(saved), os.path.join(out, f"{name}_recovered.safetensors"))
    with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    acc.wait_for_everyone()


def resume_without_engine_state(out: str, config: str) -> None:
    """Loop's checkpoint-4 less the engine's folder (`global_step4/`, `latest`), resumed: refused on every rank before
    anything loads; writes `stripped_rank<r>.json` with the error."""
    import shutil

    import torch.distributed as dist

    stripped = os.path.join(out, "stripped", f"checkpoint-{SAVE_AT}")
    rank = int(os.environ["RANK"])
    if rank == 0:
        shutil.copytree(os.path.join(out, "loop", f"checkpoint-{SAVE_AT}"), stripped)
        shutil.rmtree(os.path.join(stripped, f"global_step{SAVE_AT}"))
        os.remove(os.path.join(stripped, "latest"))
    dist.barrier()
    loop = build("loop", os.path.join(out, "stripped_run"), config)
    try:
        loop.train(resume_from_checkpoint=stripped)
        error = None
    except ValueError as exc:
        error = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"stripped_rank{rank}.json"), "w") as f:
        json.dump({"error": error, "global_step": loop.state.global_step}, f)


def main() -> None:
    out, config = sys.argv[1], sys.argv[2]
    run(out, "trainer", "trainer", config)
    run(out, "loop", "loop", config)
    for name, (who, source) in RESUMES.items():
        run(out, name, who, config, resume_from=os.path.join(out, source, f"checkpoint-{SAVE_AT}"))
    for who in ("trainer", "loop"):
        run(out, f"{who}_best", who, config, **BEST)
    if config == "zero2":
        resume_without_engine_state(out, config)
    if config == "zero2":  # the engine configured by the launcher, and by a plugin object with LoopArgs
        os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="2")  # accelerate launch's
        for who in ("trainer", "loop"):
            run(out, f"{who}_launcher", who, config, deepspeed=None)
        run(out, "loop_plugin", "loop_plugin", config)


if __name__ == "__main__":
    main()
    dist_child.leave()
