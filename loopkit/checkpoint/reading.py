"""Finding the checkpoint to resume from, and reading the layout-independent files of one (trainer state, stage
states, RNG states)."""

from __future__ import annotations

import os
import warnings

from ..args import trainer_error
from .lineage import WEIGHTS_NAME, checkpoints_by_recency
from .rng import read_rng_file
from .stage_tensors import with_stage_tensors
from .validation import read_stage_states, read_trainer_state


class Resuming:
    """The part of a checkpoint storage that picks and reads the checkpoint a `train()` resumes from. Needs the
    layout's `checkpoint_problem` and `holds_model_weights`."""

    def resolve(self, resume_from_checkpoint) -> str | None:
        """The checkpoint folder to resume from. `True`: the most recently saved usable one in `output_dir` (module
        docstring), falling back (with a warning) past any that is corrupt; a path: that folder, or a clear error
        naming the bad file."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        output_dir = self.run.args.output_dir
        if resume_from_checkpoint is True:
            for path in reversed([r.path for r in checkpoints_by_recency(output_dir)]):
                problem = self.checkpoint_problem(path)
                if problem is None:
                    return path
                warnings.warn(f"Not resuming from {path}: {problem}. Falling back to the previous checkpoint.")
            raise trainer_error(f"No valid checkpoint found in output directory ({output_dir})",
                                "resume_from_checkpoint", True, f"output_dir={output_dir!r} holds no usable "
                                f"checkpoint-<step> folder", "train without resuming first, or pass the path of a "
                                "checkpoint folder")
        if not os.path.isdir(resume_from_checkpoint) or not self.holds_model_weights(resume_from_checkpoint):
            raise trainer_error(f"Can't find a valid checkpoint at {resume_from_checkpoint}",
                                "resume_from_checkpoint", resume_from_checkpoint,
                                "it is not a folder" if not os.path.isdir(resume_from_checkpoint) else
                                f"the folder holds no model weights ({WEIGHTS_NAME}, an index or an adapter)",
                                "pass a checkpoint-<step> folder, or resume_from_checkpoint=True for the latest one")
        problem = self.checkpoint_problem(resume_from_checkpoint)
        if problem is not None:
            raise ValueError(f"Cannot resume from {resume_from_checkpoint}: {problem}.")
        return resume_from_checkpoint

    def read_trainer_state(self, checkpoint: str):
        """The checkpoint's `trainer_state.json` as a `LoopState` (a clear error naming a damaged file)."""
        return read_trainer_state(checkpoint)

    def read_stage_states(self, checkpoint: str) -> dict:
        """The checkpoint's `loopkit_state.json` (each stage's state by name; {} for HF Trainer's folders), with this
        process's stage tensors put back (the data stage's batch read ahead)."""
        return with_stage_tensors(read_stage_states(checkpoint), checkpoint, self.context.accelerator)

    def read_rng(self, checkpoint: str) -> dict | None:
        """This process's RNG states saved in `checkpoint` (None if it has none, e.g. `save_only_model`)."""
        return read_rng_file(checkpoint, self.context.accelerator)
