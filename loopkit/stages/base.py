"""What every stage shares: the run state and context it is bound to, checkpointable state, and the lifecycle.

Lifecycle of a stage within a `Loop` (see docs/stages.md for each stage's contract):

    stage.bind(run, context)     once, in Loop.__init__: `self.run` is the `loopkit.run.RunState` (the run's state),
                                 `self.context` the `loopkit.run.RunContext` (its services: the accelerator, the
                                 events, the checkpoint storage, ...; and the callables one stage offers another)
    stage.load_state_dict(d)     at each train(): {} for a fresh run, the checkpoint's entry when resuming
    stage.prepare(...)           at each train(), where the stage has one (data: plan; step: optimizer, prepare)
    stage.on_<event>(...)        during the run: a stage hears each event before the callbacks do
    stage.state_dict()           at each checkpoint: JSON values, written to `loopkit_state.json`, and tensors,
                                 written to safetensors (a state holding tensors is this process's own)

A stage reads what it needs from `self.run`, `self.context` and the arguments of its methods, writes only the
run-state fields the table in `loopkit/run.py` gives it (never a context field: what it makes for the context, it
returns), and returns what it produces. It fires events through `self.context.events.fire(...)`. It never reads
another stage's attributes or the `Loop`'s, so it can be built and tested with a small `RunState` and `RunContext`
and no `Loop` at all.
"""

from __future__ import annotations

from ..models import base_model  # noqa: F401 (re-exported: it lives in loopkit/models.py, below every layer)


class Stage:
    """One phase of a run, bound to a `RunState` and a `RunContext`."""

    run = None
    context = None

    def bind(self, run, context) -> "Stage":
        self.run, self.context = run, context
        return self

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
