"""Rotation: HF's `save_total_limit` rule over this run's checkpoints only, with the best ones kept; and, at a run's
first save, the folders of runs older than the previous one (docs/checkpoints.md, "Reruns")."""

from __future__ import annotations

import math
import os
import shutil
import warnings

from .lineage import CHECKPOINT_RE
from ..state import best_metric_key


class Rotation:
    """The part of the checkpoint policy that deletes checkpoints: `rotate` after each save, `keep_only_best` at the
    end of training, `finish_uploads` once the last push is done. Receives the run lineage (which folders are this
    run's, which are older runs'), the run (`args`, `state`), `best_total_limit`, whether this process writes files,
    and the uploads (`hub`: no folder is deleted while it uploads; the policy's `upload_with` replaces it)."""

    def __init__(self, lineage, run, best_total_limit: int | None, writes_files: bool, hub):
        self.lineage, self.run, self.best_total_limit = lineage, run, best_total_limit
        self.writes_files, self.hub = writes_files, hub
        self.rotation_deferred = False  # a folder rotation left because it was uploading
        self.older_runs_pending = False  # this train()'s first save still has older runs' folders to remove

    def start(self) -> None:
        """A `train()` starts: its first save removes older runs' folders (`remove_older_runs`)."""
        self.older_runs_pending = True

    def delete(self, path: str) -> None:
        """Rename first, so a kill mid-delete never leaves a half-deleted folder named like a checkpoint."""
        doomed = os.path.join(os.path.dirname(path), ".deleting-" + os.path.basename(path))
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def checkpoint_scores(self, dirs: list[str], state) -> dict[str, float]:
        """`metric_for_best_model` of each checkpoint folder in `dirs` whose step was evaluated (from `state`'s
        `log_history`, which resumes with the run); non-finite values are left out."""
        args = self.run.args
        if args.metric_for_best_model is None:
            return {}
        key = best_metric_key(args)
        by_step = {entry["step"]: entry[key] for entry in state.log_history if key in entry}
        scores = {}
        for path in dirs:
            step = int(CHECKPOINT_RE.match(os.path.basename(path)).group(1))
            if step in by_step and math.isfinite(by_step[step]):
                scores[path] = by_step[step]
        return scores

    def best_checkpoints(self, dirs: list[str], state) -> set[str]:
        """The folders among `dirs` that rotation must keep as best: `state.best_model_checkpoint` (HF), plus, with
        `best_total_limit=k`, the k best scored checkpoints (ties: the earlier step, as a strict improvement
        decides the best)."""
        recorded = state.best_model_checkpoint
        # Compared as real paths: `output_dir` may be relative, and a resumed run's best may lie in another folder.
        best = {d for d in dirs if recorded is not None and os.path.realpath(d) == os.path.realpath(recorded)}
        if self.best_total_limit is not None:
            scores = self.checkpoint_scores(dirs, state)
            sign = -1 if self.run.args.greater_is_better else 1
            ranked = sorted(scores, key=lambda path: (sign * scores[path], dirs.index(path)))
            best.update(ranked[:self.best_total_limit])
        return best

    def rotate(self, state=None) -> None:
        """HF's `save_total_limit` rule: keep the newest and the best, delete the oldest others beyond the limit.
        `state`: the trainer state the best are read from (an asynchronous save's own, on its writer thread: the
        run's may have moved on), by default the run's.
        With `EvalStage(best_total_limit=k)` the limits are separate: the `save_total_limit` newest checkpoints and
        the k best (by `metric_for_best_model`) are kept.

        Only this run's checkpoints are counted and deleted (another run's are never this run's to delete), in the
        order they were saved (their save numbers; HF uses mtimes, which a copy or a restore can reorder).
        """
        self.remove_older_runs()
        limit = self.run.args.save_total_limit
        if limit is None or limit <= 0:
            return
        dirs = self.lineage.own_checkpoints()
        if not dirs:
            return
        best = self.best_checkpoints(dirs, state if state is not None else self.run.state)
        if self.best_total_limit is not None:
            keep = set(dirs[-limit:]) | best
        else:
            protected = {dirs[-1]} | best
            others = [d for d in dirs if d not in protected]
            room = max(limit, len(protected)) - len(protected)  # for the newest unprotected checkpoints
            keep = protected | set(others[len(others) - room:] if room else [])
        for path in dirs:
            if path in keep:
                continue
            if self.hub.uploading(path):  # deleted by a later rotation, once uploaded (finish_uploads at the latest)
                self.rotation_deferred = True
            else:
                self.delete(path)

    def remove_older_runs(self) -> None:
        """At this run's first complete save, with `save_total_limit`: delete the folders (checkpoints and set-aside
        `-of-run-` ones) of the runs older than the previous run, which stays whole, and the damaged folders whose
        record cannot be read, and say so in one line. So a folder rerun again and again holds this run's checkpoints
        and the previous run's, and a rerun that fails before its first save has deleted nothing. Undamaged folders
        that record no run (HF Trainer's) are never deleted."""
        if not self.older_runs_pending:
            return
        self.older_runs_pending = False  # once per train(), at its first save
        limit = self.run.args.save_total_limit
        if limit is None or limit <= 0:
            return
        doomed = self.lineage.older_runs()
        for record in doomed:
            self.delete(record.path)
        if doomed:
            names = ", ".join(r.describe() if r.problem else os.path.basename(r.path) for r in doomed[:4]) + (
                f" +{len(doomed) - 4}" if len(doomed) > 4 else "")
            damaged = " or damaged" if any(r.problem for r in doomed) else ""
            warnings.warn(f"Removed {len(doomed)} checkpoint folder(s) of runs older than the previous one{damaged} "
                          f"({names}) from output_dir: save_total_limit={self.run.args.save_total_limit} keeps this "
                          f"run's and the previous run's. One output_dir per run keeps them all.")

    def finish_uploads(self) -> None:
        """The end of `train()`: wait for the push in progress (Trainer's `_finish_current_push`), then delete what
        rotation left because it was uploading."""
        self.hub.wait()
        if self.rotation_deferred and self.writes_files:
            self.rotation_deferred = False
            self.rotate()

    def keep_only_best(self) -> None:
        """End of training with `save_total_limit == 1`: only the best checkpoint survives (HF). Nothing is deleted
        when the best is not one of this run's checkpoints (else "all but the best" would be everything: transformers
        PR 25136, and HF 5.24 still does it after resuming into a new output_dir) or when best and regular checkpoints
        have separate limits (`EvalStage(best_total_limit=...)`)."""
        best = self.run.state.best_model_checkpoint
        if self.run.args.save_total_limit != 1 or best is None or not self.writes_files:
            return
        if self.best_total_limit is not None:
            return
        dirs = self.lineage.own_checkpoints()
        if os.path.realpath(best) not in {os.path.realpath(d) for d in dirs}:
            return  # e.g. a run resumed into a new output_dir: its best lies elsewhere (HF deletes the whole run here)
        self.hub.wait()  # no folder is deleted while it uploads
        for path in dirs:
            if os.path.realpath(path) != os.path.realpath(best):
                self.delete(path)

