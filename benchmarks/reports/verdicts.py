"""Statistics of paired rounds, result rows and their verdicts (parent side, no torch).

Every benchmark's rows come from `comparison_row`: medians, round-by-round ratios or differences, and a verdict
only where every round points the same way (benchmarks/README.md, "How it keeps the comparison honest").
"""

from __future__ import annotations

import math
import statistics

from ..contenders.names import LABELS, PEERS

RATIO_PAIRS = (("loopkit", "raw"), ("loopkit", "hf"), ("hf", "raw"))


# What a row measures decides how contenders are compared:
# * "amount": a time, a size, a rate: positive in every round; compared by ratios ("1.10x", "23x").
# * "difference": a change between two measurements (the time a save blocks training, how much slower the steps
#   after it run): any sign, near zero when there is nothing to measure; compared by differences in its unit, never
#   by ratios (a ratio of two negative slowdowns reads backwards).
KINDS = ("amount", "difference")


def median(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


def paired(a_values: list, b_values: list, combine) -> dict | None:
    """Median, min and max of round-by-round `combine(a, b)`. Rounds alternate contenders, so each pair of samples was
    taken under nearly the same machine conditions; the median of paired values cancels drift better than comparing
    medians."""
    pairs = [combine(a, b) for a, b in zip(a_values, b_values) if a is not None and b is not None]
    if not pairs:
        return None
    return {"median": statistics.median(pairs), "min": min(pairs), "max": max(pairs), "n": len(pairs)}


def paired_ratio(numerators: list, denominators: list) -> dict | None:
    """Round-by-round ratios (see `paired`); None unless every value is positive: a ratio is only read as "times as
    much" between positive quantities."""
    values = [v for v in list(numerators) + list(denominators) if v is not None]
    if any(v <= 0 for v in values):
        return None
    return paired(numerators, denominators, lambda a, b: a / b)


def paired_difference(a_values: list, b_values: list) -> dict | None:
    """Round-by-round differences a - b, in the row's unit (see `paired`)."""
    return paired(a_values, b_values, lambda a, b: a - b)


def direction(comparison: dict | None, neutral: float) -> int | None:
    """+1 when every round lies above `neutral` (1 for ratios, 0 for differences), -1 when every round lies below,
    0 when all equal it, None when the rounds disagree (some on each side) or there is nothing to compare."""
    if comparison is None:
        return None
    if comparison["min"] > neutral:
        return 1
    if comparison["max"] < neutral:
        return -1
    if comparison["min"] == comparison["max"] == neutral:
        return 0
    return None


def check_equal(values: dict, rtol: float, what: str, atol: float = 0.0) -> dict:
    """Did every contender end where the reference did? The reference is the raw loop if present, else HF.
    Returns {"ok", "detail", "mismatched", "values"}; a mismatched contender's numbers are not reported."""
    reference = "raw" if "raw" in values else "hf" if "hf" in values else next(iter(values))
    expected = values[reference]
    mismatched = [name for name, value in values.items()
                  if value is None or expected is None
                  or abs(value - expected) > atol + rtol * abs(expected)]
    if mismatched:
        detail = f"{what} differs from {reference}'s " + ", ".join(
            f"{name}={values[name]!r}" for name in mismatched) + f" vs {expected!r} (rtol {rtol:g})"
    else:
        detail = f"equal {what} (rtol {rtol:g})"
    return {"ok": not mismatched, "detail": detail, "mismatched": mismatched, "values": values}


def check_runs(replies: dict, key: str, rtol: float, what: str) -> list[dict]:
    """`check_equal` on `key` for every round: `replies[contender][round]` are the workers' answers."""
    rounds = min(len(runs) for runs in replies.values())
    return [check_equal({c: runs[i][key] for c, runs in replies.items()}, rtol, what) for i in range(rounds)]


def merge_checks(*checks: dict) -> dict:
    mismatched = sorted({name for c in checks for name in c["mismatched"]})
    failing = [c["detail"] for c in checks if not c["ok"]]
    details = dict.fromkeys(failing or [c["detail"] for c in checks])  # unique, in order
    return {"ok": not mismatched, "mismatched": mismatched, "detail": "; ".join(details),
            "values": [c["values"] for c in checks]}


def fmt(value, digits: int = 3) -> str:
    """A number for a table or a summary line: thousands separators for large values, 3 significant digits else."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.{digits}g}"


# A row gets no verdict when a contender's rounds include a non-positive amount (no ratio exists), or when a contender
# beats the physical limit (`floor`: the hand-written loop doing the same work with nothing extra) by more than
# FLOOR_MARGIN: neither can be a real difference, so the row's ratios are not to be trusted. A pair whose rounds point
# both ways gets no verdict. A contender whose measured rounds spread over NOISE_SPREAD of their median is stated
# beside the verdict, which stands when every round points the same way (the rounds are paired, run side by side).
NOISE_SPREAD = 0.20


FLOOR_MARGIN = 0.05


def spread(values: list) -> float | None:
    """(max - min) / median of an amount's measured rounds; None with fewer than two (or a non-positive median,
    where a fraction of it means nothing)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if len(values) < 2 or not statistics.median(values) > 0:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def comparisons(samples: dict, kind: str, floor: str | None) -> dict:
    """The row's pairs ("loopkit/hf", ...) compared round by round: paired ratios for amounts, paired differences
    for differences; loopkit against each peer (contenders/peers.py) the row has. With a `floor`, every contender
    against it too (the physical-limit check)."""
    pairs = [(a, b) for a, b in RATIO_PAIRS if a in samples and b in samples]
    pairs += [("loopkit", peer) for peer in PEERS if "loopkit" in samples and peer in samples]
    if floor in samples:
        pairs += [(c, floor) for c in samples if c != floor and (c, floor) not in pairs]
    compare = paired_ratio if kind == "amount" else paired_difference
    return {f"{a}/{b}": compare(samples[a], samples[b]) for a, b in pairs}


