"""Checkpoint storages: `CheckpointStorage` (the interface, loopkit/storage/base.py), `HFStorage` (the default: HF
Trainer's layout) and `DCPStorage` (torch.distributed.checkpoint: async saves, resharding on load). Pass one as
`Loop(..., storage=...)`."""

_EXPORTS = {"CheckpointStorage": "loopkit.storage.base", "HFStorage": "loopkit.storage.hf",
            "DCPStorage": "loopkit.storage.dcp"}

__all__ = sorted(_EXPORTS) + ["run_storage"]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loopkit.storage' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def run_storage(storage, stage_options: dict):
    """The run's checkpoint storage: `storage`, or the default one with the options `EvalStage` was given (the
    earlier place of `async_save`, `on_save_error` and `best_total_limit`, still accepted)."""
    from ..errors import config_error
    from .base import CheckpointStorage
    from .hf import HFStorage

    if storage is None:
        return HFStorage(**stage_options)
    if not isinstance(storage, CheckpointStorage):
        raise config_error("storage", storage, "it is not a loopkit.storage.CheckpointStorage",
                           "pass HFStorage(...), DCPStorage(...) or a subclass of CheckpointStorage")
    given = {name: value for name, value in stage_options.items() if value != HFStorage().options()[name]}
    if given:
        name, value = next(iter(given.items()))
        raise config_error(name, value, "it was passed to the evaluation stage and a storage was passed too",
                           f"pass it to the storage: {type(storage).__name__}({name}={value!r})")
    return storage
