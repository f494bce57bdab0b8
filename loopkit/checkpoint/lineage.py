"""Which run wrote each checkpoint folder, and in what order: the names of the HF layout, the folder records, and
the run ids (see loopkit/checkpoint/__init__.py's docstring, "Reruns")."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass

CHECKPOINT_PREFIX = "checkpoint"
CHECKPOINT_RE = re.compile(r"^" + CHECKPOINT_PREFIX + r"-(\d+)$")
SET_ASIDE_RE = re.compile(r"^" + CHECKPOINT_PREFIX + r"-(\d+)-of-run-")  # another run's folder a save renamed
TRAINER_STATE_NAME = "trainer_state.json"
LOOPKIT_STATE_NAME = "loopkit_state.json"
WEIGHTS_NAME = "model.safetensors"
OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME = "optimizer.pt", "scheduler.pt", "scaler.pt"
RECORD_KEY = "checkpoint"  # the entry of `loopkit_state.json` that says which run wrote the checkpoint, and when
LEFTOVER_PREFIXES = (".tmp-", ".old-", ".deleting-")  # a killed save's, replace's or rotation's folders


def checkpoint_dirs(output_dir: str, pattern: re.Pattern = CHECKPOINT_RE) -> list[str]:
    """Complete checkpoint folders under `output_dir` (with `SET_ASIDE_RE`: the set-aside ones), in step order."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = pattern.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


@dataclass(frozen=True)
class CheckpointRecord:
    """Who wrote a checkpoint folder and when, as it records it (see the module docstring)."""

    path: str
    step: int
    run_id: str | None  # None: not recorded (HF Trainer's folder, or loopkit's before run ids), or unreadable
    save_index: int | None
    saved_at: str | None  # UTC time of the save, for messages only
    mtime: float
    problem: str | None = None  # why the folder is damaged (its record unreadable, or `with_problems` found it)
    format_known: bool = True  # False: no known format recognises the folder (a storage of yours not registered)

    def recency(self) -> tuple:
        """Sort key, oldest first: numbered saves after unnumbered ones, which go by folder mtime, then step."""
        if self.save_index is not None:
            return (1, self.save_index, 0.0, self.step)
        return (0, 0, self.mtime, self.step)

    def describe(self) -> str:
        name = os.path.basename(self.path)
        run = f"run {self.run_id}, save #{self.save_index}, {self.saved_at}" if self.run_id is not None else None
        if self.problem is not None:
            return f"{name} (damaged: {self.problem}{'; ' + run if run else ''})"
        if run is None:
            return f"{name} (no run recorded: HF Trainer's, or loopkit's before run ids)"
        return f"{name} ({run})"


def read_record(path: str, storage=None) -> CheckpointRecord:
    """The record of checkpoint folder `path`, read through its format (`storage` first, else the one that
    recognises it: format.py). A folder without one (HF Trainer's) is not recorded; one whose record cannot be read
    is not recorded either and is damaged (`problem` says which file and what is wrong)."""
    from .format import format_of

    name = os.path.basename(os.path.normpath(path))
    match = CHECKPOINT_RE.match(name) or SET_ASIDE_RE.match(name)
    found, state, problem = format_of(path, storage), {}, None
    try:
        state = found.read_loopkit_state(path) if found is not None else {}
    except (RuntimeError, OSError, ValueError) as exc:
        problem = f"its run record cannot be read: {quiet_problem(found, path) or exc}"
    entry = state.get(RECORD_KEY) if isinstance(state, dict) else None
    entry = entry if isinstance(entry, dict) else {}
    run_id, save_index = entry.get("run_id"), entry.get("save_index")
    recorded = isinstance(run_id, str) and isinstance(save_index, int)
    return CheckpointRecord(path=path, step=int(match.group(1)) if match else -1,
                            run_id=run_id if recorded else None, save_index=save_index if recorded else None,
                            saved_at=entry.get("saved_at") if recorded else None, mtime=os.path.getmtime(path),
                            problem=problem, format_known=found is not None)


def quiet_problem(found, path: str) -> str | None:
    """`found.checkpoint_problem(path)`, without the warning HF Trainer's folders are accepted with."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return found.checkpoint_problem(path)


def with_problems(records: list[CheckpointRecord], storage=None) -> list[CheckpointRecord]:
    """`records`, each damaged one with its `problem` (the format's `checkpoint_problem`: which file, what is
    wrong). Reads every folder's files: for messages, not for every save's rotation."""
    from .format import format_of

    checked = []
    for record in records:
        found = format_of(record.path, storage) if record.problem is None else None
        if found is not None:
            record = dataclasses.replace(record, problem=quiet_problem(found, record.path))
        checked.append(record)
    return checked


def checkpoints_by_recency(output_dir: str, storage=None) -> list[CheckpointRecord]:
    """The checkpoint folders under `output_dir`, least recently saved first (read through `storage`'s format where
    it recognises them, else through the format that does)."""
    return sorted((read_record(path, storage) for path in checkpoint_dirs(output_dir)), key=CheckpointRecord.recency)


def last_checkpoint(output_dir: str, storage=None) -> str | None:
    """The most recently saved checkpoint folder under `output_dir` (not the highest step: see the module
    docstring)."""
    records = checkpoints_by_recency(output_dir, storage)
    return records[-1].path if records else None


def set_aside_path(record: CheckpointRecord) -> str:
    """Where another run's checkpoint goes when this run saves the same step: beside it, under a name that is no
    checkpoint's (so neither rotation nor `resume_from_checkpoint=True` sees it)."""
    base = f"{os.path.normpath(record.path)}-of-run-{record.run_id or 'unrecorded'}"
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


