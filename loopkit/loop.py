"""`Loop`: HF Trainer's constructor and methods, driving five swappable stages. Read `train()` top to bottom to see
a whole run in order; each stage is a chapter in `loopkit/stages/`.

    setup      seeding, Accelerate, the model, the resume point            stages/setup.py
    data       dataloaders, collation, step and epoch arithmetic             stages/data.py
    step       forward/backward, accumulation, clipping, optimizer         stages/step.py
    evaluation the log/eval/save schedule, eval loops, best model, saving  stages/evaluation.py
    teardown   the summary, best-model loading, releasing resources         stages/teardown.py

HF's overridable methods (`compute_loss`, `training_step`, `create_optimizer`, `create_scheduler`,
`get_train_dataloader`, `get_eval_dataloader`, `prediction_step`, `evaluation_loop`, ...) live on `Loop` with HF's
signatures and delegate to the stage that owns them; stages always call back through the `Loop`, so overriding one
on a `Loop` subclass works exactly as on a `Trainer` subclass, and replacing a stage works too.
"""

from __future__ import annotations

import contextlib
import time
import warnings

import torch

from .args import LoopArgs, check_args, check_inputs, config_error
from .checkpoint import Checkpointer
from .events import DefaultFlow, EventHandler, Printer, ProgressBar, reporting_callbacks
from .guards import Preempted, PreemptionWatch
from .report import PhaseClock
from .metrics import check_metrics
from .stages.data import DataStage, find_labels
from .stages.evaluation import EvalStage
from .stages.setup import SetupStage
from .stages.step import StepStage
from .stages.teardown import TeardownStage
from .state import LoopControl, LoopState


