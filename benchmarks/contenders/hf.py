"""HF Trainer and loopkit's Loop built from a `TrainSpec`: the same arguments, one constructor call each.

Framework imports happen inside the functions, so a loopkit process never imports `transformers.trainer` and the
time-to-first-step benchmark measures each contender's real import cost.
"""

from __future__ import annotations


from ..workloads.data import collator_for
from ..workloads.spec import TrainSpec
from .clock import as_hf_callback


def trainer_arguments(spec: TrainSpec, output_dir: str, **overrides) -> dict:
    """`TrainingArguments` / `LoopArgs` fields for `spec` (identical names in both)."""
    values = dict(
        output_dir=output_dir, per_device_train_batch_size=spec.batch_size,
        gradient_accumulation_steps=spec.grad_accum, max_steps=spec.max_steps, learning_rate=spec.learning_rate,
        warmup_steps=spec.warmup_steps, weight_decay=spec.weight_decay, max_grad_norm=spec.max_grad_norm,
        logging_steps=spec.logging_steps, save_strategy="no", report_to="none", disable_tqdm=True, seed=spec.seed,
        bf16=spec.bf16, use_cpu=spec.device == "cpu",
    )
    values.update(overrides)
    return values


def build_trainer(contender: str, spec: TrainSpec, model, output_dir: str, train_dataset=None, callbacks=(),
                  args_overrides=None, **trainer_kwargs):
    """An HF `Trainer` or a loopkit `Loop` with identical arguments; `trainer_kwargs` go to the constructor."""
    arguments = trainer_arguments(spec, output_dir, **(args_overrides or {}))
    if contender == "hf":
        from transformers import Trainer, TrainingArguments

        return Trainer(model=model, args=TrainingArguments(**arguments), train_dataset=train_dataset,
                       data_collator=collator_for(spec), callbacks=[as_hf_callback(cb) for cb in callbacks],
                       **trainer_kwargs)
    if contender == "loopkit":
        from loopkit import Loop, LoopArgs

        return Loop(model=model, args=LoopArgs(**arguments), train_dataset=train_dataset,
                    data_collator=collator_for(spec), callbacks=list(callbacks), **trainer_kwargs)
    raise ValueError(f"contender={contender!r} has no trainer; choose 'hf' or 'loopkit'")
