"""`RunState`: everything the stages share, each field with exactly one writer; `RunContext`: the services and
cross-stage callables they use. Both are declared here, in one place.

A stage is bound to both (`stage.bind(run, context)`: `self.run`, `self.context`). It reads the state it needs
from `self.run` and writes only the fields the first table below gives it; it uses the services of `self.context`
(the accelerator, the events, the checkpoint storage, ...) and never assigns them; it never reads another stage's
attributes or the `Loop`'s. Values that flow from one stage to the next (the training plan, a window of
micro-batches, a step's result, the resume point) are arguments and return values, not fields. `Loop` keeps HF
Trainer's attribute names (`trainer.model`, `trainer.optimizer`, `trainer.state`, `trainer.accelerator`,
`trainer.callback_handler`, ...) as views onto these fields, so HF callbacks and Trainer-style subclasses work
unchanged (a user's own `loop.optimizer = ...` goes through those views; it is the user's write, not a stage's).

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
| signature_columns              | the columns `remove_unused_columns` keeps, where a `Loop`   | trl/base.py       |
|                                | subclass declares them (HF's `_signature_columns`, which    |                   |
|                                | TRL's trainers set); None: the model forward's arguments    |                   |
| state                          | HF's `TrainerState` (`loopkit.state`)                       | loop.py           |
| control                        | HF's `TrainerControl`; `context.events.fire` stores what    | events.py         |
|                                | the callbacks return                                        |                   |
| train_dataloader               | the prepared train loader of the current `train()`          | loop.py           |
| is_in_train                    | whether `train()` is running (HF's `trainer.is_in_train`)   | loop.py           |
| train_batch_size               | per-device train batch of the current `train()` (lowered by | loop.py           |
|                                | `auto_find_batch_size` after an out-of-memory error)        |                   |
| model                          | the unwrapped model                                         | stages/setup.py   |
| model_accepts_loss_kwargs      | whether the model's loss takes `num_items_in_batch`         | stages/setup.py   |
| label_smoother                 | HF's `LabelSmoother` when `label_smoothing_factor` is set   | stages/setup.py   |
| model_wrapped                  | the model as `accelerator.prepare` returned it (DDP, ...)   | stages/step.py    |
| optimizer, lr_scheduler        | the prepared optimizer and its scheduler                    | stages/step.py    |
| eval_dataloader                | the loader of the latest evaluation or prediction           | stages/evaluation.py |

The fields of `state` have one writer each too (the control's flags are HF's protocol: callbacks set them, and
the loop sets `should_training_stop` when a guard or a failed save stops the run):

| state field                                        | written by                                            |
|----------------------------------------------------|-------------------------------------------------------|
| global_step, epoch                                 | stages/step.py                                        |
| log_history                                        | loop.py (`Loop.log`, the context's `log`)             |
| best_metric, best_global_step, total_flos          | schedule.py                                           |
| num_input_tokens_seen                              | schedule.py (summed over processes at logs and saves) |
| best_model_checkpoint                              | checkpoint/writing.py (the storage's `save`)          |
| stateful_callbacks                                 | state.py (`record_callback_states`: start, each save) |
| max_steps, num_train_epochs, is_hyper_param_search,| loop.py (when a `train()` begins)                     |
|   trial_params, trial_name, is_local_process_zero, |                                                       |
|   is_world_process_zero                            |                                                       |

The context holds what the run uses rather than what it is. The `Loop` assigns every field, once, while it is
built (loop.py; the accelerator in HF's hook `create_accelerator_and_postprocess`, trainer/overridable.py); "made
by" says where the object comes from. The setup stage makes the accelerator and the memory tracker and returns them;
no stage assigns a context field. The callables go through the `Loop`, so a `Loop` subclass's override (or one
assigned to a `Loop`, `loop.compute_loss = f`: `bind_override` in loopkit/trainer/overridable.py) applies in every
stage.

| context field                   | what it is                              | made by         | assigned by            |
|---------------------------------|-----------------------------------------|-----------------|------------------------|
| events                          | the callbacks and their dispatch;       | loop.py         | loop.py                |
|                                 | `fire(event)` fires an event on the     |                 |                        |
|                                 | stages and callbacks and stores their   |                 |                        |
|                                 | control in `run` (`loopkit.events`)     |                 |                        |
| clock                           | time by phase for the report            | loop.py         | loop.py                |
|                                 | (`loopkit.phases`)                      |                 |                        |
| checkpointer                    | the checkpoint policy (holds the        | loop.py         | loop.py                |
|                                 | storage format; `loopkit.checkpoint`)   |                 |                        |
| preemption                      | the SIGTERM/SIGINT watch                | loop.py         | loop.py                |
|                                 | (`loopkit.guards`)                      |                 |                        |
| accelerator, gather_function    | the `accelerate.Accelerator`, and the   | stages/setup.py | trainer/overridable.py |
|                                 | function that gathers eval tensors      |                 |                        |
|                                 | across processes                        |                 |                        |
| memory                          | the memory metrics (`loopkit.memory`)   | stages/setup.py | loop.py                |
| log                             | HF's `Trainer.log` (`Loop.log`)         | loop.py         | loop.py                |
| compute_loss,                   | the step stage's loss methods, for the  | stages/step.py  | loop.py                |
|   compute_loss_context_manager, | evaluation stage                        |                 |                        |
|   count_loss_items              |                                         |                 |                        |
| get_eval_dataloader,            | the data stage's loaders, for the       | stages/data.py  | loop.py                |
|   get_test_dataloader           | evaluation stage                        |                 |                        |

`tests/test_stage_contract.py` reads the source of `loopkit/` and checks the three tables.
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
    signature_columns: list | None = None
    state: Any = None
    control: Any = field(default_factory=LoopControl)
    train_dataloader: Any = None
    is_in_train: bool = False
    train_batch_size: int | None = None
    model: Any = None
    model_accepts_loss_kwargs: bool = False
    label_smoother: Callable | None = None
    model_wrapped: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    eval_dataloader: Any = None

    def __getattr__(self, name):
        """Only for a name `RunState` lacks: the services and callables that moved to `RunContext` say where they
        are now (a stage written before the context existed reads `self.run.accelerator`)."""
        if name in CONTEXT_FIELDS:
            raise AttributeError(f"'RunState' object has no attribute {name!r}: it moved to the run context; use "
                                 f"self.context.{name} in a stage (loopkit/run_state.py: RunContext)", name=name,
                                 obj=self)
        raise AttributeError(f"'RunState' object has no attribute {name!r}", name=name, obj=self)

    def event_objects(self) -> dict:
        """The keywords every HF event receives. Before `train()` prepares an optimizer, the one passed in
        `optimizers=` (HF passes it from `on_init_end` on)."""
        optimizer = self.optimizer if self.optimizer is not None else self.optimizers_given[0]
        scheduler = self.lr_scheduler if self.lr_scheduler is not None else self.optimizers_given[1]
        return dict(model=self.model, processing_class=self.processing_class, optimizer=optimizer,
                    lr_scheduler=scheduler, train_dataloader=self.train_dataloader,
                    eval_dataloader=self.eval_dataloader)


@dataclass(eq=False)
class RunContext:
    """The services and cross-stage callables of one `Loop`; see the module docstring for who makes each."""

    events: Any = None
    clock: Any = None
    checkpointer: Any = None
    preemption: Any = None
    accelerator: Any = None
    gather_function: Callable | None = None
    memory: MemoryTracker = field(default_factory=MemoryTracker)
    log: Callable | None = None
    compute_loss: Callable | None = None
    compute_loss_context_manager: Callable | None = None
    count_loss_items: Callable | None = None
    get_eval_dataloader: Callable | None = None
    get_test_dataloader: Callable | None = None


# RunContext's fields: each was a RunState field before the context was split off (RunState answers with this).
CONTEXT_FIELDS = frozenset(RunContext.__dataclass_fields__)
