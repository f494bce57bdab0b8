"""Pushing to the Hugging Face Hub as `transformers.Trainer` does with `push_to_hub=True`, through `huggingface_hub`
(transformers 5.24's `init_hf_repo`, `_push_from_checkpoint`, `push_to_hub` and `_finish_current_push`), without an
upload ever racing loopkit's checkpoint writing or rotation.

As Trainer:
* the repo (`hub_model_id`, default the output folder's name; `hub_private_repo`, `hub_token`) is created when the
  `Loop` is built;
* at each save, on the main process, unless `hub_strategy="end"` or the previous push is still uploading (then the
  save pushes nothing, unless `hub_always_push`), `on_push_begin` fires and uploads are queued as futures of
  transformers' shared `HfApi` (one background queue): `output_dir` (its checkpoint folders and `_*` left out) after
  the model files of the checkpoint are copied into it and the processing class saved there, commit "Training in
  progress, step N" (epoch N when `save_strategy` is not "steps"); with `hub_strategy="checkpoint"` also the
  checkpoint folder as `last-checkpoint/`, with "all_checkpoints" under its own name ("..., checkpoint");
* `train()` waits for the push in progress after `on_train_end`; `save_model()` and `push_to_hub()` upload
  `output_dir` (`hub_revision`: the branch of every upload).

What loopkit does differently (docs/differences.md):
* `training_args.bin` (a pickle of the arguments) is written and uploaded as Trainer does only when the arguments are
  a `TrainingArguments` (none for `LoopArgs`: loopkit/checkpoint/model_files.py);
* `on_push_begin` fires when a pushing save starts, on the training thread (Trainer: once its files are written),
  and the uploads are queued once the checkpoint folder is complete (renamed into place; with `async_save`, by the
  writer thread, after it has written the folder): no upload sees a half-written checkpoint;
* rotation (`save_total_limit`) leaves a checkpoint folder that is still uploading, and deletes it at a later
  rotation or, at the latest, when `train()` has waited for the last push; rotation runs before the uploads are
  queued (Trainer: after), so the upload that starts then does not list `output_dir` while that save's deletions
  run;
* files are put into `output_dir` atomically (written beside it under `_loopkit-*`, which no upload lists, then
  renamed), so an upload still reading the previous version (`hub_always_push`) never reads a half-written file, and
  `push_to_hub()` waits for the push in progress before it saves into `output_dir` (Trainer: after);
* a failed push warns, naming the checkpoint, the repo and the error, and training goes on (Trainer: a failed upload
  is silent, a failed copy stops training);
* the token goes to `huggingface_hub` only: `LoopArgs` does not print it and its `to_dict` masks it, as
  `TrainingArguments` does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from concurrent import futures
from pathlib import Path

from ..args import plain
from ..checkpoint import CHECKPOINT_PREFIX, LEFTOVER_PREFIXES, save_training_args

# Trainer's modeling files (CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME, SAFE_WEIGHTS_NAME and PEFT's adapter
# files), and the index files whose shards are copied too.
MODEL_FILES = ("config.json", "generation_config.json", "pytorch_model.bin", "model.safetensors",
               "adapter_config.json", "adapter_model.bin", "adapter_model.safetensors")
INDEX_FILES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")
# Trainer's ["_*", "checkpoint-*"], and the folders loopkit's atomic saves and deletions leave beside checkpoints.
# run_status.json says whether a train() is still running (for `python -m loopkit report`): local, never uploaded.
OUTPUT_DIR_IGNORE = ["_*", f"{CHECKPOINT_PREFIX}-*", "run_status.json"] + [f"{prefix}{CHECKPOINT_PREFIX}-*"
                                                                           for prefix in LEFTOVER_PREFIXES]
STAGING_PREFIX = "_loopkit-"  # matched by "_*": a folder in output_dir no upload lists
HUB_TIMEOUT_S = 5.0  # a Hub that does not answer in this time counts as unreachable: nothing hangs on it

logger = logging.getLogger(__name__)


def hf_api():
    """transformers' shared `HfApi`, the one Trainer pushes through: its background uploads share one queue."""
    from transformers.utils.hub import hf_api as shared_api

    return shared_api()


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_unreachable_reason(endpoint: str, timeout: float = HUB_TIMEOUT_S) -> str | None:
    """Why the Hub cannot be reached right now (offline mode, or no TCP connection within `timeout`), or None."""
    import socket
    import urllib.request
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(endpoint)
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(url.hostname):
        url = urlparse(proxy if "://" in proxy else f"http://{proxy}")  # the connection goes to the proxy
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as exc:
        return f"no connection to {url.hostname}:{port} within {timeout:g} s ({exc})"
    return None


