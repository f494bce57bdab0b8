"""Events: HF Trainer's callback protocol, reimplemented without importing `transformers.trainer_callback`.

Every event gets `args, state, control` positionally and the keywords `model, processing_class, optimizer,
lr_scheduler, train_dataloader, eval_dataloader` (plus `logs=` for `on_log`, `metrics=` for `on_evaluate` and
`on_predict`). Callbacks run in list order; a callback that returns a control replaces the one later callbacks see.
The handler resets flags before dispatch exactly as HF's `CallbackHandler` does. Any object with `on_*` methods is a
callback (duck typing), so unmodified `transformers.TrainerCallback`s work. The default callbacks are HF's
`DefaultFlowCallback` and `ProgressCallback` / `PrinterCallback` / `NotebookProgressCallback` (`default_callbacks`);
in a process that has not imported `transformers.trainer_utils` (which imports peft), the first three start as
loopkit's quiet stand-ins and become HF's classes when user code can first see them (`callbacks`, `listeners`, add /
pop / remove: see loopkit/default_callbacks.py). The handler's own `on_<event>` methods
(`loop.callback_handler.on_evaluate(args, state, control, metrics)`) have HF's `CallbackHandler` signatures.

Stages receive events too: a stage that defines an `on_*` method is called before the callbacks for that event.

loopkit adds events HF lacks (a callback without the method, such as an unmodified `TrainerCallback`, is simply
not called for them: the handler lists only the `on_*` methods a listener has):
* `on_evaluate_begin` / `on_evaluate_end`, `on_predict_begin` / `on_predict_end`: first and last thing in each
  `evaluate()` (each evaluation set of a dict) and `predict()`; the end events fire even when the evaluation raises, so
  a listener that changed the model for it (weight averaging: loopkit/averaging.py) puts it back.
* `on_gradients_ready(args, state, control, **kwargs)`: after the last backward of an optimizer step, gradients
  accumulated and unscaled (fp16), **before** clipping. Per-layer gradient monitoring belongs here; HF's
  `on_pre_optimizer_step` only sees clipped gradients.
* `on_train_failed(args, state, control, exception=..., **kwargs)`: an exception escaped the run; fired before it
  propagates.
"""

from __future__ import annotations

import operator
import time

from .default_callbacks import become_hf_class, default_callback, hf_classes_are_free, is_stand_in

# HF's 16 events, in the order a run meets them, then loopkit's additions.
HF_EVENTS = (
    "on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end", "on_pre_optimizer_step",
    "on_optimizer_step", "on_step_end", "on_log", "on_prediction_step", "on_evaluate", "on_save", "on_epoch_end",
    "on_train_end", "on_predict", "on_push_begin",
)
LOOPKIT_EVENTS = ("on_gradients_ready", "on_train_failed", "on_evaluate_begin", "on_evaluate_end", "on_predict_begin",
                  "on_predict_end")
EVENTS = HF_EVENTS + LOOPKIT_EVENTS

