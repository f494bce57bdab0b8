"""Benchmark 1, per-step overhead: the same model, data, optimizer, schedule and clipping under the hand-written
loop, HF Trainer and loopkit, on a near-null model (the loop dominates: microseconds per step) and a tiny
`LlamaForCausalLM` (milliseconds per step, tokens per second). Host reads of tensor values (device syncs on a GPU)
are counted per step in one extra, untimed run per contender.
"""

from __future__ import annotations

from .harness import check_runs, comparison_row, median, merge_checks
from .spec import CONTENDERS, TrainSpec

MODULE = "benchmarks.bench_overhead"
TITLE = "Per-step overhead"


def workloads_for(suite) -> list[dict]:
    """(row name, spec, steps timed after `warmup_steps`, unit and scale)."""
    null_warmup = suite.pick(full=50, quick=20, tiny=2)
    null_spec = TrainSpec(model="null", num_train=4096, batch_size=8, grad_accum=2, logging_steps=suite.pick(50, 20, 2),
                          max_steps=null_warmup + suite.pick(full=400, quick=200, tiny=4), warmup_steps=10)
    llama_warmup = suite.pick(full=10, quick=5, tiny=2)
    llama_spec = TrainSpec(model="llama-tiny", num_train=512, seq_len=64, batch_size=8, grad_accum=2,
                           logging_steps=suite.pick(10, 5, 2), max_steps=llama_warmup + suite.pick(40, 15, 2),
                           warmup_steps=5)
    if suite.size == "tiny":
        llama_spec = llama_spec.replace(seq_len=16, model_overrides=dict(hidden_size=16, intermediate_size=32,
                                                                         vocab_size=64))
    return [
        {"name": "near-null model (16x16 linear)", "spec": null_spec, "warmup_steps": null_warmup,
         "unit": "us/step", "scale": 1e6},
        {"name": "tiny LlamaForCausalLM", "spec": llama_spec, "warmup_steps": llama_warmup,
         "unit": "ms/step", "scale": 1e3},
    ]


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def train_steps(contender: str, spec: dict, warmup_steps: int, output_dir: str, count_syncs: bool = False) -> dict:
    """Train `spec.max_steps` steps; time the steps after the first `warmup_steps` (end of step `warmup_steps` to
    end of the last step). With `count_syncs`, count host reads over the same steps instead (slower: not timed)."""
    import gc

    from . import workloads
    from .contenders import StepClock, train
    from .syncs import HostReadCounter

    spec = TrainSpec.from_dict(spec)
    timed_steps = spec.max_steps - warmup_steps
    clock = StepClock()
    counter = HostReadCounter()
    if count_syncs:
        clock.listeners.append(lambda step: setattr(counter, "active", warmup_steps <= step < spec.max_steps))
    gc.collect()
    if count_syncs:
        with counter:
            result = train(contender, spec, clock, output_dir)
    else:
        result = train(contender, spec, clock, output_dir)
    probe = workloads.heldout_rows(spec, 32)
    return {
        "seconds_per_step": (clock.ends[-1] - clock.ends[warmup_steps - 1]) / timed_steps,
        # Building the trainer (the raw loop: entering it) to the end of step 1, imports already done (this worker
        # trained before): the setup each contender does itself.
        "setup_seconds": clock.ends[0] - result.started_at,
        "train_seconds": result.train_seconds,
        "global_step": result.global_step,
        "logged_losses": result.logged_losses,
        "probe_loss": workloads.probe_loss(result.model, probe, spec.device),
        "syncs_per_step": counter.total() / timed_steps if count_syncs else None,
        "sync_sites": counter.per_site(timed_steps) if count_syncs else None,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    rows = []
    warmup_rounds, measured_rounds = suite.pick(full=1, quick=1, tiny=0), suite.pick(full=7, quick=3, tiny=1)
    with suite.workers(prefix="overhead-") as workers:
        for workload in workloads_for(suite):
            spec, warmup = workload["spec"], workload["warmup_steps"]
            suite.say(f"overhead: {workload['name']}, {warmup_rounds}+{measured_rounds} rounds")
            samples = {c: [] for c in CONTENDERS}
            replies = {c: [] for c in CONTENDERS}
            warmups = []
            for _, is_warmup in suite.rounds(warmup_rounds, measured_rounds):
                warmups.append(is_warmup)
                for contender in CONTENDERS:
                    reply = workers[contender].request(MODULE, "train_steps", contender=contender,
                                                       spec=spec.to_dict(), warmup_steps=warmup,
                                                       output_dir=suite.scratch_dir(f"overhead-{contender}"))
                    replies[contender].append(reply)
                    if not is_warmup:
                        samples[contender].append(reply["seconds_per_step"] * workload["scale"])
            syncs = {c: workers[c].request(MODULE, "train_steps", contender=c, spec=spec.to_dict(),
                                           warmup_steps=warmup, output_dir=suite.scratch_dir(f"overhead-{c}"),
                                           count_syncs=True) for c in CONTENDERS}
            check = merge_checks(*check_runs(replies, "probe_loss", 1e-5, "final probe loss"),
                                 *check_runs(replies, "global_step", 0, "optimizer steps"))
            extra = {
                "spec": spec.to_dict(), "timed_steps": spec.max_steps - warmup, "warmup_steps": warmup,
                "syncs_per_step": {c: syncs[c]["syncs_per_step"] for c in CONTENDERS},
                "sync_sites": {c: syncs[c]["sync_sites"] for c in CONTENDERS},
                "train_call_seconds": {c: [r["train_seconds"] for r in replies[c]] for c in CONTENDERS},
            }
            if spec.model != "null":
                tokens_per_step = spec.samples_per_step * spec.seq_len
                extra["tokens_per_step"] = tokens_per_step
                extra["tokens_per_second"] = {c: [tokens_per_step * workload["scale"] / v for v in samples[c]]
                                              for c in CONTENDERS}
            rows.append(comparison_row(workload["name"], workload["unit"], samples, check, extra, floor="raw"))
            if spec.model != "null":
                setup = {c: [r["setup_seconds"] for r, w in zip(replies[c], warmups) if not w] for c in CONTENDERS}
                rows.append(comparison_row(f"setup, imports done: trainer built to end of step 1 ({workload['name']})",
                                           "s", setup, check, floor="raw"))
    return {"title": TITLE, "rows": rows}


def markdown(section: dict) -> str:
    from .report import comparison_table, fmt

    lines = [comparison_table(section["rows"])]
    lines.append("\nHost reads of tensor values per optimizer step (each one a device sync on a GPU):\n")
    lines.append("| model | " + " | ".join(CONTENDERS) + " | where (per step) |")
    lines.append("|---|" + "---|" * len(CONTENDERS) + "---|")
    step_rows = [row for row in section["rows"] if "syncs_per_step" in row["extra"]]
    for row in step_rows:
        syncs = row["extra"]["syncs_per_step"]
        sites = []
        for contender in CONTENDERS:
            for site in row["extra"]["sync_sites"][contender] or []:
                if site["per_step"] >= 0.5:
                    sites.append(f"{contender}: {site['per_step']:.2g} `{site['method']}` in `{site['where']}`")
        lines.append(f"| {row['name']} | " + " | ".join(fmt(syncs[c]) for c in CONTENDERS) +
                     f" | {'; '.join(sites) or 'only at logging points'} |")
    for row in section["rows"]:
        if "tokens_per_second" in row["extra"]:
            tps = {c: median(v) for c, v in row["extra"]["tokens_per_second"].items()}
            lines.append(f"\n{row['name']}: tokens/s (median) " +
                         ", ".join(f"{c} {fmt(tps[c])}" for c in CONTENDERS) + ".")
    return "\n".join(lines)
