"""Writing files so that they survive a crash (fsync, flushed while written), and the state files of a checkpoint
(`torch.save` without CRCs; `torch.load` with `weights_only=True` only)."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch


def write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def fsync_dir(path: str) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(root, name))
    fsync_dir(path)


class EarlyFlush:
    """Flushes a checkpoint's finished files to disk on a helper thread while the next ones are serialised, so the
    disk's write-back overlaps the CPU work instead of following it. `fsync_tree` still runs before the rename (then
    cheap: nothing left to write), so what makes a checkpoint durable and complete is unchanged."""

    def __init__(self, folder: str):
        self.folder, self.started, self.thread = folder, set(), None

    def flush_new_files(self) -> None:
        """Start flushing the files written into the folder since the last call (after the earlier ones)."""
        paths = [os.path.join(root, name) for root, _, files in os.walk(self.folder) for name in sorted(files)]
        new = [path for path in paths if path not in self.started]
        if not new:
            return
        self.started.update(new)
        previous = self.thread
        self.thread = threading.Thread(target=self.flush, args=(previous, new), daemon=True)
        self.thread.start()

    @staticmethod
    def flush(previous, paths) -> None:
        if previous is not None:
            previous.join()
        for path in paths:
            try:
                fsync_file(path)
            except OSError:  # the final fsync_tree reports what matters
                return

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()


class FlushWhileWriting:
    """Flushes a file to disk on a helper thread while it is being written (every `every` seconds), so the fsync
    before the rename waits for the last part only instead of the whole file: for the optimizer state, the largest
    file, written last. The helper waits in the kernel, not for the GIL."""

    def __init__(self, path: str, every: float = 0.03):
        self.path, self.every = path, every
        self.done = threading.Event()

    def __enter__(self):
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)  # no truncation: torch.save reopens it
        self.thread = threading.Thread(target=self.flush, daemon=True)
        self.thread.start()
        return self

    def flush(self) -> None:
        sync = getattr(os, "fdatasync", os.fsync)
        while not self.done.wait(self.every):
            try:
                sync(self.fd)
            except OSError:  # the final fsync_tree reports what matters
                return

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        os.close(self.fd)
        return False


def save_state_file(obj, path: str) -> None:
    """`torch.save` of optimizer, scheduler, scaler or RNG state without the zip records' CRC32s: `torch.load` never
    checks them (a corrupted payload loads silently either way), and computing them takes about a third of the time
    of saving an optimizer state. (The switch is torch's global one: set for this call, then restored.)

    Into a file object, not a path: torch's writer then hands each record to the file's `write`, which lets go of
    the GIL while the kernel copies it; given a path it holds the GIL for the whole write, and training on another
    thread (`async_save`) stalls for it. The archive's inner folder is then named `archive/` instead of after the
    file; `torch.load` reads either."""
    set_crc = getattr(torch.serialization, "set_crc32_options", None)
    computed = torch.serialization.get_crc32_options() if set_crc is not None else None
    try:
        if set_crc is not None:
            set_crc(False)
        with open(path, "wb") as f:
            torch.save(obj, f)
    finally:
        if set_crc is not None:
            set_crc(computed)


def import_serialisers() -> None:
    """Write a one-element state to memory with safetensors and with `torch.save`: each imports a module at its
    first write, which an asynchronous save's writer thread would otherwise do with the GIL held while training runs
    (a format's `before_async_saves`)."""
    import io

    from safetensors.torch import save

    save({"first": torch.zeros(1)})
    torch.save({"first": torch.zeros(1)}, io.BytesIO())


def safe_torch_load(path: str):
    """`torch.load` that can only rebuild tensors, primitives and numpy's RNG state: never arbitrary code."""
    allowed = [np.ndarray, np.dtype, np.dtypes.UInt32DType]
    reconstruct = getattr(getattr(np, "_core", np.core).multiarray, "_reconstruct")
    allowed.append(reconstruct)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, truncated zip, ...: name the file, never fall back to full pickle
        raise RuntimeError(f"Refusing or failing to load {path}: {exc}. loopkit loads only tensors and plain values "
                           f"(weights_only=True); re-create the file or resume from another checkpoint.") from exc

