"""Stage 5, teardown: the run summary, the best model, the final checkpoint clean-up, and releasing resources.

Contract:
* `finish_training(plan, start_time, train_loss, steps_run)` logs HF's summary (`train_runtime`,
  `train_samples_per_second`, `train_steps_per_second`, `total_flos`, `train_loss`), loads the best checkpoint's
  weights when `load_best_model_at_end`, keeps only the best checkpoint when `save_total_limit == 1`, fires
  `on_train_end` and returns a `TrainOutput`.
* `release()` frees what the run holds on the device (gradients, cached blocks); it also runs when training fails.
* `run_status.json` in the output folder says how the latest `train()` ended: "running" from `on_train_begin`, then
  "completed", "stopped_early" (a callback set `should_training_stop`), "interrupted" or "failed", with the status
  line of the run report, for `python -m loopkit report` to rebuild a report that says what the run's own said.
* `write_run_report(status, counters, train_metrics)` writes the run report (loopkit/report/: JSON summary, time
  by phase, slow steps, a console summary: milliseconds, not printed when `log_level` keeps the run quiet:
  loopkit/trainer/log_messages.py `quiet`); a failed or interrupted run gets its report too.
  Everything is written before it returns, so nothing of the run's is still being written when `train()` returns or
  raises. The charts are drawn on demand (`python -m loopkit report RUN_DIR`, or inline by `loop.report` in a
  notebook): about a second of matplotlib, most of a short run. `TeardownStage(charts=True)` draws them into the
  output folder before `train()` returns. `last_report` keeps the report (`loop.report` renders it in a notebook).
* `on_log`: at the first log (training or evaluation) that finds the run starved of CPU (loopkit/report/record.py,
  `cpu_starvation`), a warning on the `loopkit` logger with the numbers and the fix, once per `train()`.
* `export(output_dir, example_inputs, formats)` writes the model in `save_pretrained`, `torch.export` and ONNX
  form, each checked against the live model.

The summary also carries the memory metrics of `skip_memory_metrics=False` (`context.memory`, loopkit/memory.py),
added before it is logged, as in HF.

Reads `run.args`, `run.state`, `run.model_wrapped`, `run.optimizer`, `run.processing_class`; uses
`context.accelerator`, `context.checkpointer`, `context.clock`, `context.preemption`, `context.memory`, `context.log`,
`context.events`; writes no run-state field.
"""

from __future__ import annotations

import logging
import warnings

import torch

from ..export import export_model
from ..report import STATUS_JSON, build_report, cpu_starvation, starvation_text, write_report, write_run_status
from ..trainer import log_messages
from ..state import TrainOutput, best_checkpoint_to_load
from .base import Stage
from ..phases import speed_metrics

logger = logging.getLogger("loopkit")


