"""Recipe 5: smart early stopping: stop after `patience` evaluations in a row that did not improve the metric by at
least a *relative* margin (`min_relative_improvement=0.03`: less than 3% better than the best so far counts as no
improvement).

HF's `EarlyStoppingCallback` uses an absolute threshold, which means different things for a loss of 2.3 and one of
0.05; a relative margin does not. loopkit ships the callback: `loopkit.callbacks.EarlyStopping`. Its counter and
best value are saved in every checkpoint and restored on resume, so a resumed run keeps counting.

Evaluation must happen during training (`eval_strategy="steps"` or `"epoch"`); the metric defaults to
`metric_for_best_model` (here `eval_loss`). The run's stop is visible in `state.global_step < state.max_steps`.
"""

from __future__ import annotations

from common import Size, accuracy, cli, load_classifier, loop_args, output_folder, review_datasets
from loopkit import Loop
from loopkit.callbacks import EarlyStopping


def main(tiny: bool = False, output_dir: str | None = None, patience: int = 2,
         min_relative_improvement: float = 0.03, eval_steps: int | None = None, num_train_epochs: float = 3):
    size = Size.pick(tiny)
    train, evaluation = review_datasets(size)
    eval_steps = eval_steps or (2 if tiny else 16)
    args = loop_args(output_folder(output_dir, "early-stopping"), size, num_train_epochs=num_train_epochs,
                     eval_strategy="steps", eval_steps=eval_steps, logging_steps=eval_steps,
                     metric_for_best_model="loss")
    stopper = EarlyStopping(patience=patience, min_relative_improvement=min_relative_improvement)
    loop = Loop(model=load_classifier(size), args=args, train_dataset=train, eval_dataset=evaluation,
                compute_metrics=accuracy, callbacks=[stopper])
    loop.train()
    state = loop.state
    print(f"stopped at step {state.global_step} of {state.max_steps}; best eval_loss {stopper.best_value:.4f}")
    return loop, stopper


if __name__ == "__main__":
    cli(main, __doc__)
