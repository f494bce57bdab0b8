"""Issue 46: loopkit's Python calls per optimizer step stay within a fixed budget of the hand-written loop's.

Counted, not timed: cProfile's call counts (builtins included) over 200 optimizer steps of the near-null model
(a 16x16 linear layer, where the loop's own work is the step), both contenders in this process after each trained
once, by `benchmarks.overhead_grid` (the same counts as its grid). A count does not depend on the machine's load, so
a change that adds work to every step, every micro-batch or every log fails here, on any machine.

The budgets are the counts measured when the test was written plus 15 calls. The phase clock's slow-step record
(loopkit/phases.py: a step 3x slower than the median) is switched off here: whether a step is slow depends on the
machine, and a slow step's record is no per-step work.
"""

from __future__ import annotations

import math

import pytest

from benchmarks.overhead_grid import Cell, calls_cell

# (cell, loopkit's calls per step beyond the hand-written loop's at most); measured: +21 and +100 (2026-12-06)
BUDGETS = [
    (Cell(logging_steps=10, grad_accum=1, args_class="TrainingArguments", callback=False), 35),
    (Cell(logging_steps=1, grad_accum=2, args_class="LoopArgs", callback=True), 115),
]


@pytest.mark.parametrize("cell, budget", BUDGETS, ids=[cell.name for cell, _ in BUDGETS])
def test_loopkit_calls_per_step_stay_within_budget_of_the_hand_written_loop(cell, budget, monkeypatch):
    from loopkit import phases

    monkeypatch.setattr(phases, "SLOW_FACTOR", math.inf)
    counted = calls_cell(cell, ["raw", "loopkit"])
    calls = counted["calls_per_step"]
    # The count covers the steps: the raw loop's forward, backward, clipping, AdamW and schedule alone are hundreds.
    assert calls["raw"] > 300, calls
    extra = calls["loopkit"] - calls["raw"]
    assert extra <= budget, (f"loopkit makes {extra:+.1f} calls per optimizer step over the hand-written loop "
                             f"({calls}), over the budget of {budget}; the functions that differ most: "
                             f"{counted['loopkit_minus_raw_by_function']}")
