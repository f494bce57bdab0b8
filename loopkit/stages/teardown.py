"""Stage 5, teardown: the run summary, the best model, the final checkpoint clean-up, and releasing resources.

Contract: `finish_training(plan, start_time)` logs HF's summary (`train_runtime`, `train_samples_per_second`,
`train_steps_per_second`, `total_flos`, `train_loss`), loads the best checkpoint's weights when
`load_best_model_at_end`, keeps only the best checkpoint when `save_total_limit == 1`, fires `on_train_end` and
returns a `TrainOutput`. It then writes the run report (loopkit/report.py: JSON summary, time by phase, slow steps,
charts, a console summary); a failed run gets its report too. `release()` frees what the run holds (persistent
dataloader workers, gradients, device caches); it also runs when training fails. `export()` writes the model in
`save_pretrained`, `torch.export` and ONNX form, each checked against the live model.
"""

from __future__ import annotations

import warnings

import torch

from ..checkpoint import load_model_weights
from ..export import export_model
from ..report import build_report, write_report
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
        self.write_run_report("preempted" if loop.preemption.requested else "completed", metrics)
        return TrainOutput(state.global_step, train_loss, metrics)

    def write_run_report(self, status: str, train_metrics: dict | None = None) -> None:
        """run_report.json / .md, charts and the console summary (loopkit/report.py); main process only. A failure
        to write it is a warning: it must never hide the run's own outcome."""
        loop = self.loop
        if not loop.accelerator.is_main_process:
            return
        try:
            write_report(build_report(loop, status, train_metrics), loop.args.output_dir)
        except Exception as exc:
            warnings.warn(f"Could not write the run report: {type(exc).__name__}: {exc}")

    def release(self) -> None:
        """Let go of what the run holds: persistent dataloader workers, gradients and cached device blocks. (No
        `gc.collect()`: on a large heap it costs about half a second, and Accelerate collects at the next start.)"""
        loop = self.loop
        loop.data.shut_down_workers()
        if loop.optimizer is not None:
            loop.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def export(self, output_dir: str, example_inputs: dict, formats=("pretrained",)) -> dict:
        """Export the trained model (loopkit/export.py); returns {format: (path, max |difference| to the model)}."""
        loop = self.loop
        model = loop.accelerator.unwrap_model(loop.model_wrapped, keep_torch_compile=False)
        return export_model(model, output_dir, example_inputs, formats, loop.processing_class)
