"""The errors of a configuration loopkit cannot run with, and the helpers that word them: field, value, problem and
fix; the nearest name to a misspelt one; `plain`, the value of a str-enum argument.

A neutral module: every other module may import it, and it imports none of loopkit.
"""

from __future__ import annotations

import difflib
from typing import Any


class LoopConfigError(ValueError):
    """A configuration value loopkit cannot run with. The message names the field, the value and the fix."""


class UnknownArgumentError(LoopConfigError, TypeError):
    """A keyword `LoopArgs` has no field for (a `TypeError` too, as Python's own error for it is)."""


class RuntimeConfigError(LoopConfigError, RuntimeError):
    """A configuration loopkit cannot run with, where Trainer raises a `RuntimeError` for it (a `RuntimeError` too,
    so code written for Trainer catches it)."""


class MetricNotFoundError(LoopConfigError, KeyError):
    """`metric_for_best_model` names a metric the evaluation did not return (a `KeyError`, as Trainer raises)."""


def config_error(field_name: str, value: Any, problem: str, fix: str) -> LoopConfigError:
    return LoopConfigError(f"{field_name}={value!r}: {problem}. Fix: {fix}.")


def trainer_error(trainer_message: str, field_name: str, value: Any, problem: str, fix: str,
                  kind: type = LoopConfigError) -> LoopConfigError:
    """The error Trainer raises in the same situation: its exception type (`LoopConfigError` is a `ValueError`;
    `kind` for another) and its message, then loopkit's field, value, problem and fix, so that code matching
    either finds its words."""
    return kind(f"{trainer_message} ({field_name}={value!r}: {problem}. Fix: {fix}.)")


def nearest(name: str, candidates, n: int = 1) -> list[str]:
    """The (up to `n`) candidates closest to a misspelt `name` (difflib), closest first; [] when none is close."""
    return difflib.get_close_matches(name, sorted(candidates), n=n, cutoff=0.75)


def plain(value: Any) -> Any:
    """The plain value of a str-enum (`IntervalStrategy.STEPS` -> "steps"); anything else unchanged."""
    return getattr(value, "value", value)
