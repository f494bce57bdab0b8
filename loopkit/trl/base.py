"""`TRLLoop`: `Loop` standing where `transformers.Trainer` stands under a TRL trainer class.

A TRL trainer is a `Trainer` subclass: its `__init__` prepares the model (PEFT, chat template), the datasets
(tokenising text, prompt-completion, messages or preference pairs; packing), the collator and the loss settings, and
then calls `super().__init__(model=..., args=..., ...)` with Trainer's arguments; its `compute_loss`, `log`,
`prediction_step` and `evaluate` overrides call `super()` for Trainer's part. Each of loopkit's TRL loops is

    class SFTLoop(LoopKeywords, SFTTrainer, TRLLoop): ...

whose method order is `SFTLoop, LoopKeywords, SFTTrainer, _BaseTrainer, TRLLoop, Loop, ..., Trainer`: TRL's
preparation runs first (after `LoopKeywords` takes loopkit's own keywords out, below), and its
`super().__init__(...)` is `Loop.__init__`; TRL's overrides are bound onto loopkit's stages as any `Loop`
subclass's are (loopkit/trainer/overridable.py), so TRL's loss runs inside loopkit's step stage, and `train()` is
loopkit's run. `Trainer` stays last in the order only so that `isinstance(loop, Trainer)` holds for TRL's code and
callbacks. A `Trainer` method that TRL calls and loopkit does not define would fall through to `Trainer`'s own
implementation, which reads state a `Loop` does not keep: each one TRL's trainers reach is defined here (those common
to every TRL trainer) or on the TRL loop that needs it, and the parity tests (tests/test_trl_*.py) run TRL's trainer
live beside it.

Defined here, for every TRL trainer:
* `_prepare_inputs` (TRL's `prediction_step` calls it): the batch on the run's device, as Trainer's.
* `current_gradient_accumulation_steps` (TRL's MoE auxiliary loss reads it): the micro-batches of the step in
  progress, which Trainer keeps as an attribute of its training loop and the step stage keeps here.
* `_save_checkpoint`: TRL's override writes the model card (`README.md` in `output_dir`) and then calls Trainer's;
  every checkpoint loopkit writes goes through it, and Trainer's part is `Loop.save_checkpoint`.
* TRL's running metrics (`_total_train_tokens`, the `num_tokens` it logs, and the training metrics gathered since
  the last log, `_metrics["train"]`) are kept in each checkpoint and restored on resume. TRL keeps them on the
  trainer object only, so a resumed TRL run counts `num_tokens` from zero again (docs/trl.md, "Where TRL is wrong").

Under FSDP2 and DeepSpeed, TRL's engine code reads `is_fsdp_enabled` / `is_deepspeed_enabled` (Loop's: DPOTrainer
then shards or wraps its reference model with `prepare_fsdp` / `prepare_deepspeed`) and `_prepare_inputs` (above):
nothing else was reached in tests/test_trl_engines.py (SFT, DPO, reward; FSDP2 and ZeRO-2 against TRL's trainers).

loopkit's own keywords (`Loop(...)`'s keyword-only ones: `storage=`, `metrics=`, `observers=`, the stage swaps
`setup=`, `data=`, `step=`, `evaluation=`, `teardown=`) are passed beside TRL's arguments: `LoopKeywords`, the
first base of each TRL loop, takes them out before TRL's `__init__` (which does not know them) and `TRLLoop.__init__`
hands them to `Loop.__init__`. The class's signature (`help()`, `inspect.signature`) shows TRL's arguments and these.
"""

from __future__ import annotations

import inspect

from transformers import Trainer

from ..errors import config_error, nearest
from ..loop import STAGES, Loop
from ..stages.step import StepStage

# The key of TRL's running metrics in a checkpoint's loopkit state (`loopkit_state.json`).
TRL_STATE_KEY = "trl"

# loopkit's own keywords of `Loop(...)`, which no TRL trainer takes: its keyword-only parameters.
LOOP_KEYWORDS = tuple(name for name, parameter in inspect.signature(Loop.__init__).parameters.items()
                      if parameter.kind is parameter.KEYWORD_ONLY)


