"""Benchmark 1, per-step overhead: the same model, data, optimizer, schedule and clipping under the hand-written
loop, HF Trainer and loopkit, and the peers where installed (pytorch-ignite, Lightning Fabric, Lightning's Trainer:
benchmarks/contenders/peers.py), on a near-null model (the loop dominates: microseconds per step) and a tiny
`LlamaForCausalLM` (milliseconds per step, tokens per second). Each step is timed twice: wall time and the training
process's CPU time (steadier on a machine shared with other jobs: time spent waiting for a core is not counted).
Host reads of tensor values (device syncs on a GPU) are counted per step in one extra, untimed run per contender.
"""

from __future__ import annotations

from ..contenders.names import CONTENDERS, LABELS, PEERS, missing_peers
from ..reports.verdicts import check_runs, comparison_row, direction, fmt, fmt_comparison, median, merge_checks, verdict
from ..workloads.spec import TrainSpec

MODULE = "benchmarks.suite.overhead"
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

    from ..contenders.clock import StepClock
    from ..contenders.run import train
    from ..harness.syncs import HostReadCounter
    from ..workloads.checks import probe_loss
    from ..workloads.data import heldout_rows

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
    probe = heldout_rows(spec, 32)
    return {
        "seconds_per_step": (clock.ends[-1] - clock.ends[warmup_steps - 1]) / timed_steps,
        "cpu_seconds_per_step": (clock.cpu_ends[-1] - clock.cpu_ends[warmup_steps - 1]) / timed_steps,
        "weights_sha256": weights_digest(result.model),
        # Building the trainer (the raw loop: entering it) to the end of step 1, imports already done (this worker
        # trained before): the setup each contender does itself.
        "setup_seconds": clock.ends[0] - result.started_at,
        "train_seconds": result.train_seconds,
        "global_step": result.global_step,
        "logged_losses": result.logged_losses,
        "probe_loss": probe_loss(result.model, probe, spec.device),
        "syncs_per_step": counter.total() / timed_steps if count_syncs else None,
        "sync_sites": counter.per_site(timed_steps) if count_syncs else None,
    }


