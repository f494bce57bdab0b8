"""The overhead profile's tables (benchmarks/profiles/overhead.py measures them): CPU time per step, lockstep,
the profile's lines and the interleaved differences against the hand-written loop.
"""

from __future__ import annotations

import statistics


def markdown(results: dict) -> str:
    lines = []
    if "cpu_us_per_step" in results:
        lines += [f"Near-null model (16x16 linear), CPU microseconds per optimizer step, {results['rounds']} "
                  f"alternated rounds of {results['timed_steps']} timed steps, each contender in a fresh process; "
                  f"load average {results['load_average']['min']:.1f}-{results['load_average']['max']:.1f} on "
                  f"{results['cores']} cores. Per run: the mean over its timed steps (logging steps included), and "
                  f"its median step (robust to the steps other processes slowed). Then the median of the rounds "
                  f"(their range), and the median of the round-by-round differences to the hand-written loop (their "
                  f"range).\n"]
        for key, title in (("cpu_us_per_step", "mean step"), ("cpu_us_median_step", "median step")):
            lines += [cpu_table(results[key], title), ""]
            samples = results[key]
            if "loopkit-before" in samples:
                diffs = [a - b for a, b in zip(samples["loopkit"], samples["loopkit-before"])]
                lines.append(f"{title}: loopkit minus loopkit-before ({results['before']}), per round: median "
                             f"{statistics.median(diffs):+,.0f} us/step ({min(diffs):+,.0f} to {max(diffs):+,.0f}).\n")
    if "interleaved" in results:
        lines += [interleaved_table(results), ""]
    if "lockstep" in results:
        lines += [lockstep_table(results), ""]
    if results.get("profiles"):
        lines.append(profile_table(results["profiles"]))
    return "\n".join(lines) + "\n"


OVERHEAD_GOAL_US = 50  # issue 37: loopkit at most the hand-written loop + 50 us of CPU per step


def interleaved_differences(rounds: list, contender: str, baseline: str) -> list:
    """Per round, the median over its passes of `contender`'s run minus `baseline`'s run of the same pass."""
    return [statistics.median(c["cpu_us_per_step"] - b["cpu_us_per_step"]
                              for c, b in zip(reply[contender], reply[baseline])) for reply in rounds]


def interleaved_table(results: dict) -> str:
    """The interleaved method's table and verdicts (`interleaved`, `interleaved_rounds`)."""
    part = results["interleaved"]
    rounds, names = part["rounds"], list(part["rounds"][0])
    contenders = [c for c in names if not c.startswith("raw beside")]
    lines = [f"Interleaved in one process ({len(rounds)} rounds, each a fresh process; in it every contender trains "
             f"once to warm up, then {part['passes']} passes in turn, {results['timed_steps']} timed steps a run): "
             f"each run's mean CPU us per step; per round the median over the passes of each contender's run minus "
             f"the hand-written loop's run of the same pass (loopkit-before: its own process, beside its own "
             f"hand-written loop runs), and of loopkit's run minus each other contender's. Then the median of the "
             f"rounds (their range). Peers not installed: " + (", ".join(part["peers_missing"]) or "none") + ".\n",
             "| contender | CPU us/step | minus the hand-written loop, per round | loopkit minus it, per round | "
             "logged losses = the hand-written loop's |", "|---|---|---|---|---|"]
    verdicts = []
    for contender in contenders:
        baseline = "raw beside loopkit-before" if contender == "loopkit-before" else "raw"
        values = [statistics.median(run["cpu_us_per_step"] for run in reply[contender]) for reply in rounds]
        over_raw = interleaved_differences(rounds, contender, baseline)
        same = all(run["logged_losses"] == raw["logged_losses"] for reply in rounds
                   for run, raw in zip(reply[contender], reply[baseline]))
        ahead_by = None if contender in ("raw", "loopkit", "loopkit-before") else \
            interleaved_differences(rounds, "loopkit", contender)
        versus = spread(ahead_by) if ahead_by else ""
        lines.append(f"| {contender} | {statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f}) | "
                     + ("" if contender == "raw" else spread(over_raw)) + f" | {versus} | "
                     + ("yes" if same else "no") + " |")
        if contender == "loopkit":
            verdicts.append(f"- loopkit within {OVERHEAD_GOAL_US} us of the hand-written loop in every round: "
                            + ("yes" if max(over_raw) <= OVERHEAD_GOAL_US else "no") + f" ({spread(over_raw)} us)")
        elif ahead_by:
            verdicts.append(f"- loopkit below {contender} in every round: " + ("yes" if max(ahead_by) < 0 else "no"))
    return "\n".join(lines + [""] + verdicts)


