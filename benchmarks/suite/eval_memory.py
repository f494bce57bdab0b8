"""Benchmark 3, evaluation memory: peak resident memory of one evaluation of N and 4N samples (sequence 64, a
32,000-token vocabulary, so logits are what grows), one fresh process per measurement.

Measured: the peak RSS during evaluation minus the RSS when evaluation starts (the peak is reset first through
/proc/self/clear_refs on Linux; elsewhere the process's lifetime peak from getrusage is used, which can only
overstate the growth). Every configuration computes the same eval loss and (where it computes one) the same
next-token accuracy; the check compares them.
"""

from __future__ import annotations

from ..reports.verdicts import check_equal, comparison_row, merge_checks
from ..workloads.spec import TrainSpec

MODULE = "benchmarks.suite.eval_memory"
TITLE = "Evaluation memory"

# Configurations: (contender, how it computes accuracy).
CONFIGS = {
    "raw-streaming": "hand-written eval loop: loss and accuracy summed batch by batch",
    "hf-loss-only": "HF Trainer, no compute_metrics (loss only)",
    "hf-metrics": "HF Trainer, compute_metrics on the full logits",
    "hf-argmax": "HF Trainer, preprocess_logits_for_metrics=argmax, then compute_metrics",
    "loopkit-loss-only": "loopkit, no compute_metrics (loss only)",
    "loopkit-metrics": "loopkit, compute_metrics on the full logits",
    "loopkit-argmax": "loopkit, preprocess_logits_for_metrics=argmax, then compute_metrics",
    "loopkit-streaming": "loopkit, Loop(metrics=[TokenAccuracy()]) (streaming, loopkit.metrics)",
}
# Rows of the comparison table: which configuration stands for each contender.
ROWS = (
    ("loss only", {"raw": "raw-streaming", "hf": "hf-loss-only", "loopkit": "loopkit-loss-only"}),
    ("accuracy, compute_metrics on full logits", {"raw": "raw-streaming", "hf": "hf-metrics",
                                                   "loopkit": "loopkit-metrics"}),
    ("accuracy, argmax preprocess", {"raw": "raw-streaming", "hf": "hf-argmax", "loopkit": "loopkit-argmax"}),
    ("accuracy, loopkit streaming metrics vs HF argmax", {"raw": "raw-streaming", "hf": "hf-argmax",
                                                          "loopkit": "loopkit-streaming"}),
)
EVAL_BATCH_SIZE = 8


def plan(suite, streaming_available: bool) -> tuple[TrainSpec, list[int], list[str]]:
    spec = TrainSpec(model="llama-32k", seq_len=suite.pick(64, 64, 16))
    # quick: half the samples (HF's compute_metrics concatenates logits batch by batch, quadratic in N).
    sizes = suite.pick(full=[64, 256], quick=[32, 128], tiny=[8, 32])
    configs = list(CONFIGS) if suite.size == "full" else \
        ["hf-metrics", "hf-argmax", "loopkit-loss-only", "loopkit-metrics", "loopkit-streaming"]
    if not streaming_available:
        configs.remove("loopkit-streaming")
    return spec, sizes, configs


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Linux: make the kernel's peak-RSS mark (VmHWM) start again from the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb(reset_worked: bool) -> float:
    if reset_worked:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def token_accuracy(eval_prediction) -> dict:
    """compute_metrics: next-token accuracy (position t predicts label t+1), from logits or from argmax ids."""
    import numpy as np

    predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
    if predictions.ndim == 3:
        predictions = predictions.argmax(-1)
    predictions, labels = predictions[:, :-1], labels[:, 1:]
    counted = labels != -100
    return {"token_accuracy": float(np.sum((predictions == labels) & counted) / np.sum(counted))}


def argmax_logits(logits, labels):
    return logits.argmax(-1)


