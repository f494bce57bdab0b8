"""`Loop`: HF Trainer's constructor and methods, driving five swappable stages. Read `train()` top to bottom to see
a whole run in order; each stage is a chapter in `loopkit/stages/`; their state and services: `loopkit/run_state.py`.

    setup      seeding, Accelerate, the model, the resume point          stages/setup.py
    data       dataloaders, collation, step and epoch arithmetic           stages/data.py
    step       forward/backward, accumulation, clipping, optimizer        stages/step.py
    evaluation evaluate / predict, batch by batch                         stages/evaluation.py
    teardown   the summary, best-model loading, the run report            stages/teardown.py

Between optimizer steps the `Schedule` (loopkit/schedule.py) keeps the running loss and does the log / evaluate /
save that the callbacks ask for; the checkpoint storage (`storage=`, loopkit/storage/) writes and reads checkpoints.
HF's overridable methods (`compute_loss`, `training_step`, ...) each belong to one stage; overriding one on a `Loop`
subclass works exactly as on a `Trainer` subclass (loopkit/trainer/overridable.py).
"""

from __future__ import annotations

import time

from .args import ArgsClassDeclaration, LoopArgs, check_args, check_inputs
from .averaging import AVERAGING_KEY, bind_averaging, warn_if_average_left_behind
from .checkpoint import CHECKPOINT_PREFIX, warn_if_checkpoint_args_differ
from .columns import find_labels
from .distributed import release_earlier_run
from .events import EventHandler, default_callbacks
from .guards import PreemptionWatch, stop_at_step_boundary, with_batch_size_search
from .metrics import check_metrics
from .phases import PhaseClock
from .process import leaves_process_as_found
from .report import RUN_RECORD_KEY, run_record
from .run_state import RunContext, RunState
from .schedule import Schedule, running_loss_state
from .stages.data import DataStage
from .stages.evaluation import EvalStage
from .stages.setup import SetupStage, take_accumulation_steps
from .stages.step import StepStage
from .stages.teardown import TeardownStage
from .state import LoopState, restore_callback_states
from .storage import run_storage
from .trainer import log_messages
from .trainer.hub import HubPush, quiet_hub_progress
from .trainer.methods import TrainerAPI
from .trainer.notebook import default_progress_callback
from .trainer.overridable import HFMethods, bind_overrides

STAGES = {"setup": SetupStage, "data": DataStage, "step": StepStage, "evaluation": EvalStage,
          "teardown": TeardownStage}


