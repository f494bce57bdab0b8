"""Between optimizer steps: the running loss, the work counters, and HF's log / evaluate / save schedule.

`Schedule` is a run-level component the `Loop` owns (not a stage): after every optimizer step the loop hands it the
step stage's `StepResult` and its window (`record`, which passes both to the step observers, loopkit/observers/),
then lets it act on what the callbacks asked for in `control` (`after_step`, HF's `_maybe_log_save_evaluate`): a
train log (the one host sync of the training loop; the observers' keys join it), an evaluation (then the best metric
and, for `ReduceLROnPlateau` and `GreedyLR`, the scheduler), a checkpoint (then `on_save`).

It writes `state.log_history` through `context.log`, `state.best_metric`, `state.best_global_step`, `state.total_flos`
and `state.num_input_tokens_seen` (`include_num_input_tokens_seen`: counted on the device or from shapes each step,
summed over processes into the state only before a log, an evaluation or a save, where HF syncs at every step);
it reads the evaluation through the `evaluate` callable it is given (`Loop.evaluate`, overridable as on a Trainer)
and saves through `context.checkpointer`.
"""

from __future__ import annotations

import functools
import math

import torch

from .errors import MetricNotFoundError, trainer_error
from .checkpoint import restore_rng_state, rng_state
from .guards import EvaluationInterrupted
from .observers import check_observers, observer_logs, start_observers
from .optimizers import steps_on_metrics
from .phases import speed_metrics
from .state import best_metric_key


# Micro-batch losses kept for the NaN/Inf filter are stacked into one tensor per this many (bounded memory when logs
# are far apart).
UNSETTLED_RUN = 512


class RunningLoss:
    """The training loss since the last log (a device tensor: no host sync per step) and the total over the run.

    HF's `tr_loss` / `_total_loss_scalar` / `_globalstep_last_logged` in one object. The part since the last log
    and the step of that log survive a resume (`state_dict`), so the first log after a resume averages the same
    steps as in an uninterrupted run; `train_loss` then counts only the steps this `train()` call ran.

    HF's `logging_nan_inf_filter` replaces a NaN/Inf micro-batch loss by the running mean since the last log. Doing
    that on the device for every micro-batch costs three kernels each; instead each loss is just added, and the
    filter runs where the sum is read anyway (`settle`: logs, the summary, checkpoints). A non-finite loss leaves
    the sum non-finite, so a finite sum is exactly HF's; a non-finite one is recomputed, micro-batch by micro-batch
    with HF's rule, from the losses kept since the last read.
    """

    def __init__(self):
        self.since_log = None  # device tensor: sum of step losses since the last log
        self.total = 0.0  # host float: sum of the logged parts (this train() call)
        self.restored = 0.0  # the part since the last log that a checkpoint brought in
        self.last_logged_step = 0
        self.nan_inf_filter = True
        # The sum at the last settle, where a recomputation starts: the host value read there (a float holds the
        # device sum exactly), so a log makes no device copy of it.
        self.settled_sum = 0.0
        self.unsettled = []  # micro-batch losses added since then: 0-d tensors, older runs stacked
        self.unsettled_steps = []  # the global step before each of them

    def start(self, device, global_step: int, saved: dict, nan_inf_filter: bool) -> None:
        """A new `train()`: `saved` is the checkpoint's `state_dict()` ({} for a fresh run)."""
        self.restored = saved.get("tr_loss", 0.0)
        self.last_logged_step = saved.get("last_logged_step") if saved.get("last_logged_step") is not None \
            else global_step
        self.since_log = torch.full((), self.restored, device=device)
        self.total, self.nan_inf_filter = 0.0, nan_inf_filter
        self.forget_unsettled(self.restored)

    def forget_unsettled(self, settled: float) -> None:
        """The sum is `settled` now (as read on the host), with no micro-batch loss pending."""
        self.settled_sum, self.unsettled, self.unsettled_steps = settled, [], []

    def add(self, step_loss: torch.Tensor, global_step: int) -> None:
        """One micro-batch's (scaled) loss of the optimizer step that follows `global_step`."""
        self.since_log += step_loss
        if self.nan_inf_filter:
            self.unsettled.append(step_loss)
            self.unsettled_steps.append(global_step)
            if len(self.unsettled) >= UNSETTLED_RUN and self.unsettled[-UNSETTLED_RUN].ndim == 0:
                self.unsettled[-UNSETTLED_RUN:] = [self.stacked(self.unsettled[-UNSETTLED_RUN:])]

    def stacked(self, losses: list) -> torch.Tensor:
        """One 1-d tensor of `losses` (0-d tensors or stacked runs), in a dtype that holds each exactly."""
        dtype = functools.reduce(torch.promote_types, (loss.dtype for loss in losses), self.since_log.dtype)
        return torch.cat([loss.to(dtype).reshape(-1) for loss in losses])

    def settle(self) -> float:
        """This process's sum since the last log with HF's NaN/Inf filter applied, read on the host (the one sync
        of a log)."""
        value = self.since_log.item()
        if self.unsettled and not math.isfinite(value):
            since_log = torch.full((), self.settled_sum, dtype=self.since_log.dtype, device=self.since_log.device)
            losses = self.stacked(self.unsettled)
            for index, global_step in enumerate(self.unsettled_steps):  # HF's rule, micro-batch by micro-batch
                since = 1 + global_step - self.last_logged_step
                since_log += torch.where(torch.isfinite(losses[index]), losses[index], since_log / since)
            self.since_log.copy_(since_log)
            value = self.since_log.item()
        self.forget_unsettled(value)
        return value

    def read_for_log(self, accelerator, global_step: int) -> float:
        """The mean loss per optimizer step since the last log (averaged over processes); restarts the sum."""
        loss_sum = self.process_mean(accelerator)
        self.since_log.zero_()
        self.forget_unsettled(0.0)
        mean = loss_sum / (global_step - self.last_logged_step)
        self.total += loss_sum
        self.last_logged_step = global_step
        return mean

    def process_mean(self, accelerator) -> float:
        """The settled sum since the last log, averaged over processes (one process: the settled value itself)."""
        value = self.settle()
        if accelerator.num_processes == 1:
            return value
        return accelerator.gather(self.since_log.detach()).mean().item()

    def train_loss(self, accelerator, steps_run: int) -> float:
        """HF's `train_loss`: the mean step loss over the steps this `train()` call ran."""
        remaining = self.process_mean(accelerator)
        return (self.total + remaining - self.restored) / max(steps_run, 0.001)

    def state_dict(self) -> dict:
        since = self.settle() if self.since_log is not None else 0.0
        return {"tr_loss": since, "last_logged_step": self.last_logged_step}


