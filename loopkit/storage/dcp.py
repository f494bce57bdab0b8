"""`DCPStorage`: checkpoints through PyTorch's distributed checkpoint (torch.distributed.checkpoint, DCP), the engine
large runs use: every process writes its own shards (nothing is gathered), `async_save=True` stages the state in
host memory on a thread while the next step runs and writes it on a background thread while training goes on (the
policy's staging and writer threads: `dcp.save` of the host copies, with several processes on a gloo group of its
own), and a checkpoint loads at any number of processes, sharded or not (DCP reshards on load). Plain, DDP and
FSDP2 models alike: the state is taken with torch's `get_state_dict` (parameter names without wrapper prefixes;
FSDP2's DTensor shards as they are).

The folder is the HF layout's with the weights and the optimizer replaced by one DCP folder:

    checkpoint-<step>/dcp/            .metadata and __<rank>_<n>.distcp: {"model": ..., "optimizer": ...}
    checkpoint-<step>/config.json     the model's config (and the processing class's files), for conversion
    scheduler.pt, scaler.pt, rng_state[_<rank>].pth, trainer_state.json, loopkit_state.json (as in the HF layout)

Everything else is `CheckpointStorage`'s policy: the run lineage, rotation and the best checkpoints, the atomic
protocol (the DCP folder is written inside the hidden `.tmp-checkpoint-<step>`, which gets its name only once every
process has written, the metadata is written and everything is fsynced: a kill during a save, synchronous or not,
leaves the previous checkpoint the newest complete one), and `async_save` (the host copies and the writer thread).
This class is the format only: the same public methods `HFStorage` implements.

Reading unpickles nothing loopkit did not write: DCP folders are read only through `loopkit.dcp_reading.read_dcp`
(metadata through a restricted unpickler that admits DCP's metadata classes only, values with
`weights_only=True`), the other files as in the HF layout (`safe_torch_load`, JSON).

`python -m loopkit convert-dcp SRC DST [--checkpoint]` turns a DCP checkpoint into a `save_pretrained` folder, or
(`--checkpoint`) into an HF-layout checkpoint that HF Trainer (and `HFStorage`) resume.

This module uses only the storage interface and public functions of loopkit.
"""

from __future__ import annotations

import copy
import os
import shutil

import torch

from ..checkpoint import (OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, import_serialisers,
                          safe_torch_load, save_state_file)
from ..checkpoint.format import Checkpoint, ProcessState
from ..checkpoint.state_files import (read_loopkit_state_file, read_process_files, read_state_files,
                                      write_state_files)
from ..dcp_reading import UnsafeCheckpointError, distributed, load_metadata, one_process_quiet, read_dcp
from ..distributed import unwrap_model
from ..errors import config_error
from .base import CheckpointStorage

DCP_FOLDER = "dcp"


def save_dcp(state: dict, folder: str, process_group=None) -> None:
    """`dcp.save` into `folder`: collective with a process group (`process_group`, else the default one); in one
    process without torch's notice that it assumes one (loopkit knows). The writer is named, not guessed from a path:
    the guess imports DCP's fsspec writer at the first save, on an asynchronous save's writer thread."""
    import torch.distributed.checkpoint as dcp

    with one_process_quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=not distributed(),
                 process_group=process_group)


