"""Finding the checkpoint to resume from, and reading the layout-independent files of one (trainer state, stage
states, RNG states)."""

from __future__ import annotations

import os
import warnings

from ..errors import trainer_error
from .lineage import checkpoints_by_recency
from .stage_tensors import tensors_back


class Resuming:
    """The part of the checkpoint policy that picks and reads the checkpoint a `train()` resumes from. Receives the
    format (`recognises`, `checkpoint_problem`, `read_states`, `read_process_state`), the run (`args.output_dir`)
    and whether each node keeps its own checkpoints (`node_local_disks`: then every node must hold the pick)."""

    def __init__(self, format, run, node_local_disks: bool):
        self.format, self.run, self.node_local_disks = format, run, node_local_disks

    def resolve(self, resume_from_checkpoint) -> str | None:
        """The checkpoint folder to resume from (`pick`)."""
        return self.pick(resume_from_checkpoint)[0]

    def pick(self, resume_from_checkpoint) -> tuple[str | None, dict]:
        """The checkpoint folder to resume from, and the damaged folders passed over (their problems by path).
        `True`: the most recently saved usable one in `output_dir` (lineage.py), falling back (with a warning) past
        any that is damaged; a path: that folder, or a clear error naming the bad file."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None, {}
        output_dir = self.run.args.output_dir
        if resume_from_checkpoint is True:
            usable, skipped = [], {}
            for path in reversed([r.path for r in checkpoints_by_recency(output_dir, self.format)]):
                problem = self.format.checkpoint_problem(path)
                if problem is None:
                    usable.append(path)
                    if not self.node_local_disks:
                        break
                else:
                    skipped[path] = problem
                    warnings.warn(f"Not resuming from {path}: it is damaged ({problem}). Falling back to the previous "
                                  f"checkpoint.")
            usable = self.held_by_every_node(usable)
            if usable:
                return usable[0], skipped
            raise trainer_error(f"No valid checkpoint found in output directory ({output_dir})",
                                "resume_from_checkpoint", True, f"output_dir={output_dir!r} holds no usable "
                                f"checkpoint-<step> folder", "train without resuming first, or pass the path of a "
                                "checkpoint folder")
        if not os.path.isdir(resume_from_checkpoint) or not self.format.recognises(resume_from_checkpoint):
            raise trainer_error(f"Can't find a valid checkpoint at {resume_from_checkpoint}",
                                "resume_from_checkpoint", resume_from_checkpoint,
                                "it is not a folder" if not os.path.isdir(resume_from_checkpoint) else
                                f"the folder holds no checkpoint {type(self.format).__name__} reads (for HF's "
                                f"layout: model weights, an index or an adapter)",
                                "pass a checkpoint-<step> folder, or resume_from_checkpoint=True for the latest one")
        problem = self.format.checkpoint_problem(resume_from_checkpoint)
        if problem is not None:
            raise ValueError(f"Cannot resume from {resume_from_checkpoint}: it is damaged ({problem}).")
        return resume_from_checkpoint, {}

    def held_by_every_node(self, paths: list[str]) -> list[str]:
        """With node-local disks: those of `paths` (newest first) whose folder name every process also found usable
        on its own disk. A kill between two nodes' renames leaves the newest checkpoint on some nodes only: every
        node resumes the newest they all hold."""
        if not self.node_local_disks:
            return paths
        from accelerate.utils import gather_object

        everyone = gather_object([[os.path.basename(path) for path in paths]])
        return [path for path in paths if all(os.path.basename(path) in names for names in everyone)]

    def read_trainer_state(self, checkpoint: str):
        """The checkpoint's trainer state as a `LoopState` (a clear error naming a damaged file)."""
        import dataclasses

        from ..state import LoopState

        trainer_state = self.format.read_states(checkpoint)[0]
        try:
            known = {f.name for f in dataclasses.fields(LoopState)}
            return LoopState(**{k: v for k, v in trainer_state.items() if k in known})
        except (AttributeError, TypeError) as exc:
            raise RuntimeError(f"{checkpoint}'s trainer state is corrupt ({exc}).") from exc

    def read_stage_states(self, checkpoint: str) -> dict:
        """The checkpoint's loopkit state (each stage's state by name; {} for HF Trainer's folders), with this
        process's stage entries and tensors put back (the data stage's batch read ahead)."""
        own = self.format.read_process_state(checkpoint)
        return tensors_back({**self.format.read_states(checkpoint)[1], **own.own_stage_states}, own.stage_tensors)

    def read_rng(self, checkpoint: str) -> dict | None:
        """This process's RNG states saved in `checkpoint` (None if it has none, e.g. `save_only_model`)."""
        return self.format.read_process_state(checkpoint).rng