def untrusted_reasons(unit: str, samples: dict, kind: str, compared: dict, floor: str | None) -> list[str]:
    """Why no pair of this row can have a verdict ([] when one can): an amount that is not positive, a contender
    beating the floor."""
    reasons = []
    for contender, values in samples.items():
        if kind == "amount" and any(v is not None and v <= 0 for v in values):
            reasons.append(f"{contender}'s rounds include values <= 0 ({', '.join(fmt(v) for v in values)} {unit}): "
                           f"not a positive amount, so no ratio")
    for contender in samples:
        ratio = compared.get(f"{contender}/{floor}") if kind == "amount" else None
        if contender != floor and ratio and ratio["median"] < 1 - FLOOR_MARGIN:
            reasons.append(f"{contender} faster than {floor}, the physical limit ({fmt(median(samples[contender]))} "
                           f"vs {fmt(median(samples[floor]))} {unit}, {ratio['median']:.3f}x)")
    return reasons


def noise_reasons(unit: str, samples: dict, kind: str, compared: dict, floor: str | None) -> list[str]:
    """Why some verdict of this row is withheld ([] when none is): the row's untrusted reasons, and each pair whose
    rounds point both ways."""
    reasons = untrusted_reasons(unit, samples, kind, compared, floor)
    neutral = 1.0 if kind == "amount" else 0.0
    for pair, comparison in compared.items():
        if comparison is not None and comparison["n"] > 1 and direction(comparison, neutral) is None:
            reasons.append(f"{pair.replace('/', ' vs ')} points both ways over the rounds "
                           f"({fmt_comparison(comparison, kind, unit)})")
    return reasons


def wide_spreads(unit: str, samples: dict, kind: str) -> list[str]:
    """The contenders whose rounds of an amount spread over NOISE_SPREAD of their median, each with its range."""
    notes = []
    for contender, values in samples.items():
        fraction = spread(values) if kind == "amount" else None
        if fraction is not None and fraction > NOISE_SPREAD:
            notes.append(f"{contender}'s rounds spread {fraction:.0%} ({fmt(min(values))}-{fmt(max(values))} {unit})")
    return notes


