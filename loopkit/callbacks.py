"""loopkit's own callbacks. Like every loopkit callback they are plain objects with HF's `on_*` event methods.

`EarlyStopping`: stop when the evaluation metric stops improving by a relative margin, e.g. "stop after 3
evaluations that improve the loss by less than 5%":

    loop = Loop(..., callbacks=[EarlyStopping(patience=3, min_relative_improvement=0.05)])

Its state (the count of evaluations without improvement, and the best value so far) is saved in every checkpoint
(`trainer_state.json`, `stateful_callbacks`, HF's `ExportableState` layout) and, unlike HF callbacks, restored on resume
whether or not `restore_callback_states_from_checkpoint` is set: a resumed run keeps counting where it stopped.
"""

from __future__ import annotations

import math
import warnings


class RestoredOnResume:
    """Mixin for callbacks whose `state()` must survive a resume unconditionally.

    `state()` is HF's `ExportableState`: `{"args": constructor arguments, "attributes": running values}`. The loop
    writes it into every checkpoint. At `on_train_begin` the run's `state.stateful_callbacks` is the checkpoint's when
    resuming and empty when starting fresh, so the callback resets itself, then takes its saved attributes back.
    Duplicates of one class are matched by their arguments (else by order), as HF saves them as a list.
    """

    def reset(self) -> None:
        raise NotImplementedError

    def state(self) -> dict:
        raise NotImplementedError

    def restore_from(self, stateful_callbacks: dict) -> bool:
        saved = stateful_callbacks.get(type(self).__name__)
        if saved is None:
            return False
        entries = saved if isinstance(saved, list) else [saved]
        mine = self.state()["args"]
        entry = next((e for e in entries if e.get("args") == mine), entries[0])
        for key, value in entry.get("attributes", {}).items():
            setattr(self, key, value)
        return True

    def on_train_begin(self, args, state, control, **kwargs):
        self.reset()
        self.restore_from(state.stateful_callbacks or {})


class EarlyStopping(RestoredOnResume):
    """Stop training after `patience` evaluations in a row that do not improve the metric by more than
    `min_relative_improvement` relative to the best value so far.

    An evaluation improves when `(best - current) / max(|best|, eps) > min_relative_improvement` for a metric to
    minimise (`(current - best) / ...` for one to maximise). The first evaluation always counts as an improvement.
    The best value is updated by any better value (like `state.best_metric`), so a slow drift is measured against the
    latest best. `metric` and `greater_is_better` default to `metric_for_best_model` and `greater_is_better` from the
    training arguments (`"loss"`, lower is better, if none is set).
    """

    def __init__(self, patience: int = 1, min_relative_improvement: float = 0.0, metric: str | None = None,
                 greater_is_better: bool | None = None, eps: float = 1e-12):
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping(patience={patience!r}): the number of evaluations without improvement "
                             f"before stopping. Fix: pass a positive integer.")
        if not min_relative_improvement >= 0:
            raise ValueError(f"EarlyStopping(min_relative_improvement={min_relative_improvement!r}): a fraction of "
                             f"the best value, e.g. 0.05 for 5%. Fix: pass a number >= 0.")
        self.patience, self.min_relative_improvement = patience, min_relative_improvement
        self.metric, self.greater_is_better, self.eps = metric, greater_is_better, eps
        self.warned_missing = False
        self.reset()

    def reset(self) -> None:
        self.evaluations_without_improvement = 0
        self.best_value = None

    def state(self) -> dict:
        return {
            "args": {"patience": self.patience, "min_relative_improvement": self.min_relative_improvement,
                     "metric": self.metric, "greater_is_better": self.greater_is_better, "eps": self.eps},
            "attributes": {"evaluations_without_improvement": self.evaluations_without_improvement,
                           "best_value": self.best_value},
        }

    def metric_key(self, args) -> str:
        name = self.metric or args.metric_for_best_model or "loss"
        return name if name.startswith("eval_") else f"eval_{name}"

    def maximises(self, args) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        if self.metric is None and args.metric_for_best_model is not None and args.greater_is_better is not None:
            return args.greater_is_better
        return not self.metric_key(args).endswith("loss")

    def relative_improvement(self, current: float, maximise: bool) -> float:
        gain = current - self.best_value if maximise else self.best_value - current
        return gain / max(abs(self.best_value), self.eps)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        key = self.metric_key(args)
        if metrics is None or key not in metrics:
            # Evaluating a dict of datasets fires on_evaluate once per dataset; only one of them has the key.
            if not self.warned_missing:
                warnings.warn(f"EarlyStopping watches {key!r}, which this evaluation did not produce (it has "
                              f"{sorted(metrics or {})}); it is not counted. Fix, if no evaluation has it: "
                              f"EarlyStopping(metric=...) or metric_for_best_model naming one of those.")
                self.warned_missing = True
            return control
        current, maximise = float(metrics[key]), self.maximises(args)
        if not math.isfinite(current):
            self.evaluations_without_improvement += 1
        elif self.best_value is None:
            self.best_value = current
            self.evaluations_without_improvement = 0
        else:
            if self.relative_improvement(current, maximise) > self.min_relative_improvement:
                self.evaluations_without_improvement = 0
            else:
                self.evaluations_without_improvement += 1
            if (current > self.best_value) if maximise else (current < self.best_value):
                self.best_value = current
        if self.evaluations_without_improvement >= self.patience:
            control.should_training_stop = True
        return control