class Schedule:
    """What happens after each optimizer step: counting, then the log / evaluation / save `control` asks for."""

    def __init__(self, run, context, evaluate, save, observers=None):
        """`run`, `context`: the run's state and services (loopkit/run_state.py); `evaluate()`: the run's evaluation
        (`Loop.evaluate`); `save()`: writes a checkpoint of this step; `observers`: step observers
        (loopkit/observers/), whose keys join each training log."""
        self.run, self.context, self.evaluate, self.save = run, context, evaluate, save
        self.observers = check_observers(observers)
        self.running_loss = RunningLoss()
        self.current_flos = 0.0  # this process's FLOPs since the last log or save
        self.tokens_seen = self.samples_seen = 0  # input tokens and samples of this train() call (the report)
        self.pending_evaluation = None  # an evaluation a preemption interrupted (resumed runs do it first)
        self.last_step = None  # the latest completed step's result: its grad norm and LR go into the next log
        self.input_tokens_pending = 0  # this process's input tokens not yet in state.num_input_tokens_seen
        self.initial_tokens_seen = 0  # state.num_input_tokens_seen when this train() started (HF's tokens/s)
        self.start_time = None  # when this train() started training (after the optimizer is prepared)

    def start(self, saved_loss: dict, saved_schedule: dict) -> None:
        run, context = self.run, self.context
        self.running_loss.start(context.accelerator.device, run.state.global_step, saved_loss,
                                run.args.logging_nan_inf_filter)
        self.pending_evaluation = saved_schedule.get("pending_evaluation")
        self.tokens_seen = self.samples_seen = 0
        self.last_step = None
        self.input_tokens_pending, self.initial_tokens_seen = 0, run.state.num_input_tokens_seen
        start_observers(self.observers, run.state)

    def record(self, result, window) -> None:
        """A `StepResult`: its losses into the running loss, its work into the counters; it and its `window` to
        the step observers."""
        step_before = self.run.state.global_step - (1 if result.completed else 0)
        for loss in result.losses:
            self.running_loss.add(loss, step_before)
        self.current_flos += result.flos
        self.tokens_seen += result.tokens
        self.samples_seen += result.samples
        self.input_tokens_pending = self.input_tokens_pending + result.input_tokens_seen
        if result.completed:
            self.last_step = result
        for observer in self.observers:
            observer.on_step(result, window, self.run.state)

    def counters(self) -> dict:
        """The input tokens and samples this `train()` call trained on (the run report divides them by time)."""
        return {"tokens": self.tokens_seen, "samples": self.samples_seen}

    def store_flos(self) -> None:
        """Move this process's FLOP count into `state.total_flos` (summed over processes), at logs and saves."""
        run, flos = self.run, self.current_flos
        accelerator = self.context.accelerator
        if accelerator.num_processes > 1:
            flos = accelerator.reduce(torch.tensor(flos, dtype=torch.float64, device=accelerator.device),
                                      reduction="sum").item()
        run.state.total_flos += flos
        self.current_flos = 0.0

    def store_input_tokens(self) -> None:
        """Move the input tokens counted since the last call into `state.num_input_tokens_seen`, summed over
        processes (HF gathers them at every step; here only before a log, an evaluation or a save)."""
        run, context = self.run, self.context
        if run.args.include_num_input_tokens_seen == "no":
            return
        pending = torch.as_tensor(self.input_tokens_pending, dtype=torch.int64, device=context.accelerator.device)
        if context.accelerator.num_processes > 1:
            pending = context.accelerator.reduce(pending, reduction="sum")
        run.state.num_input_tokens_seen += int(pending.item())
        self.input_tokens_pending = 0

    def store_work(self) -> None:
        """The FLOPs and input tokens counted so far into the state (at logs and saves, and at the end)."""
        self.store_flos()
        self.store_input_tokens()

    def token_logs(self, start_time=None) -> dict:
        """What HF's `Trainer.log` adds with `include_num_input_tokens_seen`: the count, and with the training's
        `start_time` (step logs) the runtime and tokens per second of this `train()` call."""
        run = self.run
        if run.args.include_num_input_tokens_seen == "no":
            return {}
        logs = {"num_input_tokens_seen": run.state.num_input_tokens_seen}
        if start_time is not None:
            tokens = run.state.num_input_tokens_seen - self.initial_tokens_seen
            logs.update(speed_metrics("train", start_time, num_tokens=tokens))
        return logs

    def log_training_progress(self) -> None:
        """The step log: mean loss per optimizer step since the last log, pre-clip grad norm, LR."""
        run, context, last = self.run, self.context, self.last_step
        logs = {"loss": self.running_loss.read_for_log(context.accelerator, run.state.global_step)}
        grad_norm = last.grad_norm if last is not None else None
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
        lr = last.learning_rate if last is not None else None
        # torchao's low-bit optimizers keep lr as a (host) tensor; HF logs a float, and state JSON needs one.
        logs["learning_rate"] = lr.item() if isinstance(lr, torch.Tensor) else lr
        self.store_work()
        context.log(observer_logs(self.observers, logs, run.state), self.start_time)

    def after_step(self, ignore_keys_for_eval=None) -> None:
        """HF's `_maybe_log_save_evaluate`: act on `control.should_log / should_evaluate / should_save`."""
        run, context = self.run, self.context
        control = run.control
        self.announce_saves()  # an asynchronous save committed since the last step: its on_save first
        if control.should_evaluate:
            self.store_input_tokens()  # the evaluation's log shows the count
        if control.should_log and run.state.global_step > self.running_loss.last_logged_step:
            with context.clock.span("logging"):  # where a GPU run waits for its device (the loss read)
                self.log_training_progress()
        if control.should_evaluate:
            rng_before = rng_state() if context.preemption.active else None
            try:
                with context.clock.span("evaluation"):
                    metrics = self.evaluate_during_training(ignore_keys_for_eval)
            except EvaluationInterrupted:
                # Preempted mid-evaluation: the checkpoint the loop now writes remembers the evaluation (and the
                # save that would have followed) and the RNG from before it; a resumed run does them first.
                self.pending_evaluation = {"should_save": bool(control.should_save)}
                context.checkpointer.rng_for_next_save = rng_before
                return
            is_new_best = self.update_best_metric(metrics)
            if run.args.save_strategy == "best":
                control.should_save = is_new_best
        if run.control.should_save:
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        """A checkpoint of this step; its `on_save` once it is committed: at once for a synchronous save, later for
        an asynchronous one (`announce_saves`). The save in flight is waited for first, and announced."""
        self.announce_saves(wait=True)
        self.store_work()
        with self.context.clock.span("checkpoint"):
            self.save()
        self.run.control.should_save = False  # asked for and made (HF's on_save resets it; a late one resets none)
        self.announce_saves()

    def announce_saves(self, wait: bool = False) -> None:
        """`on_save` for each checkpoint committed since the last announcement (`wait`: first wait for the save in
        flight), on the training thread. A synchronous save is announced right after it, with the run's state, as
        HF does. A late one (asynchronous) gets the state its checkpoint holds (`global_step` its step, the
        `log_history` up to it), and resets no flag: the step it is announced at keeps its own `should_save`."""
        events = self.context.events
        for saved in self.context.checkpointer.take_committed(wait):
            if saved.state is None:
                events.fire("on_save")
            else:
                events.fire_with_state("on_save", saved.state)

    def run_pending_evaluation(self, resume, ignore_keys_for_eval=None) -> None:
        """After a resume: the evaluation a preemption interrupted, and the save scheduled after it. It starts from
        the RNG state saved before it, and training then continues from the state it leaves."""
        pending, self.pending_evaluation = self.pending_evaluation, None
        if pending is None or resume is None:
            return
        if resume.rng is not None:
            restore_rng_state(resume.rng)
        self.run.control.should_evaluate = True
        self.run.control.should_save = pending["should_save"]
        self.after_step(ignore_keys_for_eval)
        resume.rng = rng_state()

    def evaluate_during_training(self, ignore_keys=None, skip_scheduler=False) -> dict:
        metrics = self.evaluate(ignore_keys=ignore_keys)
        scheduler = self.run.lr_scheduler
        if steps_on_metrics(scheduler) and not skip_scheduler:
            key = best_metric_key(self.run.args)
            if key not in metrics:
                raise metric_not_found(self.run.args, key, metrics, "Please ensure that the `compute_metrics` "
                                       f"function returns a dictionary that includes '{key}' or consider changing "
                                       "the `metric_for_best_model` via the TrainingArguments.")
            scheduler.step(metrics[key])
        return metrics

    def update_best_metric(self, metrics: dict) -> bool:
        """HF's `_determine_best_metric`: whether this evaluation is the best so far (then recorded in `state`)."""
        args, state = self.run.args, self.run.state
        if args.metric_for_best_model is None:
            return False
        key = best_metric_key(args)
        if key not in metrics:
            raise metric_not_found(args, key, metrics, "Consider changing the `metric_for_best_model` via the "
                                   "TrainingArguments.")
        value = metrics[key]
        if state.best_metric is None:
            state.best_metric = -math.inf if args.greater_is_better else math.inf
        better = value > state.best_metric if args.greater_is_better else value < state.best_metric
        if better:
            state.best_metric = value
            if args.save_strategy in ("steps", "epoch", "best"):
                state.best_global_step = state.global_step
        return better

    def state_dict(self) -> dict:
        return {"pending_evaluation": self.pending_evaluation}


def running_loss_state(saved: dict) -> dict:
    """The running loss of a checkpoint: its own entry, or where checkpoints before the stage-contract redesign
    kept it (the step stage's `tr_loss` and the evaluation stage's `last_logged_step`)."""
    if "running_loss" in saved:
        return saved["running_loss"]
    return {"tr_loss": saved.get("step", {}).get("tr_loss", 0.0),
            "last_logged_step": saved.get("evaluation", {}).get("last_logged_step")}


def metric_not_found(args, key: str, metrics: dict, trainer_advice: str) -> KeyError:
    """Trainer's `KeyError` when the evaluation lacks `metric_for_best_model` (its words), with loopkit's fix."""
    return trainer_error(
        f"The `metric_for_best_model` training argument is set to '{key}', which is not found in the evaluation "
        f"metrics. The available evaluation metrics are: {list(metrics.keys())}. {trainer_advice}",
        "metric_for_best_model", args.metric_for_best_model, f"it looks for {key!r}, which the evaluation did not "
        "produce", "name one of those metrics (without or with the eval_ prefix), or return it from compute_metrics",
        kind=MetricNotFoundError)