SAVE_NOW_UPLOAD_LATER = ("save with loop.save_model(dir) now and upload that folder later with "
                         "huggingface_hub.upload_folder")


def require_hub(what: str, instead: str = SAVE_NOW_UPLOAD_LATER) -> None:
    """Raise `ConnectionError` at once, naming the reason and the fix, when the Hub cannot be reached now."""
    reason = hub_unreachable_reason(hub_endpoint())
    if reason is not None:
        raise ConnectionError(f"{what}: the Hugging Face Hub at {hub_endpoint()} is not reachable: {reason}. "
                              f"Fix: connect to the network (or unset HF_HUB_OFFLINE), or {instead}.")


@contextlib.contextmanager
def quiet_hub_progress(args):
    """While training with `push_to_hub`: no `huggingface_hub` progress bars from background uploads (Trainer's
    `suppress_progress_bars`, copied from `transformers.trainer_utils`)."""
    if not getattr(args, "push_to_hub", False):
        yield
        return
    import huggingface_hub.utils as hub_utils

    hub_utils.disable_progress_bars()
    try:
        yield
    finally:
        hub_utils.enable_progress_bars()


def model_files(checkpoint: str) -> list[str]:
    """The modeling files Trainer copies from a checkpoint into output_dir before pushing: config, weights (with
    the shards an index names), adapters; those present."""
    names = list(MODEL_FILES)
    for index_name in INDEX_FILES:
        index_path = os.path.join(checkpoint, index_name)
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                names += [index_name] + sorted(set(json.load(f)["weight_map"].values()))
    return [name for name in names if os.path.isfile(os.path.join(checkpoint, name))]


def move_into(staging: str, output_dir: str) -> None:
    """Each file written into `staging` takes its place in `output_dir` by an atomic rename."""
    for name in os.listdir(staging):
        source, target = os.path.join(staging, name), os.path.join(output_dir, name)
        if os.path.isdir(source):
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            os.replace(source, target)


