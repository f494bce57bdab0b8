"""Writing results: `results.json` (every raw sample and the environment), `results.md` (tables) and PNG charts.

matplotlib is optional (`pip install matplotlib`, or loopkit's `charts` extra) and imported only here, when charts
are drawn; without it the JSON and Markdown are still written and the summary says how to get the charts.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from ..contenders.names import CONTENDERS, LABELS, PEERS
from .verdicts import FLOOR_MARGIN, NOISE_SPREAD, fmt, fmt_comparison, loopkit_flags, median, rebuilt_row, verdict

CHARTS_HINT = "Charts need matplotlib: pip install matplotlib (or pip install 'loopkit[charts]'), then re-run."


def with_range(value, samples) -> str:
    """A median with the min-max of its measured rounds (when there are several)."""
    values = [v for v in samples or [] if v is not None]
    if len(values) < 2:
        return fmt(value)
    low, high = min(values), max(values)
    return f"{fmt(value)} ({fmt(low)}{' to ' if low < 0 else '-'}{fmt(high)})"  # "-0.6 to 0.4", not "-0.6-0.4"


def compared(row: dict) -> dict:
    return row["differences"] if row.get("kind") == "difference" else row["ratios"]


def agreement(row: dict) -> str:
    """The "rounds agree?" cell: why a verdict is withheld, or the spread of the rounds (a spread over NOISE_SPREAD
    stated, the verdicts standing where every round of a pair points one way)."""
    wide = row.get("wide_spread") or []
    if row.get("noisy"):
        return f"NO, no verdict: {'; '.join(row['noisy'] + wide)}"
    if row.get("kind") == "difference":
        several = any(c and c["n"] > 1 for c in row["differences"].values())
        return "yes (every pair's rounds differ in the same direction)" if several else "one round: unknown"
    spreads = [v for v in row.get("spread", {}).values() if v is not None]
    if not spreads:
        return "one round: unknown"
    if wide:
        return (f"yes, every round of each pair points one way, though the rounds spread up to {max(spreads):.0%}: "
                f"{'; '.join(wide)}")
    return f"yes (spread up to {max(spreads):.0%})"


def verdicts(row: dict) -> str:
    """The "verdict" cell: loopkit against HF Trainer and against the raw loop, each in words (`verdict`)."""
    return "; ".join(text for other in ("hf", "raw") for text in [verdict(row, other)] if text) or "-"


def comparison_table(rows: list, contenders=CONTENDERS) -> str:
    """Medians per contender, paired ratios, the same-work check, loopkit's verdicts and whether the rounds agree. A
    contender whose run did not end where the reference did shows MISMATCH instead of a number; a row whose rounds
    cannot back a verdict says why."""
    present = [c for c in contenders if any(c in row["samples"] for row in rows)]
    pairs = [p for p in ("loopkit/raw", "loopkit/hf", "hf/raw") if any(p in compared(row) for row in rows)]
    header = ["benchmark", "unit"] + [LABELS[c] for c in present] + \
        [p.replace("hf", "HF").replace("/", " vs ") for p in pairs] + ["same work?", "verdict", "rounds agree?"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        mismatched = row["check"]["mismatched"]
        kind = row.get("kind", "amount")
        cells = [row["name"], row["unit"]]
        for c in present:
            cells.append("MISMATCH" if c in mismatched else with_range(row["median"].get(c), row["samples"].get(c)))
        for pair in pairs:
            a, b = pair.split("/")
            cells.append("n/a" if a in mismatched or b in mismatched else
                         fmt_comparison(compared(row).get(pair), kind, row["unit"]))
        cells.append("yes" if row["check"]["ok"] else f"NO: {row['check']['detail']}")
        cells.append(verdicts(row))
        cells.append(agreement(row))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\nEach value is the median of the measured rounds (their min-max in brackets). \"A vs B\": for "
                 "times and sizes the median of round-by-round ratios A/B (min-max in brackets; below 1 means A takes "
                 "less); for differences (a slowdown, a blocked time: any sign) the median of round-by-round "
                 "differences A - B in the row's unit (below 0 means A's is smaller). A verdict needs every round of "
                 "its pair to point the same way (the rounds run side by side, so a busy moment slows both sides of "
                 "a round). Spread: (max - min) / median of a contender's measured rounds; one over "
                 f"{NOISE_SPREAD:.0%} is stated beside the verdicts. No verdict where a pair's rounds point both "
                 f"ways, where an amount is not positive, or where a contender beats the hand-written loop doing the "
                 f"same work by over {FLOOR_MARGIN:.0%}.")
    return "\n".join(lines)


def rebuilt(results: dict) -> dict:
    """`results` with every comparison row computed again from its raw samples (`rebuilt_row`)."""
    sections = {name: dict(section, rows=[rebuilt_row(row) for row in section["rows"]]) if "rows" in section
                else section for name, section in results["benchmarks"].items()}
    return dict(results, benchmarks=sections)


# ---------------------------------------------------------------------------------------------------------------------
def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, default=str))


def section_markdown(name: str, section: dict) -> str:
    module = importlib.import_module(f"benchmarks.suite.{name}")
    if "error" in section:
        return f"Failed: `{section['error'].strip().splitlines()[-1]}` (full traceback in results.json)."
    if hasattr(module, "markdown"):
        return module.markdown(section)
    return comparison_table(section["rows"])


def environment_markdown(env: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items())
    load = env.get("load_average", {})
    return (f"- Machine: {env.get('cpu_model', '?')}, {env.get('cpu_count', '?')} logical CPUs, "
            f"torch threads per process: {env.get('torch_threads', '?')}, device: {env.get('device', 'cpu')}\n"
            f"- Software: Python {env.get('python', '?')}, {versions}\n"
            f"- Size: `{env.get('size')}`; run started {env.get('started_at')}, took {fmt(env.get('seconds'))} s\n"
            f"- Load average (1 min) at start / end: {fmt(load.get('start'))} / {fmt(load.get('end'))} "
            f"(other processes competing for the CPUs make timings noisy; ratios of alternating runs are steadier "
            f"than absolute numbers)")


def slow_rows(results: dict) -> list[str]:
    """Summary lines for the rows where loopkit is worse (noisy rows are never among them)."""
    found = []
    for name, section in results["benchmarks"].items():
        for row in section.get("rows", []):
            for flag in loopkit_flags(row):
                found.append(f"- {section['title']} / {row['name']}: loopkit is {flag}")
    return found


def noisy_rows(results: dict) -> list[str]:
    """Summary lines for the rows whose rounds disagree: no win or loss is read from them."""
    return [f"- {section['title']} / {row['name']}: {'; '.join(row['noisy'])}"
            for section in results["benchmarks"].values() for row in section.get("rows", []) if row.get("noisy")]


def write_markdown(results: dict, path: Path, charts: list[str]) -> str:
    text = markdown(results, charts)
    path.write_text(text)
    return text


def markdown(results: dict, charts: list[str], kept: dict | None = None) -> str:
    """results.md's text: the environment, each benchmark's tables (with its chart when drawn), the rows where
    loopkit is slower, and the rows too noisy for a verdict. `kept` (section number -> its text in an earlier
    results.md): the text of a section today's code cannot read (a results file of an older format)."""
    parts = ["# loopkit benchmarks\n", environment_markdown(results["environment"]), ""]
    for number, (name, section) in enumerate(results["benchmarks"].items(), start=1):
        parts.append(f"## {number}. {section.get('title', name)}\n")
        try:
            parts.append(section_markdown(name, section))
        except KeyError:
            if number not in (kept or {}):
                raise
            parts.append(kept[number])
            continue
        chart = f"{name}.png"
        if chart in charts:
            parts.append(f"\n![{section.get('title', name)}]({chart})")
        parts.append("")
    slow = slow_rows(results)
    parts.append("## Where loopkit is slower than HF Trainer, or more than 2% slower than the raw loop\n")
    parts.append("\n".join(slow) if slow else "Nowhere in this run.")
    noisy = noisy_rows(results)
    if noisy:
        parts.append("\n## Too noisy for a verdict (re-run on a quieter machine)\n")
        parts.append("\n".join(noisy))
    if not charts:
        parts.append(f"\n{CHARTS_HINT}")
    return "\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