class Loop:
    """A training run with `transformers.Trainer`'s arguments, methods, attributes and callback events.

    Replace `Trainer(` with `Loop(`. Pass `setup=`, `data=`, `step=`, `evaluation=` or `teardown=` to swap a stage.
    `metrics=[...]` adds streaming evaluation metrics (`loopkit.metrics`), computed batch by batch on the device.
    """

    # HF 5.x class attribute: None = infer whether `compute_loss` already normalized over the accumulated batch.
    loss_is_scaled_for_ga = None
    # With several processes, preemption and non-finite checks agree through one all-reduce every this many
    # optimizer steps (see loopkit/guards.py); non-finite values are read back this often on one process too.
    guard_check_every = 10

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, model_init=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, *, metrics=None, setup: SetupStage | None = None,
                 data: DataStage | None = None, step: StepStage | None = None,
                 evaluation: EvalStage | None = None, teardown: TeardownStage | None = None):
        self.args = args if args is not None else LoopArgs()
        check_args(self.args)
        self.data_collator, self.processing_class = data_collator, processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.model_init, self.compute_loss_func = model_init, compute_loss_func
        self.compute_metrics, self.preprocess_logits_for_metrics = compute_metrics, preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.scheduler_given = self.lr_scheduler is not None
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        if self.optimizer is not None and optimizer_cls_and_kwargs is not None:
            raise config_error("optimizer_cls_and_kwargs", optimizer_cls_and_kwargs, "an optimizer was passed too",
                               "pass either optimizers=(opt, sched) or optimizer_cls_and_kwargs")
        check_inputs(self.args, model=model, model_init=model_init, train_dataset=train_dataset,
                     eval_dataset=eval_dataset, compute_metrics=compute_metrics, optimizers=optimizers)
        self.setup, self.data, self.step = setup or SetupStage(), data or DataStage(), step or StepStage()
        self.evaluation, self.teardown = evaluation or EvalStage(), teardown or TeardownStage()
        for stage in self.stages:
            stage.bind(self)

        # Setup: seeds, Accelerate, the model.
        self.setup.build(model)
        self.metrics = check_metrics(metrics, self.accelerator.num_processes)  # streaming metrics (loopkit.metrics)
        self.gather_function = self.accelerator.gather_for_metrics
        self.label_names = list(self.args.label_names) if self.args.label_names is not None else \
            find_labels(self.model)
        self.current_flos = 0.0
        self.train_dataloader = None

        # Events: HF's callback order (flow, integrations, the user's, then progress or printer).
        default = [DefaultFlow()] + reporting_callbacks(self.args.report_to)
        progress = Printer() if self.args.disable_tqdm else ProgressBar()
        self.callback_handler = EventHandler(default + list(callbacks or []) + [progress], self.stages)
        self.callback_handler.model, self.callback_handler.processing_class = self.model, processing_class
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, self.lr_scheduler
        # As in Trainer.__init__: an evaluate() before train() logs (and reports) on the main process only.
        self.state = LoopState(is_local_process_zero=self.accelerator.is_local_main_process,
                               is_world_process_zero=self.accelerator.is_main_process)
        self.control = LoopControl()
        self.preemption = PreemptionWatch()
        self.clock = self.callback_handler.clock = PhaseClock()  # the run report's time by phase
        self.samples_seen = self.tokens_seen = 0
        self.fire("on_init_end")

    @property
    def checkpointer(self) -> Checkpointer:
        """Writes and reads checkpoints; part of the evaluation-and-checkpoint stage."""
        return self.evaluation.checkpointer

    @property
    def stages(self):
        return (self.setup, self.data, self.step, self.evaluation, self.teardown)

    def fire(self, event: str, **extra):
        """Fire `event` on stages and callbacks; the returned control becomes `self.control` (HF's protocol)."""
        self.control = self.callback_handler.fire(event, self.args, self.state, self.control, **extra)
        return self.control

    # ------------------------------------------------------------------------------------------------------------
    # The run
    # ------------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Train; returns `TrainOutput(global_step, training_loss, metrics)`."""
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(kwargs)}")
        try:
            with self.preemption:
                output = self.run_training(resume_from_checkpoint, trial, ignore_keys_for_eval)
        except BaseException as exc:
            self.checkpointer.wait_quietly()
            self.fire("on_train_failed", exception=exc)
            self.teardown.release()
            self.teardown.write_run_report(f"failed: {type(exc).__name__}: {exc}")
            raise
        if self.preemption.requested:  # the checkpoint is written and the run torn down: leave as documented
            raise Preempted(128 + self.preemption.signum)
        return output

    def run_training(self, resume_from_checkpoint, trial, ignore_keys_for_eval):
        args = self.args
        self.clock.reset()
        self.samples_seen = self.tokens_seen = 0
        # 1. Setup: the model (model_init), and the checkpoint to resume from, whose weights load now.
        checkpoint = self.setup.begin_training(resume_from_checkpoint, trial)

        # 2. Data: the train loader and the step/epoch arithmetic.
        self.accelerator.free_memory()
        self.train_dataloader = self.get_train_dataloader()
        plan = self.data.plan(self.train_dataloader)

        # The run's state: fresh, or the checkpoint's (HF: the file's logging/eval/save intervals win).
        self.state = LoopState(train_batch_size=args.per_device_train_batch_size)
        self.state.compute_steps(args, plan.max_steps)
        stage_states = {}
        if checkpoint is not None:
            self.state = self.checkpointer.read_trainer_state(checkpoint)
            self.restore_callback_states()
            stage_states = self.checkpointer.read_stage_states(checkpoint)
        self.state.max_steps, self.state.num_train_epochs = plan.max_steps, plan.num_train_epochs
        self.state.is_hyper_param_search = trial is not None
        self.state.is_local_process_zero = self.accelerator.is_local_main_process
        self.state.is_world_process_zero = self.accelerator.is_main_process
        self.evaluation.last_logged_step = self.initial_global_step = self.state.global_step
        self.evaluation.total_loss_scalar = 0.0
        self.load_stage_states(stage_states)  # data position, running loss, ... (empty for a fresh run)
        resume = self.data.resume_point(checkpoint, self.state.global_step, plan)

        # 3. Step: optimizer, scheduler, accelerator.prepare, and their resumed state.
        self.step.prepare(plan.max_steps, checkpoint)
        handler = self.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = self.model, self.optimizer, self.lr_scheduler
        handler.train_dataloader = self.train_dataloader
        start_time = time.time()
        self.model_wrapped.zero_grad()

        # 4. The epochs: optimizer steps, each followed by the log / evaluate / save schedule.
        self.fire("on_train_begin")
        if args.eval_on_start:
            self.evaluation.evaluate_during_training(ignore_keys_for_eval, skip_scheduler=True)
        self.evaluation.run_pending_evaluation(resume, ignore_keys_for_eval)

        first_epoch = resume.epochs_trained if resume is not None else 0
        for epoch in range(first_epoch, plan.num_train_epochs):
            self.fire("on_epoch_begin")
            self.run_epoch(epoch, plan, resume, ignore_keys_for_eval)
            if self.control.should_training_stop:
                break

        # 5. Teardown: summary, best model, on_train_end.
        return self.teardown.finish_training(plan, start_time)

    def run_epoch(self, epoch, plan, resume, ignore_keys_for_eval):
        """One pass over the data: a window of micro-batches per optimizer step, then the log/eval/save schedule."""
        for window in self.data.windows(epoch, plan, resume):
            completed = self.step.run(window, epoch, plan.steps_in_epoch)
            if completed:
                self.evaluation.after_step(ignore_keys_for_eval)
                self.check_guards()
                self.clock.step_done(self.state.global_step)
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        if self.data.micro_batches_done == 0:
            warnings.warn(f"Epoch {epoch} yielded no batch: stopping at step {self.state.global_step}. An "
                          f"IterableDataset shorter than max_steps={self.state.max_steps} ends training here.")
            self.control.should_training_stop = True
        self.fire("on_epoch_end")
        self.evaluation.after_step(ignore_keys_for_eval)

    def check_guards(self) -> None:
        """Preemption and non-finite values (loopkit/guards.py): act on them at an optimizer-step boundary."""
        step, several = self.state.global_step, self.accelerator.num_processes > 1
        due = step % self.guard_check_every == 0
        if several and not due:
            return
        preempted = self.preemption.requested
        if several:  # one tiny all-reduce: a signal on any rank stops every rank at this same step
            flag = torch.tensor(float(preempted), device=self.accelerator.device)
            preempted = self.accelerator.reduce(flag, reduction="max").item() > 0
            if preempted and self.preemption.signum is None:
                self.preemption.signum = 15  # another rank was signalled: leave as that rank does (SIGTERM)
        watch = self.step.nonfinite
        report = watch.check() if watch is not None and due else None
        if report is not None:
            if watch.policy == "raise":
                raise FloatingPointError(report + " (nonfinite='raise').")
            warnings.warn(report + f" (nonfinite={watch.policy!r}: those steps were not applied"
                          + (", stopping with a checkpoint)." if watch.policy == "stop" else ")."))
        if preempted or (report is not None and watch.policy == "stop"):
            if self.checkpointer.last_saved_step != step:
                self.evaluation.save_checkpoint()
                self.fire("on_save")
            self.control.should_training_stop = True

    # ------------------------------------------------------------------------------------------------------------
    # Resume helpers
    # ------------------------------------------------------------------------------------------------------------
    def stage_states(self) -> dict:
        """Each stage's own checkpointed state, by stage name (written to `loopkit_state.json`)."""
        return {name: stage.state_dict() for name, stage in zip(STAGE_NAMES, self.stages)}

    def load_stage_states(self, states: dict) -> None:
        for name, stage in zip(STAGE_NAMES, self.stages):
            stage.load_state_dict(states.get(name, {}))

    def restore_callback_states(self) -> None:
        """HF's `restore_callback_states_from_checkpoint`: re-create stateful callbacks from the saved state."""
        if not self.args.restore_callback_states_from_checkpoint:
            return
        from .state import state_name

        saved = self.state.stateful_callbacks
        seen: dict[str, int] = {}
        for callback in self.callback_handler.callbacks + [self.control]:
            name = state_name(callback)
            if name not in saved:
                continue
            entries = saved[name] if isinstance(saved[name], list) else [saved[name]]
            index = seen[name] = seen.get(name, -1) + 1  # duplicates of a class restore in order, as in HF
            if index >= len(entries):
                continue
            entry = entries[index]
            # HF re-creates the callback as `type(cb)(**args)` and then sets the saved attributes; loopkit does the
            # same but copies the result into the existing object, so a reference the user holds stays live and
            # the callback keeps its place in the list.
            restored = type(callback)(**entry.get("args", {}))
            for key, value in entry.get("attributes", {}).items():
                setattr(restored, key, value)
            vars(callback).update(vars(restored))

    def store_flos(self) -> None:
        """Move this process's FLOP count into `state.total_flos` (summed over processes), at logs and saves."""
        flos = self.current_flos
        if self.accelerator.num_processes > 1:
            flos = self.accelerator.reduce(torch.tensor(flos, dtype=torch.float64, device=self.accelerator.device),
                                           reduction="sum").item()
        self.state.total_flos += flos
        self.current_flos = 0.0

    # ------------------------------------------------------------------------------------------------------------
    # HF Trainer's public and overridable methods, delegating to the stage that owns each
    # ------------------------------------------------------------------------------------------------------------
    def get_train_dataloader(self):
        return self.data.get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        return self.data.get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        return self.data.get_test_dataloader(test_dataset)

    def get_decay_parameter_names(self, model) -> list[str]:
        from .stages.step import decay_parameter_names

        return decay_parameter_names(model)

    def create_optimizer(self, model=None):
        return self.step.create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return self.step.create_scheduler(num_training_steps, optimizer)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self.step.compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def compute_loss_context_manager(self):
        return contextlib.nullcontext()  # Accelerate applies autocast by wrapping model.forward

    def count_loss_items(self, batches):
        return self.step.count_loss_items(batches)

    def training_step(self, model, inputs, num_items_in_batch=None):
        return self.step.training_step(model, inputs, num_items_in_batch)

    def floating_point_ops(self, inputs) -> int:
        return self.step.floating_point_ops(inputs)

    def log(self, logs: dict, start_time=None) -> None:
        self.evaluation.log(logs, start_time)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        return self.evaluation.evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        return self.evaluation.predict(test_dataset, ignore_keys, metric_key_prefix)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        return self.evaluation.evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                               metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return self.evaluation.prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def save_model(self, output_dir=None, _internal_call=False) -> None:
        """Weights, config and processing class in `save_pretrained` layout (no `on_save`, as in HF)."""
        from .checkpoint import save_model_files

        save_model_files(self.model_wrapped, self.accelerator, output_dir or self.args.output_dir,
                         self.processing_class)

    def export(self, output_dir: str, example_inputs: dict, formats=("pretrained",)) -> dict:
        """loopkit addition: export the model as "pretrained", "torch_export" and/or "onnx", each checked against
        the live model on `example_inputs`; returns {format: (path, max |difference|)}."""
        return self.teardown.export(output_dir, example_inputs, formats)

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


STAGE_NAMES = ("setup", "data", "step", "evaluation", "teardown")
