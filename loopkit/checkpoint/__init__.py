"""Checkpoint folders, written atomically, and read back without unpickling code: the pieces every checkpoint storage
(loopkit/storage/) is built from, one module per job.

A checkpoint is `<output_dir>/checkpoint-<global_step>/` holding `model.safetensors` (+ `config.json` through
`save_pretrained` when the model has it), `optimizer.pt`, `scheduler.pt`, `scaler.pt` (fp16), `rng_state.pth`,
`trainer_state.json`, `training_args.bin` (Trainer's pickle of the arguments, written only when they are a
`TrainingArguments`, never read: model_files.py), and loopkit's own `loopkit_state.json` (stage state, e.g. the
running loss) with, when a stage's state holds tensors (the data stage's batch read ahead),
`loopkit_tensors.safetensors` (one per process: `loopkit_tensors_<rank>.safetensors`, stage_tensors.py). HF Trainer
resumes from it; loopkit resumes from HF's.

Atomicity: everything is written into a hidden sibling `.tmp-checkpoint-<step>`, flushed and fsynced, marked complete
(`loopkit_state.json` is the last file written) and renamed into place. A kill mid-save leaves only the temporary
folder, which the next save removes; `resume_from_checkpoint=True` never picks it.

Reruns: every checkpoint records, in `loopkit_state.json` ("checkpoint" entry), the run that wrote it (`run_id`: new
for each fresh `train()`, inherited when resuming) and its save number in `output_dir` (`save_index`: one more than
the highest present when it is written, so it orders saves by when they happened without reading a clock or an mtime,
which a copy or a restore changes). "Most recently saved" means the highest save number; folders that record none
(HF Trainer's, or loopkit's before run ids) rank below every numbered one and among themselves by folder mtime (all
they have). Such folders count as another run: nothing in them says who wrote them, so this run never deletes them.
Rotation deletes only the current run's checkpoints; `resume_from_checkpoint=True` takes the most recently saved
complete checkpoint and names it; a fresh run into a folder holding other runs' checkpoints says what it found, in
one line. The previous run (the last to save before this `train()`) is kept whole; with `save_total_limit`, the
recorded folders of older runs are removed at this run's first complete save, in one line (rotation.py), so the
folder holds at most two runs' checkpoints.

Security: weights go through safetensors, state through JSON, and every `torch.load` uses `weights_only=True`
(`rng_state.pth` needs numpy's RNG tuple, allowed by an explicit list of numpy classes). Sharded FSDP folders
(`pytorch_model_fsdp_0/`, `optimizer_0/`) are read by loopkit/dcp_reading.py (DCP metadata through a restricted
unpickler), DeepSpeed's `global_step*/` with its `torch.load`s forced to `weights_only=True` (loopkit/distributed.py).
docs/checkpoints.md lists every file read and how.

The modules. The format (what a storage implements, docs/checkpoints.md): format.py (`CheckpointFormat`,
`Checkpoint`, finding the format of a folder). The policy, written once, which holds a format and calls only its
documented methods: policy.py (`CheckpointPolicy`, what a run calls), built of four parts, each given what it needs:
lineage.py (folder names, records, run ids, `RunLineage`), writing.py (`AtomicSaves`: the atomic protocol, async,
`on_save_error`), rotation.py (`Rotation`), reading.py (`Resuming`). HF's layout, for the formats that write it:
durable.py (fsync, state files, safe loads), rng.py (RNG states), model_files.py (`save_pretrained` files),
state_files.py (the run's state files), stage_tensors.py, validation.py (`checkpoint_problem`), engines.py (FSDP and
DeepSpeed checkpoint I/O). The names below are the package's public ones; the writers call the file operations
through this package (`checkpoint.write_text`, ...), so that wrapping one here reaches every save.
"""

from .durable import (EarlyFlush, FlushWhileWriting, fsync_dir, fsync_file, fsync_tree, import_serialisers,
                      safe_torch_load, save_state_file, write_text)
from .lineage import (CHECKPOINT_PREFIX, CHECKPOINT_RE, LEFTOVER_PREFIXES, LOOPKIT_STATE_NAME, OPTIMIZER_NAME,
                      RECORD_KEY, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, WEIGHTS_NAME, CheckpointRecord,
                      checkpoint_dirs, checkpoints_by_recency, last_checkpoint, new_run_id, read_record,
                      set_aside_path)
from .model_files import (TRAINING_ARGS_NAME, holds_model_weights, load_model_weights, save_model_files,
                          save_training_args)
from .rng import read_rng_file, restore_rng_state, rng_file_name, rng_state, saved_world_size
from .validation import checkpoint_problem, read_stage_states, read_trainer_state, warn_if_checkpoint_args_differ
from .writing import SAVE_ERROR_POLICIES, NoUploads, Snapshot, copy_to_cpu
from .format import (BUILT_IN_FORMATS, Checkpoint, CheckpointFormat, ProcessState, format_of, read_states,
                     register_format)