# The handler's own flag resets, done before any callback runs (HF's CallbackHandler); `methodcaller`s, so a reset
# on the hot path (on_step_begin) costs no Python frame of its own.
FLAG_RESETS = {
    "on_train_begin": operator.methodcaller("_new_training"),
    "on_epoch_begin": operator.methodcaller("_new_epoch"),
    "on_step_begin": operator.methodcaller("_new_step"),
    "on_log": operator.methodcaller("__setattr__", "should_log", False),
    "on_evaluate": operator.methodcaller("__setattr__", "should_evaluate", False),
    "on_save": operator.methodcaller("__setattr__", "should_save", False),
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

    def __init__(self, callbacks, stages, run=None):
        # The list itself. loopkit's own bookkeeping (the callback states in checkpoints, `repr`) reads it, as it
        # reads only names and `state()`; users see it as `callbacks`, which first makes stand-ins HF's classes.
        self.callback_objects = []
        self.stages = list(stages)
        self.run = run  # the `RunState` whose objects HF's `on_<event>` / `call_event` calls pass to callbacks
        self.clock = None  # a phases.PhaseClock: callback time is counted under "callbacks"
        for cb in callbacks:
            self.append_callback(cb)
        self._rebuild()  # the stages' listeners, with no callback at all

    # -- the callback list (HF's `CallbackHandler.callbacks`; Trainer.add_callback / pop_callback / remove_callback)
    @property
    def callbacks(self) -> list:
        """HF's list of callbacks, in the order they run. Reading it makes loopkit's stand-ins instances of HF's
        classes first (loopkit/default_callbacks.py), so what user code finds is what it finds on Trainer."""
        self.reveal_hf_classes()
        return self.callback_objects

    @callbacks.setter
    def callbacks(self, callbacks: list):
        self.callback_objects = callbacks
        self._rebuild()

    def reveal_hf_classes(self) -> None:
        """Make every stand-in in the list an instance of HF's class of its name (in place: same object, same
        state); a no-op when there is none, which is the case unless a `LoopArgs` run left HF's module unimported."""
        if self.has_stand_ins:
            for cb in self.callback_objects:
                if is_stand_in(cb):
                    become_hf_class(cb)
            self._rebuild()

    def add_callback(self, callback):
        self.reveal_hf_classes()
        self.append_callback(callback)
        self._rebuild()

    def append_callback(self, callback):
        """HF's `CallbackHandler.add_callback`: an instance, or a class to instantiate; a duplicate class warns."""
        cb = callback() if isinstance(callback, type) else callback
        cb_class = callback if isinstance(callback, type) else type(callback)
        if cb_class in [type(c) for c in self.callback_objects]:
            import warnings

            warnings.warn(f"You are adding a {cb_class.__name__} to the callbacks but there is one already. The "
                          f"current list of callbacks is:\n{self.callback_list}")
        self.callback_objects.append(cb)

    def pop_callback(self, callback):
        """Remove and return the first callback that is an instance of class `callback`, or equals `callback`;
        None if there is none (HF's `CallbackHandler.pop_callback`)."""
        self.reveal_hf_classes()
        for cb in self.callback_objects:
            if isinstance(cb, callback) if isinstance(callback, type) else cb == callback:
                self.callback_objects.remove(cb)
                self._rebuild()
                return cb
        return None

    def remove_callback(self, callback):
        if self.pop_callback(callback) is None and not isinstance(callback, type):
            raise ValueError(f"remove_callback: {callback!r} is not among the callbacks ({self.callback_list!r}). "
                             f"Fix: pass an instance from loop.callback_handler.callbacks, or a class.")

    @property
    def callback_list(self) -> str:
        """The callbacks' class names, one a line (HF's; a stand-in has the name of HF's class)."""
        return "\n".join(type(cb).__name__ for cb in self.callback_objects)

    def _rebuild(self):
        self.methods_by_event = {}
        for event in EVENTS:
            methods = [getattr(s, event) for s in self.stages if callable(getattr(s, event, None))]
            methods += [m for m in (getattr(cb, event, None) for cb in self.callback_objects)
                        if callable(m) and not is_noop(m)]
            self.methods_by_event[event] = methods
        self.has_stand_ins = any(is_stand_in(cb) for cb in self.callback_objects)

    @property
    def listeners(self) -> dict:
        """Event -> the bound methods it calls, stages' first, in order (what `loop.show_wiring()` prints)."""
        self.reveal_hf_classes()
        return self.methods_by_event

    def has_listeners(self, event: str) -> bool:
        return bool(self.methods_by_event[event])

    # -- dispatch --
    def fire(self, event: str, **extra):
        """The handler's flag resets for `event`, then every listener with HF's arguments taken from the run state;
        the control they return becomes `run.control` (HF's protocol), and is returned."""
        run = self.run
        reset = FLAG_RESETS.get(event)
        if reset is not None:
            reset(run.control)
        if not self.methods_by_event[event]:  # the common case on the hot path: a lookup and nothing else
            return run.control
        kwargs = run.event_objects()  # a new dict at every event, as HF's
        if extra:
            kwargs.update(extra)
        run.control = self.dispatch(event, run.args, run.state, run.control, kwargs)
        return run.control

    def fire_with_state(self, event: str, state):
        """`event` with `state` in place of the run's (a late `on_save`: the state its checkpoint holds) and no flag
        resets; the control the listeners return becomes `run.control`, as with `fire`."""
        run = self.run
        run.control = self.call_event(event, run.args, state, run.control)
        return run.control

    def call_event(self, event: str, args, state, control, **kwargs):
        """HF's `CallbackHandler.call_event`: `event` on the stages and callbacks in order, without flag resets, with
        the run's objects as keywords; returns the final control."""
        objects = self.run.event_objects() if self.run is not None else {}
        return self.dispatch(event, args, state, control, {**objects, **kwargs})

    def dispatch(self, event: str, args, state, control, kwargs: dict):
        methods = self.methods_by_event[event]
        if not methods:
            return control
        start = time.perf_counter()
        ignores_results = event == "on_push_begin"  # HF ignores what these callbacks return
        for method in methods:
            result = method(args, state, control, **kwargs)
            if result is not None and not ignores_results:
                control = result
        if self.clock is not None:
            self.clock.add("callbacks", time.perf_counter() - start)
        return control

    # -- HF's CallbackHandler attributes: the run's current objects --
    model = property(lambda self: self.run.model if self.run is not None else None)
    processing_class = property(lambda self: self.run.processing_class if self.run is not None else None)
    optimizer = property(lambda self: self.run.event_objects()["optimizer"] if self.run is not None else None)
    lr_scheduler = property(lambda self: self.run.event_objects()["lr_scheduler"] if self.run is not None else None)
    train_dataloader = property(lambda self: self.run.train_dataloader if self.run is not None else None)
    eval_dataloader = property(lambda self: self.run.eval_dataloader if self.run is not None else None)


# HF's CallbackHandler takes these events' payload as a fourth positional parameter (`on_evaluate(args, state,
# control, metrics)`, as HF's question-answering example calls it); every other event takes keywords only.
PAYLOAD_PARAMETERS = {"on_evaluate": "metrics", "on_predict": "metrics", "on_log": "logs"}


def event_method(event: str):
    """`EventHandler.on_<event>` with HF's `CallbackHandler` signature: reset the event's flags, then `call_event`."""
    reset = FLAG_RESETS.get(event, lambda control: None)
    payload = PAYLOAD_PARAMETERS.get(event)
    if payload == "metrics":
        def method(self, args, state, control, metrics, **kwargs):
            reset(control)
            return self.call_event(event, args, state, control, metrics=metrics, **kwargs)
    elif payload == "logs":
        def method(self, args, state, control, logs, **kwargs):
            reset(control)
            return self.call_event(event, args, state, control, logs=logs, **kwargs)
    else:
        def method(self, args, state, control, **kwargs):
            reset(control)
            return self.call_event(event, args, state, control, **kwargs)

    method.__name__ = method.__qualname__ = event
    method.__doc__ = f"Fire `{event}` (HF's `CallbackHandler.{event}`)."
    return method


for _event in EVENTS:
    setattr(EventHandler, _event, event_method(_event))


def default_callbacks(args, callbacks, progress) -> list:
    """HF Trainer's callback list: its `DefaultFlowCallback`, the `report_to` integrations, the user's `callbacks`,
    then `progress` (the printer, tqdm bars or the notebook display: loopkit/trainer/notebook.py; None: none). The
    defaults are HF's
    classes when their module is free to import, else loopkit's stand-ins, which become HF's classes when user code
    can first see them (loopkit/default_callbacks.py); `import loopkit` imports neither."""
    integrations = reporting_callbacks(args.report_to)  # their module imports HF's callback module
    flow = default_callback("DefaultFlowCallback")
    if hf_classes_are_free() and is_stand_in(progress):  # made before an integration imported HF's module
        become_hf_class(progress)
    return [flow] + integrations + list(callbacks or []) + ([progress] if progress is not None else [])


def reporting_callbacks(report_to) -> list:
    """HF's integration callbacks for `report_to` (TensorBoard, W&B, ...), imported only when asked for."""
    if not report_to:
        return []
    from transformers.integrations import get_reporting_integration_callbacks

    return list(get_reporting_integration_callbacks(report_to))