class TRLStepStage(StepStage):
    """loopkit's step stage, without the warning for a `compute_loss` override that leaves the loss scaling for
    gradient accumulation to HF's rule: a TRL trainer's `compute_loss` is written for exactly that rule (TRL's
    `loss_is_scaled_for_ga` is None), and the parity tests run it with accumulation against TRL's trainer."""

    def warn_if_override_scaling_is_implicit(self) -> None:
        pass


class TRLLoop(Loop, Trainer):
    """`Loop` in `Trainer`'s place for TRL's trainer classes (module docstring). Not used on its own."""

    stage_classes = {**STAGES, "step": TRLStepStage}
    # method -> the stage that owns it: a variant defines it on a subclass of that stage (`stage_classes`), and a
    # definition on the loop, which the loop never calls, is refused when the class is defined
    stage_hooks = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, owner in cls.stage_hooks.items():
            if name in vars(cls):
                stage = cls.stage_classes[owner].__name__
                raise TypeError(f"{cls.__name__} defines {name}, which is a method of the {owner} stage, not of the "
                                f"loop: define it on a {stage} subclass and pass {owner}=YourStage()")

    def __init__(self, *args, **kwargs):
        """`Trainer.__init__`'s place: TRL's `super().__init__(...)`, with loopkit's keywords `LoopKeywords` took."""
        super().__init__(*args, **kwargs, **vars(self).pop("loop_keywords", {}))
        # TRL's trainers name the columns their collators read (`prompt_ids`, `seq_lengths`, `completion_mask`, ...)
        # in this hook of Trainer's; `remove_unused_columns` keeps exactly those, as in Trainer.
        self._signature_columns = None
        self._set_signature_columns_if_needed()
        self.run.signature_columns = list(self._signature_columns)

    # -- Trainer methods TRL calls ---------------------------------------------------------------------------------
    def _prepare_inputs(self, inputs):
        """Trainer's: `inputs` on the run's device (floating tensors in DeepSpeed's dtype under DeepSpeed)."""
        import torch
        from accelerate.utils import recursively_apply

        if len(inputs) == 0:
            raise ValueError(f"The batch received was empty, so the model cannot train on it. Fix: make the dataset "
                             f"hold the columns the model reads: {', '.join(self._signature_columns or [])}.")
        options = {"device": self.accelerator.device}

        def move(tensor):
            if self.is_deepspeed_enabled and (torch.is_floating_point(tensor) or torch.is_complex(tensor)):
                return tensor.to(dtype=self.accelerator.state.deepspeed_plugin.hf_ds_config.dtype(), **options)
            return tensor.to(**options)

        return recursively_apply(move, inputs)

    @property
    def current_gradient_accumulation_steps(self) -> int:
        """The number of micro-batches of the optimizer step in progress (fewer at an epoch's uneven end)."""
        return getattr(self.step, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)

    def save_checkpoint(self) -> str:
        """loopkit's checkpoint, through TRL's `_save_checkpoint` (the model card, then Trainer's part)."""
        self._save_checkpoint(self.model_wrapped, None)  # TRL's override passes `trial` on to Trainer's only
        return self.saved_checkpoint

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's part of a checkpoint save, after TRL's own: loopkit's checkpoint of this step."""
        self.saved_checkpoint = Loop.save_checkpoint(self)

    # -- TRL's running metrics in the checkpoint ---------------------------------------------------------------
    def trl_state_dict(self) -> dict:
        """TRL's running training metrics: the token count behind `num_tokens` and the values since the last log."""
        metrics = getattr(self, "_metrics", {}).get("train", {})
        return {"total_train_tokens": getattr(self, "_total_train_tokens", None),
                "train_metrics": {key: list(values) for key, values in metrics.items()}}

    def load_trl_state_dict(self, state: dict) -> None:
        if state.get("total_train_tokens") is not None:
            self._total_train_tokens = state["total_train_tokens"]
        if hasattr(self, "_metrics"):
            self._metrics["train"].clear()
            self._metrics["train"].update({key: list(values) for key, values in state["train_metrics"].items()})

    def stage_states(self) -> dict:
        return {**super().stage_states(), TRL_STATE_KEY: self.trl_state_dict()}

    def start_state(self, checkpoint, plan, trial) -> None:
        super().start_state(checkpoint, plan, trial)
        if checkpoint is not None:  # a fresh train() keeps counting, as TRL's trainer does
            saved = self.context.checkpointer.read_stage_states(checkpoint).get(TRL_STATE_KEY)
            if saved is not None:  # a checkpoint written by TRL's trainer or by a plain Loop has none
                self.load_trl_state_dict(saved)