class Loop(ArgsClassDeclaration, HFMethods, TrainerAPI):
    """A training run with `transformers.Trainer`'s arguments, methods, attributes and callback events.

    Replace `Trainer(` with `Loop(`. Pass `setup=`, `data=`, `step=`, `evaluation=` or `teardown=` to swap a stage.
    `metrics=[...]` adds streaming evaluation metrics (`loopkit.metrics`), computed batch by batch on the device;
    `observers=[...]` receives each step's result and adds keys to the training logs (`loopkit.observers`).
    `storage=` picks how checkpoints are stored (`loopkit.storage`: `HFStorage()`, the default, or `DCPStorage()`).
    `averaging=EMA(decay=0.999)` or `SWA()` keeps an average of the weights (docs/weight-averaging.md).
    """

    # Non-finite losses and gradients are read back (one host sync) every this many optimizer steps; preemption is
    # agreed after every step, without a device sync (loopkit/guards.py).
    guard_check_every = 10
    # The class of each stage not passed in; a subclass may change one (`Seq2SeqLoop`: the evaluation stage), and
    # a subclass's overrides of HF's methods are checked against these (loopkit/trainer/overridable.py).
    stage_classes = STAGES

    @leaves_process_as_found  # a refused Loop changes nothing; the next Loop takes back this one's (process.py)
    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, model_init=None, compute_loss_func=None, compute_metrics=None,
                 callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None,
                 preprocess_logits_for_metrics=None, *, metrics=None, observers=None, setup: SetupStage | None = None,
                 data: DataStage | None = None, step: StepStage | None = None,
                 evaluation: EvalStage | None = None, teardown: TeardownStage | None = None, storage=None,
                 averaging=None):
        args_given, args = args is not None, args if args is not None else LoopArgs()
        take_accumulation_steps(args)  # accelerator_config's num_steps, as Trainer takes it
        check_args(args, type(self))  # with the fields the class reads (`args_class`: loopkit/args/checks.py)
        check_inputs(args, model=model, model_init=model_init, train_dataset=train_dataset, eval_dataset=eval_dataset,
                     compute_metrics=compute_metrics, optimizers=optimizers,
                     optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
        run = self.run = RunState(
            args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, data_collator=data_collator,
            processing_class=processing_class, model_init=model_init, compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            optimizers_given=tuple(optimizers), optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
        context = self.context = RunContext(  # through the Loop, so a subclass's overrides apply in every stage
            log=self.log, compute_loss=self.compute_loss, count_loss_items=self.count_loss_items,
            compute_loss_context_manager=self.compute_loss_context_manager,
            get_eval_dataloader=self.get_eval_dataloader, get_test_dataloader=self.get_test_dataloader)
        classes = self.stage_classes
        self.setup, self.data = setup or classes["setup"](), data or classes["data"]()
        self.step, self.evaluation = step or classes["step"](), evaluation or classes["evaluation"]()
        self.teardown = teardown or classes["teardown"]()
        for stage in self.stages:
            stage.bind(run, context)
        self.averaging = bind_averaging(averaging, run, context)
        bind_overrides(self, classes)
        self.setup.begin(model)  # every RNG seeded first, as in Trainer.__init__
        self.create_accelerator_and_postprocess()
        context.memory = self.setup.track_memory()  # memory metrics from here to on_init_end
        self.setup.build(model)  # the model, on the device
        log_messages.start(args, context.accelerator, args_given, train_dataset)  # verbosity, Trainer's notes
        run.metrics = check_metrics(metrics, context.accelerator.num_processes)
        run.label_names = list(args.label_names) if args.label_names is not None else find_labels(run.model)
        self.data.check_eval_labels()  # before any training: metric_for_best_model needs labelled evaluations
        # events: flow, integrations, the user's, then this (HF's order); none when log_level keeps the run quiet
        progress = default_progress_callback(args, log_messages.quiet(args, context.accelerator))
        context.events = EventHandler(default_callbacks(args, callbacks, progress), tuple(self.components.values()), run)
        # As in Trainer.__init__: an evaluate() before train() logs (and reports) on the main process only.
        run.state = LoopState(is_local_process_zero=context.accelerator.is_local_main_process,
                              is_world_process_zero=context.accelerator.is_main_process)
        context.preemption = PreemptionWatch(run, context)
        context.clock = context.events.clock = PhaseClock()  # the run report's time by phase
        context.checkpointer = run_storage(storage, self.evaluation.checkpoint_options()).attach(run, context)
        context.checkpointer.upload_with(HubPush(run, context))  # push_to_hub: uploads of complete checkpoints
        self.schedule = Schedule(run, context, evaluate=self.evaluate, save=self.save_checkpoint, observers=observers)
        self.initial_global_step = 0
        if getattr(args, "push_to_hub", False):  # as Trainer.__init__: the repo exists before training
            self.init_hf_repo()
        context.events.fire("on_init_end")

    @property
    def stages(self):
        return (self.setup, self.data, self.step, self.evaluation, self.teardown)

    @property
    def components(self) -> dict:
        """By checkpoint key, what has checkpointed state and hears events before the callbacks: the stages, then
        the weight averaging."""
        named = dict(zip(STAGES, self.stages))
        return {**named, AVERAGING_KEY: self.averaging} if self.averaging is not None else named

    def fire(self, event: str, **extra):
        """Fire `event` on stages and callbacks; the returned control becomes `self.control` (HF's protocol)."""
        return self.context.events.fire(event, **extra)

    # ------------------------------------------------------------------------------------------------------------
    # The run
    # ------------------------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Train; returns `TrainOutput(global_step, training_loss, metrics)`."""
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(kwargs)}")
        run, context, args = self.run, self.context, self.run.args
        self.is_in_train = True
        try:
            with context.preemption, quiet_hub_progress(args):
                resume_from_checkpoint = self.setup.resume_point(resume_from_checkpoint)  # "auto": agreed here
                output = with_batch_size_search(self.run_training, run, context)(resume_from_checkpoint, trial,
                                                                                 ignore_keys_for_eval)
        except BaseException as exc:
            context.checkpointer.wait_quietly()
            context.events.fire("on_train_failed", exception=exc)
            self.release()
            self.teardown.write_run_report(context.preemption.status(exc), self.schedule.counters())
            context.preemption.leave(exc)  # a second signal under a launcher: exit 128 + signal
            raise
        finally:
            self.is_in_train = False
        context.preemption.leave()  # interrupted: checkpoint written, run torn down; leave as guards.py documents
        return output

    def run_training(self, batch_size, resume_from_checkpoint, trial, ignore_keys_for_eval):
        run, context, args = self.run, self.context, self.run.args
        run.train_batch_size = batch_size
        context.clock.reset()
        # 1. Setup: the model (model_init), and the checkpoint to resume from, whose weights load now.
        checkpoint = self.setup.begin_training(resume_from_checkpoint, trial)

        # 2. Data: the train loader and the step/epoch arithmetic; the run's state, fresh or the checkpoint's.
        release_earlier_run(context.accelerator)
        run.train_dataloader = self.get_train_dataloader()
        plan = self.data.plan(run.train_dataloader)
        self.start_state(checkpoint, plan, trial)
        resume = self.data.resume_point(checkpoint, run.state.global_step, plan)

        # 3. Step: optimizer, scheduler, accelerator.prepare, and their resumed state.
        self.step.prepare(plan.max_steps, checkpoint)
        log_messages.log_training_start(args, plan, batch_size, run.model_wrapped, resume, run.state.global_step)
        start_time = self.schedule.start_time = time.time()
        run.model_wrapped.zero_grad()

        # 4. The epochs: optimizer steps, each followed by the log / evaluate / save schedule.
        context.clock.enter(None)  # the end of the setup phase
        context.events.fire("on_train_begin")
        if checkpoint is None:  # HF: a fresh run's state holds the callback states from its start (save_state)
            run.state.record_callback_states(context.events.callback_objects + [run.control])
        if args.eval_on_start:
            self.schedule.evaluate_during_training(ignore_keys_for_eval, skip_scheduler=True)
        self.schedule.run_pending_evaluation(resume, ignore_keys_for_eval)
        first_epoch = resume.epochs_trained if resume is not None else 0
        for epoch in range(first_epoch, plan.num_train_epochs):
            context.events.fire("on_epoch_begin")
            self.run_epoch(epoch, plan, resume, ignore_keys_for_eval)
            if run.control.should_training_stop:
                break

        # 5. Teardown: summary, best model, on_train_end, resources, the run report.
        context.clock.enter("teardown")
        return self.finish(plan, start_time)

    def start_state(self, checkpoint, plan, trial) -> None:
        """The run's `state` (HF: a checkpoint's logging/eval/save intervals win) and every component's own
        checkpointed state (empty for a fresh run)."""
        run, context, args = self.run, self.context, self.run.args
        run.state = LoopState(train_batch_size=run.train_batch_size)
        run.state.compute_steps(args, plan.max_steps)
        saved = {}
        if checkpoint is not None:
            run.state = context.checkpointer.read_trainer_state(checkpoint)
            warn_if_checkpoint_args_differ(args, run.state)
            if args.restore_callback_states_from_checkpoint:
                restore_callback_states(context.events.callback_objects + [run.control], run.state.stateful_callbacks)
            saved = context.checkpointer.read_stage_states(checkpoint)
            context.clock.resume_from(saved.get(RUN_RECORD_KEY), run.state.global_step)  # the report covers it all
        state = run.state
        state.max_steps, state.num_train_epochs = plan.max_steps, plan.num_train_epochs
        state.is_hyper_param_search = trial is not None
        state.trial_params = getattr(trial, "params", trial)  # HF's hp_params: optuna's, or a ray/wandb dict
        state.trial_name = self.hp_name(trial) if self.hp_name is not None and trial is not None else None
        state.is_local_process_zero = context.accelerator.is_local_main_process
        state.is_world_process_zero = context.accelerator.is_main_process
        self.initial_global_step = state.global_step
        for name, component in self.components.items():
            component.load_state_dict(saved.get(name, {}))
        warn_if_average_left_behind(self.averaging, saved, checkpoint)
        self.schedule.start(running_loss_state(saved), saved.get("schedule", saved.get("evaluation", {})))

    def run_epoch(self, epoch, plan, resume, ignore_keys_for_eval):
        """One pass over the data: a window of micro-batches per optimizer step, then the log/eval/save schedule."""
        run, context, windows = self.run, self.context, 0
        asked = time.perf_counter()  # a window's seconds: fetching it and its step, host time (loopkit/observers/)
        for window in self.data.windows(epoch, plan, resume):
            windows += 1
            result = self.step.run_step(window, epoch, plan.steps_in_epoch)
            result.seconds = time.perf_counter() - asked
            self.schedule.record(result, window)
            if result.completed:
                self.schedule.after_step(ignore_keys_for_eval)
                self.check_guards()
                context.clock.step_done(run.state.global_step)
            asked = time.perf_counter()
            if run.control.should_epoch_stop or run.control.should_training_stop:
                break
        if self.data.yielded_nothing(windows, epoch, resume):  # an IterableDataset shorter than max_steps
            run.control.should_training_stop = True
        context.events.fire("on_epoch_end")
        self.schedule.after_step(ignore_keys_for_eval)

    def check_guards(self) -> None:
        """Preemption and non-finite values (loopkit/guards.py): act on them at an optimizer-step boundary."""
        stop_at_step_boundary(self.run, self.context, self.guard_check_every, self.step.check_nonfinite,
                              self.schedule.save_checkpoint)

    def finish(self, plan, start_time):
        run, context = self.run, self.context
        self.schedule.announce_saves(wait=True)  # the last checkpoint committed and its on_save, before the summary
        steps_run = run.state.global_step - self.initial_global_step
        train_loss = self.schedule.running_loss.train_loss(context.accelerator, steps_run)
        self.schedule.store_work()
        output = self.teardown.finish_training(plan, start_time, train_loss, steps_run)
        context.checkpointer.finish_uploads()  # push_to_hub: the last push, awaited after on_train_end as in Trainer
        self.release()
        self.teardown.write_run_report(context.preemption.status(), self.schedule.counters(), output.metrics)
        return output

    def release(self) -> None:
        """Persistent dataloader workers, gradients and device caches (also when training fails)."""
        self.data.shut_down_workers()
        self.teardown.release()

    # ------------------------------------------------------------------------------------------------------------
    # Checkpointed state of every component
    # ------------------------------------------------------------------------------------------------------------
    def stage_states(self) -> dict:
        """Each stage's own checkpointed state by stage name, the schedule's, and the run record (elapsed time and
        phases so far, for the run report): `loopkit_state.json`."""
        states = {name: component.state_dict() for name, component in self.components.items()}
        states["running_loss"] = self.schedule.running_loss.state_dict()
        states["schedule"] = self.schedule.state_dict()
        states[RUN_RECORD_KEY] = run_record(self.context.clock, self.run)
        return states

    def save_checkpoint(self) -> str:
        """A checkpoint of the current step (`checkpoint-<global_step>`), written atomically; returns its path."""
        name = f"{CHECKPOINT_PREFIX}-{self.run.state.global_step}"  # the final folder's name
        log_messages.log_model_save(self.run, self.context, checkpoint=name)
        return self.context.checkpointer.save(self.stage_states())

    # ------------------------------------------------------------------------------------------------------------
    # HF Trainer's public methods that are not a stage's (the overridable ones: loopkit/trainer/overridable.py)
    # ------------------------------------------------------------------------------------------------------------
    def log(self, logs: dict, start_time=None) -> None:
        """HF's `Trainer.log`: adds `epoch`, appends to `log_history` with `step`, fires `on_log`."""
        state = self.run.state
        logs["epoch"] = state.epoch
        logs.update(self.schedule.token_logs(start_time))  # include_num_input_tokens_seen
        state.log_history.append({**logs, "step": state.global_step})
        self.context.events.fire("on_log", logs=logs)
