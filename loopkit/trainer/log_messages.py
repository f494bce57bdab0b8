"""HF Trainer's own logging: the verbosity it sets at construction, and its messages, word for word, at its levels,
under its logger (`transformers.trainer`), so a user's log handler and `--log_level info` show what they show under
`Trainer`.

Each message is one function here; the stages and the `Loop` call them where Trainer logs, in a line or two.
Like Trainer, every process logs; the verbosity set at construction decides what a process shows
(`log_level` on the process that logs, `log_level_replica` elsewhere, `log_on_each_node` choosing which processes
log: `start`). Nothing here is on the per-step path.

The same field keeps a run quiet (`quiet`): asked above WARNING (`log_level="error"`), `train()` shows no progress
display and prints no run summary.

Not one of these messages carries an argument's value other than the sizes, paths and scores named in it, so no
secret (`hub_token`) reaches a log.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers.utils import logging as hf_logging

from ..distributed import unwrap_model

logger = hf_logging.get_logger("transformers.trainer")


# -- construction ---------------------------------------------------------------------------------------------------
def process_log_level(args, accelerator) -> int:
    """`TrainingArguments.get_process_log_level`: `log_level` on a process that logs (the main process of each node
    with `log_on_each_node`, else of process 0), `log_level_replica` on the others; "passive" keeps the current
    verbosity. `LoopArgs` has no such fields: Trainer's defaults ("passive", "warning", True)."""
    level = asked_log_level(args, accelerator)
    return hf_logging.get_verbosity() if level == -1 else level


def asked_log_level(args, accelerator) -> int:
    """The level the arguments ask of this process (`process_log_level`), -1 for "passive"."""
    levels = {**hf_logging.get_log_levels_dict(), "passive": -1}
    logs_here = (accelerator.local_process_index == 0 if getattr(args, "log_on_each_node", True)
                 else accelerator.process_index == 0)
    main, replica = getattr(args, "log_level", "passive"), getattr(args, "log_level_replica", "warning")
    return levels[main if logs_here else replica]


def quiet(args, accelerator) -> bool:
    """Whether the arguments ask this process for a log level above WARNING (`log_level="error"` or "critical"):
    then `train()` prints nothing of its own, neither the progress display (tqdm bars, the notebook table, the
    printed logs of `disable_tqdm=True`) nor the run summary; the logs still reach `report_to`, `state.log_history`
    and the run report's files. Asked, not inherited: "passive" (the default) prints as before whatever
    transformers' verbosity is, as Trainer prints its bars or logs then. (`disable_tqdm=True` alone prints each log
    as a line instead of bars, as under Trainer.)"""
    return asked_log_level(args, accelerator) > hf_logging.WARNING


def start(args, accelerator, args_given: bool, train_dataset) -> None:
    """What `Trainer.__init__` does for logging: transformers' verbosity for this process (`process_log_level`),
    then its notes about the arguments."""
    hf_logging.set_verbosity(process_log_level(args, accelerator))
    if not args_given:
        logger.info(f"No `TrainingArguments` passed, using `output_dir={args.output_dir}`.")
    if args.max_steps > 0 and args.num_train_epochs > 0:
        logger.info("max_steps is given, it will override any value given in num_train_epochs")
    if isinstance(train_dataset, torch.utils.data.IterableDataset):
        logger.info(f"The `train_sampling_strategy='{args.train_sampling_strategy}'` option is ignored when using "
                    "an `IterableDataset`. Samplers cannot be used with IterableDataset as they require indexed "
                    "access to the dataset.")


# -- training ---------------------------------------------------------------------------------------------------------
def log_loading_checkpoint(checkpoint) -> None:
    if checkpoint is not None:
        logger.info(f"Loading model from {checkpoint}.")


def log_training_start(args, plan, train_batch_size: int, model, resume, global_step: int) -> None:
    """The "***** Running training *****" block; `resume` is the `ResumePoint` of a resumed run (the position
    loopkit resumes from, which is HF's wherever HF resumes exactly), else None."""
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {plan.num_examples:,}")
    logger.info(f"  Num Epochs = {plan.num_train_epochs:,}")
    logger.info(f"  Num update steps per epoch = {plan.num_update_steps_per_epoch:,}")
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
    if args.per_device_train_batch_size != train_batch_size:
        logger.info(f"  Training with DataParallel so batch size has been adjusted to: {train_batch_size:,}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {plan.total_train_batch_size:,}")
    logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
    logger.info(f"  Total optimization steps = {plan.max_steps:,}")
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    logger.info(f"  Number of trainable parameters = {trainable:,}")
    if resume is not None:
        logger.info(f"  Resuming training from checkpoint with epoch {resume.epochs_trained} and global step "
                    f"{global_step}")
        if not args.ignore_data_skip:
            logger.info(f"  Fast-forwarding the dataloader past {resume.epochs_trained} epochs and"
                        f" {resume.micro_batches_to_skip} batches to resume from the exact training state.")


def log_training_completed() -> None:
    logger.info("\n\nTraining completed. Do not forget to share your model on huggingface.co/models =)\n\n")


def log_loading_best_model(state) -> None:
    logger.info(f"Loading best model from {state.best_model_checkpoint} (score: {state.best_metric}).")


def log_deleted_checkpoints(before: list, after: list) -> None:
    """The checkpoints the `save_total_limit == 1` clean-up at the end of training deleted."""
    for checkpoint in before:
        if checkpoint not in after:
            logger.info(f"Deleting older checkpoint [{checkpoint}] due to args.save_total_limit")


# -- saving -----------------------------------------------------------------------------------------------------------
def log_model_save(run, context, output_dir=None, checkpoint: str | None = None) -> None:
    """`Trainer._save`, on the process that writes: the checkpoint named `checkpoint` (its final folder in
    `args.output_dir`, not the hidden one it is written into), or `save_model(output_dir)`."""
    if not context.checkpointer.writes_files:
        return
    if checkpoint:
        output_dir = os.path.join(run.args.output_dir, checkpoint)
    logger.info(f"Saving model checkpoint to {output_dir or run.args.output_dir}")
    model = unwrap_model(context.accelerator, run.model_wrapped if run.model_wrapped is not None else run.model)
    # A transformers model exists only once its module is imported; importing it for a plain module would import
    # transformers' quantizers (and torchao, noisily) for nothing.
    modeling = sys.modules.get("transformers.modeling_utils")
    if (modeling is None or not isinstance(model, modeling.PreTrainedModel)) \
            and not type(model).__module__.startswith("peft."):
        logger.info("Trainer.model is not a `PreTrainedModel`, only saving its state dict.")


# -- evaluation -------------------------------------------------------------------------------------------------------
def num_examples(dataloader, args) -> int:
    """Samples in the loader's dataset, else an estimate from its length (HF's `Trainer.num_examples`)."""
    try:
        dataset = dataloader.dataset
        if type(dataset).__name__ == "IterableDatasetShard":  # HF's shard wraps the real dataset
            return len(dataset.dataset)
        return len(dataset)
    except (NameError, AttributeError, TypeError):
        return len(dataloader) * args.per_device_train_batch_size


def log_evaluation_start(description: str, dataloader, args) -> None:
    """The "***** Running Evaluation *****" (or Prediction) block of `evaluation_loop`."""
    from ..batches import has_length

    logger.info(f"\n***** Running {description} *****")
    if has_length(dataloader):
        logger.info(f"  Num examples = {num_examples(dataloader, args)}")
    else:
        logger.info("  Num examples: Unknown")
    logger.info(f"  Batch size = {args.eval_batch_size}")

