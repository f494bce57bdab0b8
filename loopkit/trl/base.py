"""`TRLLoop`: `Loop` standing where `transformers.Trainer` stands under a TRL trainer class.

A TRL trainer is a `Trainer` subclass: its `__init__` prepares the model (PEFT, chat template), the datasets
(tokenising text, prompt-completion, messages or preference pairs; packing), the collator and the loss settings, and
then calls `super().__init__(model=..., args=..., ...)` with Trainer's arguments; its `compute_loss`, `log`,
`prediction_step` and `evaluate` overrides call `super()` for Trainer's part. Each of loopkit's TRL loops is

    class SFTLoop(SFTTrainer, TRLLoop): ...

whose method order is `SFTLoop, SFTTrainer, _BaseTrainer, TRLLoop, Loop, ..., Trainer`: TRL's preparation runs
first, and its `super().__init__(...)` is `Loop.__init__`; TRL's overrides are bound onto loopkit's stages as any
`Loop` subclass's are (loopkit/trainer/overridable.py), so TRL's loss runs inside loopkit's step stage, and `train()`
is loopkit's run. `Trainer` stays last in the order only so that `isinstance(loop, Trainer)` holds for TRL's code and
callbacks. A `Trainer` method that TRL calls and loopkit does not define would fall through to `Trainer`'s own
implementation, which reads state a `Loop` does not keep: each such method is defined on the TRL loop that needs it,
and the parity tests (tests/test_trl_*.py) run TRL's trainer live beside it.
"""

from __future__ import annotations

from transformers import Trainer

from ..loop import Loop


class TRLLoop(Loop, Trainer):
    """`Loop` in `Trainer`'s place for TRL's trainer classes (module docstring). Not used on its own."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # TRL's trainers name the columns their collators read (`prompt_ids`, `seq_lengths`, `completion_mask`, ...)
        # in this hook of Trainer's; `remove_unused_columns` keeps exactly those, as in Trainer.
        self._signature_columns = None
        self._set_signature_columns_if_needed()
        self.run.signature_columns = list(self._signature_columns)