def weights_digest(model) -> str:
    """SHA-256 of every tensor of the model's state, names and bytes: equal digests, equal weights bit for bit."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    missing = missing_peers()
    for peer, reason in missing.items():
        suite.say(f"overhead: {LABELS[peer]} skipped: {reason}")
    contenders = CONTENDERS + tuple(peer for peer in PEERS if peer not in missing)
    rows = []
    warmup_rounds = suite.pick(full=1, quick=1, tiny=0)
    measured_rounds = suite.measured_rounds(full=7, quick=3, tiny=1)
    with suite.workers(contenders, prefix="overhead-") as workers:
        for workload in workloads_for(suite):
            spec, warmup = workload["spec"], workload["warmup_steps"]
            suite.say(f"overhead: {workload['name']}, {warmup_rounds}+{measured_rounds} rounds of "
                      f"{', '.join(contenders)}")
            replies = {c: [] for c in contenders}
            warmups = []
            for _, is_warmup in suite.rounds(warmup_rounds, measured_rounds):
                warmups.append(is_warmup)
                for contender in contenders:
                    replies[contender].append(workers[contender].request(
                        MODULE, "train_steps", contender=contender, spec=spec.to_dict(), warmup_steps=warmup,
                        output_dir=suite.scratch_dir(f"overhead-{contender}")))
            syncs = {c: workers[c].request(MODULE, "train_steps", contender=c, spec=spec.to_dict(),
                                           warmup_steps=warmup, output_dir=suite.scratch_dir(f"overhead-{c}"),
                                           count_syncs=True) for c in contenders}
            check = merge_checks(*check_runs(replies, "probe_loss", 1e-5, "final probe loss"),
                                 *check_runs(replies, "global_step", 0, "optimizer steps"))

            def measured(key, scale=1.0):
                return {c: [r[key] * scale for r, w in zip(replies[c], warmups) if not w] for c in contenders}

            extra = {
                "spec": spec.to_dict(), "timed_steps": spec.max_steps - warmup, "warmup_steps": warmup,
                "syncs_per_step": {c: syncs[c]["syncs_per_step"] for c in contenders},
                "sync_sites": {c: syncs[c]["sync_sites"] for c in contenders},
                "train_call_seconds": {c: [r["train_seconds"] for r in replies[c]] for c in contenders},
                # the final weights equal to the hand-written loop's bit for bit in every round (the check above
                # compares the held-out loss, rtol 1e-5)
                "same_weights_as_raw": {c: all(r["weights_sha256"] == raw["weights_sha256"]
                                               for r, raw in zip(replies[c], replies["raw"])) for c in contenders},
                "peers_missing": missing,
            }
            samples = measured("seconds_per_step", workload["scale"])
            if spec.model != "null":
                tokens_per_step = spec.samples_per_step * spec.seq_len
                extra["tokens_per_step"] = tokens_per_step
                extra["tokens_per_second"] = {c: [tokens_per_step * workload["scale"] / v for v in samples[c]]
                                              for c in contenders}
            rows.append(comparison_row(workload["name"], workload["unit"], samples, check, extra, floor="raw"))
            rows.append(comparison_row(f"{workload['name']}, CPU time", f"CPU {workload['unit']}",
                                       measured("cpu_seconds_per_step", workload["scale"]), check,
                                       {"peers_missing": missing}, floor="raw"))
            if spec.model != "null":
                rows.append(comparison_row(f"setup, imports done: trainer built to end of step 1 ({workload['name']})",
                                           "s", measured("setup_seconds"), check, floor="raw"))
    return {"title": TITLE, "rows": rows, "peers_missing": missing}


def step_rows(section: dict) -> list[dict]:
    """The rows that time a training step (wall and CPU time per model), not the setup."""
    return [row for row in section["rows"] if "/step" in row["unit"]]


def peer_table(section: dict) -> str:
    """Every contender's CPU time per step beside loopkit's, loopkit / contender round by round and the verdict, per
    model; then whether loopkit is ahead of every peer that ran, per model. CPU time only: on a machine shared with
    other jobs it leaves out the waits for a core (the wall-time rows are in the comparison table above it)."""
    lines = ["| CPU time per optimizer step | contender | median (min-max of the rounds) | "
             "loopkit / contender, round by round | verdict for loopkit |", "|---|---|---|---|---|"]
    ahead = []
    for row in [row for row in step_rows(section) if row["unit"].startswith("CPU ")]:
        model = f"{row['name'].removesuffix(', CPU time')}, {row['unit'].removeprefix('CPU ').removesuffix('/step')}"
        mismatched = row["check"]["mismatched"]
        for contender in [c for c in CONTENDERS + PEERS if c in row["samples"]]:
            values = row["samples"][contender]
            value = "MISMATCH" if contender in mismatched else \
                f"{fmt(row['median'][contender])} ({fmt(min(values))}-{fmt(max(values))})"
            pair = row["ratios"].get(f"loopkit/{contender}")
            words = verdict(row, contender) if pair is not None or contender in mismatched else None
            lines.append(f"| {model} | {LABELS[contender]} | {value} | "
                         f"{fmt_comparison(pair, 'amount', row['unit']) if contender != 'loopkit' else '-'} | "
                         f"{words or '-'} |")
        ahead.append(f"- {model}: {peers_verdict(row)}")
    missing = section.get("peers_missing") or {}
    notes = [f"Not run: {LABELS[peer]} ({reason})." for peer, reason in missing.items()]
    for row in section["rows"]:
        same = row["extra"].get("same_weights_as_raw")
        if same:
            notes.append(f"{row['name']}: final weights bit-identical to the hand-written loop's in every round: " +
                         ", ".join(f"{LABELS[c]} {'yes' if same[c] else 'no'}" for c in same if c != "raw") + ".")
    return "\n".join(lines + [""] + ["Is loopkit ahead of every peer?"] + ahead + ([""] + notes if notes else []))


def peers_verdict(row: dict) -> str:
    """"faster than every peer in every round" only where every peer that ran did the same work and every round
    of every pair points that way; else which peers it is not ahead of, and why."""
    peers = [p for p in PEERS if p in row["samples"]]
    if not peers:
        return "no peer ran"
    behind = []
    for peer in peers:
        way = direction(row["ratios"].get(f"loopkit/{peer}"), 1.0)
        if way != -1 or row.get("untrusted") or {peer, "loopkit"} & set(row["check"]["mismatched"]):
            behind.append(verdict(row, peer))
    if behind:
        return "no: " + "; ".join(behind)
    ranges = ", ".join(f"{LABELS[p]} {fmt_comparison(row['ratios'][f'loopkit/{p}'], 'amount', row['unit'])}"
                       for p in peers)
    return f"yes, faster than each in every round (loopkit / peer: {ranges})"


def markdown(section: dict) -> str:
    from ..reports.tables import comparison_table, fmt

    contenders = [c for c in CONTENDERS + PEERS if c in section["rows"][0]["samples"]]
    lines = [comparison_table(section["rows"], contenders)]
    if set(PEERS) & set(contenders) or section.get("peers_missing"):  # a run before the peers: no such table
        lines.append("\nloopkit against every contender, step rows:\n")
        lines.append(peer_table(section))
    lines.append("\nHost reads of tensor values per optimizer step (each one a device sync on a GPU):\n")
    lines.append("| model | " + " | ".join(contenders) + " | where (per step) |")
    lines.append("|---|" + "---|" * len(contenders) + "---|")
    for row in [row for row in section["rows"] if "syncs_per_step" in row["extra"]]:
        syncs = row["extra"]["syncs_per_step"]
        sites = []
        for contender in contenders:
            for site in row["extra"]["sync_sites"][contender] or []:
                if site["per_step"] >= 0.5:
                    sites.append(f"{contender}: {site['per_step']:.2g} `{site['method']}` in `{site['where']}`")
        lines.append(f"| {row['name']} | " + " | ".join(fmt(syncs[c]) for c in contenders) +
                     f" | {'; '.join(sites) or 'only at logging points'} |")
    for row in section["rows"]:
        if "tokens_per_second" in row["extra"]:
            tps = {c: median(v) for c, v in row["extra"]["tokens_per_second"].items()}
            lines.append(f"\n{row['name']}: tokens/s (median) " +
                         ", ".join(f"{c} {fmt(tps[c])}" for c in contenders) + ".")
    return "\n".join(lines)
