"""The benchmarks' verdicts are right by construction (issue 22): times and sizes are compared by ratios of positive
quantities, differences (the slowdown after a save, the time a save blocks training) by differences, a large ratio
reads "23x" and never "2191%", and rounds that point both ways get no verdict.

The property test walks every sign combination of two contenders' rounds and checks the words against the
direction the rounds actually show; the rows quoted in the issue are checked as quoted. No benchmark runs here.
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `benchmarks/` lives in the repository, next to the installed loopkit
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.reports.verdicts import comparison_row, loopkit_flags  # noqa: E402
from benchmarks.reports.tables import comparison_table, noisy_rows, slow_rows  # noqa: E402

SLOWDOWN = "the 8 steps after the save, slower by"
# Three rounds of one contender, by sign: the magnitudes differ between contenders so neither can tie.
ROUNDS = {
    "positive": [0.30, 0.32, 0.34],  # spread 12%: below the 20% that makes a row of amounts noisy
    "negative": [-0.30, -0.32, -0.34],
    "mixed": [-0.20, 0.05, 0.30],
    "zero": [0.0, 0.0, 0.0],
}
SCALES = (0.5, 1.0, 2.0)  # loopkit's rounds = a sign pattern times a scale


def row_of(loopkit: list, hf: list, kind: str):
    return comparison_row(SLOWDOWN, "s", {"hf": hf, "loopkit": loopkit}, kind=kind)


def signs_of(values: list) -> set:
    return {(v > 0) - (v < 0) for v in values}


def test_every_sign_combination_of_a_slowdown_gets_the_verdict_its_rounds_show():
    """For a difference row, loopkit is flagged slower exactly when it slowed down more than HF Trainer in every
    round; the flag gives a positive difference in seconds, never a ratio; rounds that point both ways are "no
    verdict"; and no number in the table is a ratio or a percentage of a quantity that can be negative."""
    checked = 0
    for (l_name, l_rounds), (h_name, h_rounds), scale in itertools.product(ROUNDS.items(), ROUNDS.items(), SCALES):
        loopkit = [v * scale for v in l_rounds]
        row = row_of(loopkit, h_rounds, kind="difference")
        per_round = [a - b for a, b in zip(loopkit, h_rounds)]
        flags = loopkit_flags(row)
        table = comparison_table([row])
        case = f"loopkit {l_name} x{scale}, hf {h_name}: {loopkit} vs {h_rounds}"
        if all(d > 0 for d in per_round):
            assert len(flags) == 1 and flags[0].startswith("slower than HF Trainer by "), case
            amount = float(re.match(r"slower than HF Trainer by (\S+) s", flags[0]).group(1))
            assert amount > 0 and abs(amount - sorted(per_round)[1]) < 1e-2 * max(1e-9, amount), case
        else:
            assert flags == [], case
        if signs_of(per_round) - {0} == {1, -1}:  # some rounds say more, some less: no verdict either way
            assert row["noisy"] and "NO, no verdict" in table, case
            assert slow_rows({"benchmarks": {"c": {"title": "C", "rows": [row]}}}) == [], case
        # a difference is never read as a ratio or a percentage of itself
        assert row["ratios"] == {}, case
        assert not re.search(r"-?\d+(\.\d+)?x\b", table.split("\n\n")[0]), (case, table)
        assert not re.search(r"-\d+%", table), (case, table)
        checked += 1
    assert checked == len(ROUNDS) ** 2 * len(SCALES)


def test_every_sign_combination_of_an_amount_is_ratioed_only_when_positive():
    """For an amount row (a time, a size), ratios exist only between positive rounds; a non-positive round makes the
    row "no verdict"; with positive rounds the flag's direction is the ratios' (slower exactly when every round's
    ratio is above 1)."""
    for (l_name, l_rounds), (h_name, h_rounds), scale in itertools.product(ROUNDS.items(), ROUNDS.items(), SCALES):
        loopkit = [v * scale for v in l_rounds]
        row = comparison_row("time per step", "s", {"hf": h_rounds, "loopkit": loopkit})
        flags = loopkit_flags(row)
        case = f"loopkit {l_name} x{scale}, hf {h_name}"
        if l_name == h_name == "positive":
            ratios = [a / b for a, b in zip(loopkit, h_rounds)]
            assert row["ratios"]["loopkit/hf"]["median"] > 0, case
            slower = all(r > 1 for r in ratios)
            assert not row["noisy"] and bool(flags) == slower, case
            if slower:
                assert flags[0].startswith("slower than HF Trainer"), case
            if any(r < 1 for r in ratios) and any(r > 1 for r in ratios):
                assert row["noisy"], case
        else:
            assert row["ratios"]["loopkit/hf"] is None, case
            assert row["noisy"] and any("not a positive amount" in reason for reason in row["noisy"]), case
            assert flags == [], case
            assert "NO, no verdict" in comparison_table([row]), case