# -- loopkit's own keywords beside TRL's arguments ---------------------------------------------------------------
class LoopKeywords:
    """The first base of each TRL loop (`class SFTLoop(LoopKeywords, SFTTrainer, TRLLoop)`): takes loopkit's own
    keywords (LOOP_KEYWORDS) out of the call before TRL's `__init__`, for `TRLLoop.__init__` to hand to
    `Loop.__init__`; refuses a keyword neither takes, naming the nearest; gives the class the signature of both."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own_init = "__init__" in vars(cls) and not cls.__module__.startswith("loopkit.")
        cls.__signature__ = None if own_init else trl_loop_signature(cls)  # None: a user's __init__ is shown

    def __init__(self, *args, **kwargs):
        refuse_unknown_keywords(type(self), kwargs)
        self.loop_keywords = {name: kwargs.pop(name) for name in LOOP_KEYWORDS if name in kwargs}
        refuse_foreign_stages(type(self), self.loop_keywords)
        super().__init__(*args, **kwargs)


def refuse_foreign_stages(cls, keywords: dict) -> None:
    """A stage given to a TRL loop is an instance of the loop's own class for it (`stage_classes`: DPOLoop's step is a
    `DPOStep`, GRPOLoop's data a `RolloutDataStage`): a variant subclasses it, and the loop hands it TRL's parts."""
    for name, stage in keywords.items():
        kind = cls.stage_classes.get(name)
        if kind is not None and stage is not None and not isinstance(stage, kind):
            raise config_error(name, type(stage).__name__, f"{cls.__name__}'s {name} stage is a {kind.__name__}",
                               f"pass an instance of a {kind.__name__} subclass")


def trl_trainer_class(cls) -> type:
    """The TRL trainer class a TRL loop runs (`SFTTrainer` for `SFTLoop` and its subclasses)."""
    return next(base for base in cls.__mro__ if issubclass(base, Trainer) and not issubclass(base, TRLLoop))


def trl_loop_signature(cls) -> inspect.Signature:
    """TRL's trainer's parameters (less `self`), then loopkit's own keywords (keyword-only), as `cls(...)` takes
    them."""
    trl_parameters = list(inspect.signature(trl_trainer_class(cls).__init__).parameters.values())[1:]
    loop_parameters = [parameter for name, parameter in inspect.signature(Loop.__init__).parameters.items()
                       if name in LOOP_KEYWORDS]
    before = [p for p in trl_parameters if p.kind is not p.VAR_KEYWORD and p.name not in LOOP_KEYWORDS]
    after = [p for p in trl_parameters if p.kind is p.VAR_KEYWORD]
    return inspect.Signature(before + loop_parameters + after)


def refuse_unknown_keywords(cls, kwargs: dict) -> None:
    """A keyword neither TRL's trainer nor `Loop` takes: a TypeError (as Python's) naming the nearest one."""
    known = trl_loop_signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in known.values()):
        return
    for name in kwargs:
        if name not in known:
            guesses = nearest(name, known, n=2)
            fix = (f"did you mean {' or '.join(guesses)}? Write {cls.__name__}(..., {guesses[0]}=...)" if guesses else
                   f"{cls.__name__} takes {trl_trainer_class(cls).__name__}'s arguments and loopkit's own "
                   f"({', '.join(LOOP_KEYWORDS)})")
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}. Fix: {fix}.")
