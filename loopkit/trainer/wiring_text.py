"""The wiring of a `Loop`, as text: who runs at each event, and where each of HF's overridable methods runs.

`loop.show_wiring()` prints `wiring_text(loop)`. Events are listed in the order a run meets them; under each, the
stage methods and then the callbacks, in the order they run (the event handler's per-event lists, so what is printed
is what fires; HF's empty `TrainerCallback` methods are skipped there, and so here). Step observers appear where
they run: after `on_step_end`, and at each training log before `on_log`. Then each overridable method, the stage
that calls it, and what that call reaches: the stage's own method, or a `Loop` subclass's override bound onto it
(loopkit/trainer/overridable.py).
"""

from __future__ import annotations

from .overridable import OWNERS

# EVENTS in the order a run meets them: loopkit's on_gradients_ready inside the step, on_evaluate_begin / _end and
# on_predict_begin / _end around HF's evaluation and prediction events, on_train_failed at the end.
FIRING_ORDER = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
                "on_gradients_ready", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log",
                "on_evaluate_begin", "on_prediction_step", "on_evaluate", "on_evaluate_end", "on_save", "on_epoch_end",
                "on_train_end", "on_train_failed", "on_predict_begin", "on_predict", "on_predict_end", "on_push_begin")
EVENT_WIDTH = max(len(event) for event in FIRING_ORDER) + 2
METHOD_WIDTH = max(len(name) for name in OWNERS) + 2


def listener_text(method, event: str, stage_names: dict) -> str:
    """`step stage      MyStep.on_step_end` or `callback        MyCallback.on_log`, with the class that defines the
    method when it is inherited."""
    owner = getattr(method, "__self__", None)
    if owner is None:  # a plain function set as a callback's attribute
        return f"{'callback':<16}{method!r}"
    kind = f"{stage_names[id(owner)]} stage" if id(owner) in stage_names else "callback"
    text = f"{kind:<16}{type(owner).__name__}.{event}"
    defined_in = getattr(getattr(method, "__func__", None), "__qualname__", None)
    return text if defined_in in (None, f"{type(owner).__name__}.{event}") else f"{text}  (defined in {defined_in})"


def event_lines(loop) -> list[str]:
    stage_names = {id(stage): name for name, stage in zip(loop.stage_classes, loop.stages)}
    if getattr(loop, "averaging", None) is not None:
        stage_names[id(loop.averaging)] = "averaging"
    observers = [type(observer).__name__ for observer in loop.schedule.observers]
    lines = ["Events, in the order a run meets them (stages first, then callbacks, each in the order it runs):"]
    for event in FIRING_ORDER:
        if event == "on_log" and observers:
            lines.append(f"  {'(training logs)':<{EVENT_WIDTH}}step observers' logs(): {', '.join(observers)}")
        listeners = loop.callback_handler.listeners[event]
        first = listener_text(listeners[0], event, stage_names) if listeners else "(nobody)"
        lines.append(f"  {event:<{EVENT_WIDTH}}{first}")
        lines += [f"  {'':<{EVENT_WIDTH}}{listener_text(method, event, stage_names)}" for method in listeners[1:]]
        if event == "on_step_end" and observers:
            lines.append(f"  {'(after each step)':<{EVENT_WIDTH}}step observers' on_step(): {', '.join(observers)}")
    return lines


def method_lines(loop) -> list[str]:
    lines = ["HF's overridable methods: the stage that calls each, and what the call runs:"]
    for name, owner in OWNERS.items():
        stage = getattr(loop, owner)
        method = getattr(stage, name)
        runs = getattr(getattr(method, "__func__", method), "__qualname__", repr(method))
        if name in vars(stage):  # put onto the stage from the Loop (overridable.bind_override)
            runs = f"{type(loop).__name__}.{name} (the Loop subclass's override)" \
                if getattr(method, "__self__", None) is loop else f"{runs} (set on the Loop)"
        lines.append(f"  {name:<{METHOD_WIDTH}}{owner + ' stage':<18}{runs}")
    return lines


def wiring_text(loop) -> str:
    """What `loop.show_wiring()` prints."""
    return "\n".join(event_lines(loop) + [""] + method_lines(loop))
