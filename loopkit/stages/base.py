"""What every stage shares: a reference to the `Loop` it serves, and checkpointable state."""

from __future__ import annotations


class Stage:
    """One phase of a run. `Loop` binds each stage to itself; a stage reads and writes the run through `self.loop`.

    A stage may define any event method (`on_epoch_end`, ...): it is called before the callbacks for that event.
    `state_dict()` / `load_state_dict()` carry what the stage must remember across a resume (JSON values only).
    """

    loop = None

    def bind(self, loop) -> "Stage":
        self.loop = loop
        return self

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def base_model(model):
    """The model under a PEFT wrapper (its forward signature and class decide columns, labels and loss counting)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
