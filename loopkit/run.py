"""`RunState`: everything the stages share, declared in one place, each field with exactly one writer.

A stage is bound to the run state (`stage.bind(run)`) and reads what it needs from it; it writes only the fields the
table below gives it, and it never reads another stage's attributes or the `Loop`'s. Values that flow from one
stage to the next (the training plan, a window of micro-batches, a step's result, the resume point) are arguments
and return values, not fields. `Loop` keeps HF Trainer's attribute names (`trainer.model`, `trainer.optimizer`,
`trainer.state`, ...) as views onto these fields, so HF callbacks and Trainer-style subclasses work unchanged (a
user's own `loop.optimizer = ...` goes through those views; it is the user's write, not a stage's).

| field                          | what it is                                                  | written by        |
|--------------------------------|-------------------------------------------------------------|-------------------|
| args                           | `TrainingArguments` or `LoopArgs`                           | loop.py           |
| train_dataset, eval_dataset    | as passed to `Loop`                                         | loop.py           |
| data_collator                  | as passed to `Loop` (None: the data stage picks HF's)       | loop.py           |
| processing_class               | tokenizer / processor, as passed to `Loop`                  | loop.py           |
| model_init                     | as passed to `Loop`                                         | loop.py           |
| compute_loss_func              | as passed to `Loop`; its loss is already normalised over    | loop.py           |
|                                | the accumulated batch (it receives `num_items_in_batch`)    |                   |
| compute_metrics                | as passed to `Loop`                                         | loop.py           |
| preprocess_logits_for_metrics  | as passed to `Loop`                                         | loop.py           |
| metrics                        | streaming metrics (`loopkit.metrics`)                       | loop.py           |
| optimizers_given               | `optimizers=(optimizer, scheduler)` as passed to `Loop`     | loop.py           |
| optimizer_cls_and_kwargs       | as passed to `Loop`                                         | loop.py           |
| label_names                    | `args.label_names`, or the model's label arguments          | loop.py           |
| state                          | HF's `TrainerState` (`loopkit.state`)                       | loop.py           |
| control                        | HF's `TrainerControl`; `fire` stores what callbacks return  | run.py            |
| events                         | the callbacks and their dispatch (`loopkit.events`)         | loop.py           |
| clock                          | time by phase for the run report (`loopkit.phases`)         | loop.py           |
| checkpointer                   | the checkpoint storage (`loopkit.storage`)                  | loop.py           |
| preemption                     | SIGTERM/SIGINT watch (`loopkit.guards`)                     | loop.py           |
| log                            | HF's `Trainer.log` (a `Loop` subclass may override it)      | loop.py           |
| compute_loss,                  | the step stage's loss methods, for the evaluation stage     | loop.py           |
|   compute_loss_context_manager,| (through the `Loop`, so a subclass's overrides apply)       |                   |
|   count_loss_items             |                                                             |                   |
| get_eval_dataloader,           | the data stage's loaders, for the evaluation stage          | loop.py           |
|   get_test_dataloader          | (through the `Loop`, likewise)                              |                   |
| train_dataloader               | the prepared train loader of the current `train()`          | loop.py           |
| is_in_train                    | whether `train()` is running (HF's `trainer.is_in_train`)   | loop.py           |
| train_batch_size               | per-device train batch of the current `train()` (lowered by | loop.py           |
|                                | `auto_find_batch_size` after an out-of-memory error)        |                   |
| accelerator                    | the `accelerate.Accelerator`                                | stages/setup.py   |
| gather_function                | gathers eval tensors across processes (HF's attribute)      | stages/setup.py   |
| model                          | the unwrapped model                                         | stages/setup.py   |
| model_accepts_loss_kwargs      | whether the model's loss takes `num_items_in_batch`         | stages/setup.py   |
| label_smoother                 | HF's `LabelSmoother` when `label_smoothing_factor` is set   | stages/setup.py   |
| memory                         | the memory metrics (`loopkit.memory`, skip_memory_metrics)  | stages/setup.py   |
| model_wrapped                  | the model as `accelerator.prepare` returned it (DDP, ...)   | stages/step.py    |
| optimizer, lr_scheduler        | the prepared optimizer and its scheduler                    | stages/step.py    |
| eval_dataloader                | the loader of the latest evaluation or prediction           | stages/evaluation.py |

The fields of `state` have one writer each too (the control's flags are HF's protocol: callbacks set them, and
the loop sets `should_training_stop` when a guard or a failed save stops the run):

| state field                                        | written by                                            |
|----------------------------------------------------|-------------------------------------------------------|
| global_step, epoch                                 | stages/step.py                                        |
| log_history                                        | loop.py (`Loop.log`, the run's `log`)                 |
| best_metric, best_global_step, total_flos          | schedule.py                                           |
| num_input_tokens_seen                              | schedule.py (summed over processes at logs and saves) |
| best_model_checkpoint                              | checkpoint/writing.py (the storage's `save`)          |
| stateful_callbacks                                 | state.py (`record_callback_states`: start, each save) |
| max_steps, num_train_epochs, is_hyper_param_search,| loop.py (when a `train()` begins)                     |
|   trial_params, trial_name, is_local_process_zero, |                                                       |
|   is_world_process_zero                            |                                                       |

`tests/test_stage_contract.py` reads the source of `loopkit/` and checks both tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .memory import MemoryTracker
from .state import LoopControl


@dataclass(eq=False)
class RunState:
    """The shared state of one `Loop`; see the module docstring for each field's writer."""

    args: Any
    train_dataset: Any = None
    eval_dataset: Any = None
    data_collator: Any = None
    processing_class: Any = None
    model_init: Callable | None = None
    compute_loss_func: Callable | None = None
    compute_metrics: Callable | None = None
    preprocess_logits_for_metrics: Callable | None = None
    metrics: list = field(default_factory=list)
    optimizers_given: tuple = (None, None)
    optimizer_cls_and_kwargs: Any = None
    label_names: list = field(default_factory=list)
    state: Any = None
    control: Any = field(default_factory=LoopControl)
    events: Any = None
    clock: Any = None
    checkpointer: Any = None
    preemption: Any = None
    log: Callable | None = None
    compute_loss: Callable | None = None
    compute_loss_context_manager: Callable | None = None
    count_loss_items: Callable | None = None
    get_eval_dataloader: Callable | None = None
    get_test_dataloader: Callable | None = None
    train_dataloader: Any = None
    is_in_train: bool = False
    train_batch_size: int | None = None
    accelerator: Any = None
    gather_function: Callable | None = None
    model: Any = None
    model_accepts_loss_kwargs: bool = False
    label_smoother: Callable | None = None
    memory: MemoryTracker = field(default_factory=MemoryTracker)
    model_wrapped: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    eval_dataloader: Any = None

    def fire(self, event: str, **extra):
        """Fire `event` on the stages and callbacks with HF's arguments; the control they return becomes
        `self.control` (HF's protocol)."""
        self.control = self.events.fire(event, self, **extra)
        return self.control

    def event_objects(self) -> dict:
        """The keywords every HF event receives. Before `train()` prepares an optimizer, the one passed in
        `optimizers=` (HF passes it from `on_init_end` on)."""
        optimizer = self.optimizer if self.optimizer is not None else self.optimizers_given[0]
        scheduler = self.lr_scheduler if self.lr_scheduler is not None else self.optimizers_given[1]
        return dict(model=self.model, processing_class=self.processing_class, optimizer=optimizer,
                    lr_scheduler=scheduler, train_dataloader=self.train_dataloader,
                    eval_dataloader=self.eval_dataloader)
