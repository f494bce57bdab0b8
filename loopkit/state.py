"""The run's shared records: `LoopState` and `LoopControl` (field-for-field HF's `TrainerState`/`TrainerControl`),
and the result tuples `train`, `evaluate` and `predict` return.

They are our own classes so that `import loopkit` never pays for `transformers.trainer_callback`; they have HF's field
names, JSON layout (`trainer_state.json`, sorted keys) and the `ExportableState` protocol (`state()`), so HF
callbacks read and write them unchanged and HF Trainer resumes from our `trainer_state.json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple


def is_exportable(callback) -> bool:
    """HF's `ExportableState` protocol, by duck typing: a `state()` method returning `{"args", "attributes"}`."""
    return callable(getattr(callback, "state", None)) and not isinstance(callback, type)


@dataclass
class LoopState:
    """Everything about the run's progress that callbacks read and `trainer_state.json` stores."""

    epoch: float = 0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict | None = None
    stateful_callbacks: dict = field(default_factory=dict)

    def compute_steps(self, args, max_steps: int) -> None:
        """Intervals below 1 are fractions of `max_steps` (HF: `ceil(max_steps * value)`)."""
        for kind in ("logging", "eval", "save"):
            value = getattr(args, f"{kind}_steps")
            if value is not None:
                setattr(self, f"{kind}_steps", math.ceil(max_steps * value) if value < 1 else value)

    def record_callback_states(self, callbacks) -> None:
        """Refresh `stateful_callbacks` (class name -> state, a list for duplicates), as HF does at each save."""
        states: dict[str, Any] = {}
        for callback in callbacks:
            if not is_exportable(callback):
                continue
            name = state_name(callback)
            if name in states:
                if not isinstance(states[name], list):
                    states[name] = [states[name]]
                states[name].append(callback.state())
            else:
                states[name] = callback.state()
        self.stateful_callbacks = states

    def to_json_string(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    def save_to_json(self, json_path: str) -> None:
        with open(json_path, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())

    @classmethod
    def load_from_json(cls, json_path: str) -> "LoopState":
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class LoopControl:
    """The flags callbacks set to steer the run; the event handler resets them as HF's `CallbackHandler` does."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self):
        self.should_training_stop = False

    def _new_epoch(self):
        self.should_epoch_stop = False

    def _new_step(self):
        self.should_save = self.should_evaluate = self.should_log = False

    def state(self) -> dict:
        return {"args": dataclasses.asdict(self), "attributes": {}}


# HF's name for the class key in `stateful_callbacks`; HF Trainer restores its control from this key.
CONTROL_STATE_NAME = "TrainerControl"


def state_name(callback) -> str:
    """The key of `callback` in `stateful_callbacks`: its class name, HF's for the control (so the two read each
    other's `trainer_state.json`)."""
    return CONTROL_STATE_NAME if isinstance(callback, LoopControl) else type(callback).__name__


def restore_callback_states(callbacks, saved: dict) -> None:
    """HF's `restore_callback_states_from_checkpoint`: re-create stateful callbacks (and the control) from the
    checkpoint's `stateful_callbacks`. HF re-creates each as `type(cb)(**args)` and sets the saved attributes; loopkit
    does the same but copies the result into the existing object, so a reference the user holds stays live and the
    callback keeps its place in the list."""
    present = {state_name(callback) for callback in callbacks}
    missing = [name for name in saved if name not in present]
    if missing:  # HF's warning, word for word
        import warnings

        warnings.warn(f"Checkpoint included callbacks not included in current configuration. Ignoring. "
                      f"({', '.join(missing)})")
    seen: dict[str, int] = {}
    for callback in callbacks:
        name = state_name(callback)
        if name not in saved:
            continue
        entries = saved[name] if isinstance(saved[name], list) else [saved[name]]
        index = seen[name] = seen.get(name, -1) + 1  # duplicates of a class restore in order, as in HF
        if index >= len(entries):
            continue
        entry = entries[index]
        restored = type(callback)(**entry.get("args", {}))
        for key, value in entry.get("attributes", {}).items():
            setattr(restored, key, value)
        vars(callback).update(vars(restored))


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict


class EvalLoopOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict | None
    num_samples: int | None


class PredictionOutput(NamedTuple):
    predictions: Any
    label_ids: Any
    metrics: dict | None


class EvalPrediction:
    """What `compute_metrics` receives: `.predictions`, `.label_ids`, `.inputs`, `.losses`, and it unpacks as
    `(predictions, label_ids[, inputs][, losses])`, exactly like `transformers.EvalPrediction`."""

    def __init__(self, predictions, label_ids, inputs=None, losses=None):
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        self.elements = (predictions, label_ids) + tuple(x for x in (inputs, losses) if x is not None)

    def __iter__(self):
        return iter(self.elements)

    def __getitem__(self, idx):
        if idx < 0 or idx >= len(self.elements):
            raise IndexError("tuple index out of range")
        return self.elements[idx]

    def __len__(self):
        return len(self.elements)


def best_metric_key(args) -> str:
    """`eval_<metric_for_best_model>` (HF adds the prefix unless it is there)."""
    name = args.metric_for_best_model
    return name if name.startswith("eval_") else f"eval_{name}"


def best_checkpoint_to_load(args, state) -> str | None:
    """The checkpoint whose weights the end of training loads (`load_best_model_at_end`), or None: one rule for the
    teardown, which loads it, and for what follows that load (the weight averaging's best average)."""
    return state.best_model_checkpoint if args.load_best_model_at_end else None
