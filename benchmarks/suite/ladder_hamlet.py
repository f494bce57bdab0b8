"""The ladder on short, ragged text: benchmarks/suite/ladder.py's rungs and measurements on Hamlet's speeches (most
a line or two, median 15 tokens, a few whole soliloquies truncated at 128), beside the reviews (short and alike) and
the debates (a long tail)."""

from __future__ import annotations

from . import ladder as bench_ladder
from ..reports.ladder import chart, markdown  # noqa: F401  (reports/tables.py looks them up here)

DATASET = "hamlet"
TITLE = bench_ladder.TITLES[DATASET]


def run(suite) -> dict:
    return bench_ladder.run(suite, DATASET)