class TeardownStage(Stage):
    """The end of a run."""

    last_report = None  # the latest run report (a `RunReport`: `loop.report`), on the main process
    charts = False  # a subclass that does not call `__init__` keeps the default
    watching_starvation = False  # in a train() that has not yet logged the CPU-starved advice

    def __init__(self, charts: bool = False):
        """`charts`: draw the run report's PNG charts (loss, learning rate, evaluation metrics, throughput) into the
        output folder before each `train()` returns (about a second of matplotlib); by default they are drawn on
        demand: `python -m loopkit report RUN_DIR`, or `loop.report` in a notebook."""
        self.charts = charts

    def finish_training(self, plan, start_time: float, train_loss: float, steps_run: int) -> TrainOutput:
        run, context = self.run, self.context
        state = run.state
        log_messages.log_training_completed()
        metrics = speed_metrics("train", start_time,
                                num_samples=plan.num_train_samples * steps_run / max(state.max_steps, 1),
                                num_steps=steps_run)
        metrics["total_flos"] = state.total_flos
        metrics["train_loss"] = train_loss
        context.memory.stop_and_update_metrics("train", metrics)
        context.log(metrics)
        context.checkpointer.wait()  # an asynchronous save still in flight
        best = best_checkpoint_to_load(run.args, state)
        if best is not None:
            log_messages.log_loading_best_model(state)
            context.checkpointer.load_best_model(best)
        if not context.preemption.requested:  # an interrupted run keeps the checkpoint it resumes from
            kept = context.checkpointer.own_checkpoints()
            context.checkpointer.keep_only_best()
            log_messages.log_deleted_checkpoints(kept, context.checkpointer.own_checkpoints())
        context.events.fire("on_train_end")
        return TrainOutput(state.global_step, train_loss, metrics)

    def on_train_begin(self, args, state, control, **kwargs):
        """`run_status.json` says "running" until the run's end replaces it: a report rebuilt from a checkpoint
        then tells a run that never reached its end (killed) from one that did."""
        accelerator = self.context.accelerator
        # Only the main process of a CPU run says it (decided once: Accelerate builds its state at every ask).
        self.watching_starvation = accelerator.is_main_process and accelerator.device.type == "cpu" and not \
            log_messages.quiet(args, accelerator)  # a quiet run (log_level="error") keeps it for its report
        if accelerator.is_main_process:
            try:
                write_run_status(args.output_dir, self.status_record("running", "running"))
            except OSError as exc:
                warnings.warn(f"Could not write {STATUS_JSON} in {args.output_dir}: {exc}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Say it as soon as a log finds the run starved of CPU (a load average read and the process's CPU time:
        at logs only), once, on the main process: a long run on a busy machine learns to set fewer threads when it
        can still act on it, not only in the report at its end."""
        if not self.watching_starvation or torch.get_num_threads() < 2:
            return  # said already, outside train() (an evaluate() measures no training), or one thread: no starving
        starved = cpu_starvation(self.context.clock.machine(), on_cpu=True)
        if starved is not None:
            self.watching_starvation = False
            logger.warning(f"CPU starved at step {state.global_step}: {starvation_text(starved)}")

    def on_train_end(self, args, state, control, **kwargs):
        self.watching_starvation = False

    def status_record(self, end: str, status: str) -> dict:
        state = self.run.state
        return {"end": end, "status": status, "run_id": self.context.checkpointer.run_id,
                "global_step": state.global_step, "max_steps": state.max_steps}

    def end_of_run(self, status: str) -> tuple[str, str]:
        """How the run ended (one of `RUN_ENDS`) and its status line; `status` is the interruption watch's."""
        state = self.run.state
        if status.startswith("failed:"):
            return "failed", status
        if self.context.preemption.interruption() is not None:
            return "interrupted", status
        if state.global_step < state.max_steps:
            return "stopped_early", (f"stopped early at step {state.global_step} of {state.max_steps} (training was "
                                     f"told to stop: control.should_training_stop, e.g. by EarlyStoppingCallback)")
        return "completed", status

    def write_run_report(self, status: str, counters: dict, train_metrics: dict | None = None) -> None:
        """run_report.json / .md, the console summary (loopkit/report/), the charts when `charts`, and
        `run_status.json`; main
        process only. A failure to write them is a warning: it must never hide the run's own outcome. `counters`:
        the input tokens and samples the run trained on."""
        run, context = self.run, self.context
        context.clock.stop_watching_compilations()
        if not context.accelerator.is_main_process:
            return
        try:
            end, status = self.end_of_run(status)
            report = build_report(run, context, status, end, counters, train_metrics, charts=self.charts)
            self.last_report = write_report(report, run.args.output_dir,
                                            echo=not log_messages.quiet(run.args, context.accelerator))
            write_run_status(run.args.output_dir, self.status_record(end, status))
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
        run, context = self.run, self.context
        model = context.accelerator.unwrap_model(run.model_wrapped if run.model_wrapped is not None else run.model,
                                                 keep_torch_compile=False)
        return export_model(model, output_dir, example_inputs, formats, run.processing_class)
