"""Recipe 11: `model_init` and a small hyper-parameter search: a few trials, each training a freshly initialised
model, and the best trial reported.

`Loop(model_init=...)` builds the model itself and rebuilds it (re-seeded) at every `train()` call, so one loop runs
every trial from the same starting point. `model_init(trial)` receives the trial and may read model settings from it
(here the classifier's dropout); training settings (here the learning rate) go into `loop.args` before `train()`.

Search: with `optuna` installed, `loop.hyperparameter_search(...)` (Trainer's method, optuna backend, TPE sampler):
`hp_space(trial)` returns the training settings it sets on `loop.args`, and each trial is scored by `evaluate()`
after training. Without optuna, a seeded random search with the same tiny trial interface (`suggest_float`,
`suggest_categorical`, `params`, `number`) runs the same objective by hand.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import random

from common import Size, accuracy, cli, load_classifier, loop_args, output_folder, review_datasets
from loopkit import Loop


class RandomTrial:
    """The part of `optuna.Trial` this recipe uses, sampling at random (seeded). Asking twice gives one value."""

    def __init__(self, number: int, seed: int = 0):
        self.number, self.params = number, {}
        self.rng = random.Random(seed * 1000 + number)

    def suggest_float(self, name: str, low: float, high: float, log: bool = False) -> float:
        if name not in self.params:
            self.params[name] = math.exp(self.rng.uniform(math.log(low), math.log(high))) if log else \
                self.rng.uniform(low, high)
        return self.params[name]

    def suggest_categorical(self, name: str, choices):
        if name not in self.params:
            self.params[name] = self.rng.choice(list(choices))
        return self.params[name]


def search_with_optuna(loop: Loop, lr_range, n_trials: int):
    """`Loop.hyperparameter_search` (HF Trainer's, optuna backend); returns (best params, best value, all trials)."""
    import optuna

    studies = []

    def hp_space(trial):
        studies.append(trial.study)
        return {"learning_rate": trial.suggest_float("learning_rate", *lr_range, log=True)}

    best = loop.hyperparameter_search(hp_space=hp_space, compute_objective=lambda metrics: metrics["eval_loss"],
                                      n_trials=n_trials, direction="minimize",
                                      sampler=optuna.samplers.TPESampler(seed=0))
    trials = [(t.params, t.value) for t in studies[0].trials]
    return best.hyperparameters, best.objective, trials


def random_search(objective, n_trials: int):
    """Minimise `objective(trial)` over `n_trials`; returns (best params, best value, all (params, value))."""
    trials = []
    for number in range(n_trials):
        trial = RandomTrial(number)
        trials.append((trial.params, objective(trial)))
    best_params, best_value = min(trials, key=lambda t: t[1])
    return best_params, best_value, trials


def main(tiny: bool = False, output_dir: str | None = None, n_trials: int = 3, use_optuna: bool | None = None):
    size = Size.pick(tiny)
    if not tiny:  # several trials: a smaller slice of the reviews keeps the default search near two minutes
        size = dataclasses.replace(size, n_train=512)
    train, evaluation = review_datasets(size)
    lr_range = (1e-4, 3e-3) if tiny else (3e-5, 5e-4)
    model_inits = []  # the models built, one per trial (plus the one built by the constructor)

    def model_init(trial=None):
        dropout = trial.suggest_categorical("dropout", [0.0, 0.1, 0.3]) if trial is not None else 0.1
        model = load_classifier(size, classifier_dropout=dropout)
        model_inits.append(model)
        return model

    loop = Loop(model_init=model_init, args=loop_args(output_folder(output_dir, "search"), size),
                train_dataset=train, eval_dataset=evaluation, compute_metrics=accuracy)

    def objective(trial) -> float:
        loop.args.learning_rate = trial.suggest_float("learning_rate", *lr_range, log=True)
        loop.train(trial=trial)
        metrics = loop.evaluate()
        print(f"trial {trial.number}: {trial.params} -> eval_loss {metrics['eval_loss']:.4f}, "
              f"accuracy {metrics['eval_accuracy']:.3f}")
        return metrics["eval_loss"]

    if use_optuna is None:
        use_optuna = importlib.util.find_spec("optuna") is not None
    if use_optuna:
        best_params, best_value, trials = search_with_optuna(loop, lr_range, n_trials)
    else:
        best_params, best_value, trials = random_search(objective, n_trials)
    print(f"best trial: {best_params} with eval_loss {best_value:.4f}")
    return best_params, best_value, trials, model_inits


if __name__ == "__main__":
    cli(main, __doc__)
