"""`SFTLoop`: TRL's `SFTTrainer` on loopkit's loop (docs/trl.md). `SFTTrainer(` becomes `SFTLoop(`.

Everything `SFTTrainer.__init__` does is TRL's (the model from a name, PEFT, the chat template, tokenising text,
prompt-completion and conversational datasets, truncation, packing, the collator, the fused LM head); its
`compute_loss` (NLL or DFT over the completion or assistant tokens), `log` (entropy, mean_token_accuracy, num_tokens),
`prediction_step` and `evaluate` run inside loopkit's stages. The fused LM head TRL installs is wrapped by
loopkit's (loopkit/trl/fused.py): the same numbers, from the logits of the scored tokens only, in one pass. The run
is loopkit's: TRLLoop (loopkit/trl/base.py) defines each `Trainer` method these reach, and keeps TRL's running
metrics exact over a resume.
"""

from __future__ import annotations

from trl import SFTConfig, SFTTrainer

from .base import LoopKeywords, TRLLoop
from .fused import use_fast_lm_heads

# The fields SFTTrainer asks its fused LM head for (`add_fused_lm_head(..., outputs=...)` in its __init__).
SFT_HEAD_OUTPUTS = ("log_probs", "entropy", "is_top1")


class SFTLoop(LoopKeywords, SFTTrainer, TRLLoop):
    """TRL's `SFTTrainer`: its arguments, data preparation, collator and loss; loopkit's run (loopkit/trl/base.py)."""

    #: The configuration class whose every field this loop honours (SFTTrainer reads SFTConfig's own fields).
    args_class = SFTConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        use_fast_lm_heads(self, SFT_HEAD_OUTPUTS)  # TRL's head, with less work (loopkit/trl/fused.py)
