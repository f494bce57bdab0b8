"""`SFTLoop`: TRL's `SFTTrainer` on loopkit's loop (docs/trl.md). `SFTTrainer(` becomes `SFTLoop(`."""

from __future__ import annotations

from trl import SFTTrainer

from .base import TRLLoop


class SFTLoop(SFTTrainer, TRLLoop):
    """TRL's `SFTTrainer`: its arguments, data preparation, collator and loss; loopkit's run (loopkit/trl/base.py)."""
