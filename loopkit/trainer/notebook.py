"""Working in a notebook: the progress display a Jupyter kernel gets, and `Loop`'s readable `repr`.

In a Jupyter kernel `Trainer` shows `transformers.utils.notebook.NotebookProgressCallback` (an HTML table of the
training and validation losses, a bar per evaluation) instead of tqdm; `Loop` does the same, with HF's own class, so
a notebook looks as it did under `Trainer`. As under `Trainer`, that callback removes the runtime and speed entries
(`eval_runtime`, ...) from the metrics `evaluate()` returns in a notebook. The run report renders as Markdown
(`loop.report`, loopkit/report/record.py `RunReport`).
"""

from __future__ import annotations

import os
import sys

from ..batches import has_length
from ..default_callbacks import default_callback


def in_notebook() -> bool:
    """HF's `is_in_notebook` rule (transformers.utils.import_utils), without importing transformers: a marimo
    notebook, or an IPython shell started by a kernel app (not the terminal IPython; not Databricks before 11)."""
    if "marimo" in sys.modules:
        return True
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    if shell is None or "IPKernelApp" not in getattr(shell, "config", {}):
        return False
    databricks = os.environ.get("DATABRICKS_RUNTIME_VERSION")
    return not (databricks and databricks < "11.0")


def default_progress_callback(args, quiet: bool = False):
    """HF's choice for the last default callback: the printer with `disable_tqdm`, the notebook display in a notebook
    (HF's class), else tqdm bars (HF's classes, or loopkit's stand-ins for them: loopkit/default_callbacks.py).
    None for a `quiet` run (`log_level` above WARNING: loopkit/trainer/log_messages.py `quiet`)."""
    if quiet:
        return None
    if args.disable_tqdm:
        return default_callback("PrinterCallback")
    if in_notebook():
        from transformers.utils.notebook import NotebookProgressCallback

        return NotebookProgressCallback()
    return default_callback("ProgressCallback")


# -- repr ---------------------------------------------------------------------------------------------------------
KEY_ARGS = ("output_dir", "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
            "lr_scheduler_type", "optim", "eval_strategy", "save_strategy", "metric_for_best_model", "seed")


def count_text(n: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def dataset_text(dataset) -> str:
    if dataset is None:
        return "None"
    if isinstance(dataset, dict):
        return "{" + ", ".join(f"{k!r}: {dataset_text(v)}" for k, v in dataset.items()) + "}"
    return f"{type(dataset).__name__}({len(dataset)} rows)" if has_length(dataset) else type(dataset).__name__


def args_text(args) -> str:
    values = {name: getattr(getattr(args, name, None), "value", getattr(args, name, None)) for name in KEY_ARGS}
    values["max_steps" if args.max_steps > 0 else "num_train_epochs"] = (
        args.max_steps if args.max_steps > 0 else args.num_train_epochs)
    if args.bf16 or args.fp16:
        values["mixed_precision"] = "bf16" if args.bf16 else "fp16"
    return ", ".join(f"{k}={v!r}" for k, v in values.items() if v is not None)


def model_text(run, context) -> str:
    model = run.model
    if model is None:
        return "None"
    params = list(model.parameters())
    total, trainable = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    device = params[0].device if params else context.accelerator.device
    return f"{type(model).__name__} ({count_text(total)} parameters, {count_text(trainable)} trainable, on {device})"


def loop_repr(loop) -> str:
    """What a `Loop` is at a glance: its model, stages, key arguments, data, callbacks and progress."""
    run = loop.run
    stages = ", ".join(f"{name}={type(stage).__name__}" for name, stage in
                       zip(("setup", "data", "step", "evaluation", "teardown"), loop.stages))
    state, events = run.state, loop.context.events  # None while a failing construction is under way
    progress = "not started" if state is None else \
        f"global_step={state.global_step}" + (f"/{state.max_steps}" if state.max_steps else "")
    collator = run.data_collator
    collator = "default" if collator is None else getattr(collator, "__name__", type(collator).__name__)
    callbacks = "not built" if events is None else ", ".join(events.callback_list.splitlines())
    return "\n".join([
        f"{type(loop).__name__}(",
        f"  model: {model_text(run, loop.context)}",
        f"  stages: {stages}",
        f"  args ({type(run.args).__name__}): {args_text(run.args)}",
        f"  data: train_dataset={dataset_text(run.train_dataset)}, eval_dataset={dataset_text(run.eval_dataset)}, "
        f"data_collator={collator}",
        f"  callbacks: {callbacks}",
        f"  state: {progress}",
        ")",
    ])
