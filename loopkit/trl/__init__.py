"""TRL's trainers on loopkit's loop: `SFTLoop`, `DPOLoop`, `RewardLoop`, `GRPOLoop` (docs/trl.md).

`from trl import SFTTrainer` becomes `from loopkit.trl import SFTLoop`, and `SFTTrainer(` becomes `SFTLoop(`: the same
arguments (TRL's config, `processing_class`, `peft_config`, `ref_model`, `reward_funcs`, ...), the same data formats,
TRL's own data preparation, collators and losses, and loopkit's run (its stages, events, checkpoints, exact resume,
run report and engines). Needs the `trl` extra (`pip install loopkit[trl]`); `import loopkit` never imports TRL.
"""

_EXPORTS = {
    "TRLLoop": "loopkit.trl.base",
    "SFTLoop": "loopkit.trl.sft",
    "DPOLoop": "loopkit.trl.dpo",
    "RewardLoop": "loopkit.trl.reward",
    "GRPOLoop": "loopkit.trl.grpo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loopkit.trl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