class HubPush:
    """One `Loop`'s pushes: the repo, the uploads in flight (futures, with the folder each reads), and the rules
    above. The `Loop` registers it with its checkpoint storage (`upload_with`), which calls `begin_push` when a save
    starts, `push_checkpoint` once the folder is complete, and asks `uploading(folder)` before rotation deletes one."""

    def __init__(self, run, context):
        self.run, self.context = run, context
        self.repo_id: str | None = None  # Trainer's `hub_model_id`, once the repo exists
        # The push in progress: (the folder an upload reads, what it pushes, for a warning; the upload's future).
        self.jobs: list[tuple[str, str, futures.Future]] = []

    @property
    def pushes(self) -> bool:
        """Whether this process pushes at saves: push_to_hub, a strategy other than "end", the main process."""
        args = self.run.args
        return bool(getattr(args, "push_to_hub", False)) and plain(args.hub_strategy) != "end" \
            and self.context.accelerator.is_main_process

    def create_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Trainer's `init_hf_repo`: create (or reuse) the repo, on the main process."""
        if not self.context.accelerator.is_main_process:
            return
        args = self.run.args
        require_hub("init_hf_repo", "build the Loop with push_to_hub=False and upload output_dir later with "
                    "huggingface_hub.upload_folder" if getattr(args, "push_to_hub", False) else SAVE_NOW_UPLOAD_LATER)
        name = getattr(args, "hub_model_id", None) or Path(args.output_dir).absolute().name
        token = token if token is not None else getattr(args, "hub_token", None)
        private = private if private is not None else getattr(args, "hub_private_repo", None)
        self.repo_id = hf_api().create_repo(name, token=token, private=private, exist_ok=True).repo_id
        self.jobs = []

    def in_progress(self) -> bool:
        return any(not job.done() for _, _, job in self.jobs)

    def uploading(self, folder: str) -> bool:
        """Whether an upload still in flight reads `folder` (rotation must not delete it now)."""
        path = os.path.realpath(folder)
        return any(not job.done() and os.path.realpath(read) == path for read, _, job in self.jobs)

    def begin_push(self) -> str | None:
        """When a save starts, on the training thread: whether it pushes (Trainer's rule: not while the previous
        push uploads, unless `hub_always_push`) and then its commit message, after firing `on_push_begin`."""
        run = self.run
        if not self.pushes or (not run.args.hub_always_push and self.in_progress()):
            return None
        self.context.events.fire("on_push_begin")
        if plain(run.args.save_strategy) == "steps":
            return f"Training in progress, step {run.state.global_step}"
        return f"Training in progress, epoch {int(run.state.epoch)}"

    def push_checkpoint(self, checkpoint: str, commit_message: str | None) -> None:
        """Once `checkpoint` is complete: its model files and the processing class into output_dir, then the uploads
        queued (Trainer's `_push_from_checkpoint`). A failure warns; training goes on."""
        if commit_message is None:
            return
        args = self.run.args
        strategy = plain(args.hub_strategy)
        try:
            if self.repo_id is None:  # push_to_hub set after the Loop was built
                self.create_repo()
            self.refresh_output_dir(checkpoint)
            api, common = hf_api(), dict(repo_id=self.repo_id, token=args.hub_token, run_as_future=True,
                                         revision=args.hub_revision)
            jobs = [(args.output_dir, f"{args.output_dir} ({commit_message})",
                     api.upload_folder(folder_path=args.output_dir, commit_message=commit_message,
                                       ignore_patterns=OUTPUT_DIR_IGNORE, **common))]
            if strategy in ("checkpoint", "all_checkpoints"):
                path_in_repo = "last-checkpoint" if strategy == "checkpoint" else os.path.basename(checkpoint)
                jobs.append((checkpoint, f"{checkpoint} as {path_in_repo}",
                             api.upload_folder(folder_path=checkpoint, path_in_repo=path_in_repo,
                                               commit_message=commit_message + ", checkpoint", **common)))
        except Exception as exc:
            self.warn_failed(f"{checkpoint} ({commit_message})", exc)
            return
        self.forget_done()
        self.jobs += jobs

    def refresh_output_dir(self, checkpoint: str) -> None:
        """Trainer copies the model files from the checkpoint and saves the processing class into output_dir; here
        each file replaces its old version atomically (see the module docstring)."""
        output_dir, processing_class = self.run.args.output_dir, self.run.processing_class
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=output_dir)
        try:
            for name in model_files(checkpoint):
                shutil.copy(os.path.join(checkpoint, name), os.path.join(staging, name))
            if processing_class is not None and hasattr(processing_class, "save_pretrained"):
                processing_class.save_pretrained(staging)
            save_training_args(self.run.args, staging)  # as Trainer: `training_args.bin` of TrainingArguments
            move_into(staging, output_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def forget_done(self) -> None:
        """Drop the finished uploads, warning about each that failed."""
        for _, what, job in [entry for entry in self.jobs if entry[2].done()]:
            if not job.cancelled() and job.exception() is not None:
                self.warn_failed(what, job.exception())
        self.jobs = [entry for entry in self.jobs if not entry[2].done()]

    def warn_failed(self, what: str, exc: BaseException) -> None:
        warnings.warn(f"Pushing {what} to the Hub repo {self.repo_id} failed ({type(exc).__name__}: {exc}). "
                      f"Nothing else is affected: training goes on, the files stay on disk, and "
                      f"loop.push_to_hub() uploads output_dir again.")

    def wait(self) -> None:
        """Trainer's `_finish_current_push`: wait for the uploads in flight."""
        if self.in_progress():
            logger.info("Waiting for the current checkpoint push to be finished, this might take a couple of "
                        "minutes.")
            futures.wait([job for _, _, job in self.jobs])
        self.forget_done()


# The Loop's own Hub methods (`create_model_card`, `push_to_hub`: thin calls into these).
def write_model_card(loop, language=None, license=None, tags=None, model_name=None, finetuned_from=None,
                     tasks=None, dataset_tags=None, dataset=None, dataset_args=None) -> None:
    """`Loop.create_model_card`: `output_dir/README.md`, drafted by transformers' `TrainingSummary` from the run."""
    if not loop.is_world_process_zero():
        return
    from transformers import TrainingArguments
    from transformers.modelcard import TrainingSummary

    if not isinstance(loop.args, TrainingArguments):
        raise TypeError(f"create_model_card reads a transformers.TrainingArguments, and this Loop has "
                        f"{type(loop.args).__name__}. Fix: build the Loop with TrainingArguments(...).")
    path = os.path.join(loop.args.output_dir, "README.md")
    is_peft_library = False
    if os.path.exists(path):
        from huggingface_hub import ModelCard

        card = ModelCard.load(path)
        is_peft_library = card.data.get("library_name") == "peft"
        if tags is not None and card.data.tags is not None:
            tags = [tags] if isinstance(tags, str) else tags
            tags += [tag for tag in card.data.tags if tag not in tags]
    summary = TrainingSummary.from_trainer(loop, language=language, license=license, tags=tags,
                                           model_name=model_name, finetuned_from=finetuned_from, tasks=tasks,
                                           dataset_tags=dataset_tags, dataset=dataset, dataset_args=dataset_args)
    with open(path, "w", encoding="utf-8") as f:
        f.write(summary.to_model_card())
    if is_peft_library:
        loop.accelerator.unwrap_model(loop.model).create_or_update_model_card(loop.args.output_dir)


def push_output_dir(loop, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None, **kwargs):
    """`Loop.push_to_hub`: save the model and processing class to `output_dir` and upload it, after the push in
    progress has finished. An unreachable Hub raises `ConnectionError` at once, after `on_push_begin` (which
    fires first, as in HF)."""
    loop.fire("on_push_begin")
    require_hub("push_to_hub")
    model_name = kwargs.pop("model_name", None)
    if model_name is None and loop.is_world_process_zero():
        hub_model_id = getattr(loop.args, "hub_model_id", None)
        model_name = Path(loop.args.output_dir).name if hub_model_id is None else hub_model_id.split("/")[-1]
    token = token if token is not None else getattr(loop.args, "hub_token", None)
    if loop.hub_model_id is None:
        loop.init_hf_repo(token=token, private=private)
    loop.context.checkpointer.hub.wait()  # before saving into output_dir, which an upload in flight may be reading
    loop.save_model(_internal_call=True)
    if not loop.is_world_process_zero():
        return None
    model_tags = getattr(loop.model, "model_tags", None)
    if model_tags is not None:
        tags = kwargs.get("tags") or []
        tags = [tags] if isinstance(tags, str) else tags
        kwargs["tags"] = tags + [tag for tag in model_tags if tag not in tags]
    loop.create_model_card(model_name=model_name, **kwargs)  # a subclass's override, as Trainer calls it
    return hf_api().upload_folder(repo_id=loop.hub_model_id, folder_path=loop.args.output_dir,
                                  commit_message=commit_message, token=token, run_as_future=not blocking,
                                  ignore_patterns=OUTPUT_DIR_IGNORE,
                                  revision=revision if revision is not None else getattr(loop.args,
                                                                                         "hub_revision", None))
