"""Hyperparameter search: HF Trainer's `hyperparameter_search` with the optuna backend, run by `Loop` (the method
is a thin call into `hyperparameter_search` here). Each trial sets its values on `args`, trains a new model from
`model_init(trial)` in `output_dir/run-<number>` and is scored by `compute_objective` of its last evaluation. Small
pieces of `transformers.trainer_utils` are copied (each says so): `import loopkit` must not load it.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
import warnings
from typing import Any, NamedTuple

from ..errors import config_error


class BestRun(NamedTuple):
    """What `hyperparameter_search` returns (copied from `transformers.trainer_utils.BestRun`)."""

    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_summary: Any | None = None


def default_compute_objective(metrics: dict[str, float]) -> float:
    """The eval loss if there are no other metrics, else their sum (copied from `transformers.trainer_utils`)."""
    metrics = copy.deepcopy(metrics)
    loss = metrics.pop("eval_loss", None)
    metrics.pop("epoch", None)
    for key in [m for m in metrics if m.endswith("_runtime") or m.endswith("_per_second")]:
        metrics.pop(key)
    return loss if len(metrics) == 0 else sum(metrics.values())


def default_hp_space_optuna(trial) -> dict[str, float]:
    """Copied from `transformers.trainer_utils.default_hp_space_optuna`."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-4, log=True),
        "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 5),
        "seed": trial.suggest_int("seed", 1, 40),
        "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [4, 8, 16, 32, 64]),
    }


class HyperparameterObjective:
    """During a search: the objective of each evaluation in training, reported to the trial (HF's
    `_report_to_hp_search`); a trial the sampler prunes stops with `optuna.TrialPruned`."""

    def __init__(self, loop, trial):
        self.loop, self.trial = loop, trial

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loop = self.loop
        loop.objective = loop.compute_objective(dict(metrics))
        study = getattr(self.trial, "study", None)
        if study is not None and not study._is_multi_objective():
            self.trial.report(loop.objective, state.global_step)
            if self.trial.should_prune():
                import optuna

                raise optuna.TrialPruned()


def hyperparameter_search(loop, hp_space=None, compute_objective=None, n_trials: int = 20,
                          direction: str | list[str] = "minimize", backend=None, hp_name=None, **kwargs):
    """HF's search with the optuna backend: each trial sets `hp_space(trial)` on `args`, trains a new model from
    `model_init(trial)` and is scored by `compute_objective` of its last evaluation (an `evaluate()` after
    training if none ran). Extra keywords go to `optuna.create_study` (`timeout`, `n_jobs`, `gc_after_trial`,
    `catch` to `study.optimize`). Returns a `BestRun` (a list of them for several directions)."""
    backend = str(getattr(backend, "value", backend) or "optuna")
    if backend != "optuna":
        raise config_error("backend", backend, "loopkit runs the optuna backend only", "pip install optuna and "
                           "use backend='optuna', or drive that backend yourself with model_init and "
                           "train(trial=...)")
    if importlib.util.find_spec("optuna") is None:
        raise ImportError("hyperparameter_search runs optuna, which is not installed. Fix: pip install optuna.")
    if loop.model_init is None:
        raise RuntimeError("To use hyperparameter search, you need to pass your model through a model_init "
                           "function: each trial trains a new model. Fix: Loop(model_init=..., ...).")
    loop.hp_space = default_hp_space_optuna if hp_space is None else hp_space
    loop.hp_name, loop.hp_search_backend = hp_name, "optuna"
    loop.compute_objective = default_compute_objective if compute_objective is None else compute_objective
    try:
        return run_optuna_search(loop, n_trials, direction, **kwargs)
    finally:
        loop.hp_search_backend = None


def run_optuna_search(loop, n_trials: int, direction, **kwargs):
    """HF's `run_hp_search_optuna`, one process."""
    import optuna

    optimize_kwargs = {key: kwargs.pop(key) for key in ("timeout", "n_jobs", "gc_after_trial", "catch")
                       if key in kwargs}
    several = isinstance(direction, list)
    study = optuna.create_study(direction=None if several else direction,
                                directions=direction if several else None, **kwargs)
    study.optimize(functools.partial(run_trial, loop), n_trials=n_trials, **optimize_kwargs)
    if several:
        return [BestRun(str(best.number), best.values, best.params) for best in study.best_trials]
    best = study.best_trial
    return BestRun(str(best.number), best.value, best.params)


def run_trial(loop, trial) -> float:
    """One trial, its checkpoints in `output_dir/run-<number>` (or `hp_name(trial)`) as in HF."""
    apply_trial_params(loop.args, loop.hp_space(trial))
    loop.objective = None
    reporter = HyperparameterObjective(loop, trial)
    loop.add_callback(reporter)
    output_dir = loop.args.output_dir
    loop.args.output_dir = os.path.join(output_dir, loop.hp_name(trial) if loop.hp_name is not None
                                        else f"run-{trial.number}")
    try:
        loop.train(trial=trial)
    finally:
        loop.remove_callback(reporter)
        loop.args.output_dir = output_dir
    if loop.objective is None:  # no evaluation during training
        loop.objective = loop.compute_objective(loop.evaluate())
    return loop.objective


def apply_trial_params(args, params: dict) -> None:
    """Set a trial's values on `args`, cast to each field's type (HF's `_hp_search_setup`)."""
    for key, value in params.items():
        if not hasattr(args, key):
            warnings.warn(f"hyperparameter_search: the search space sets {key!r}, which is no field of "
                          f"{type(args).__name__}; it is ignored.")
            continue
        old = getattr(args, key)
        setattr(args, key, type(old)(value) if old is not None else value)
