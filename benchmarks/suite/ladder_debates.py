"""Benchmark 8, the ladder on a text with a long length tail: benchmarks/suite/ladder.py's rungs and measurements
on the 2016 presidential debates' statements (mostly short, a few hundred tokens at the tail: a padded batch is mostly
padding), where the reviews of benchmark 7 are short and alike. The two bound the ladder's ratios."""

from __future__ import annotations

from . import ladder as bench_ladder
from ..reports.ladder import chart, markdown  # noqa: F401  (reports/tables.py looks them up here)

DATASET = "debates"
TITLE = bench_ladder.TITLES[DATASET]


def run(suite) -> dict:
    return bench_ladder.run(suite, DATASET)
