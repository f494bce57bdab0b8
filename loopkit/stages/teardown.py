"""Stage 5, teardown: the run summary, the best model, the final checkpoint clean-up, and releasing resources.

Contract:
* `finish_training(plan, start_time, train_loss, steps_run)` logs HF's summary (`train_runtime`,
  `train_samples_per_second`, `train_steps_per_second`, `total_flos`, `train_loss`), loads the best checkpoint's
  weights when `load_best_model_at_end`, keeps only the best checkpoint when `save_total_limit == 1`, fires
  `on_train_end` and returns a `TrainOutput`.
* `release()` frees what the run holds on the device (gradients, cached blocks); it also runs when training fails.
* `write_run_report(status, counters, train_metrics)` writes the run report (loopkit/report.py: JSON summary, time
  by phase, slow steps, charts, a console summary); a failed run gets its report too.
  `last_report` keeps it (`loop.report` renders it in a notebook).
* `export(output_dir, example_inputs, formats)` writes the model in `save_pretrained`, `torch.export` and ONNX
  form, each checked against the live model.

The summary also carries the memory metrics of `skip_memory_metrics=False` (`run.memory`, loopkit/memory.py), added
before it is logged, as in HF.

Reads `run.args`, `run.accelerator`, `run.state`, `run.model_wrapped`, `run.optimizer`, `run.checkpointer`,
`run.clock`, `run.processing_class`, `run.preemption`; writes no run-state field.
"""

from __future__ import annotations

import warnings

import torch

from ..export import export_model
from ..report import build_report, write_report
from .. import trainer_logging
from ..state import TrainOutput
from .base import Stage
from .evaluation import speed_metrics


class TeardownStage(Stage):
    """The end of a run."""

    last_report = None  # the latest run report (a `RunReport`: `loop.report`), on the main process

    def finish_training(self, plan, start_time: float, train_loss: float, steps_run: int) -> TrainOutput:
        run = self.run
        state = run.state
        trainer_logging.log_training_completed()
        metrics = speed_metrics("train", start_time,
                                num_samples=plan.num_train_samples * steps_run / max(state.max_steps, 1),
                                num_steps=steps_run)
        metrics["total_flos"] = state.total_flos
        metrics["train_loss"] = train_loss
        run.memory.stop_and_update_metrics("train", metrics)
        run.log(metrics)
        run.checkpointer.wait()  # an asynchronous save still in flight
        if run.args.load_best_model_at_end and state.best_model_checkpoint is not None:
            trainer_logging.log_loading_best_model(state)
            run.checkpointer.load_best_model(state.best_model_checkpoint)
        if not run.preemption.requested:  # an interrupted run keeps the checkpoint it resumes from
            kept = run.checkpointer.own_checkpoints()
            run.checkpointer.keep_only_best()
            trainer_logging.log_deleted_checkpoints(kept, run.checkpointer.own_checkpoints())
        run.fire("on_train_end")
        return TrainOutput(state.global_step, train_loss, metrics)

    def write_run_report(self, status: str, counters: dict, train_metrics: dict | None = None) -> None:
        """run_report.json / .md, charts and the console summary (loopkit/report.py); main process only. A failure
        to write it is a warning: it must never hide the run's own outcome. `counters`: the input tokens and
        samples the run trained on."""
        run = self.run
        run.clock.stop_watching_compilations()
        if not run.accelerator.is_main_process:
            return
        try:
            self.last_report = write_report(build_report(run, status, counters, train_metrics), run.args.output_dir)
        except Exception as exc:
            warnings.warn(f"Could not write the run report: {type(exc).__name__}: {exc}")

    def release(self) -> None:
        """Let go of what the run holds on the device: gradients and cached blocks. (No `gc.collect()`: on a large
        heap it costs about half a second, and Accelerate collects at the next start.)"""
        if self.run.optimizer is not None:
            self.run.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def export(self, output_dir: str, example_inputs: dict, formats=("pretrained",)) -> dict:
        """Export the trained model (loopkit/export.py); returns {format: (path, max |difference| to the model)}."""
        run = self.run
        model = run.accelerator.unwrap_model(run.model_wrapped if run.model_wrapped is not None else run.model,
                                             keep_torch_compile=False)
        return export_model(model, output_dir, example_inputs, formats, run.processing_class)