def own_class(model) -> type:
    """The class the model was built as. FSDP2's `fully_shard` swaps in a subclass, `FSDP<Name>` with `FSDPModule`
    first in its bases, which no `from_pretrained` knows (transformers' `save_pretrained` drops the prefix too)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def dcp_metadata(checkpoint: str):
    """The DCP metadata of `checkpoint`, read without unpickling anything else (`UnsafeCheckpointError` if it
    asks for more, `OSError` if it is missing)."""
    path = os.path.join(checkpoint, DCP_FOLDER, ".metadata")
    with open(path, "rb") as f:
        return load_metadata(f.read(), path)


class DCPStorage(CheckpointStorage):
    """Checkpoints through torch.distributed.checkpoint (module docstring). Options as every storage:
    `async_save` (here also with several processes: the writer's collectives run on a process group of their
    own), `on_save_error`, `best_total_limit`."""

    def check_launch(self) -> None:
        from ..distributed import active_engine

        if active_engine(self.context.accelerator) == "DeepSpeed":
            raise config_error("storage", "DCPStorage()", "DeepSpeed writes its own checkpoints (`global_step*/`)",
                               "use the default storage (HFStorage) with DeepSpeed")
        if self.run.args.save_on_each_node and self.context.accelerator.num_processes > 1:
            raise config_error("save_on_each_node", True, "every process of a DCPStorage save writes into one "
                               "folder (rank 0 its metadata), which needs a disk all nodes see",
                               "use a shared file system with save_on_each_node=False, or the default storage")

    def before_async_saves(self) -> None:
        """The serialisers' first writes import a module each: here, not on the writer thread (format.py)."""
        import_serialisers()

    # -- the format: any folder --
    def recognises(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, DCP_FOLDER, ".metadata"))

    def read_states(self, path: str) -> tuple[dict, dict]:
        return read_state_files(path)

    def read_loopkit_state(self, path: str) -> dict:
        return read_loopkit_state_file(path)

    # -- the format: writing --
    def states_to_save(self) -> tuple[dict, dict | None]:
        """The model's (and, unless `save_only_model`, the optimizer's) state as DCP saves it: torch's
        `get_state_dict`, the same names for plain, DDP and FSDP2 models (every process: its own shards)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        run = self.run
        if run.args.save_only_model or run.optimizer is None:
            return get_model_state_dict(run.model_wrapped), None
        return get_state_dict(run.model_wrapped, getattr(run.optimizer, "optimizer", run.optimizer))

    def write_model_description(self, folder: str) -> None:
        """The model's config and the processing class's files, for `convert-dcp` (the writing process only)."""
        run, context = self.run, self.context
        if not self.writes_files:
            return
        model = unwrap_model(context.accelerator, run.model_wrapped, keep_torch_compile=False)
        config = getattr(model, "config", None)
        if hasattr(config, "save_pretrained"):
            config = copy.copy(config)
            config.architectures = [own_class(model).__name__]  # as `save_pretrained` records it: the class to rebuild
            config.save_pretrained(folder)
        if hasattr(run.processing_class, "save_pretrained"):
            run.processing_class.save_pretrained(folder)

    def write_checkpoint(self, checkpoint: Checkpoint, folder: str) -> None:
        """The model description and the state files, then DCP's folder (collective: every process its shards,
        rank 0 the metadata once all have written)."""
        self.write_model_description(folder)
        write_state_files(checkpoint, folder, self.run.args)
        state = {"model": checkpoint.model_state}
        if checkpoint.optimizer_state is not None:
            state["optimizer"] = checkpoint.optimizer_state
        save_dcp(state, os.path.join(folder, DCP_FOLDER), checkpoint.process_group)

    # -- the format: reading --
    def read_process_state(self, path: str) -> ProcessState:
        return read_process_files(path, self.context.accelerator)

    def load_model_before_prepare(self, model, checkpoint: str) -> None:
        """Nothing: DCP loads into the prepared (possibly sharded) model, in `load_optimizer_and_scheduler`."""

    def load_optimizer_and_scheduler(self, checkpoint: str) -> None:
        """After `prepare`, on every process: the model and the optimizer from the DCP folder, resharded to this
        run's layout, then the scheduler and the scaler."""
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        run, context = self.run, self.context
        model, optimizer = run.model_wrapped, getattr(run.optimizer, "optimizer", run.optimizer)
        sched_path = os.path.join(checkpoint, SCHEDULER_NAME)
        with_optimizer = os.path.isfile(sched_path) and self.holds_optimizer(checkpoint)  # as HF: not save_only_model
        state = {"model": get_model_state_dict(model)}
        if with_optimizer:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)  # the layout to fill
        context.accelerator.wait_for_everyone()
        read_dcp(state, os.path.join(checkpoint, DCP_FOLDER))
        set_model_state_dict(model, state["model"])
        if with_optimizer:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
            run.lr_scheduler.load_state_dict(safe_torch_load(sched_path))
        scaler_path = os.path.join(checkpoint, SCALER_NAME)
        if os.path.isfile(scaler_path) and context.accelerator.scaler is not None:
            context.accelerator.scaler.load_state_dict(safe_torch_load(scaler_path))

    @staticmethod
    def holds_optimizer(checkpoint: str) -> bool:
        return any(key.startswith("optimizer.") for key in dcp_metadata(checkpoint).state_dict_metadata)

    def load_best_model(self, checkpoint: str) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        model = self.run.model_wrapped
        state = {"model": get_model_state_dict(model)}
        read_dcp(state, os.path.join(checkpoint, DCP_FOLDER))
        set_model_state_dict(model, state["model"])

    def checkpoint_problem(self, path: str) -> str | None:
        """The trainer state parses, the DCP metadata loads (restricted) and every data file it names is there
        and long enough."""
        try:
            read_state_files(path)
        except RuntimeError as exc:
            return str(exc)
        if not self.recognises(path):
            return (f"it has no {DCP_FOLDER}/.metadata (not written by DCPStorage: resume it with "
                    f"storage=HFStorage(), or convert it)")
        try:
            metadata = dcp_metadata(path)
        except (OSError, UnsafeCheckpointError) as exc:
            return str(exc)
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in needed.items():
            data = os.path.join(path, DCP_FOLDER, name)
            if not os.path.isfile(data):
                return f"{DCP_FOLDER}/{name}: missing (its .metadata names it)"
            if os.path.getsize(data) < size:
                return f"{DCP_FOLDER}/{name}: {os.path.getsize(data):,} bytes, its .metadata promises {size:,}"
        return None


