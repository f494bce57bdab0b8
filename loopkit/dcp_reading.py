"""Reading torch.distributed.checkpoint (DCP) folders without running code planted in them.

A sharded FSDP checkpoint (`pytorch_model_fsdp_0/`, `optimizer_0/`) is a DCP folder: `.metadata`, a pickle of DCP's
`Metadata`, and `__<rank>_<n>.distcp` files of tensors and small non-tensor values. DCP's own reader loads
`.metadata` with `pickle.load`, and its default planner loads the non-tensor values (an optimizer's `lr`, `betas`,
...) with `torch.load(weights_only=False)`: either runs whatever a planted file asks for. loopkit reads every DCP
folder through `read_dcp`, which differs from `dcp.load` in exactly those two places:

* `.metadata` goes through `MetadataUnpickler`, which rebuilds only DCP's metadata classes (`Metadata`,
  `TensorStorageMetadata`, ... the globals that a real `.metadata` asks for) and the plain values they hold, sets
  the state of those objects only (as torch's weights-only unpickler), and refuses anything else, naming the file.
  The bytes validated are the bytes loaded (one read), so nothing can be swapped in between. The storage entries
  must name files inside the folder.
* non-tensor values go through `torch.load(weights_only=True)`, as tensors already do in DCP's reader.

What is refused raises `UnsafeCheckpointError`; checkpoints DCP writes load unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp

from .private_api import dcp_private_classes, dcp_set_element, dcp_storage_info_class, torch_layout_lookup
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

__all__ = ["UnsafeCheckpointError", "MetadataUnpickler", "load_metadata", "CheckedFileSystemReader",
           "WeightsOnlyLoadPlanner", "read_dcp"]


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file asks for something loopkit does not load (a pickled global outside the allowed ones, a
    storage entry outside its folder)."""


def _allowed_globals() -> dict:
    """(module, name) -> the object an allowed global resolves to. A path (`StorageMeta.checkpoint_id`, where the
    checkpoint was written) becomes a pure path: it is only recorded, never opened."""
    classes = {("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata")}
    classes.update(dcp_private_classes())
    classes[("torch", "Size")] = torch.Size
    layout = torch_layout_lookup()  # a lookup in torch's layouts, by the name the metadata's pickle gives
    classes[(layout.__module__, layout.__name__)] = layout
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes to pathlib._local
        for name, pure in (("PosixPath", pathlib.PurePosixPath), ("PurePosixPath", pathlib.PurePosixPath),
                           ("WindowsPath", pathlib.PureWindowsPath), ("PureWindowsPath", pathlib.PureWindowsPath)):
            classes[(module, name)] = pure
    return classes


_ALLOWED = _allowed_globals()
STORAGE_INFO = dcp_storage_info_class()


# The objects whose state a pickle may set (BUILD): DCP's metadata dataclasses; not the enum, whose members are
# shared by the whole process.
_BUILDABLE = tuple(cls for cls in _ALLOWED.values() if dataclasses.is_dataclass(cls))


class MetadataUnpickler(pickle._Unpickler):
    """Rebuilds DCP metadata and nothing else. `find_class` (every global a pickle names, to call it, instantiate it
    or build it) admits only DCP's metadata classes, `torch.Size`, torch dtypes and layouts, and paths; BUILD (setting
    an object's state) only DCP's metadata objects, never a class or a function, as torch's weights-only unpickler
    does. (Python's implementation of the unpickler, because BUILD cannot be restricted in the C one.)"""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def refuse(self, what: str):
        raise UnsafeCheckpointError(
            f"Refusing to load {self.path}: {what}. loopkit loads only torch.distributed.checkpoint's metadata "
            f"classes and plain values from it, so that a planted file cannot run code; re-create the checkpoint or "
            f"resume from another one.")

    def find_class(self, module: str, name: str):
        allowed = _ALLOWED.get((module, name))
        if allowed is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = getattr(torch, name)
        if allowed is None:
            self.refuse(f"it asks for `{module}.{name}`, which is not part of DCP's metadata")
        return allowed

    def persistent_load(self, pid):
        self.refuse("it holds a persistent id, which DCP metadata never does")

    def load_build(self):
        target = self.stack[-2]  # below the state
        if type(target) not in _BUILDABLE:
            self.refuse(f"it sets the state of a {type(target).__name__}, not of a DCP metadata object")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


