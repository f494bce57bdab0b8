"""`Seq2SeqLoop`: `transformers.Seq2SeqTrainer`'s equivalent. Replace `Seq2SeqTrainer(` with `Seq2SeqLoop(`; its
`Seq2SeqTrainingArguments` work as they are.

It is a `Loop` whose evaluation stage generates by default (`Seq2SeqEvalStage`, loopkit/stages/seq2seq.py), so
`evaluate(...)` and `predict(...)` take `generate`'s keywords (`max_length`, `max_new_tokens`, `num_beams`, ...)
and, with `predict_with_generate=True`, return generated token ids as predictions. A subclass overrides
`prediction_step`, `evaluate` or `predict` as it would on a `Seq2SeqTrainer` subclass.
"""

from __future__ import annotations

from .loop import STAGES, Loop
from .stages.seq2seq import Seq2SeqEvalStage, load_generation_config


class Seq2SeqLoop(Loop):
    """A `Loop` with HF `Seq2SeqTrainer`'s evaluation: `predict_with_generate`, `generation_max_length`,
    `generation_num_beams` and `generation_config` from the arguments, `generate`'s keywords on `evaluate` and
    `predict`."""

    stage_classes = {**STAGES, "evaluation": Seq2SeqEvalStage}

    @staticmethod
    def load_generation_config(gen_config_arg):
        """HF's `Seq2SeqTrainer.load_generation_config` (a copy of a `GenerationConfig`, or one read from a path)."""
        return load_generation_config(gen_config_arg)