logger = logging.getLogger("loopkit.checkpoint")


class RunLineage:
    """Which run the coming saves belong to (`run_id`, `next_save_index`): set at each `train()` by `start`, written
    into every checkpoint by `record`, and used to keep other runs' folders. Receives the format (each folder's
    record is read through it), the run (`args.output_dir`, `args.save_total_limit`) and the accelerator."""

    def __init__(self, format, run, accelerator):
        self.format, self.run, self.accelerator = format, run, accelerator
        self.run_id: str | None = None
        self.next_save_index = 1
        self.previous_run: str | None = None  # the most recently saved other run at this train()'s start: kept

    def records(self) -> list[CheckpointRecord]:
        """The checkpoint folders of `output_dir`, least recently saved first."""
        return checkpoints_by_recency(self.run.args.output_dir, self.format)

    def start(self, checkpoint: str | None, resume_from_checkpoint, records: list[CheckpointRecord],
              skipped: dict) -> None:
        """The start of a `train()` resuming `checkpoint` (None: fresh), `records` the folders found before:
        set the run the coming saves belong to (the checkpoint's when resuming, else a new one) and the previous run
        (kept whole). Says what it found: a fresh run next to other checkpoints warns in one line;
        `resume_from_checkpoint=True` names its pick and the damaged folders it passed over (`skipped`: their
        problems by path)."""
        previous_run = self.run_id
        resumed = read_record(checkpoint, self.format) if checkpoint is not None else None
        self.begin_run((resumed.run_id if resumed is not None else None) or new_run_id(), records)
        others = [r for r in self.recorded_folders() if r.run_id != self.run_id]
        self.previous_run = max(others, key=CheckpointRecord.recency).run_id if others else None
        if self.accelerator.is_main_process:
            if checkpoint is None:
                self.report_other_runs(records)
            elif resume_from_checkpoint is True:
                self.report_resume_pick(resumed, records, previous_run, skipped)

    def begin_run(self, run_id: str, records: list[CheckpointRecord]) -> None:
        """Saves from now on belong to `run_id` and are numbered after every checkpoint in `records`. With several
        processes the main process's id is taken by all (a fresh id differs by rank; `save` compares it on each)."""
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            run_id = broadcast_object_list([run_id], from_process=0)[0]
        self.run_id = run_id
        self.next_save_index = 1 + max((r.save_index for r in records if r.save_index is not None), default=0)

    def all_folders(self) -> list[CheckpointRecord]:
        """Every folder in `output_dir` a save may have left: checkpoints and the set-aside `-of-run-` ones."""
        run_dir = self.run.args.output_dir
        return [read_record(folder, self.format)
                for folder in checkpoint_dirs(run_dir) + checkpoint_dirs(run_dir, SET_ASIDE_RE)]

    def recorded_folders(self) -> list[CheckpointRecord]:
        """Every folder in `output_dir` that records its run: checkpoints and the set-aside `-of-run-` ones."""
        return [r for r in self.all_folders() if r.run_id is not None]

    def older_runs(self) -> list[CheckpointRecord]:
        """What a run's first save removes (with `save_total_limit`): the recorded folders of runs other than this
        one and the previous one, and the damaged folders whose record cannot be read (no run can resume them, and
        nothing says whose they are). Folders that record no run, undamaged (HF Trainer's), are never removed."""
        kept_runs = (self.run_id, self.previous_run)
        return [r for r in self.all_folders()
                if (r.run_id is not None and r.run_id not in kept_runs) or (r.run_id is None and r.problem is not None)]

    def report_other_runs(self, records: list[CheckpointRecord]) -> None:
        """A fresh run into an `output_dir` that holds checkpoints: one line saying whose they are, which are
        damaged and what happens to them (docs/checkpoints.md, "Reruns")."""
        set_aside = [r for r in self.recorded_folders() if SET_ASIDE_RE.match(os.path.basename(r.path))]
        records = with_problems(sorted(records + set_aside, key=CheckpointRecord.recency), self.format)
        if not records:
            return
        limit = self.run.args.save_total_limit
        removed = "removed at the first save" if limit and limit > 0 else "kept, save_total_limit=None"
        runs: dict = {}
        for record in records:
            if record.problem is None or record.run_id is not None:
                runs.setdefault(record.run_id, []).append(os.path.basename(record.path))
        fate = {self.previous_run: "previous run: kept", None: "no run recorded: kept"}
        found = [f"{'run ' + run_id if run_id else 'unrecorded'} {self.named(names, run_id in fate)} "
                 f"({fate.get(run_id, 'older: ' + removed)})" for run_id, names in runs.items()]
        for record in (r for r in records if r.problem is not None):  # named with what is wrong, and their fate
            outcome = ("record unreadable: " + removed if record.run_id is None
                       else fate.get(record.run_id, "older: " + removed))
            found.append(f"{record.describe()} ({outcome})")
        warnings.warn(f"output_dir={self.run.args.output_dir!r} holds other runs' checkpoints: {'; '.join(found)}. "
                      f"One output_dir per run keeps them all.")

    @staticmethod
    def named(names: list[str], kept: bool) -> str:
        """The folders of one run in the start line: named when kept (up to 3), counted when older (the removal
        line names them)."""
        if not kept:
            return f"{len(names)} folder{'s' if len(names) > 1 else ''}"
        return ", ".join(names[:3]) + (f" +{len(names) - 3}" if len(names) > 3 else "")

    def report_resume_pick(self, picked: CheckpointRecord, records: list[CheckpointRecord],
                           previous_run: str | None, skipped: dict) -> None:
        """`resume_from_checkpoint=True`: name the checkpoint; warn when another run's is picked or passed over,
        and name the damaged ones passed over (`skipped`: problem by path) as damaged."""
        damaged = [dataclasses.replace(r, problem=r.problem or skipped[r.path]) for r in records
                   if r.path in skipped or r.problem is not None]
        passed_over = {r.path for r in damaged}
        others = [r for r in records if r.run_id != picked.run_id and r.path not in passed_over]
        message = (f"resume_from_checkpoint=True: resuming from {picked.describe()}, the most recently saved "
                   f"complete checkpoint in output_dir={self.run.args.output_dir!r}.")
        if previous_run is not None and picked.run_id != previous_run:
            message += f" It belongs to another run than this Loop's previous train() (run {previous_run})."
        elif not others and not damaged:
            logger.info(message)
            return
        if damaged:
            message += f" Passed over as damaged: {', '.join(r.describe() for r in damaged)}."
        if others:
            message += (f" Not picked, from other runs: {', '.join(r.describe() for r in others)}. Pass "
                        f"resume_from_checkpoint=<folder> to resume one of those.")
        warnings.warn(message)

    def record(self) -> dict:
        """The next save's entry in `loopkit_state.json`: its run and save number."""
        if self.run_id is None:  # a save outside train(): a run of its own
            self.begin_run(new_run_id(), self.records())
        entry = {"run_id": self.run_id, "save_index": self.next_save_index,
                 "saved_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        self.next_save_index += 1
        return entry

    def remove_leftovers(self) -> None:
        """Folders a killed save or rotation left behind (never complete checkpoints): removed at train start (by
        the processes that write files)."""
        run_dir = self.run.args.output_dir
        if not os.path.isdir(run_dir):
            return
        for entry in os.listdir(run_dir):
            if entry.startswith(LEFTOVER_PREFIXES) and CHECKPOINT_RE.match(entry.split("-", 1)[1]):
                shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)

    def own_checkpoints(self) -> list[str]:
        """This run's checkpoint folders in `output_dir`, least recently saved first (damaged ones included: they
        are rotated away like the others)."""
        return [r.path for r in self.records() if r.run_id is not None and r.run_id == self.run_id]

    def last_checkpoint(self) -> str | None:
        """The most recently saved checkpoint folder in `output_dir` (read through this run's format)."""
        return last_checkpoint(self.run.args.output_dir, self.format)

    def is_own(self, path: str) -> bool:
        return self.run_id is not None and read_record(path, self.format).run_id == self.run_id

    def replace_existing(self, final: str, tmp: str) -> None:
        """A save at a step whose folder exists. This run's own (a re-save after a resume) is swapped and dropped;
        another run's, or an unrecorded one, is renamed to a name that is not a checkpoint's, never deleted."""
        record = read_record(final, self.format)
        own = record.run_id is not None and record.run_id == self.run_id
        name = os.path.basename(final)
        aside = os.path.join(os.path.dirname(final), f".old-{name}") if own else set_aside_path(record)
        os.replace(final, aside)
        os.replace(tmp, final)
        if own:
            shutil.rmtree(aside, ignore_errors=True)
        else:  # announced at the start (report_other_runs); the path, for whoever looks for it
            logger.info(f"This run (run {self.run_id}) saved {name}, where {record.describe()} was: that one is "
                        f"kept as {aside} (pass it to resume_from_checkpoint to resume it).")
