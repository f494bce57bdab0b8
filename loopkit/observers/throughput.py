"""`Throughput`: real (non-padding) tokens per second and the padding share, added to every training log."""

from __future__ import annotations

from collections.abc import Mapping

from . import StepObserver


class Throughput(StepObserver):
    """`real_tokens_per_second`: the main input's tokens less padding (`attention_mask == 0`) over the windows' host
    seconds since the last log; `padding_share`: the padding's share of those tokens. This process's windows."""

    def __init__(self):
        self.start(None)

    def start(self, state) -> None:
        self.tokens, self.padding, self.seconds = 0, 0, 0.0

    def on_step(self, result, window, state) -> None:
        self.tokens += result.tokens
        self.seconds += result.seconds
        for batch in window.batches:
            if isinstance(batch, Mapping) and "attention_mask" in batch:  # a device tensor: summed, not read
                self.padding = self.padding + (batch["attention_mask"] == 0).sum()

    def logs(self, state) -> dict:
        padding, tokens, seconds = int(self.padding), self.tokens, self.seconds  # int(): the one device read
        self.start(state)
        return {"real_tokens_per_second": round((tokens - padding) / seconds, 3) if seconds else 0.0,
                "padding_share": round(padding / tokens, 4) if tokens else 0.0}