def fmt_comparison(comparison: dict | None, kind: str, unit: str) -> str:
    """A paired comparison for a table: "1.100x (1.05-1.12)" for amounts, "+0.0247 s (+0.01 to +0.03)" for
    differences."""
    if comparison is None:
        return "n/a"
    if kind == "amount":
        text = f"{comparison['median']:.3f}x"
        digits = 3 if comparison["min"] < 0.1 else 2  # a range of small ratios keeps its digits (0.006x: 0.005-0.012)
        return text if comparison["n"] == 1 else f"{text} ({comparison['min']:.{digits}f}-{comparison['max']:.{digits}f})"
    text = f"{comparison['median']:+.3g} {unit}"
    return text if comparison["n"] == 1 else f"{text} ({comparison['min']:+.3g} to {comparison['max']:+.3g})"


def comparison_row(name: str, unit: str, samples: dict, check: dict | None = None, extra: dict | None = None,
                   higher_is_better: bool = False, floor: str | None = None, kind: str = "amount") -> dict:
    """A row comparing contenders on one measurement: raw samples (per measured round), medians, paired comparisons
    (`ratios` for an amount, `differences` for a difference: see KINDS), each contender's spread, `noisy` (the
    reasons a verdict is withheld), `untrusted` (those of them that withhold every verdict of the row) and
    `wide_spread` (contenders whose rounds spread over NOISE_SPREAD: stated beside the verdicts). `floor` names the
    contender no other can beat doing the same work (the raw loop, for times of the same training); leave it None
    where a contender may do less.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: choose one of {', '.join(KINDS)}")
    compared = comparisons(samples, kind, floor)
    return {
        "name": name, "unit": unit, "kind": kind, "higher_is_better": higher_is_better, "samples": samples,
        "median": {c: median(v) for c, v in samples.items()},
        "spread": {c: spread(v) if kind == "amount" else None for c, v in samples.items()},
        "ratios": compared if kind == "amount" else {},
        "differences": compared if kind == "difference" else {},
        "floor": floor,
        "noisy": noise_reasons(unit, samples, kind, compared, floor),
        "untrusted": untrusted_reasons(unit, samples, kind, compared, floor),
        "wide_spread": wide_spreads(unit, samples, kind),
        "check": check or {"ok": True, "detail": "", "mismatched": [], "values": None},
        "extra": extra or {},
    }


SIZE_UNITS = ("MB", "GB", "KB", "bytes")


# Peak RSS moves by a few pages from run to run: memory within 1% counts as equal.
MEMORY_TOLERANCE = 0.01


# Against the raw loop an amount is flagged from 2% worse; against HF Trainer from any consistent loss.
RAW_MARGIN = 0.02


def rebuilt_row(stored: dict) -> dict:
    """A results file's row computed again from its raw samples by today's rules (a results file keeps the row as
    its run computed it). A row stored with no noise reasons keeps none: its benchmark applies no noise rule to it
    (memory rows), and today's reasons are a subset of those a run stored."""
    row = comparison_row(stored["name"], stored["unit"], stored["samples"], check=stored.get("check"),
                         extra=stored.get("extra"), higher_is_better=stored.get("higher_is_better", False),
                         floor=stored.get("floor"), kind=stored.get("kind", "amount"))
    if stored.get("noisy") == []:
        row["noisy"], row["untrusted"] = [], []
    return row


def loopkit_flags(row: dict) -> list[str]:
    """Where loopkit is worse than HF Trainer, or more than 2% worse than the raw loop, on this row (slower for
    times, larger for memory and sizes), each with both medians beside the comparison. Only where every round of
    that pair says so, and the row's amounts can be trusted (see `untrusted_reasons`); a wide spread does not
    withhold it."""
    if row.get("untrusted", row.get("noisy")) or "loopkit" in row["check"]["mismatched"] or row["higher_is_better"]:
        return []
    return [flag for other in ("hf", "raw") for flag in [worse_than(row, other)] if flag]


OTHER_LABELS = {"hf": "HF Trainer", "raw": "the raw loop", **{peer: LABELS[peer] for peer in PEERS}}


