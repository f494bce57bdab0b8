"""Counting host reads of tensor values: each one is a device synchronization on a GPU.

CPU torch has no synchronization counter, so we count the calls that need a tensor's value on the host
(`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool(t)`, `float(t)`, `int(t)`) by wrapping those `torch.Tensor`
methods, and record who called each one (file:function), so a report can say where a per-step sync comes from.
Wrapping costs time: count in a run that is not timed.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def short_path(filename: str) -> str:
    """`.../site-packages/transformers/trainer.py` -> `transformers/trainer.py`; repo files relative to the repo."""
    parts = filename.replace(os.sep, "/").split("/")
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1:])
    for anchor in ("loopkit", "benchmarks", "torch"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return filename


class HostReadCounter:
    """Use as a context manager; counts only while `active` is True (e.g. over the measured steps)."""

    def __init__(self):
        self.active = False
        self.calls: Counter = Counter()  # (method, "file:function") -> calls
        self.originals: dict = {}

    def __enter__(self):
        import torch

        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self.originals[name] = original
            setattr(torch.Tensor, name, self.counting(name, original))
        return self

    def __exit__(self, *exc):
        import torch

        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)
        self.originals = {}
        return False

    def counting(self, name, original):
        counter = self

        def counted(tensor, *args, **kwargs):
            if counter.active:
                caller = sys._getframe(1).f_code
                counter.calls[(name, f"{short_path(caller.co_filename)}:{caller.co_name}")] += 1
            return original(tensor, *args, **kwargs)

        counted.__name__ = name
        return counted

    def total(self) -> int:
        return sum(self.calls.values())

    def per_site(self, steps: int) -> list[dict]:
        """Host reads per step by (method, caller), most frequent first."""
        return [{"method": method, "where": where, "per_step": count / steps}
                for (method, where), count in self.calls.most_common()]
