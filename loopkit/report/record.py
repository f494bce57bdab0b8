"""The run record and the report of a live run: what a checkpoint remembers of the run as a whole (`run_record`,
under "run_record" in `loopkit_state.json`), the totals read from it (time by phase, compilations, CPU starvation),
and the report the teardown stage builds at the end of `train()` (`build_report`, a `RunReport`)."""

from __future__ import annotations

import json
import resource
import sys

from ..phases import PHASES, PhaseClock
from .charts import charts_drawn, charts_on_demand
from .text import report_markdown

RUN_ENDS = ("running", "completed", "stopped_early", "interrupted", "failed")
RUN_RECORD_KEY = "run_record"  # the run record's top-level key in loopkit_state.json
# A run starved of CPU: its process got under this share of the cores its torch threads could use, on a busy machine.
STARVED_SHARE = 0.5


def run_record(clock: PhaseClock, run) -> dict:
    """What a checkpoint remembers of the run as a whole (plain JSON): elapsed time and phase totals (None when a
    stretch before a resume is unknown), the metric settings, the learning-rate schedule's settings, how busy the
    machine was, and each stretch of training (`segments`: steps and seconds before and after every resume). `run`:
    the `RunState`."""
    args = run.args
    segments = clock.segments(run.state.global_step)
    seconds, phases = whole_run_totals(segments)
    return {"elapsed_seconds": seconds, "phase_seconds": phases,
            "metric_for_best_model": args.metric_for_best_model, "greater_is_better": args.greater_is_better,
            "lr_schedule": lr_schedule_settings(run), "machine": clock.machine(), "segments": segments}


def lr_schedule_settings(run) -> dict | None:
    """What the learning-rate chart redraws the schedule from, step by step: the scheduler `create_scheduler` builds
    from the arguments (type, peak rate, warmup, length, keywords); None when the user passed a scheduler of their
    own in `optimizers=` (its shape is unknown here)."""
    from ..errors import plain

    args, max_steps = run.args, run.state.max_steps
    kwargs = args.lr_scheduler_kwargs or {}
    if run.optimizers_given[1] is not None or not isinstance(kwargs, dict):
        return None
    try:  # it goes into every checkpoint's JSON: keywords JSON cannot hold leave the schedule unknown instead
        kwargs = json.loads(json.dumps(kwargs))
    except (TypeError, ValueError):
        return None
    return {"type": str(plain(args.lr_scheduler_type)), "learning_rate": args.learning_rate,
            "warmup_steps": args.get_warmup_steps(max_steps), "training_steps": max_steps, "kwargs": kwargs}


def whole_run_totals(segments: list[dict]) -> tuple[float | None, dict]:
    """Seconds of all segments (None if any is unknown) and phase seconds summed over the known ones."""
    phases = dict.fromkeys(PHASES, 0.0)
    for segment in segments:
        for phase, value in (segment.get("phase_seconds") or {}).items():
            phases[phase] = round(phases.get(phase, 0.0) + value, 6)
    known = [s["seconds"] for s in segments]
    return (round(sum(known), 6) if None not in known else None), phases


def time_by_phase(segments: list[dict]) -> dict | None:
    """Seconds and percent per phase over the segments whose time is known (`covers_steps` lists them); "other" is
    the rest of their time."""
    known = [s for s in segments if s["seconds"] is not None]
    if not known:
        return None
    total, phases = whole_run_totals(known)
    phases["other"] = round(max(0.0, total - sum(phases.values())), 6)
    return {"seconds": phases, "percent": {p: round(100 * v / total, 2) if total else 0.0 for p, v in phases.items()},
            "covers_steps": [[s["from_step"], s["to_step"]] for s in known]}


def compile_record(segments: list[dict]) -> dict | None:
    """torch.compile over the run: compilations and their seconds (None when no segment compiled anything)."""
    count = sum(s.get("compilations") or 0 for s in segments)
    if not count:
        return None
    seconds = sum((s.get("phase_seconds") or {}).get("compile", 0.0) for s in segments)
    return {"compilations": count, "seconds": round(seconds, 6)}