def spread(values: list) -> str:
    return f"{statistics.median(values):+,.1f} ({min(values):+,.1f} to {max(values):+,.1f})"


def lockstep_table(results: dict) -> str:
    """Per round, loopkit's step minus the hand-written loop's, the two taking turns step by step in one process."""
    lines = [f"Lockstep ({results['rounds']} rounds; each a fresh process where the hand-written loop and loopkit "
             f"take turns, one optimizer step each, in two threads, so both see the machine alike): per round the "
             f"median over {results['timed_steps']} steps of loopkit's step CPU time minus the hand-written "
             f"loop's step just before it; then the median of the rounds (their range).\n",
             "| loopkit | hand-written loop, median step | loopkit, median step | loopkit minus hand-written |",
             "|---|---|---|---|"]
    for contender, replies in results["lockstep"].items():
        raw = [r["median_step_us"]["raw"] for r in replies]
        own = [r["median_step_us"]["loopkit"] for r in replies]
        diffs = [r["median_difference_us"]["loopkit"] for r in replies]
        lines.append(f"| {contender} | {statistics.median(raw):,.0f} ({min(raw):,.0f}-{max(raw):,.0f}) | "
                     f"{statistics.median(own):,.0f} ({min(own):,.0f}-{max(own):,.0f}) | "
                     f"{statistics.median(diffs):+,.1f} ({min(diffs):+,.1f} to {max(diffs):+,.1f}) |")
    return "\n".join(lines)


def cpu_table(samples: dict, title: str) -> str:
    raw = samples["raw"]
    lines = [f"| contender | CPU us/step, {title} | minus the hand-written loop, per round |", "|---|---|---|"]
    for contender, values in samples.items():
        diffs = [v - r for v, r in zip(values, raw)]
        lines.append(f"| {contender} | {statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f}) | "
                     + ("" if contender == "raw" else
                        f"{statistics.median(diffs):+,.0f} ({min(diffs):+,.0f} to {max(diffs):+,.0f})") + " |")
    return "\n".join(lines)


def profile_table(profiles: dict) -> str:
    """One line per event / stage, one column per profiled contender: microseconds per step."""
    names = list(profiles)
    rows = {c: dict(p["lines_us_per_step"]) for c, p in profiles.items()}
    calls = {c: r.pop("_wrapped calls per step") for c, r in rows.items()}
    totals = {c: r.pop("step, total") for c, r in rows.items()}
    lines = [f"Where a step's time goes ({profiles['loopkit']['profiled_steps']} profiled steps each; each loopkit "
             f"in lockstep with the hand-written loop in a process of their own; wall microseconds per step, the "
             f"median over steps of each line, the other contender's turn left out; each line exclusive of the lines "
             f"inside it). Profiled totals (medians): " +
             ", ".join(f"{c} {totals[c]:,.1f}" for c in names) + " us/step. The profiler's own cost (" +
             ", ".join(f"{c} {calls[c]:.0f} wrapped calls" for c in names) +
             f", {profiles['loopkit']['wrapper_cost_us']:.2f} us each) is taken off the lines that make the calls "
             f"and left out of the table.\n",
             "| event / stage | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    order = sorted(set().union(*rows.values()), key=lambda n: -max(r.get(n, 0.0) for r in rows.values()))
    for name in order:
        lines.append(f"| {name} | " + " | ".join(f"{rows[c][name]:,.1f}" if name in rows[c] else ""
                                                  for c in names) + " |")
    lines.append("| **step, total** | " + " | ".join(f"**{totals[c]:,.1f}**" for c in names) + " |")
    return "\n".join(lines)