def load_metadata(data: bytes, path: str) -> dcp_metadata.Metadata:
    """`data` (the bytes of the `.metadata` file at `path`) as DCP `Metadata`, or `UnsafeCheckpointError`."""
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated, not a pickle, a class called with arguments it does not take, ...
        raise UnsafeCheckpointError(f"{path} is not readable DCP metadata ({type(exc).__name__}: {exc}).") from exc
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata.")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, STORAGE_INFO) or not isinstance(name, str) or name in ("", ".", "..") \
                or os.path.basename(name) != name or os.path.isabs(name):
            raise UnsafeCheckpointError(f"Refusing to load {path}: a storage entry names {name!r}, not a file of "
                                        f"its folder.")
    return metadata


class CheckedFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader, with `.metadata` read by `load_metadata`. A refusal is kept (`refusal`) and
    raised again on every later metadata read: DCP catches the first one and falls back to per-rank metadata
    files, which must not rescue a folder whose metadata was refused."""

    def __init__(self, path):
        super().__init__(path)
        self.refusal: UnsafeCheckpointError | None = None

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if self.refusal is not None:
            raise self.refusal
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            data = stream.read()
        try:
            metadata = load_metadata(data, str(path))
        except UnsafeCheckpointError as exc:
            self.refusal = exc
            raise
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def file_of(self, read_item) -> str:
        return os.path.join(str(self.path), self.storage_data[read_item.storage_index].relative_path)


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values read by `torch.load(weights_only=True)`."""

    def __init__(self, reader: CheckedFileSystemReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            path = self.reader.file_of(read_item)
            self.reader.refusal = UnsafeCheckpointError(
                f"Refusing to load {path} (entry {read_item.dest_index.fqn!r}): {exc}. loopkit loads only tensors "
                f"and plain values from it (weights_only=True); re-create the checkpoint or resume from another one.")
            raise self.reader.refusal from exc
        if self.flatten_state_dict:
            set_element = dcp_set_element()  # as DefaultLoadPlanner.load_bytes
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


# torch's notice at every `dcp.save` / `dcp.load` without a process group, even with `no_dist=True`: loopkit calls
# them so only in one process, on purpose, and says nothing about it.
SINGLE_PROCESS_NOTICE = (r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
                         r"(save|load) in a single process\.")


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def one_process_quiet():
    """Around a DCP call: in one process, torch's notice that it assumes one process is not shown (that exact
    message only); with a process group, nothing changes. Python's warning filters are process-wide, so during the
    call (on a one-process asynchronous save's writer thread: the write) the filter holds for every thread, and a
    filter another thread adds meanwhile is undone with it at the end (`warnings.catch_warnings`)."""
    if distributed():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_NOTICE, category=UserWarning)
        yield


def read_dcp(state_dict: dict, folder: str) -> None:
    """`dcp.load(state_dict, checkpoint_id=folder)` (in place, resharding to `state_dict`'s layout; a collective
    when a process group is up), reading nothing as a full pickle. A refusal on this process is raised as itself,
    naming the file, rather than as DCP's wrapped error."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: DCP's collective failures

    reader = CheckedFileSystemReader(folder)
    try:
        with one_process_quiet():
            dcp.load(state_dict, storage_reader=reader, planner=WeightsOnlyLoadPlanner(reader))
    except (Exception, CheckpointException) as exc:
        if reader.refusal is not None and exc is not reader.refusal:
            raise reader.refusal from exc
        raise
