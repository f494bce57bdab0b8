"""`TrainerAPI`: the rest of `transformers.Trainer` 5.x's public methods and attributes, as a mixin `Loop` inherits.

Everything here reads the run through `Loop`'s public attributes (`args`, `model`, `optimizer`, `state`,
`accelerator`, `callback_handler`, the stages, ...). The Hub methods are thin calls into loopkit/trainer/hub.py and
`hyperparameter_search` into loopkit/trainer/search.py. Small pieces of `transformers.trainer_pt_utils` and
`transformers.trainer_utils` are copied (each says so): those are `transformers.trainer*` modules, which
`import loopkit` must not load.

HF's overridable hooks, and where loopkit calls them:
* called where Trainer calls them: `create_accelerator_and_postprocess` (construction) by the `Loop`, which hands
  the setup stage's accelerator to the run context; by the stage that owns them (loopkit/trainer/overridable.py):
  `call_model_init` (construction and each `train()`) by the setup stage;
  `autocast_smart_context_manager` (inside `compute_loss_context_manager`, around every forward) and
  `get_optimizer_cls_and_kwargs` (in `create_optimizer`) by the step stage.
* not called by loopkit, so overriding them would change nothing: `get_batch_samples` and
  `set_initial_training_values`. They work when called, and a subclass that overrides one is refused at class
  creation with the stage method to override instead (`HOOKS_TO_OVERRIDE_ELSEWHERE`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any

from .log_messages import log_model_save

# Trainer hooks loopkit does not call, and what a subclass overrides instead.
HOOKS_TO_OVERRIDE_ELSEWHERE = {
    "get_batch_samples": "DataStage.windows (which micro-batches form an optimizer step; pass data=YourDataStage()) "
                         "and Loop.count_loss_items(batches) (num_items_in_batch)",
    "set_initial_training_values": "DataStage.plan(dataloader) (the epoch and step arithmetic; pass "
                                   "data=YourDataStage())",
}

def secs_to_timedelta(secs: float) -> str:
    """hh:mm:ss.msec (copied from `transformers.trainer_pt_utils._secs2timedelta`)."""
    msec = int(abs(secs - int(secs)) * 100)
    return f"{datetime.timedelta(seconds=int(secs))}.{msec:02d}"


def metrics_format(metrics: dict[str, float]) -> dict[str, float]:
    """Human-readable metric values (copied from `transformers.trainer_pt_utils.metrics_format`)."""
    formatted = metrics.copy()
    for key, value in formatted.items():
        if "_mem_" in key:
            formatted[key] = f"{value >> 20}MB"
        elif "_runtime" in key:
            formatted[key] = secs_to_timedelta(value)
        elif key == "total_flos":
            formatted[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            formatted[key] = round(value, 4)
    return formatted


class TrainerAPI:
    """HF Trainer's public methods and attributes that are not part of a run's stages."""

    # Instance attributes of a constructed Trainer that loopkit sets only when they change.
    hp_name = None  # set by hyperparameter_search
    hp_search_backend = None  # "optuna" during hyperparameter_search
    hp_space = compute_objective = objective = None  # set by hyperparameter_search

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for hook, instead in HOOKS_TO_OVERRIDE_ELSEWHERE.items():
            if getattr(cls, hook) is not getattr(TrainerAPI, hook):
                raise TypeError(f"{cls.__name__} overrides Trainer.{hook}, which loopkit's run does not call, so the "
                                f"override would change nothing. Override {instead} instead.")

    # -- callbacks and processes ---------------------------------------------------------------------------------
    def add_callback(self, callback):
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback):
        self.callback_handler.remove_callback(callback)

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def __repr__(self) -> str:
        """The model, stages, key arguments, data, callbacks and progress (loopkit/trainer/notebook.py)."""
        if "run" not in vars(self):  # a Loop whose construction failed
            return object.__repr__(self)
        from .notebook import loop_repr

        return loop_repr(self)

    @property
    def report(self):
        """loopkit addition: the latest run report (`RunReport`, a dict that renders as Markdown in a notebook),
        None before the first `train()` ends and on processes other than the main one."""
        return getattr(self.teardown, "last_report", None)

    def show_wiring(self, file=None) -> None:
        """loopkit addition: print, for each event in firing order, the stage methods and callbacks that run, the
        step observers, and where each of HF's overridable methods runs (`wiring_text` returns it:
        loopkit/trainer/wiring_text.py)."""
        from .wiring_text import wiring_text

        print(wiring_text(self), file=file)

    # -- attributes derived from the run --------------------------------------------------------------------------
    @property
    def is_deepspeed_enabled(self) -> bool:
        return getattr(self.accelerator.state, "deepspeed_plugin", None) is not None

    @property
    def is_fsdp_enabled(self) -> bool:
        return getattr(self.accelerator.state, "fsdp_plugin", None) is not None

    @property
    def deepspeed(self):
        """HF: the DeepSpeed engine once `train()` has prepared it, else None."""
        prepared = self.is_deepspeed_enabled and self.model_wrapped is not self.model
        return self.model_wrapped if prepared else None

    @property
    def is_fsdp_xla_enabled(self):
        fsdp_config = getattr(self.args, "fsdp_config", None) or {}
        return getattr(self.args, "fsdp", None) and fsdp_config.get("xla", False)

    # loopkit does not run on XLA: None when FSDP is off, as on a Trainer outside XLA.
    is_fsdp_xla_v1_enabled = is_fsdp_xla_v2_enabled = is_fsdp_xla_enabled

    @property
    def is_model_parallel(self) -> bool:
        """HF's rule: the model was split over several devices by `device_map`."""
        device_map = getattr(self.model, "hf_device_map", None)
        if device_map is None:
            return False
        devices = {device for device in device_map.values() if device not in ("cpu", "disk")}
        if len(devices) > 1:
            return True
        import torch

        return len(devices) == 1 and self.accelerator.device != torch.device(next(iter(devices)))

    @property
    def is_distributed_loading_by_transformers(self) -> bool:
        return getattr(self.model, "is_distributed_loading_by_transformers", False)

    @property
    def place_model_on_device(self) -> bool:
        """Whether the loop moves the model to the device itself (not for a split model, DeepSpeed or FSDP)."""
        return not (self.is_model_parallel or self.is_deepspeed_enabled or self.is_fsdp_enabled
                    or self.is_distributed_loading_by_transformers or getattr(self.model, "hf_device_map", None))

    @property
    def can_return_loss(self) -> bool:
        from transformers.utils.generic import can_return_loss

        from ..models import base_model

        return can_return_loss(type(base_model(self.model)))

    @property
    def neftune_noise_alpha(self):
        return getattr(self.args, "neftune_noise_alpha", None)

    # -- optimizer, scheduler and parameters ----------------------------------------------------------------------
    def store_flos(self) -> None:
        """Move this process's FLOP count into `state.total_flos` (the schedule does it at every log and save)."""
        self.schedule.store_flos()

    @property
    def current_flos(self) -> float:
        return self.schedule.current_flos

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps)

    def get_num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def require_optimizer(self):
        if self.optimizer is None:
            raise ValueError("Loop.optimizer is None: it is built by train() (or create_optimizer()). Fix: call "
                             "create_optimizer() first, or pass optimizers=(optimizer, None).")
        return self.optimizer

    def get_learning_rates(self) -> list[float]:
        return [group["lr"] for group in self.require_optimizer().param_groups]

    def get_optimizer_group(self, param=None):
        """The param group holding `param` (a name's tensor or a Parameter), else every group's params (HF)."""
        optimizer = self.require_optimizer()
        if param is not None:
            for group in optimizer.param_groups:
                if any(param is p for p in group["params"]):
                    return group
        return [group["params"] for group in optimizer.param_groups]

    # -- sizes -----------------------------------------------------------------------------------------------------
    def num_examples(self, dataloader) -> int:
        """Samples in the loader's dataset, else an estimate from its length (HF's `Trainer.num_examples`)."""
        from .log_messages import num_examples

        return num_examples(dataloader, self.args)

    def get_sp_size(self) -> int:
        config = getattr(self.accelerator, "parallelism_config", None)
        return 1 if config is None else config.sp_size

    def get_cp_size(self) -> int:
        config = getattr(self.accelerator, "parallelism_config", None)
        return 1 if config is None else config.cp_size

    def get_tp_size(self) -> int:
        model_tp = getattr(self.model, "tp_size", None)  # transformers' public property
        if model_tp is not None:
            return model_tp
        config = getattr(self.accelerator, "parallelism_config", None)
        return 1 if config is None else config.tp_size

    def get_total_train_batch_size(self, args) -> int:
        """Micro-batch x accumulation x data-parallel processes."""
        data_parallel = self.accelerator.num_processes // self.get_tp_size() // self.get_cp_size() // \
            self.get_sp_size()
        micro_batch = self.run.train_batch_size or args.per_device_train_batch_size  # auto_find_batch_size's
        return micro_batch * args.gradient_accumulation_steps * data_parallel

    def set_initial_training_values(self, args, dataloader) -> tuple:
        """HF's 7-tuple (epochs, updates per epoch, examples, train samples, total batch, micro-batches per epoch,
        max_steps), from `DataStage.plan`, which the run itself uses."""
        if args is not self.args:
            raise ValueError("set_initial_training_values(args, ...): loopkit plans from loop.args. Fix: pass "
                             "loop.args (or set the values on loop.args first).")
        return dataclasses.astuple(self.data.plan(dataloader))

    def get_batch_samples(self, epoch_iterator, num_batches: int, device) -> tuple[list, Any]:
        """Up to `num_batches` batches from `epoch_iterator` and their `num_items_in_batch` (HF's helper; the run
        itself groups batches in `DataStage.windows`)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        count = self.count_loss_items(batches)
        return batches, count.to(device) if count is not None else None

    # -- result files (trainer_pt_utils' Trainer helpers, copied) -------------------------------------------------
    # A staticmethod: HF binds the plain function, so `trainer.metrics_format(metrics)` raises TypeError there.
    metrics_format = staticmethod(metrics_format)

    def log_metrics(self, split: str, metrics: dict) -> None:
        """Print `metrics` as an aligned table, on the main process (HF's `log_metrics`)."""
        if not self.is_world_process_zero():
            return
        print(f"***** {split} metrics *****")
        formatted = metrics_format(metrics)
        key_width = max(len(str(x)) for x in formatted)
        value_width = max(len(str(x)) for x in formatted.values())
        for key in sorted(formatted):
            print(f"  {key: <{key_width}} = {formatted[key]:>{value_width}}")

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """`output_dir/<split>_results.json`, and (combined) merged into `all_results.json` (HF's `save_metrics`)."""
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, f"{split}_results.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(metrics, f, indent=4, sort_keys=True)
        if combined:
            path = os.path.join(self.args.output_dir, "all_results.json")
            all_metrics = {}
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    all_metrics = json.load(f)
            all_metrics.update(metrics)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(all_metrics, f, indent=4, sort_keys=True)

    def save_model(self, output_dir=None, _internal_call=False) -> None:
        """Weights, config and processing class in `save_pretrained` layout (no `on_save`, as in HF)."""
        from ..checkpoint import save_model_files, save_training_args

        log_model_save(self.run, self.context, output_dir=output_dir)
        folder, writer = output_dir or self.run.args.output_dir, self.context.checkpointer.writes_files
        save_model_files(self.model_wrapped, self.context.accelerator, folder, self.run.processing_class,
                         writer=writer)
        if writer:
            save_training_args(self.run.args, folder)  # Trainer's `training_args.bin`, for its readers
        if getattr(self.args, "push_to_hub", False) and not _internal_call:  # as Trainer: a user's save pushes
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def export(self, output_dir: str, example_inputs: dict, formats=("pretrained",)) -> dict:
        """loopkit addition: export the model as "pretrained", "torch_export" and/or "onnx", each checked against
        the live model on `example_inputs`; returns {format: (path, max |difference|)}."""
        return self.teardown.export(output_dir, example_inputs, formats)

    def save_state(self) -> None:
        """`output_dir/trainer_state.json` (HF's `save_state`)."""
        if not self.is_world_process_zero():
            return
        self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    # -- the end of a script -----------------------------------------------------------------------------------
    def end(self) -> None:
        """Finish the trackers and destroy the process group: once, at the very end of a script."""
        self.accelerator.end_training()

    # -- the Hub and the model card (the pushes at saves: loopkit/trainer/hub.py) ---------------------------------
    @property
    def hub_model_id(self) -> str | None:
        """The Hub repo pushes go to, once `init_hf_repo` has created it (at construction with push_to_hub)."""
        return self.context.checkpointer.hub.repo_id

    @hub_model_id.setter
    def hub_model_id(self, repo_id: str | None) -> None:
        self.context.checkpointer.hub.repo_id = repo_id

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Create (or reuse) the Hub repo `args.hub_model_id` (default: the output folder's name). An unreachable
        Hub raises `ConnectionError` at once."""
        self.context.checkpointer.hub.create_repo(token=token, private=private)

    def create_model_card(self, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                          tasks=None, dataset_tags=None, dataset=None, dataset_args=None) -> None:
        """`output_dir/README.md`, drafted by transformers' `TrainingSummary` from this run (loopkit/trainer/hub.py)."""
        from .hub import write_model_card

        write_model_card(self, language=language, license=license, tags=tags, model_name=model_name,
                         finetuned_from=finetuned_from, tasks=tasks, dataset_tags=dataset_tags, dataset=dataset,
                         dataset_args=dataset_args)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
        """Save the model and processing class to `output_dir` and upload it (HF's `push_to_hub`), after the push in
        progress has finished. An unreachable Hub raises `ConnectionError` at once, after `on_push_begin` (which
        fires first, as in HF). loopkit/trainer/hub.py does it."""
        from .hub import push_output_dir

        return push_output_dir(self, commit_message=commit_message, blocking=blocking, token=token,
                               revision=revision, private=private, **kwargs)

    # -- hyper-parameter search (loopkit/trainer/search.py) ---------------------------------------------------------
    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int = 20,
                              direction: str | list[str] = "minimize", backend=None, hp_name=None, **kwargs):
        """HF's search with the optuna backend (loopkit/trainer/search.py): each trial sets `hp_space(trial)` on `args`,
        trains a new model from `model_init(trial)` and is scored by `compute_objective` of its last evaluation.
        Returns a `BestRun` (a list of them for several directions)."""
        from .search import hyperparameter_search

        return hyperparameter_search(self, hp_space, compute_objective, n_trials, direction, backend, hp_name,
                                     **kwargs)


__all__ = ["TrainerAPI", "metrics_format"]
