"""A report rebuilt from a run's folder: the run's own `run_report.json` when it covers the newest checkpoint (by
save numbers, never file times), else one rebuilt from that checkpoint and `run_status.json`."""

from __future__ import annotations

import os

from .files import REPORT_NAME, STATUS_JSON, read_json
from .record import RUN_RECORD_KEY, compile_record, time_by_phase, whole_run_totals


def is_current(own: dict, newest) -> bool:
    """Whether the run's own report covers the newest checkpoint (`newest`: its `CheckpointRecord`), by save
    numbers (loopkit/checkpoint.py), else by steps: never by file times, which a copy or a restore changes."""
    if newest is None:
        return True
    saves = own.get("saves") or {}
    if isinstance(saves.get("save_index"), int) and newest.save_index is not None:
        return newest.save_index <= saves["save_index"]
    return own.get("global_step", -1) >= newest.step


def rebuilt_end(run_status: dict | None, newest, max_steps: int) -> tuple[str, str]:
    """How the run of checkpoint `newest` ended (`RUN_ENDS`, or "unknown") and the status line of a report rebuilt
    from it: what the run recorded of its end when `run_status` is that run's; "incomplete" when it never reached
    its end (killed, or the machine went); without its record (a copied checkpoint, or a later run's record in the
    folder), what the checkpoint itself shows: all `max_steps` steps trained, or not."""
    name = os.path.basename(os.path.normpath(newest.path))
    if run_status is None or run_status.get("run_id") != newest.run_id:
        if max_steps and newest.step >= max_steps:
            return "unknown", (f"all {max_steps} steps trained (rebuilt from {name}; how the run ended is not "
                               f"recorded here: no run_status.json of its run)")
        return "unknown", f"incomplete (rebuilt from {name}, step {newest.step} of {max_steps})"
    if run_status.get("end") == "running":
        return "running", f"incomplete: the run stopped without reaching its end (killed?), rebuilt from {name}"
    return run_status["end"], f"{run_status['status']} (rebuilt from {name}, step {newest.step})"


class UnknownCheckpointFormat(ValueError):
    """A run folder holds checkpoints that no known format reads: the message names the `--storage` to pass."""


def readable_records(run_dir: str) -> list:
    """The checkpoint records of `run_dir`, least recently saved first, each damaged one with its problem. Raises
    `UnknownCheckpointFormat` when a folder is in no known format: nothing about the run can be trusted then (its
    newest checkpoint may be that one), and the message says which `--storage` to pass."""
    from ..checkpoint import checkpoints_by_recency
    from ..checkpoint.format import BUILT_IN_FORMATS, registered_formats
    from ..checkpoint.lineage import with_problems

    records = checkpoints_by_recency(run_dir)
    unknown = [os.path.basename(r.path) for r in records if not r.format_known]
    if unknown:
        known = [name.rpartition(":")[2] for name in BUILT_IN_FORMATS] + [type(f).__name__ for f in registered_formats]
        raise UnknownCheckpointFormat(
            f"{run_dir}: no checkpoint format loopkit knows ({', '.join(known)}) reads "
            f"{', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}. Name the storage class that wrote them, "
            f"as module:Class: python -m loopkit report {run_dir} --storage mypackage.storages:MyStorage")
    return with_problems(records)


def report_from_files(run_dir: str, force: bool = False) -> tuple[dict, bool]:
    """The report of a finished, failed or killed run from its folder, and whether it is the run's own: its
    `run_report.json` when that covers the newest checkpoint (and not `force`), else a report rebuilt from the
    newest undamaged checkpoint's `trainer_state.json` and run record, its status from `run_status.json`. Damaged
    checkpoints are named in the report's `damaged_checkpoints` (folder: which file, what is wrong)."""
    own = read_json(os.path.join(run_dir, REPORT_NAME + ".json"))
    records = readable_records(run_dir)
    damaged = {os.path.basename(r.path): r.problem for r in records if r.problem is not None}
    newest = records[-1] if records else None
    if own is not None and (newest is None or (not force and is_current(own, newest))):
        return {**own, "damaged_checkpoints": damaged} if damaged else own, True
    usable = [r for r in records if r.problem is None]
    if not usable:
        raise FileNotFoundError(f"{run_dir} holds neither {REPORT_NAME}.json nor an undamaged checkpoint: nothing "
                                f"to report" + (f" (damaged: {damaged})" if damaged else "") + ".")
    report = report_from_checkpoint(run_dir, usable[-1].path)
    report["end"], report["status"] = rebuilt_end(read_json(os.path.join(run_dir, STATUS_JSON)), usable[-1],
                                                  report["max_steps"])
    report["saves"] = {"run_id": newest.run_id, "save_index": newest.save_index}  # what it covers (`is_current`)
    if damaged:
        report["damaged_checkpoints"] = damaged
    return report, False


def report_from_checkpoint(run_dir: str, checkpoint: str) -> dict:
    """The report as far as `checkpoint` knows the run. Without a run record (HF Trainer's checkpoints, loopkit's
    before it had one) the time and the metric name are unknown, and the report says so."""
    from ..checkpoint import read_states  # through the checkpoint's format (any storage's)

    state, loopkit_state = read_states(checkpoint)
    record = loopkit_state.get(RUN_RECORD_KEY)
    step = state["global_step"]
    segments = record["segments"] if record else [{"from_step": 0, "to_step": step, "seconds": None,
                                                  "phase_seconds": None}]
    history = state["log_history"]
    evals = [h for h in history if any(k.startswith("eval_") for k in h)]
    record = record or {}
    schedule = record.get("lr_schedule")
    report = {"status": f"incomplete (rebuilt from {os.path.basename(checkpoint)})", "end": "unknown",
              "output_dir": run_dir, "global_step": step, "max_steps": state["max_steps"],
              "epoch": state["epoch"] or 0, "final_metrics": evals[-1] if evals else {},
              "best_metric": state.get("best_metric"), "metric_for_best_model": record.get("metric_for_best_model"),
              "greater_is_better": record.get("greater_is_better"),
              "best_checkpoint": state.get("best_model_checkpoint"),
              "total_seconds": whole_run_totals(segments)[0], "segments": segments,
              "time_by_phase": time_by_phase(segments), "log_history": history,
              "best_step": state.get("best_global_step"), "slow_steps": [], "interruption": None,
              "compile": compile_record(segments), "machine": record.get("machine"), "lr_schedule": schedule,
              "warmup_steps": schedule["warmup_steps"] if schedule else None}
    return report
