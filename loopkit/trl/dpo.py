"""`DPOLoop`: TRL's `DPOTrainer` on loopkit's loop (docs/trl.md). `DPOTrainer(` becomes `DPOLoop(`."""

from __future__ import annotations

from trl import DPOTrainer

from .base import TRLLoop


class DPOLoop(DPOTrainer, TRLLoop):
    """TRL's `DPOTrainer`: its arguments, data preparation, collator and loss; loopkit's run (loopkit/trl/base.py)."""