def raw_streaming_eval(model, rows) -> dict:
    """The hand-written baseline: one pass, loss and accuracy summed on the device, nothing kept."""
    import torch

    from ..workloads.data import batches

    model.eval()
    loss_sum, samples = torch.zeros((), dtype=torch.float64), 0
    correct, counted = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    with torch.no_grad():
        for batch in batches(rows, EVAL_BATCH_SIZE, "cpu"):
            outputs = model(**batch, use_cache=False)
            size = len(batch["labels"])
            loss_sum += outputs["loss"].double() * size  # HF's eval_loss: batch means weighted by batch size
            samples += size
            predictions, labels = outputs["logits"].argmax(-1)[:, :-1], batch["labels"][:, 1:]
            correct += ((predictions == labels) & (labels != -100)).sum()
            counted += (labels != -100).sum()
            del outputs, predictions  # or this batch's logits stay alive through the next forward
    return {"eval_loss": float(loss_sum) / samples, "eval_token_accuracy": float(correct) / float(counted)}


def make_half_predictable(model, rows) -> None:
    """Rewrite every other next-token label to what the (random) model predicts there, so token accuracy is near
    50% rather than 0, and the configurations' accuracies are a real check that they score the same predictions."""
    import torch

    from ..workloads.data import batches

    model.eval()
    predicted = []
    with torch.no_grad():
        for batch in batches(rows, EVAL_BATCH_SIZE, "cpu"):
            predicted.append(model(input_ids=batch["input_ids"], use_cache=False)["logits"].argmax(-1))
    predicted = torch.cat(predicted)
    labels = rows.columns["labels"]
    labels[:, 1::2] = predicted[:, :-1][:, 0::2]  # label t+1 is scored against the prediction at t


def evaluator(config: str, spec: TrainSpec, model, rows, output_dir: str):
    """A zero-argument function that runs one evaluation under `config` and returns its metrics."""
    if config == "raw-streaming":
        return lambda: raw_streaming_eval(model, rows)
    from ..contenders.hf import build_trainer

    contender, _, variant = config.partition("-")
    kwargs = {}
    if variant in ("metrics", "argmax"):
        kwargs["compute_metrics"] = token_accuracy
    if variant == "argmax":
        kwargs["preprocess_logits_for_metrics"] = argmax_logits
    if variant == "streaming":
        from loopkit.metrics import TokenAccuracy

        kwargs["metrics"] = [TokenAccuracy()]
    trainer = build_trainer(contender, spec, model, output_dir, eval_dataset=rows,
                            args_overrides={"per_device_eval_batch_size": EVAL_BATCH_SIZE}, **kwargs)
    return trainer.evaluate


def eval_peak(config: str, num_samples: int, spec: dict, output_dir: str) -> dict:
    import gc
    import time

    from ..workloads.data import heldout_rows
    from ..workloads.models import build_model

    spec = TrainSpec.from_dict(spec)
    model = build_model(spec)
    rows = heldout_rows(spec, num_samples)
    make_half_predictable(model, rows)
    evaluate = evaluator(config, spec, model, rows, output_dir)
    gc.collect()
    rss_before = current_rss_mb()
    reset_worked = reset_peak_rss()
    started = time.perf_counter()
    metrics = evaluate()
    seconds = time.perf_counter() - started
    peak = peak_rss_mb(reset_worked)
    return {"rss_before_mb": rss_before, "peak_mb": peak, "growth_mb": peak - rss_before, "seconds": seconds,
            "peak_method": "VmHWM after clear_refs" if reset_worked else "getrusage lifetime peak",
            "eval_loss": metrics.get("eval_loss"), "token_accuracy": metrics.get("eval_token_accuracy")}


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    from ..harness.environment import describe

    streaming = suite.environment.get("loopkit_metrics", describe(suite.threads)["loopkit_metrics"])
    spec, sizes, configs = plan(suite, streaming)
    suite.say(f"eval memory: {len(configs)} configurations x N={sizes}, a fresh process each, two at a time")
    # Peak memory is per process, so two measurements can run side by side (times are not compared here).
    keys = [(config, size) for size in sizes for config in configs]
    jobs = [(f"eval-{config}", MODULE, "eval_peak", dict(config=config, num_samples=size, spec=spec.to_dict(),
                                                          output_dir=suite.scratch_dir(f"eval-{config}-{size}")))
            for config, size in keys]
    measured = dict(zip(keys, suite.fresh_many(jobs, parallel=2)))
    rows = []
    for size in sizes:
        results = {config: measured[(config, size)] for config in configs}
        losses = check_equal({c: r["eval_loss"] for c, r in results.items() if r["eval_loss"] is not None},
                             1e-5, f"eval loss (N={size})")
        accuracies = check_equal({c: r["token_accuracy"] for c, r in results.items()
                                  if r["token_accuracy"] is not None}, 1e-9, f"token accuracy (N={size})")
        for name, mapping in ROWS:
            present = {contender: config for contender, config in mapping.items() if config in configs}
            if "loopkit" not in present or len(present) < 2:
                continue
            mismatched = [contender for contender, config in present.items()
                          if config in losses["mismatched"] + accuracies["mismatched"]]
            check = merge_checks(losses, accuracies)
            check["mismatched"] = mismatched
            check["ok"] = not mismatched
            samples = {contender: [results[config]["growth_mb"]] for contender, config in present.items()}
            rows.append(comparison_row(f"{name}, N={size}", "MB", samples, check,
                                       {"configs": present, "num_samples": size}))
    missing = [] if streaming else ["loopkit-streaming: loopkit.metrics / Loop(metrics=...) is not available "
                                    "in this checkout"]
    return {"title": TITLE, "rows": rows, "spec": spec.to_dict(), "sizes": sizes, "configs": configs,
            "measurements": [{"config": c, "num_samples": n, **r} for (c, n), r in measured.items()],
            "missing": missing}