# -------------------------------------------------------------------------------------------------------------
# Conversion: `python -m loopkit convert-dcp SRC DST [--checkpoint]`
# -------------------------------------------------------------------------------------------------------------
def read_whole_state(checkpoint: str) -> dict:
    """The whole state a DCP checkpoint holds ({"model": {...}, "optimizer": {...}}), in one process, built from
    its metadata and read by `read_dcp`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..private_api import dcp_set_element

    set_element = dcp_set_element()  # DCP's own nesting of flattened keys

    metadata = dcp_metadata(checkpoint)
    state: dict = {}
    for key, item in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(key, (key,))
        value = (torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata)
                 else None)
        set_element(state, path, value)
    read_dcp(state, os.path.join(checkpoint, DCP_FOLDER))
    return state


def positional_optimizer_state(optimizer_state: dict) -> dict:
    """torch's `optimizer.state_dict()` layout (parameters numbered across the param groups, in order) from the
    named layout DCP saved (`get_optimizer_state_dict`): what `optimizer.pt` holds."""
    groups = optimizer_state["param_groups"]
    numbers = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    return {"state": {numbers[name]: value for name, value in optimizer_state["state"].items()},
            "param_groups": [{**group, "params": [numbers[name] for name in group["params"]]} for group in groups]}


def save_pretrained_from(checkpoint: str, state: dict, destination: str) -> None:
    """The model weights as `save_pretrained` writes them (with the checkpoint's config and processing files);
    a bare `model.safetensors` when the checkpoint has no config."""
    os.makedirs(destination, exist_ok=True)
    weights = state["model"]
    if os.path.isfile(os.path.join(checkpoint, "config.json")):
        import transformers

        config = transformers.AutoConfig.from_pretrained(checkpoint)
        architecture = (getattr(config, "architectures", None) or [None])[0]
        model_class = getattr(transformers, architecture or "", None)
        if model_class is None:
            raise ValueError(f"{checkpoint}/config.json names no transformers model class (architectures="
                             f"{config.architectures}); cannot write a save_pretrained folder for it.")
        model = model_class(config)
        result = model.load_state_dict(weights, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"{checkpoint} holds weights {model_class.__name__} does not have: "
                             f"{result.unexpected_keys[:5]}")
        if result.missing_keys:  # tied weights saved once (as `load_model_weights` does)
            model.tie_weights()
        model.save_pretrained(destination)
        for name in os.listdir(checkpoint):  # the processing class's files, as the checkpoint holds them
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "preprocessor")):
                shutil.copy2(os.path.join(checkpoint, name), destination)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(destination, "model.safetensors"),
                  metadata={"format": "pt"})


def convert(checkpoint: str, destination: str, as_checkpoint: bool = False) -> str:
    """A DCP checkpoint folder as a `save_pretrained` folder or (`as_checkpoint`) an HF-layout checkpoint:
    `optimizer.pt` in torch's positional layout, the other files copied. Returns `destination`."""
    if not os.path.isfile(os.path.join(checkpoint, DCP_FOLDER, ".metadata")):
        raise FileNotFoundError(f"{checkpoint} holds no {DCP_FOLDER}/.metadata: it is not a DCPStorage checkpoint.")
    if os.path.exists(destination) and os.listdir(destination):
        raise FileExistsError(f"{destination} exists and is not empty: pick a new folder.")
    state = read_whole_state(checkpoint)
    save_pretrained_from(checkpoint, state, destination)
    if as_checkpoint:
        if "optimizer" in state:
            save_state_file(positional_optimizer_state(state["optimizer"]),
                            os.path.join(destination, OPTIMIZER_NAME))
        for name in sorted(os.listdir(checkpoint)):
            path = os.path.join(checkpoint, name)
            if os.path.isfile(path) and not os.path.exists(os.path.join(destination, name)):
                shutil.copy2(path, destination)  # scheduler, scaler, RNG states, trainer and loopkit states
        if not os.path.isfile(os.path.join(destination, TRAINER_STATE_NAME)):
            raise FileNotFoundError(f"{checkpoint} has no {TRAINER_STATE_NAME}")
    return destination


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loopkit convert-dcp",
                                     description="Turn a DCPStorage checkpoint into a save_pretrained folder, or "
                                                 "(--checkpoint) into an HF-layout checkpoint HF Trainer resumes.")
    parser.add_argument("source", help="a checkpoint-<step> folder written by DCPStorage")
    parser.add_argument("destination", help="a new folder")
    parser.add_argument("--checkpoint", action="store_true",
                        help="write a whole HF-layout checkpoint (optimizer, scheduler, RNG and trainer states)")
    options = parser.parse_args(argv)
    path = convert(options.source, options.destination, as_checkpoint=options.checkpoint)
    print(f"wrote {path}")
    return 0
