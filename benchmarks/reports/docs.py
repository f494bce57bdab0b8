"""The benchmark numbers in README.md and docs/, and the tables of the committed results.md files, generated from the
committed results files.

    python -m benchmarks.reports.docs          # rewrite the generated sections and results.md from benchmarks/results/
    python -m benchmarks.reports.docs --check  # exit 1 if a page differs from what the results files give

`results.md` beside a committed `results.json` is written again from it, every row computed again from its raw
samples by today's verdict rules (`harness.rebuilt_row`), with the charts already in its folder: no benchmark runs.

A generated section sits between `<!-- generated: NAME from FILE -->` and `<!-- end generated: NAME -->`; nothing
inside is written by hand, so every number there is a value of FILE (tests/test_docs.py checks each page against
`render`). A section whose benchmark FILE does not hold yet says so, with the command that measures it. The parent
side only: no torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

from ..harness.runner import REPO_ROOT
from ..profiles import ladder as ladder_profile
from ..suite import compile as bench_compile
from ..suite import overhead_grid as bench_grid
from ..suite import overhead as bench_overhead
from ..suite import storage as bench_storage
from ..suite import trl as bench_trl
from ..workloads.ladder import COMPILED, DATASETS, RUNGS
from .ladder import rungs_in
from .overhead_profile import interleaved_table
from .tables import markdown, rebuilt, with_range
from .verdicts import fmt, fmt_comparison, median, paired_ratio, rebuilt_row, verdict

FULL_RESULTS = "benchmarks/results/results.json"
LADDER_RESULTS = "benchmarks/results/quick/results.json"
PAGES = ("README.md", "docs/performance.md", "docs/packing.md", "docs/evaluation.md", "docs/trl.md")
# The results.md files written again from their results.json (quick-under-load/: an older format, left as run)
RESULTS_PAGES = ("benchmarks/results/results.md", "benchmarks/results/quick/results.md",
                 "benchmarks/results/overhead/results.md", "benchmarks/results/ladder/results.md") + tuple(
    page for page in ("benchmarks/results/trl/results.md",)  # once its run is committed
    if (REPO_ROOT / page).with_name("results.json").exists())
NUMBERED = re.compile(r"^## (\d+)\. [^\n]*\n\n", re.MULTILINE)
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
    """Two tables of the same rows, rebuilt from each row's raw samples: the medians (min-max of the rounds) per
    contender, then loopkit's paired comparisons and its verdict against HF Trainer (times compared by ratios, the
    save's slowdowns by differences). Two, so that no line of the page runs past a screen's width."""
    medians = ["**Medians (min-max of the rounds).**", "", "| benchmark | unit | hand-written loop | HF Trainer | "
               "loopkit |", "|---|---|---|---|---|"]
    comparisons = ["**loopkit, round by round** (ratios of times and sizes: below 1x loopkit takes less; differences "
                   "of the save's blocked time and slowdown: below 0 s loopkit's is smaller).", "",
                   "| benchmark | loopkit vs raw | loopkit vs HF | verdict against HF Trainer |", "|---|---|---|---|"]
    for benchmark, needle, nth, kind in SUMMARY:
        stored = [r for r in results["benchmarks"][benchmark]["rows"] if needle in r["name"]][nth]
        row = rebuilt_row(dict(stored, kind=kind))
        cells = [with_range(row["median"][c], row["samples"][c]) if c in row["samples"] else ""
                 for c in ("raw", "hf", "loopkit")]
        medians.append(f"| {benchmark}: {row['name']} | {row['unit']} | " + " | ".join(cells) + " |")
        compared = row["ratios"] if kind == "amount" else row["differences"]
        shown = [fmt_comparison(compared[p], kind, row["unit"]) if compared.get(p) else ""
                 for p in ("loopkit/raw", "loopkit/hf")]
        # the verdict less the comparison its cell already shows (" (0.921x ...)", "; loopkit - hf per round ...")
        shown_again = re.escape(shown[1])
        words = re.sub(rf"; loopkit [-/] hf per round {shown_again}| \({shown_again}\)", "", verdict(row, "hf") or "")
        comparisons.append(f"| {benchmark}: {row['name']} | " + " | ".join(shown + [words]) + " |")
    syncs = results["benchmarks"]["overhead"]["rows"][0]["extra"]["syncs_per_step"]
    medians.append("| overhead: host reads per step (near-null model) | reads/step | " +
                   " | ".join(fmt(syncs[c]) for c in ("raw", "hf", "loopkit")) + " |")
    return "\n".join(medians + [""] + comparisons)


def ladder_table(section: dict) -> str:
    runs, ratios = section["runs"], section["ratios"]
    lines = ["| rung | real tokens/s | vs HF default | vs HF best | compile s (first round) | padding share | "
             "peak RSS MB | peak RSS growth during train(), MB | held-out loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in rungs_in(runs):
        label, replies = RUNGS[name][0], runs[name]
        compile_cell = fmt(replies[0]["compile_seconds"]) if name in COMPILED else ""
        lines.append(f"| {label} | {fmt(median([r['tokens_per_second'] for r in replies]))} | "
                     f"{fmt_comparison(ratios[f'{name}/hf-default'], 'amount', '')} | "
                     f"{fmt_comparison(ratios[f'{name}/hf-best'], 'amount', '')} | {compile_cell} | "
                     f"{replies[0]['padding_share']:.1%} | {fmt(median([r['peak_rss_mb'] for r in replies]))} | "
                     f"{fmt(median([r['peak_rss_mb'] - r['rss_before_train_mb'] for r in replies]))} | "
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
    parts = [f"Size `{env['size']}`, run started {env['started_at']}, load average "
             f"{fmt(env['load_average']['start'])} at the start and {fmt(env['load_average']['end'])} at the end."]
    for benchmark, section in ladder_sections(results):
        plan = section["plan"]
        parts += ["", f"**{DATASETS[plan['dataset']]['label']}** (`{command(results, benchmark)}`, "
                      f"key `benchmarks.{benchmark}`): {plan['num_train']} texts, "
                      f"{next(iter(section['real_tokens'].values())):,} real tokens over {plan['epochs']} epochs, "
                      f"batch {plan['batch_size']} or one {plan['row_tokens']}-token packed row, {plan['rounds']} "
                      f"round(s), compile backend `{plan['compile_backend']}`, the last epoch timed whole. "
                      f"{text_line(section)}", "",
                  ladder_table(section), "", f"Loss check: {section['loss_check']['detail']}."]
    return "\n".join(parts)


def text_line(section: dict) -> str:
    """The training texts' lengths and the share of padding in HF's padded batches (the first round's)."""
    first = section["runs"]["hf-default"][0]
    texts = first["texts"]
    return (f"The training texts: {texts['mean']:.1f} tokens on average, median {fmt(texts['median'])}, at most "
            f"{texts['max']}; HF Trainer's padded batches were {first['padding_share']:.0%} padding (the padding "
            f"share column: of all positions the model computed).")


# The headline's rung, the last of these the results have (older runs had no per-text attention rung), and its words
HEADLINE_RUNGS = {"loopkit-chunked": "loopkit's packed run with chunked loss",
                  "loopkit-per-text": "loopkit's packed run with chunked loss and per-text attention"}


def ladder_headline(results: dict) -> str:
    """loopkit's fastest packed run against HF default and best, one clause per dataset."""
    ends, sections = [], ladder_sections(results)
    rung = [name for name in HEADLINE_RUNGS if all(f"{name}/hf-best" in s["ratios"] for _, s in sections)][-1]
    for benchmark, section in sections:
        ratios = section["ratios"]
        ends.append(f"{ratios[f'{rung}/hf-default']['median']:.2f}x HF Trainer's default and "
                    f"{ratios[f'{rung}/hf-best']['median']:.2f}x its best configuration on "
                    f"{DATASETS[section['plan']['dataset']]['label']} (`{command(results, benchmark)}`)")
    return f"{HEADLINE_RUNGS[rung]}: " + "; ".join(ends) + "."


def durations(results: dict) -> str:
    """How long the run took, in all and per benchmark, with the load it ran under."""
    env = results["environment"]
    load = env["load_average"]
    lines = [f"Size `{env['size']}`, started {env['started_at']}: {fmt(env['seconds'])} s in all, load average (1 min) "
             f"{fmt(load['start'])} at the start and {fmt(load['end'])} at the end, {env['cpu_count']} CPUs.", "",
             "| benchmark | seconds |", "|---|---|"]
    lines += [f"| {name} | {fmt(section['seconds'])} |" for name, section in results["benchmarks"].items()]
    return "\n".join(lines)


class NotRun(LookupError):
    """The results file a section names is not committed yet (its benchmark's first run is still to come)."""


# A generated section whose name is not its benchmark's: the benchmark, for the command a missing file's section names
BENCHMARK_OF = {"trl-headline": "trl"}


class NotMeasured(LookupError):
    """The results file has no section for this benchmark (a run before the benchmark existed, or --only)."""


def benchmark_section(results: dict, benchmark: str) -> dict:
    section = results["benchmarks"].get(benchmark)
    if section is None or "error" in section:
        raise NotMeasured(benchmark)
    return section


def measured_by(results: dict, benchmark: str) -> str:
    """Which run a section comes from: the command, its size, when it started and the load it ran under."""
    env = results["environment"]
    return (f"`{command(results, benchmark)}` (key `benchmarks.{benchmark}`; size `{env['size']}`, run started "
            f"{env['started_at']}, load average {fmt(env['load_average']['start'])} at the start and "
            f"{fmt(env['load_average']['end'])} at the end, {env['cpu_count']} CPUs)")


def compile_runs(results: dict) -> str:
    """docs/performance.md's compile table: the model runs with and without buckets."""
    section = benchmark_section(results, "compile")
    plan, model = section["plan"], section["plan"]["model"]
    skipped = [bench_compile.MODEL_RUNS[n][0] for n in bench_compile.MODEL_RUNS if n not in plan["model_runs"]]
    return "\n".join([
        f"Measured by {measured_by(results, 'compile')}: a {model['num_hidden_layers']}-layer, "
        f"{model['hidden_size']}-wide Llama (vocabulary {model['vocab_size']:,}); {plan['steps']} steps of "
        f"{plan['batch_size']} samples of {plan['shortest']}-{plan['longest']} tokens padded by "
        f"`DataCollatorForLanguageModeling`; backend `{plan['backend']}`; {plan['rounds']} round(s), each run a fresh "
        f"process with an empty inductor cache (every compilation cold), one torch thread"
        + (f"; not run at this size: {'; '.join(repr(label) for label in skipped)}" if skipped else "")
        + f". Same work: "
        f"{section['loss_check']['detail']}.", "", bench_compile.model_table(section)])


def optimizer_step(results: dict) -> str:
    """docs/performance.md's optimizer-step table and the recompilation count under a schedule."""
    section = benchmark_section(results, "compile")
    plan = section["plan"]
    return "\n".join([
        f"Measured by {measured_by(results, 'compile')}: AdamW over a Llama's parameters with fixed gradients, one "
        f"torch thread, {plan['optimizer_rounds']} alternated round(s) of {plan['optimizer_steps']} steps, one "
        f"process per optimizer; median per step (min-max of the rounds' medians); backend `{plan['backend']}`. "
        + "; ".join(f"{kind}: {label}" for kind, label in bench_compile.OPTIMIZERS.items()) + ".", "",
        bench_compile.optimizer_table(section), "",
        f"With a learning rate that changes every step (a linear schedule), dynamo compiled the step "
        f"{section['lr_recompiles']} times in {plan['lr_steps']} steps."])


def chunked_loss(results: dict) -> str:
    """docs/packing.md's sentence: one step's peak memory with and without ChunkedLossStep."""
    section = benchmark_section(results, "chunked_loss")
    plan, row = section["plan"], section["rows"][0]
    ratio = section["ratio"]
    same = "the same loss" if row["check"]["ok"] else f"NOT the same loss ({row['check']['detail']})"
    return (f"Peak memory of one training step at vocabulary {plan['vocab']:,} and sequence {plan['seq']} (1-layer, "
            f"64-wide Llama, SGD, each run a fresh process, {plan['rounds']} round(s)): "
            f"{with_range(row['median']['unchunked'], row['samples']['unchunked'])} MB unchunked, "
            f"{with_range(row['median']['chunked'], row['samples']['chunked'])} MB chunked, chunked / unchunked "
            f"round by round {fmt_comparison(ratio, 'amount', '')}, {same}. Measured by "
            f"{measured_by(results, 'chunked_loss')}.")


def storage(results: dict) -> str:
    """docs/performance.md's checkpoint-storage table, from bench_storage's raw rounds: medians (min-max), the
    round-by-round ratio of blocked times to HF Trainer's sync save, the following steps' relative slowdown."""
    lines = ["| storage | processes | training blocked by one save, s | vs HF Trainer's sync save | the 8 following "
             "steps, slower by |", "|---|---|---|---|---|"]
    one_process = median([r["hf-trainer"]["blocked"] for r in results["one_process"]["rounds"]])
    for setting, processes in (("one_process", 1), ("fsdp2", 2)):
        rounds = results[setting]["rounds"]
        reference = [r["hf-trainer"]["blocked"] for r in rounds] if "hf-trainer" in rounds[0] else None
        for name in rounds[0]:
            blocked = [r[name]["blocked"] for r in rounds]
            slower = [100 * r[name]["following_relative"] for r in rounds]
            # FSDP2 has no HF Trainer row (no FSDP on CPU processes): its one-process median, not paired by round
            ratio = fmt_comparison(paired_ratio(blocked, reference), "amount", "") if reference else \
                f"{median(blocked) / one_process:.3f}x of its 1-process median"
            lines.append(f"| {bench_storage.LABELS[name]} | {processes} | {with_range(median(blocked), blocked)} | "
                         f"{ratio} | {fmt_comparison(difference_summary(slower), 'difference', '%')} |")
    return "\n".join(lines)


def difference_summary(values: list) -> dict:
    """Median, min and max of one contender's own differences, in the shape `fmt_comparison` reads."""
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


def environment(results: dict) -> str:
    """The run a results file holds: its command, duration, machine, versions and load."""
    env = results["environment"]
    versions = ", ".join(f"{name} {env['versions'][name]}" for name in ("torch", "transformers", "accelerate"))
    arguments = env["command"].split()[1:]  # sys.argv: the script's path, then the arguments
    return (f"`{' '.join(['python -m benchmarks'] + arguments)}` ({fmt(env['seconds'])} s in all): "
            f"{env['cpu_model']}, {env['cpu_count']} CPU cores, {env['torch_threads']} torch thread(s) per process, "
            f"{versions}, load average (1 min) {fmt(env['load_average']['start'])} at the start and "
            f"{fmt(env['load_average']['end'])} at the end.")


# docs/evaluation.md's table: (label, the eval_memory configuration it shows)
EVAL_MEMORY = (("loopkit, `metrics=[TokenAccuracy()]` (streaming)", "loopkit-streaming"),
               ("loopkit, `compute_metrics` on the full logits", "loopkit-metrics"),
               ("HF Trainer, `compute_metrics` on the full logits", "hf-metrics"),
               ("HF Trainer, `preprocess_logits_for_metrics` = argmax", "hf-argmax"))


def eval_memory(results: dict) -> str:
    """Peak memory growth of one evaluation per configuration and size: the median over the run's measurements."""
    section = benchmark_section(results, "eval_memory")
    sizes = sorted({m["num_samples"] for m in section["measurements"]})
    lines = ["| configuration | " + " | ".join(f"N = {n}" for n in sizes) + " |", "|---" * (len(sizes) + 1) + "|"]
    for label, config in EVAL_MEMORY:
        cells = [fmt(median([m["growth_mb"] for m in section["measurements"]
                             if m["config"] == config and m["num_samples"] == n])) + " MB" for n in sizes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return f"Measured by {measured_by(results, 'eval_memory')}:\n\n" + "\n".join(lines)


def overhead_peers(results: dict) -> str:
    """docs/performance.md's per-step table with the peers (Lightning's Trainer and Fabric, ignite): every contender's
    wall and CPU time per step, loopkit / contender round by round, the verdicts, and whether loopkit is ahead of
    every peer, from the run's raw samples by today's rules."""
    section = benchmark_section(results, "overhead")
    section = dict(section, rows=[rebuilt_row(row) for row in section["rows"]])
    first = section["rows"][0]
    rounds = len(next(iter(first["samples"].values())))
    return "\n".join([f"Measured by {environment(results)} {rounds} measured rounds, each contender in its own "
                      f"process, alternated; {first['extra']['timed_steps']} timed steps per run after "
                      f"{first['extra']['warmup_steps']} warm-up steps.", "", bench_overhead.peer_table(section)])


def overhead_interleaved(results: dict) -> str:
    """docs/performance.md's per-step overhead in one process (benchmarks/profiles/overhead.py, interleaved): every
    contender's CPU time per step, its difference to the hand-written loop and loopkit's to it, per round."""
    loads = results["load_average"]
    return "\n".join([f"Measured by `{today_command(results['command'])}` on {results['cores']} cores, load average "
                      f"{loads['min']:.1f}-{loads['max']:.1f}.", "", interleaved_table(results)])


def overhead_grid(results: dict) -> str:
    """docs/performance.md's grid of set-ups (benchmarks/suite/overhead_grid.py): per cell, the hand-written loop's CPU
    time per step, loopkit's difference to it pass by pass, the passes below each peer, the calls per step; then the
    verdicts as counts of cells. The per-cell tables, the calls and the profiles are in the results file's Markdown."""
    return "\n".join([bench_grid.measured_by(results), "", bench_grid.summary_table(results), ""] +
                      bench_grid.verdict_counts(results))


def ladder_profile_section(results: dict) -> str:
    return ladder_profile.markdown(dict(results, command=today_command(results["command"])))


# Runs recorded before benchmarks/ was laid out in packages name their command's module by its old path; a page shows
# the command that runs it today.
MOVED_MODULES = {"benchmarks.overhead_profile": "benchmarks.profiles.overhead",
                 "benchmarks.ladder_profile": "benchmarks.profiles.ladder",
                 "benchmarks.trl_profile": "benchmarks.profiles.trl"}


def today_command(recorded: str) -> str:
    for old, new in MOVED_MODULES.items():
        recorded = re.sub(rf"-m {re.escape(old)}\b", f"-m {new}", recorded)
    return recorded


def trl(results: dict) -> str:
    """docs/performance.md's table of TRL's trainers against loopkit's (bench_trl), with the run it comes from."""
    section = benchmark_section(results, "trl")
    return f"Measured by {measured_by(results, 'trl')}.\n\n" + bench_trl.markdown(section)


def trl_headline(results: dict) -> str:
    """docs/trl.md's paragraph: loopkit / TRL per workload and measure, round by round, and each verdict."""
    section = benchmark_section(results, "trl")
    workloads = section["workloads"]
    same = all(workloads[w]["same_work"] for w in workloads)
    lines = [("TRL's trainer and loopkit's logged the same losses and every other key (within "
              f"{bench_trl.LOSS_RTOL:g} relative) in every round of every workload" if same else
              "NOT the same work: " + "; ".join(f"{w}: {c['detail']}" for w in workloads
                                                for c in workloads[w]["parity"] if not c["ok"]))
             + f". Measured by {measured_by(results, 'trl')}; loopkit / TRL, round by round:", ""]
    for key, name, _ in bench_trl.MEASURES:
        lines.append(f"- {name}: " + "; ".join(
            f"{bench_trl.SHORT[w]} {fmt_comparison(workloads[w]['verdicts'][key]['ratio'], 'amount', '')}, "
            f"{workloads[w]['verdicts'][key]['text']}" for w in workloads) + ".")
    return "\n".join(lines)


GENERATORS = {"summary": summary_table, "overhead-peers": overhead_peers, "ladder": ladder,
              "overhead-interleaved": overhead_interleaved, "ladder-profile": ladder_profile_section,
              "ladder-headline": ladder_headline, "durations": durations, "compile": compile_runs,
              "optimizer-step": optimizer_step, "chunked-loss": chunked_loss, "storage": storage,
              "environment": environment, "eval-memory": eval_memory, "trl": trl, "trl-headline": trl_headline,
              "overhead-grid": overhead_grid}


# Benchmarks of `python -m benchmarks` whose published sections read a run of their own (`--only NAME --out FOLDER`:
# bench_trl's rounds take longer than a quick run of every benchmark should), not the quick run's results file.
SEPARATE_RUN = {"trl": "benchmarks/results/trl/results.json"}

# Generated prose is wrapped to the width of the pages' hand-written lines.
PAGE_WIDTH = 117
# Sections read from a results file of a benchmark's own command (not `python -m benchmarks`).
OWN_COMMAND = {"storage": "benchmarks.suite.storage", "overhead-interleaved": "benchmarks.profiles.overhead",
               "overhead-grid": "benchmarks.suite.overhead_grid",
               "ladder-profile": "benchmarks.profiles.ladder"}


def wrapped(text: str, width: int) -> str:
    """`text` with each prose line over `width` wrapped at spaces outside code spans, a list item's lines under its
    text; tables and shorter lines as they are (the pages' hand-written text keeps to the same width)."""
    lines = []
    for line in text.split("\n"):
        if len(line) <= width or line.lstrip().startswith("|"):
            lines.append(line)
            continue
        lead = re.match(r" *(?:[-*] )?", line).group(0)
        kept = re.sub(r"`[^`]*`", lambda span: span.group(0).replace(" ", "\0"), line[len(lead):])
        lines += [part.replace("\0", " ") for part in textwrap.wrap(
            kept, width, initial_indent=lead, subsequent_indent=" " * len(lead), break_long_words=False,
            break_on_hyphens=False)]
    return "\n".join(lines)


def render(text: str) -> str:
    """The page with every generated section rewritten from its results file."""
    def section(match):
        indent = match["indent"]  # a section inside a list item is indented with it
        try:
            if not (REPO_ROOT / match["file"]).exists():
                raise NotRun(match["file"])
            body = GENERATORS[match["name"]](load(match["file"]))
        except NotRun:
            folder = Path(match["file"]).parent
            body = (f"Not measured yet: `{match['file']}` does not exist. `python -m benchmarks --only "
                    f"{BENCHMARK_OF.get(match['name'], match['name'])} --out {folder}` measures it, then `python -m "
                    f"benchmarks.reports.docs` writes it here.")
        except NotMeasured as missing:
            body = (f"Not measured yet: `{match['file']}` has no `{missing}` section. `python -m benchmarks "
                    f"--only {missing}` (with the size and `--out` of that file's run) measures it, then `python -m "
                    f"benchmarks.reports.docs` writes it here.")
        body = wrapped(body, PAGE_WIDTH - len(indent)).replace("\n", "\n" + indent)
        return (f"{indent}<!-- generated: {match['name']} from {match['file']} -->\n{indent}{body}\n"
                f"{indent}<!-- end generated: {match['name']} -->")
    return SECTION.sub(section, text)


def results_markdown(page: str) -> str:
    """A committed results.md, written again from the results.json beside it (module docstring). A section of an
    older results format than today's code reads (the full run's ladder) keeps the text its run wrote."""
    folder = (REPO_ROOT / page).parent
    charts = sorted(path.name for path in folder.glob("*.png"))
    text = (REPO_ROOT / page).read_text()
    starts = list(NUMBERED.finditer(text)) + [re.search(r"^## (?!\d+\.)", text, re.MULTILINE)]
    kept = {int(a[1]): text[a.end():b.start()].rstrip("\n") + "\n" for a, b in zip(starts, starts[1:])}
    return markdown(rebuilt(json.loads((folder / "results.json").read_text())), charts, kept)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reports.docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report pages that differ; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for page in PAGES + RESULTS_PAGES:
        path = REPO_ROOT / page
        text = path.read_text()
        rendered = results_markdown(page) if page in RESULTS_PAGES else render(text)
        if rendered != text:
            stale.append(page)
            if not args.check:
                path.write_text(rendered)
    print(("differ from the results files: " if args.check else "rewrote: ") + (", ".join(stale) or "nothing"))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