def markdown(section: dict) -> str:
    from ..reports.tables import comparison_table, fmt

    sizes = section["sizes"]
    small, large = sizes[0], sizes[-1]
    by_key = {(m["config"], m["num_samples"]): m for m in section["measurements"]}
    lines = [f"Peak memory growth during one `evaluate()` (MB above the RSS at its start), N={small} and "
             f"4N={large} samples of {section['spec']['seq_len']} tokens, vocabulary 32,000. Full logits of 4N "
             f"samples are {large * section['spec']['seq_len'] * 32000 * 4 / 2**20:,.0f} MB.\n",
             f"| configuration | N={small} | 4N={large} | 4N / N | eval loss (4N) | accuracy (4N) |",
             "|---|---|---|---|---|---|"]
    for config in section["configs"]:
        a, b = by_key[(config, small)], by_key[(config, large)]
        growth = b["growth_mb"] / a["growth_mb"] if a["growth_mb"] > 1 else None
        lines.append(f"| {CONFIGS[config]} | {fmt(a['growth_mb'])} | {fmt(b['growth_mb'])} | "
                     f"{fmt(growth) + 'x' if growth else 'n/a'} | {fmt(b['eval_loss'], 6)} | "
                     f"{fmt(b['token_accuracy'], 4)} |")
    lines.append("\nSide by side (each contender's configuration for the row; the raw loop streams):\n")
    lines.append(comparison_table(section["rows"]))
    for note in section.get("missing", []):
        lines.append(f"\nNot measured: {note}.")
    return "\n".join(lines)


def chart(section: dict, plt):
    from ..reports.tables import COLORS

    sizes = section["sizes"]
    by_key = {(m["config"], m["num_samples"]): m for m in section["measurements"]}
    configs = section["configs"]
    figure, axis = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(sizes)
    for i, size in enumerate(sizes):
        values = [by_key[(c, size)]["growth_mb"] for c in configs]
        colors = [COLORS[c.split("-")[0]] for c in configs]
        axis.bar([x + i * width for x in range(len(configs))], values, width, color=colors,
                 alpha=0.5 + 0.5 * i / max(1, len(sizes) - 1), label=f"N={size}")
    axis.set_xticks([x + width * (len(sizes) - 1) / 2 for x in range(len(configs))], configs, rotation=20,
                    ha="right", fontsize=8)
    axis.set_ylabel("peak growth during evaluate (MB)")
    axis.set_title(f"{section['title']} (lighter bar: N={sizes[0]}, darker: N={sizes[-1]})")
    figure.tight_layout()
    return figure
