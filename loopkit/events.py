"""Events: HF Trainer's callback protocol, reimplemented without importing `transformers.trainer_callback`.

Every event gets `args, state, control` positionally and the keywords `model, processing_class, optimizer,
lr_scheduler, train_dataloader, eval_dataloader` (plus `logs=` for `on_log`, `metrics=` for `on_evaluate` and
`on_predict`). Callbacks run in list order; a callback that returns a control replaces the one later callbacks see.
The handler resets flags before dispatch exactly as HF's `CallbackHandler` does. Any object with `on_*` methods is a
callback (duck typing), so unmodified `transformers.TrainerCallback`s work.

Stages receive events too: a stage that defines an `on_*` method is called before the callbacks for that event.

loopkit adds two events HF lacks:
* `on_gradients_ready(args, state, control, **kwargs)`: after the last backward of an optimizer step, gradients
  accumulated and unscaled (fp16), **before** clipping. Per-layer gradient monitoring belongs here; HF's
  `on_pre_optimizer_step` only sees clipped gradients.
* `on_train_failed(args, state, control, exception=..., **kwargs)`: an exception escaped the run; fired before it
  propagates.
"""

from __future__ import annotations

import time

import tqdm.auto as tqdm_auto

# HF's 16 events, in the order a run meets them, then loopkit's additions.
HF_EVENTS = (
    "on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end", "on_pre_optimizer_step",
    "on_optimizer_step", "on_step_end", "on_log", "on_prediction_step", "on_evaluate", "on_save", "on_epoch_end",
    "on_train_end", "on_predict", "on_push_begin",
)
LOOPKIT_EVENTS = ("on_gradients_ready", "on_train_failed")
EVENTS = HF_EVENTS + LOOPKIT_EVENTS

# The handler's own flag resets, done before any callback runs (HF's CallbackHandler).
FLAG_RESETS = {
    "on_train_begin": lambda c: c._new_training(),
    "on_epoch_begin": lambda c: c._new_epoch(),
    "on_step_begin": lambda c: c._new_step(),
    "on_log": lambda c: setattr(c, "should_log", False),
    "on_evaluate": lambda c: setattr(c, "should_evaluate", False),
    "on_save": lambda c: setattr(c, "should_save", False),
}


def is_noop(method) -> bool:
    """True for the empty default methods of `transformers.TrainerCallback` (skipped: they cost time every step)."""
    qualname = getattr(getattr(method, "__func__", None), "__qualname__", "")
    return qualname.startswith("TrainerCallback.")


class EventHandler:
    """Holds the callbacks (and the stages, which hear events first) and fires events.

    The per-event lists of bound methods are built once (and rebuilt when callbacks change), so firing an event that
    nobody listens to costs a dict lookup and a flag reset.
    """

    def __init__(self, callbacks, stages):
        self.callbacks = []
        self.stages = list(stages)
        self.clock = None  # a report.PhaseClock: callback time is counted under "callbacks"
        for cb in callbacks:
            self.add_callback(cb)
        self._rebuild()  # the stages' listeners, with no callback at all

    # -- the callback list (Trainer.add_callback / pop_callback / remove_callback) --
    def add_callback(self, callback):
        cb = callback() if isinstance(callback, type) else callback
        cb_class = callback if isinstance(callback, type) else type(callback)
        if any(type(c) is cb_class for c in self.callbacks):
            import warnings

            warnings.warn(f"You are adding a {cb_class.__name__} to the callbacks but there is one already.")
        self.callbacks.append(cb)
        self._rebuild()

    def pop_callback(self, callback):
        for cb in self.callbacks:
            if (isinstance(callback, type) and type(cb) is callback) or cb is callback:
                self.callbacks.remove(cb)
                self._rebuild()
                return cb
        return None

    def remove_callback(self, callback):
        self.pop_callback(callback)

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def _rebuild(self):
        self.listeners = {}
        for event in EVENTS:
            methods = [getattr(s, event) for s in self.stages if callable(getattr(s, event, None))]
            methods += [m for m in (getattr(cb, event, None) for cb in self.callbacks)
                        if callable(m) and not is_noop(m)]
            self.listeners[event] = methods

    def has_listeners(self, event: str) -> bool:
        return bool(self.listeners[event])

    # -- dispatch --
    def fire(self, event: str, run, **extra):
        """Call every listener of `event` with HF's arguments, taken from `run` (a `loopkit.run.RunState`);
        returns the control (`RunState.fire` stores it)."""
        args, state, control = run.args, run.state, run.control
        reset = FLAG_RESETS.get(event)
        if reset is not None:
            reset(control)
        methods = self.listeners[event]
        if not methods:
            return control
        kwargs = {**run.event_objects(), **extra}
        start = time.perf_counter()
        for method in methods:
            result = method(args, state, control, **kwargs)
            if result is not None and event != "on_push_begin":
                control = result
        if self.clock is not None:
            self.clock.add("callbacks", time.perf_counter() - start)
        return control


class DefaultFlow:
    """HF's `DefaultFlowCallback` rules (5.24): when to log, evaluate, save and stop."""

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and step % state.eval_steps == 0 and args.eval_delay <= step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            # 5.x: a forced final evaluation when the last step is not an evaluation step.
            if args.eval_strategy == "steps" and step % state.eval_steps != 0 and args.eval_delay <= step:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= state.epoch:
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


def format_logs(logs: dict) -> dict:
    return {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}


class ProgressBar:
    """A tqdm bar over optimizer steps and one over evaluation batches; logs are written above the bar."""

    def __init__(self):
        self.training_bar = self.prediction_bar = None
        self.current_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = tqdm_auto.tqdm(total=state.max_steps, dynamic_ncols=True)
        self.current_step = state.global_step
        if self.training_bar is not None:
            self.training_bar.update(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.update(state.global_step - self.current_step)
            self.current_step = state.global_step

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and hasattr(eval_dataloader, "__len__"):
            if self.prediction_bar is None:
                self.prediction_bar = tqdm_auto.tqdm(total=len(eval_dataloader), leave=self.training_bar is None,
                                                     dynamic_ncols=True)
            self.prediction_bar.update(1)

    def _close_prediction_bar(self, *args, **kwargs):
        if self.prediction_bar is not None:
            self.prediction_bar.close()
        self.prediction_bar = None

    on_evaluate = on_predict = _close_prediction_bar

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.training_bar is not None:
            self.training_bar.write(str(format_logs(logs)))

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            self.training_bar.close()
        self.training_bar = None


class Printer:
    """Prints each log dict (HF's `PrinterCallback`, used when `disable_tqdm=True`)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs.pop("total_flos", None)  # HF mutates the shared dict; kept for identical `TrainOutput.metrics`.
        if state.is_local_process_zero:
            print(format_logs(logs))


def reporting_callbacks(report_to) -> list:
    """HF's integration callbacks for `report_to` (TensorBoard, W&B, ...), imported only when asked for."""
    if not report_to:
        return []
    from transformers.integrations import get_reporting_integration_callbacks

    return list(get_reporting_integration_callbacks(report_to))