def write_charts(results: dict, out_dir: Path) -> list[str]:
    """One PNG per benchmark; returns the file names written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for name, section in results["benchmarks"].items():
        if "error" in section:
            continue
        module = importlib.import_module(f"benchmarks.suite.{name}")
        figure = module.chart(section, plt) if hasattr(module, "chart") else comparison_chart(section, plt)
        if figure is None:
            continue
        figure.savefig(out_dir / f"{name}.png", dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(f"{name}.png")
    return written


COLORS = {"raw": "#7f7f7f", "hf": "#ff9d00", "loopkit": "#1f77b4", "ignite": "#d62728", "fabric": "#9467bd",
          "lightning": "#8c564b"}


def comparison_chart(section: dict, plt):
    """One panel per row: each contender's median as a bar and every measured sample as a dot."""
    rows = section.get("rows", [])
    if not rows:
        return None
    columns = min(3, len(rows))
    lines = -(-len(rows) // columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 3.4 * lines), squeeze=False)
    for axis in axes.flat[len(rows):]:
        axis.set_visible(False)
    for axis, row in zip(axes.flat, rows):
        names = [c for c in CONTENDERS + PEERS if c in row["samples"]]
        for x, contender in enumerate(names):
            samples = row["samples"][contender]
            value = median(samples)
            mismatched = contender in row["check"]["mismatched"]
            axis.bar(x, value or 0, color=COLORS[contender], alpha=0.3 if mismatched else 0.85)
            axis.scatter([x] * len(samples), samples, color="black", s=8, zorder=3)
            label = "MISMATCH" if mismatched else fmt(value)
            # Above the highest of the bar and its rounds' dots, a few points up: never over a dot.
            top = max([value or 0] + [v for v in samples if v is not None])
            axis.annotate(label, (x, top), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                          fontsize=8)
        crowded = len(names) > 3  # the per-step benchmark with the peers: slanted labels, or they overlap
        axis.set_xticks(range(len(names)), [LABELS[c] for c in names], fontsize=8, rotation=30 if crowded else 0,
                        ha="right" if crowded else "center")
        axis.set_title(row["name"], fontsize=9)
        axis.set_ylabel(row["unit"])
        values = [v for c in names for v in row["samples"][c] if v is not None]
        lowest, highest = min([0.0] + values), max([0.0] + values)
        # A slowdown can be negative (within noise); the top leaves room for the labels above the highest dots.
        axis.set_ylim(bottom=lowest, top=highest + 0.15 * (highest - lowest) if highest > lowest else None)
    figure.suptitle(section["title"])
    figure.tight_layout()
    return figure
