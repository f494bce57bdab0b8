"""The benchmark numbers in README.md and docs/performance.md, generated from the committed results files.

    python -m benchmarks.docs            # rewrite the generated sections from benchmarks/results/
    python -m benchmarks.docs --check    # exit 1 if a page differs from what the results files give

A generated section sits between `<!-- generated: NAME from FILE -->` and `<!-- end generated: NAME -->`; nothing
inside is written by hand, so every number there is a value of FILE (tests/test_docs.py checks each page against
`render`). The parent side only: no torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .bench_ladder import COMPILED, DATASETS, RUNGS
from .harness import REPO_ROOT, comparison_row, fmt, fmt_comparison, median
from .report import with_range

FULL_RESULTS = "benchmarks/results/results.json"
LADDER_RESULTS = "benchmarks/results/quick/results.json"
PAGES = ("README.md", "docs/performance.md")
SECTION = re.compile(r"^(?P<indent> *)<!-- generated: (?P<name>[\w-]+) from (?P<file>\S+) -->\n(?P<body>.*?)"
                     r"^(?P=indent)<!-- end generated: (?P=name) -->", re.DOTALL | re.MULTILINE)
# (benchmark, what its row's name contains, which of the matching rows, kind): the summary table's rows, one results
# row each, labelled with the row's own name. Found by name, not position: a quick run has fewer evaluation-memory
# configurations, and sizes (N, steps) inside the names differ between sizes.
SUMMARY = (
    ("overhead", "near-null model", 0, "amount"), ("overhead", "tiny LlamaForCausalLM", 0, "amount"),
    ("overhead", "setup, imports done", 0, "amount"), ("startup", "the contender's own part", 0, "amount"),
    ("startup", "process start to end of step 1", 0, "amount"), ("startup", "framework import alone", 0, "amount"),
    ("eval_memory", "loopkit streaming metrics vs HF argmax", 0, "amount"),
    ("eval_memory", "loopkit streaming metrics vs HF argmax", 1, "amount"),
    ("eval_memory", "compute_metrics on full logits", 0, "amount"),
    ("eval_memory", "compute_metrics on full logits", 1, "amount"),
    ("resume", "iterable-seekable data", 1, "amount"), ("resume", "map data", 1, "amount"),
    ("checkpoint", "training blocked by one save", 0, "difference"),
    ("checkpoint", "training blocked by one save, loopkit async_save=True", 0, "difference"),
    ("checkpoint", "slower by, loopkit async_save=True", 0, "difference"),
    ("checkpoint", "checkpoint size", 0, "amount"), ("finetune", "wall time", 0, "amount"),
)


def load(path: str) -> dict:
    return json.loads((REPO_ROOT / path).read_text())


def summary_table(results: dict) -> str:
    """Medians (min-max of the rounds) per contender and loopkit's paired comparisons, rebuilt from each row's raw
    samples (so times are compared by ratios and the save's slowdowns by differences)."""
    lines = ["| benchmark | unit | hand-written loop | HF Trainer | loopkit | loopkit vs raw | loopkit vs HF |",
             "|---|---|---|---|---|---|---|"]
    for benchmark, needle, nth, kind in SUMMARY:
        stored = [r for r in results["benchmarks"][benchmark]["rows"] if needle in r["name"]][nth]
        row = comparison_row(stored["name"], stored["unit"], stored["samples"], kind=kind)
        cells = [with_range(row["median"][c], row["samples"][c]) if c in row["samples"] else ""
                 for c in ("raw", "hf", "loopkit")]
        compared = row["ratios"] if kind == "amount" else row["differences"]
        cells += [fmt_comparison(compared[p], kind, row["unit"]) if compared.get(p) else ""
                  for p in ("loopkit/raw", "loopkit/hf")]
        lines.append(f"| {benchmark}: {row['name']} | {row['unit']} | " + " | ".join(cells) + " |")
    syncs = results["benchmarks"]["overhead"]["rows"][0]["extra"]["syncs_per_step"]
    lines.append("| overhead: host reads per step (near-null model) | reads/step | " +
                 " | ".join(fmt(syncs[c]) for c in ("raw", "hf", "loopkit")) + " | | |")
    return "\n".join(lines)


def ladder_table(section: dict) -> str:
    runs, ratios = section["runs"], section["ratios"]
    lines = ["| rung | real tokens/s | vs HF default | vs HF best | compile s (first round) | peak RSS MB | "
             "held-out loss |", "|---|---|---|---|---|---|---|"]
    for name, (label, _) in RUNGS.items():
        replies = runs[name]
        compile_cell = fmt(replies[0]["compile_seconds"]) if name in COMPILED else ""
        lines.append(f"| {label} | {fmt(median([r['tokens_per_second'] for r in replies]))} | "
                     f"{fmt_comparison(ratios[f'{name}/hf-default'], 'amount', '')} | "
                     f"{fmt_comparison(ratios[f'{name}/hf-best'], 'amount', '')} | {compile_cell} | "
                     f"{fmt(median([r['peak_rss_mb'] for r in replies]))} | "
                     f"{fmt(median([r['heldout_loss'] for r in replies]), 4)} |")
    return "\n".join(lines)


def ladder_sections(results: dict) -> list[tuple[str, dict]]:
    """(benchmark name, section) for each dataset the ladder ran on, in DATASETS order."""
    found = {s["plan"]["dataset"]: (name, s) for name, s in results["benchmarks"].items()
             if name.startswith("ladder") and "plan" in s}
    return [found[d] for d in DATASETS if d in found]


def command(results: dict, benchmark: str) -> str:
    size = results["environment"]["size"]
    return f"python -m benchmarks --only {benchmark}" + {"full": "", "quick": " --quick"}.get(size, f" --size {size}")


def ladder(results: dict) -> str:
    env = results["environment"]
    parts = [f"From `{LADDER_RESULTS}` (size `{env['size']}`, run started {env['started_at']}, load average "
             f"{fmt(env['load_average']['start'])} at the start and {fmt(env['load_average']['end'])} at the end)."]
    for benchmark, section in ladder_sections(results):
        plan = section["plan"]
        parts += ["", f"**{DATASETS[plan['dataset']]['label']}** (`{command(results, benchmark)}`, "
                      f"key `benchmarks.{benchmark}`): {plan['num_train']} texts, "
                      f"{next(iter(section['real_tokens'].values())):,} real tokens over {plan['epochs']} epochs, "
                      f"batch {plan['batch_size']} or one {plan['row_tokens']}-token packed row, {plan['rounds']} "
                      f"round(s), compile backend `{plan['compile_backend']}`, the last epoch timed whole.", "",
                  ladder_table(section), "", f"Loss check: {section['loss_check']['detail']}."]
    return "\n".join(parts)


def ladder_headline(results: dict) -> str:
    """loopkit's packed run with chunked loss against HF default and best, the range over the datasets."""
    ends = []
    for benchmark, section in ladder_sections(results):
        ratios = section["ratios"]
        ends.append(f"{ratios['loopkit-chunked/hf-default']['median']:.2f}x HF Trainer's default and "
                    f"{ratios['loopkit-chunked/hf-best']['median']:.2f}x its best configuration on "
                    f"{DATASETS[section['plan']['dataset']]['label']} (`{command(results, benchmark)}`)")
    return "loopkit's packed run with chunked loss: " + "; ".join(ends) + "."


def durations(results: dict) -> str:
    """How long the run took, in all and per benchmark, with the load it ran under."""
    env = results["environment"]
    load = env["load_average"]
    lines = [f"Size `{env['size']}`, started {env['started_at']}: {fmt(env['seconds'])} s in all, load average (1 min) "
             f"{fmt(load['start'])} at the start and {fmt(load['end'])} at the end, {env['cpu_count']} CPUs.", "",
             "| benchmark | seconds |", "|---|---|"]
    lines += [f"| {name} | {fmt(section['seconds'])} |" for name, section in results["benchmarks"].items()]
    return "\n".join(lines)


GENERATORS = {"summary": summary_table, "ladder": ladder, "ladder-headline": ladder_headline,
              "durations": durations}


def render(text: str) -> str:
    """The page with every generated section rewritten from its results file."""
    def section(match):
        indent = match["indent"]  # a section inside a list item is indented with it
        body = GENERATORS[match["name"]](load(match["file"])).replace("\n", "\n" + indent)
        return (f"{indent}<!-- generated: {match['name']} from {match['file']} -->\n{indent}{body}\n"
                f"{indent}<!-- end generated: {match['name']} -->")
    return SECTION.sub(section, text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report pages that differ; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for page in PAGES:
        path = REPO_ROOT / page
        text = path.read_text()
        rendered = render(text)
        if rendered != text:
            stale.append(page)
            if not args.check:
                path.write_text(rendered)
    print(("differ from the results files: " if args.check else "rewrote: ") + (", ".join(stale) or "nothing"))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
