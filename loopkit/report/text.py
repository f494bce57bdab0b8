"""The report as text: the one-screen summary (also the body of run_report.md) and the Markdown a notebook shows
(`report_markdown`, its charts drawn in memory)."""

from __future__ import annotations

import base64
import os

from .charts import CHART_TITLES, chart_names, charts_in_memory


def seconds_text(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def duration_text(report: dict) -> str:
    if report.get("total_seconds") is not None:
        return seconds_text(report["total_seconds"])
    unknown = next((s for s in report.get("segments") or [] if s["seconds"] is None), None)
    return "time unknown" + (f" (steps {unknown['from_step']}-{unknown['to_step']} ran without a run record)"
                             if unknown else "")


def segment_lines(report: dict) -> list[str]:
    """A resumed run: each stretch of training, with its steps and time, marked where it was resumed."""
    segments = report.get("segments") or []
    if len(segments) < 2:
        return []
    lines = [f"  {len(segments)} segments:"]
    for number, segment in enumerate(segments):
        took = seconds_text(segment["seconds"]) if segment["seconds"] is not None else "time unknown"
        how = "started" if number == 0 else "resumed"
        lines.append(f"    {how} at step {segment['from_step']}: steps {segment['from_step']}-{segment['to_step']}"
                     f" in {took}")
    return lines


def interruption_lines(report: dict) -> list[str]:
    interruption = report.get("interruption")
    if not interruption:
        return []
    if interruption.get("resume"):
        return [f"  resume with: {interruption['resume']}"]
    return ["  no checkpoint to resume from: train() starts afresh"]


def slow_step_lines(report: dict) -> list[str]:
    """Slow steps, consecutive ones grouped, with what the machine was doing; the machine's load over the run."""
    slow, lines = report.get("slow_steps") or [], []
    groups = []
    for record in slow:
        if groups and record["step"] == groups[-1][-1]["step"] + 1:
            groups[-1].append(record)
        else:
            groups.append([record])
    for group in groups[:5]:
        first, last = group[0], group[-1]
        where = f"step {first['step']}" if len(group) == 1 else f"steps {first['step']}-{last['step']}"
        worst = max(first["phases"], key=first["phases"].get)
        line = (f"  slow {where}: {max(r['seconds'] for r in group):.3f}s vs median {first['median']:.3f}s "
                f"(normal spread {first.get('spread', 0):.3f}s; mostly {worst}: {first['phases'][worst]:.3f}s)")
        if any(r.get("machine_busy") for r in group):
            line += f"; machine busy: load {first['load_average']} on {first['cores']} cores"
        elif first.get("cpu_share") is not None and first["cpu_share"] < 0.5 * first["usual_cpu_share"]:
            line += (f"; the process was waiting (it used {first['cpu_share']:.0%} of a CPU, usually "
                     f"{first['usual_cpu_share']:.0%})")
        lines.append(line)
    if len(groups) > 5:
        lines.append(f"  ... {len(slow)} slow steps in all (run_report.json lists them)")
    machine = report.get("machine")
    if machine and machine.get("busy"):
        busy = sum(1 for r in slow if r.get("machine_busy"))
        lines.append(f"  the machine was busy: load average {machine['load_average_start']} at the start, "
                     f"{machine['load_average_end']} at the end, on {machine['cores']} cores; the process used "
                     f"{machine['cpu_seconds_per_second']} CPU-seconds per second"
                     + (f"; {busy} of {len(slow)} slow steps came while it was busy" if slow else ""))
    return lines


def starvation_text(starved: dict) -> str:
    """A run starved of CPU (`cpu_starvation`): the numbers and what to do."""
    share, threads, fewer = starved["cpu_seconds_per_second"], starved["torch_threads"], starved["suggested_threads"]
    return (f"torch ran {threads} threads on {starved['cores']} cores under a load average of "
            f"{starved['load_average']}, and the process got {share} CPU-seconds per second ({share / threads:.0%} "
            f"of what its threads asked for): set fewer threads, OMP_NUM_THREADS={fewer} before Python starts or "
            f"torch.set_num_threads({fewer})")


def starvation_lines(report: dict) -> list[str]:
    """The one line of the summary for a run starved of CPU."""
    starved = report.get("cpu_starved")
    return [f"  CPU starved: {starvation_text(starved)}"] if starved else []


def evaluation_title(report: dict) -> str:
    """"final evaluation" only for the evaluation at the last step of a run that reached its end (completed, or
    stopped early by a callback); otherwise the last one so far, with its step (an interrupted, failed or killed
    run's evaluation at step 30 of 80 is no final one)."""
    step = report.get("final_metrics", {}).get("step")
    if report.get("end") in ("completed", "stopped_early") and step == report.get("global_step"):
        return "final evaluation"
    return f"last evaluation (step {step} of {report.get('max_steps')})" if step is not None else "last evaluation"


def summary_text(report: dict) -> str:
    """The one-screen summary, also the body of run_report.md."""
    lines = [f"loopkit run report: {report['status']}  ({report['output_dir']})", *interruption_lines(report),
             f"  steps {report['global_step']}/{report['max_steps']}, epoch {report['epoch']:.3g}, "
             f"{duration_text(report)}" + (" in all" if len(report.get("segments") or []) > 1 else ""),
             *segment_lines(report)]
    if report.get("samples_per_second") is not None:
        tokens = f", {report['tokens_per_second']:.0f} input tokens/s" if report.get("input_tokens") else \
            " (no token count: the batches have no model main input)"
        lines.append(f"  {report['samples_per_second']:.1f} samples/s{tokens}"
                     + (" (this segment)" if len(report.get("segments") or []) > 1 else "")
                     + f", peak host memory {report['peak_host_memory_mb']:.0f} MB"
                     + (f", peak device memory {report['peak_device_memory_mb']:.0f} MB"
                        if report.get("peak_device_memory_mb") else ""))
    final = {k: v for k, v in report.get("final_metrics", {}).items() if k not in ("step", "epoch")
             and not k.endswith(("_runtime", "_per_second"))}
    if final:
        lines.append(f"  {evaluation_title(report)}: " + ", ".join(f"{k}={v:.4g}" for k, v in final.items()
                                                                 if isinstance(v, (int, float))))
    if report.get("best_metric") is not None:
        lines.append(f"  best {report.get('metric_for_best_model') or '(metric name unknown)'}="
                     f"{report['best_metric']:.4g} at {report.get('best_checkpoint')}")
    if report.get("compile"):
        lines.append(f"  torch.compile: {report['compile']['compilations']} compilations, compile time "
                     f"{report['compile']['seconds']:.2f}s (not in the step phases)")
    phases = report.get("time_by_phase")
    if phases:
        covered = "" if report.get("total_seconds") is not None else " (steps " + ", ".join(
            f"{a}-{b}" for a, b in phases.get("covers_steps", [])) + ")"
        lines.append(f"  time by phase{covered}: " + ", ".join(f"{p} {s:.2f}s ({phases['percent'][p]:.0f}%)"
                                                     for p, s in phases["seconds"].items() if s > 0))
    lines += slow_step_lines(report) + starvation_lines(report)
    charts = report.get("charts")
    if isinstance(charts, list) and charts:
        lines.append("  charts: " + ", ".join(charts))
    elif isinstance(charts, str):
        lines.append("  " + charts)
    elif charts == [] and chart_names(report):
        titles = ", ".join(CHART_TITLES[name] for name in chart_names(report))
        lines.append(f"  charts ({titles}): python -m loopkit report {report['output_dir']} draws them")
    return "\n".join(lines)



def report_markdown(report: dict) -> str:
    """The report as Markdown: the summary, time by phase as a table, and the charts: the files when they were drawn
    into the folder, else drawn now in memory and embedded (a notebook shows them; nothing is written)."""
    summary = summary_text(report).splitlines()
    lines = [f"**{summary[0]}**", "", *(f"- {line.strip()}" for line in summary[1:]
                                         if not line.strip().startswith(("time by phase", "charts")))]
    phases = report.get("time_by_phase")
    if phases:
        lines += ["", "| phase | seconds | % |", "|---|---:|---:|"]
        lines += [f"| {p} | {s:.2f} | {phases['percent'][p]:.0f} |" for p, s in phases["seconds"].items() if s > 0]
    charts = report.get("charts")
    if isinstance(charts, list) and charts:
        lines += [""] + [f"![{c}]({os.path.join(report['output_dir'], c).replace(' ', '%20')})" for c in charts]
    elif charts == []:
        lines += [""] + [f"![{name}](data:image/png;base64,{base64.b64encode(png).decode()})"
                         for name, png in charts_in_memory(report)]
    return "\n".join(lines)
