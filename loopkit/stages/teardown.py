"""Stage 5, teardown: the run summary, the best model, the final checkpoint clean-up, and releasing resources.

Contract: `finish_training(plan, start_time)` logs HF's summary (`train_runtime`, `train_samples_per_second`,
`train_steps_per_second`, `total_flos`, `train_loss`), loads the best checkpoint's weights when
`load_best_model_at_end`, keeps only the best checkpoint when `save_total_limit == 1`, fires `on_train_end` and
returns a `TrainOutput`. `release()` frees what the run holds; it also runs when training fails.
"""

from __future__ import annotations

import torch

from ..checkpoint import load_model_weights
from ..state import TrainOutput
from .base import Stage
from .evaluation import speed_metrics


class TeardownStage(Stage):
    """The end of a run."""

    def finish_training(self, plan, start_time: float) -> TrainOutput:
        loop = self.loop
        evaluation, state = loop.evaluation, loop.state
        remaining = loop.accelerator.gather(loop.step.tr_loss.detach()).mean().item()
        evaluation.total_loss_scalar += remaining - loop.step.restored_loss
        steps_run = state.global_step - loop.initial_global_step
        train_loss = evaluation.total_loss_scalar / max(steps_run, 0.001)
        metrics = speed_metrics("train", start_time,
                                num_samples=plan.num_train_samples * steps_run / max(state.max_steps, 1),
                                num_steps=steps_run)
        loop.store_flos()
        metrics["total_flos"] = state.total_flos
        metrics["train_loss"] = train_loss
        loop.log(metrics)
        loop.checkpointer.wait()  # an asynchronous save still in flight
        if loop.args.load_best_model_at_end and state.best_model_checkpoint is not None:
            load_model_weights(loop.accelerator.unwrap_model(loop.model_wrapped), state.best_model_checkpoint)
        loop.checkpointer.keep_only_best()
        loop.fire("on_train_end")
        self.release()
        return TrainOutput(state.global_step, train_loss, metrics)

    def release(self) -> None:
        """Let go of per-run memory: gradients and cached device blocks. (No `gc.collect()`: on a large heap it
        costs about half a second, and Accelerate collects at the start of the next run anyway.)"""
        loop = self.loop
        if loop.optimizer is not None:
            loop.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