def test_the_rows_quoted_in_the_issue():
    # "loopkit is slower than HF Trainer (medians -0.0427 vs -0.018 s, 24.235x ...)": loopkit's following steps
    # slowed down less than HF's in every round, so loopkit is not flagged and the table shows a negative
    # difference in seconds
    quoted = row_of([-0.0427, -0.050, -0.031], [-0.018, -0.001, -0.020], kind="difference")
    assert loopkit_flags(quoted) == []
    assert quoted["differences"]["loopkit/hf"]["median"] < 0
    table = comparison_table([quoted])
    assert "-0.0247 s" in table and "24.2" not in table and "x (" not in table.split("\n\n")[0]
    # the same rows the other way round: loopkit slowed down more, by a positive number of seconds
    reverse = row_of([-0.018, -0.001, -0.020], [-0.0427, -0.050, -0.031], kind="difference")
    assert loopkit_flags(reverse)[0].startswith("slower than HF Trainer by 0.0247 s")
    # "-216.493x": rounds of both signs never give a ratio; "rounds agree? yes (spread up to -40%)": never a
    # negative spread, and rounds that point both ways get no verdict
    both_ways = row_of([0.2165, -0.05, 0.10], [-0.001, 0.02, 0.01], kind="difference")
    table = comparison_table([both_ways])
    assert "-216" not in table and "spread up to -" not in table
    assert "NO, no verdict" in table and noisy_rows({"benchmarks": {"c": {"title": "C", "rows": [both_ways]}}})
    # "2191.4% slower": 23 times the raw loop's time reads as a factor
    blocked = comparison_row("training blocked by one save", "s",
                             {"raw": [0.020, 0.021, 0.019], "hf": [0.30, 0.28, 0.33], "loopkit": [0.46, 0.48, 0.44]})
    flags = loopkit_flags(blocked)
    assert "slower than the raw loop: 23x its time" in " ".join(flags)
    assert not any("%" in flag for flag in flags)
    # a steady 10% stays a percentage with both medians beside it
    steady = comparison_row("steady", "ms/step", {"raw": [10.0, 10.1, 9.9], "loopkit": [11.0, 11.1, 10.9]})
    assert loopkit_flags(steady) == ["10.0% slower than the raw loop (medians 11.0 vs 10.0 ms/step, 1.100x; "
                                     "rounds ranged 1.10-1.10x)"]


def test_the_checkpoint_benchmark_compares_its_slowdowns_as_differences():
    """The checkpoint benchmark's own rows, from measured rounds shaped as in the issue's quick run: loopkit's steps
    after the save ran faster than before it (a negative slowdown), HF's less so; loopkit is not called slower."""
    from benchmarks.suite.checkpoint import rows_for

    def rounds(blocked, following):
        return [{"blocked": b, "following_steps_slower_by": f, "gap_without_save": 0.001, "usual_step": 0.2,
                 "total_bytes": 2 ** 20, "files": {"model.safetensors": 2 ** 20}, "probe_loss": 1.0, "global_step": 12}
                for b, f in zip(blocked, following)]

    rows = rows_for({"raw": rounds([0.02, 0.021, 0.019], [0.01, -0.02, 0.005]),
                     "hf": rounds([0.30, 0.28, 0.33], [-0.018, -0.001, -0.020]),
                     "loopkit": rounds([0.46, 0.48, 0.44], [-0.0427, -0.050, -0.031])})
    blocked, following = rows[0], rows[1]
    assert blocked["kind"] == following["kind"] == "difference"
    assert loopkit_flags(following) == [] and following["differences"]["loopkit/hf"]["median"] < 0
    assert loopkit_flags(blocked)[0].startswith("slower than HF Trainer by 0.16 s")
    assert rows[-1]["kind"] == "amount" and rows[-1]["ratios"]["loopkit/hf"]["median"] == 1.0


