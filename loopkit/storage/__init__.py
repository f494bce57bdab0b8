"""Checkpoint storages: `CheckpointStorage` (the interface, loopkit/storage/base.py), `HFStorage` (the default: HF
Trainer's layout) and `DCPStorage` (torch.distributed.checkpoint: async saves, resharding on load). Pass one as
`Loop(..., storage=...)`."""

_EXPORTS = {"CheckpointStorage": "loopkit.storage.base", "HFStorage": "loopkit.storage.hf",
            "DCPStorage": "loopkit.storage.dcp"}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loopkit.storage' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