def verdict(row: dict, other: str) -> str | None:
    """loopkit against `other` on this row, in words (None where the row does not compare them): where loopkit is
    worse, `worse_than`'s words; else the way every round points, with the rounds' range ("faster in every round
    (0.81-0.97x)"); else why there is no verdict. A wide spread does not withhold it (the table states the spread
    beside it): the rounds are paired, each run side by side."""
    kind = row.get("kind", "amount")
    pairs = row["differences"] if kind == "difference" else row["ratios"]
    if f"loopkit/{other}" not in pairs:
        return None
    comparison = pairs[f"loopkit/{other}"]
    none = f"no verdict against {OTHER_LABELS[other]}"
    if {"loopkit", other} & set(row["check"]["mismatched"]):
        return f"{none}: not the same work"
    if comparison is None or row.get("untrusted", row.get("noisy")):
        return f"{none}: the rounds cannot be compared (see rounds agree?)"
    way = direction(comparison, 0.0 if kind == "difference" else 1.0)
    if way is None:
        return f"{none}: the rounds point both ways ({fmt_comparison(comparison, kind, row['unit'])})"
    worse = None if row["higher_is_better"] else worse_than(row, other)
    if worse:
        return worse
    if way == 0:
        return f"equal to {OTHER_LABELS[other]} in every round"
    if row["unit"] in SIZE_UNITS and kind == "amount" and \
            1 - MEMORY_TOLERANCE <= comparison["min"] and comparison["max"] <= 1 + margin_of(row, other):
        return f"the same as {OTHER_LABELS[other]} within {margin_of(row, other):.0%} " \
               f"({fmt_comparison(comparison, kind, row['unit'])})"
    words = {"difference": ("smaller", "larger"), "size": ("smaller", "larger"), "better": ("lower", "higher"),
             "time": ("faster", "slower")}
    what = "difference" if kind == "difference" else "better" if row["higher_is_better"] else \
        "size" if row["unit"] in SIZE_UNITS else "time"
    word = words[what][0 if way < 0 else 1]
    span = (f"{comparison['min']:+.3g} to {comparison['max']:+.3g} {row['unit']}" if kind == "difference" else
            f"{comparison['min']:.2f}-{comparison['max']:.2f}x")
    margin = f", within the {margin_of(row, other):.0%} margin" if way > 0 and what in ("time", "size") else ""
    if comparison["n"] == 1:
        return f"{word} than {OTHER_LABELS[other]} (one round: {fmt_comparison(comparison, kind, row['unit'])}{margin})"
    return f"{word} than {OTHER_LABELS[other]} in every round ({span}{margin})"


def margin_of(row: dict, other: str) -> float:
    """How much worse than `other` loopkit may measure on an amount row before it is flagged."""
    return max(RAW_MARGIN if other == "raw" else 0.0, MEMORY_TOLERANCE if row["unit"] in SIZE_UNITS else 0.0)


def worse_than(row: dict, other: str) -> str | None:
    """The words for "loopkit is worse than `other` on this row", or None where it is not (or no verdict)."""
    kind = row.get("kind", "amount")
    comparison = (row["differences"] if kind == "difference" else row["ratios"]).get(f"loopkit/{other}")
    if direction(comparison, 0.0 if kind == "difference" else 1.0) != 1:
        return None
    memory = row["unit"] in SIZE_UNITS
    worse = "larger" if memory else "slower"
    label = OTHER_LABELS[other]
    medians = f"medians {fmt(row['median']['loopkit'])} vs {fmt(row['median'][other])} {row['unit']}"
    if kind == "difference":
        difference = comparison
        return (f"{worse} than {label} by {fmt(difference['median'])} {row['unit']} ({medians}; "
                f"loopkit - {other} per round {fmt_comparison(difference, kind, row['unit'])})")
    ratio = comparison
    if ratio["median"] <= 1 + margin_of(row, other):
        return None
    details = f"{medians}, {ratio['median']:.3f}x"
    if ratio["n"] > 1:
        details += f"; rounds ranged {ratio['min']:.2f}-{ratio['max']:.2f}x"
    if ratio["median"] >= 2:  # "23x", never "2191% slower"
        return f"{worse} than {label}: {ratio['median']:.3g}x its {'size' if memory else 'time'} ({details})"
    if other == "hf":
        return f"{worse} than {label} ({details})"
    return f"{(ratio['median'] - 1) * 100:.1f}% {worse} than {label} ({details})"