def table_cells(table: str, row_name: str) -> dict:
    """The cells of one row of a comparison table, by column header."""
    lines = table.split("\n")
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    row = next(line for line in lines if line.startswith(f"| {row_name} |"))
    return dict(zip(header, (cell.strip() for cell in row.strip("|").split("|"))))


def test_a_row_whose_every_round_points_one_way_gets_that_verdict_with_the_spread_stated():
    """Issue 34, item 11: loopkit below HF Trainer in every round (0.81-0.90x) while HF's own rounds spread 30% (a
    busy machine slows both sides of a round: the rounds are paired): the verdict stands, in the verdict column,
    with the spread stated beside it; "no verdict" only where a pair's rounds point both ways."""
    from benchmarks.reports.verdicts import verdict

    row = comparison_row("tiny LlamaForCausalLM", "ms/step", {"hf": [50.0, 45.0, 60.0], "loopkit": [45.0, 40.0, 48.6]})
    assert row["noisy"] == [] and row["wide_spread"] == ["hf's rounds spread 30% (45.0-60.0 ms/step)"]
    assert verdict(row, "hf") == "faster than HF Trainer in every round (0.81-0.90x)"
    cells = table_cells(comparison_table([row]), "tiny LlamaForCausalLM")
    assert cells["verdict"] == "faster than HF Trainer in every round (0.81-0.90x)"
    assert cells["same work?"] == "yes"
    assert "hf's rounds spread 30%" in cells["rounds agree?"] and "no verdict" not in cells["rounds agree?"]
    assert noisy_rows({"benchmarks": {"c": {"title": "C", "rows": [row]}}}) == []
    # the same spread, but one round the other way: no verdict, and the reason names the pair
    both = comparison_row("tiny LlamaForCausalLM", "ms/step", {"hf": [50.0, 45.0, 60.0], "loopkit": [45.0, 46.0, 48.6]})
    cells = table_cells(comparison_table([both]), "tiny LlamaForCausalLM")
    assert cells["verdict"].startswith("no verdict against HF Trainer: the rounds point both ways")
    assert cells["rounds agree?"].startswith("NO, no verdict: loopkit vs hf points both ways")


def test_a_slowdown_sits_in_the_verdict_column_not_in_the_same_work_column():
    """Issue 34, item 11: "7.5% slower" was written into the "same work?" column."""
    steady = comparison_row("steady", "ms/step", {"raw": [10.0, 10.1, 9.9], "loopkit": [10.75, 10.86, 10.64]})
    cells = table_cells(comparison_table([steady]), "steady")
    assert cells["same work?"] == "yes"
    assert cells["verdict"].startswith("7.5% slower than the raw loop (medians 10.8 vs 10.0 ms/step, 1.075x")


def test_every_sign_of_wide_rounds_gets_the_verdict_its_paired_ratios_show():
    """Rounds that spread far (up to 100%) in every combination: the verdict against HF Trainer follows the paired
    ratios alone: faster (every ratio below 1), slower (every ratio above 1), or no verdict (both ways)."""
    from benchmarks.reports.verdicts import verdict

    wide = {"steady": [1.0, 1.0, 1.0], "rising": [0.6, 1.0, 1.4], "falling": [1.4, 1.0, 0.6], "busy": [1.0, 2.0, 1.0]}
    for (l_name, l_shape), (h_name, h_shape), scale in itertools.product(wide.items(), wide.items(), (0.8, 1.25)):
        loopkit, hf = [v * scale for v in l_shape], h_shape
        row = comparison_row("time per step", "s", {"hf": hf, "loopkit": loopkit})
        ratios = [a / b for a, b in zip(loopkit, hf)]
        words = verdict(row, "hf")
        case = f"loopkit {l_name} x{scale}, hf {h_name}: {words}"
        if all(r < 1 for r in ratios):
            assert words.startswith("faster than HF Trainer in every round"), case
        elif all(r > 1 for r in ratios):
            assert words.startswith("slower than HF Trainer (") and loopkit_flags(row), case
        else:
            assert words.startswith("no verdict") and not loopkit_flags(row), case