def cpu_starvation(machine: dict, on_cpu: bool) -> dict | None:
    """Whether a run on the CPU got far less CPU than torch's threads asked for: several threads, a busy machine
    (load average above the cores) and under half a core per thread it could run (`STARVED_SHARE`). Its threads
    then wait for each other on cores other processes hold, and fewer threads run faster. None otherwise (a GPU
    run's CPU waits for its device; on an idle machine a low share is waiting for something else)."""
    threads, share = machine.get("torch_threads") or 1, machine.get("cpu_seconds_per_second")
    if not on_cpu or threads < 2 or share is None or not machine.get("busy"):
        return None
    if share >= STARVED_SHARE * min(threads, machine["cores"]):
        return None
    load = max(x for x in (machine["load_average_start"], machine["load_average_end"]) if x is not None)
    return {"torch_threads": threads, "cores": machine["cores"], "load_average": load,
            "cpu_seconds_per_second": share, "suggested_threads": max(1, int(share))}


def peak_host_memory_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 1024 if sys.platform != "darwin" else peak / 2**20, 1)


def peak_device_memory_mb() -> float | None:
    import torch

    if torch.cuda.is_available():
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return None


def build_report(run, context, status: str, end: str, counters: dict, train_metrics: dict | None = None,
                 charts: bool = False) -> dict:
    """The report of a live run (called by the teardown stage): `run` is the `RunState`, `context` its `RunContext`,
    `end` how it ended (`RUN_ENDS`), `counters` the input tokens and samples trained on; `saves` records the save
    number it covers (`is_current`). Its charts are drawn into the output folder now when `charts`, else left to be
    drawn on demand (`charts_on_demand`). Building it (and drawing the charts) is the "report" phase; the time by
    phase is read right after, so writing the two small report files next is the only part of `train()` outside
    it."""
    state, clock, args = run.state, context.clock, run.args
    with clock.span("report"):
        evals = [h for h in state.log_history if any(k.startswith("eval_") and k.endswith("_loss") for k in h)]
        machine = clock.machine()
        report = RunReport({
            "status": status, "end": end, "output_dir": args.output_dir, "global_step": state.global_step,
            "max_steps": state.max_steps, "epoch": state.epoch, "final_metrics": evals[-1] if evals else {},
            "best_metric": state.best_metric, "metric_for_best_model": args.metric_for_best_model,
            "greater_is_better": args.greater_is_better, "best_checkpoint": state.best_model_checkpoint,
            "train_metrics": train_metrics or {}, "input_tokens": counters["tokens"],
            "peak_host_memory_mb": peak_host_memory_mb(), "peak_device_memory_mb": peak_device_memory_mb(),
            "slow_steps": clock.slow_steps, "machine": machine, "log_history": list(state.log_history),
            "cpu_starved": cpu_starvation(machine, on_cpu=context.accelerator.device.type == "cpu"),
            "best_step": state.best_global_step, "warmup_steps": args.get_warmup_steps(state.max_steps),
            "lr_schedule": lr_schedule_settings(run),
            "interruption": interruption_record(context.preemption), "segments": clock.segments(state.global_step),
            "saves": {"run_id": context.checkpointer.run_id, "save_index": context.checkpointer.next_save_index - 1},
        })
        report["charts"] = charts_drawn(report, args.output_dir) if charts else charts_on_demand()
    clock.enter(None)  # closes the teardown phase: everything up to here is in the totals below
    segments = clock.segments(state.global_step)
    this_run = segments[-1]["seconds"]
    report.update(total_seconds=whole_run_totals(segments)[0], this_run_seconds=this_run, segments=segments,
                  time_by_phase=time_by_phase(segments),
                  compile=compile_record(segments),
                  samples_per_second=round(counters["samples"] / this_run, 3) if this_run else None,
                  tokens_per_second=round(counters["tokens"] / this_run, 3) if this_run else None)
    return report


class RunReport(dict):
    """The run report: the dict written to run_report.json, which a notebook renders as Markdown (`loop.report`)."""

    def _repr_markdown_(self) -> str:
        return report_markdown(self)



def interruption_record(preemption) -> dict | None:
    """The signal that ended the run, the checkpoint to resume from and the call that does it (`preemption`: the
    run's `PreemptionWatch`, loopkit/guards.py)."""
    interruption = preemption.interruption() if preemption is not None else None
    if interruption is None:
        return None
    from ..guards import signal_name

    return {"signal": signal_name(interruption.signum), "checkpoint": interruption.checkpoint,
            "saved": interruption.saved, "resume": interruption.resume}
