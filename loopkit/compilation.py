"""torch.compile during a run: how many compilations, and the seconds they took (the run report's "compile" phase).

`CompileWatch` registers a start and an end callback with dynamo's compilation callback handler
(`torch._dynamo.callback_handler`, torch 2.13). Dynamo runs them around every frame it compiles (a first call, and
each recompilation when a guard fails, e.g. on a new input shape) and around a backward graph compiled lazily at its
first call; nested compilations fire once. Each compilation's seconds go to the clock's "compile" phase, which the
enclosing phase (forward, evaluation, ...) then leaves out, so a first step dominated by compiling is reported as
compile time, not step time. Nothing runs between compilations: no cost per step.

The watch runs when `torch_compile` is on, or when dynamo is already imported at the start of `train()` (a model the
user compiled); otherwise importing dynamo would cost a second for nothing.
"""

from __future__ import annotations

import sys
import time


def should_watch(args) -> bool:
    return bool(getattr(args, "torch_compile", False)) or "torch._dynamo" in sys.modules


class CompileWatch:
    """Counts compilations into `clock.compilations` and their seconds into `clock`'s "compile" phase."""

    def __init__(self, clock):
        from .private_api import dynamo_callbacks

        self.clock = clock
        self.handler, self.dynamo = dynamo_callbacks()
        self.started = None
        self.handler.register_start_callback(self.on_start)
        self.handler.register_end_callback(self.on_end)

    def on_start(self, callback_args) -> None:
        self.started = time.perf_counter()
        if callback_args.callback_trigger == self.dynamo:  # a lazily compiled backward belongs to its forward's
            self.clock.compilations += 1

    def on_end(self, callback_args) -> None:
        if self.started is not None:
            self.clock.add("compile", time.perf_counter() - self.started)
            self.started = None

    def stop(self) -> None:
        """Unregister (a `torch._dynamo.reset()` may have cleared the callbacks already)."""
        for remove, callback in ((self.handler.remove_start_callback, self.on_start),
                                 (self.handler.remove_end_callback, self.on_end)):
            try:
                remove(callback)
            except ValueError:
                pass
