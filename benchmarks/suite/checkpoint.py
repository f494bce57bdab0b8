"""Benchmark 5, checkpoint cost: how long training is blocked by one save of the real MiniLM classifier (22.7 M
parameters, with its AdamW state), how much slower the steps that follow it run, and what the checkpoint's files
weigh.

The save comes after step `SAVE_AFTER_STEP`. Blocked time = the step-to-step gap with the save in it - the median
gap of the steps before it (the same work without a save). Following steps slower by = the time of the
`FOLLOWING_STEPS` steps after the save - as many times the median step before it: what a background write (or the
disk's write-back) takes from training. The hand-written loop saves what a careful engineer would (`save_pretrained`,
the optimizer and the scheduler); HF Trainer and loopkit write their full checkpoints (loopkit atomically: written to
a temporary folder, fsynced, renamed). When this loopkit has `EvalStage(async_save=True)`, it is measured too: the
state is copied at the step boundary and written in the background while training goes on.
"""

from __future__ import annotations

from ..contenders.names import CONTENDERS
from ..reports.verdicts import check_runs, comparison_row, median, merge_checks
from ..workloads.spec import TrainSpec

MODULE = "benchmarks.suite.checkpoint"
TITLE = "Checkpoint cost"
SAVE_AFTER_STEP = 4  # steps 2..4 give the no-save baseline (step 1 warms up)
FOLLOWING_STEPS = 8  # the steps after the save whose slowdown is measured
ASYNC = "loopkit-async"  # loopkit with EvalStage(async_save=True), run by the loopkit worker


def spec_for(suite) -> TrainSpec:
    if suite.size == "tiny":  # the smoke test: the same code on a model that saves in milliseconds
        return TrainSpec(model="llama-tiny", num_train=64, seq_len=8, batch_size=4, grad_accum=1, max_steps=20,
                         warmup_steps=2, logging_steps=50,
                         model_overrides=dict(hidden_size=16, intermediate_size=32, vocab_size=64))
    return TrainSpec(model="minilm", num_train=64, seq_len=32, batch_size=4, grad_accum=1, max_steps=20,
                     learning_rate=5e-5, warmup_steps=2, logging_steps=50)


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def async_save_supported() -> bool:
    import inspect

    from loopkit import EvalStage

    return "async_save" in inspect.signature(EvalStage).parameters


def save_once(contender: str, spec: dict, output_dir: str, async_save: bool = False) -> dict:
    import gc
    import os

    from ..contenders.clock import StepClock
    from ..contenders.run import train
    from ..workloads.checks import probe_loss
    from ..workloads.data import heldout_rows

    spec = TrainSpec.from_dict(spec)
    trainer_kwargs = {}
    if async_save:
        from loopkit import EvalStage

        trainer_kwargs["evaluation"] = EvalStage(async_save=True)
    clock = StepClock(save_at=[SAVE_AFTER_STEP], stop_at=SAVE_AFTER_STEP + FOLLOWING_STEPS)
    gc.collect()
    result = train(contender, spec, clock, output_dir, trainer_kwargs=trainer_kwargs)  # returns once saves are done
    folder = os.path.join(output_dir, f"checkpoint-{SAVE_AFTER_STEP}")
    files = {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}
    return {**save_timings(clock), "files": files, "total_bytes": sum(files.values()),
            "global_step": result.global_step,
            "probe_loss": probe_loss(result.model, heldout_rows(spec, 32))}


def save_timings(clock) -> dict:
    """Blocked time and the following steps' slowdown of the save after step `SAVE_AFTER_STEP` (module docstring),
    from the clock's step timestamps."""
    import statistics

    begins, ends = clock.begins, clock.ends  # index k: step k + 1
    steps = [end - begin for begin, end in zip(begins, ends)]
    gaps = [begin - end for end, begin in zip(ends, begins[1:])]  # gaps[k]: after step k + 1
    usual_gap = statistics.median(gaps[1:SAVE_AFTER_STEP - 1])
    usual_step = statistics.median(steps[1:SAVE_AFTER_STEP])
    following = steps[SAVE_AFTER_STEP:SAVE_AFTER_STEP + FOLLOWING_STEPS]
    return {"blocked": gaps[SAVE_AFTER_STEP - 1] - usual_gap, "gap_with_save": gaps[SAVE_AFTER_STEP - 1],
            "gap_without_save": usual_gap, "usual_step": usual_step,
            "following_steps_slower_by": sum(following) - len(following) * usual_step}


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    spec = spec_for(suite)
    warmup_rounds, measured_rounds = suite.pick(full=1, quick=0, tiny=0), suite.pick(full=6, quick=2, tiny=1)
    with suite.workers(prefix="checkpoint-") as workers:
        runs = list(CONTENDERS)
        if workers["loopkit"].request(MODULE, "async_save_supported"):
            runs.append(ASYNC)
        replies = {name: [] for name in runs}
        suite.say(f"checkpoint: {spec.model} saves by {', '.join(runs)}, {warmup_rounds}+{measured_rounds} rounds")
        for _, is_warmup in suite.rounds(warmup_rounds, measured_rounds):
            for name in runs:
                contender = "loopkit" if name == ASYNC else name
                reply = workers[contender].request(MODULE, "save_once", contender=contender, spec=spec.to_dict(),
                                                   output_dir=suite.scratch_dir(f"checkpoint-{name}"),
                                                   async_save=name == ASYNC)
                if not is_warmup:
                    replies[name].append(reply)
    return {"title": TITLE, "rows": rows_for(replies), "spec": spec.to_dict(), "runs": runs}


def rows_for(replies: dict) -> list[dict]:
    """The section's rows from the measured rounds (`replies[run][round]`, runs: the contenders, plus loopkit's
    async run where it was measured)."""
    runs = list(replies)
    check = merge_checks(*check_runs(replies, "probe_loss", 1e-5, "probe loss after step 3"),
                         *check_runs(replies, "global_step", 0, "optimizer steps"))
    sync_check = check_for_row(check, "loopkit")

    def samples(key, names=CONTENDERS, scale=1.0):
        return {name: [r[key] * scale for r in replies[name]] for name in names}

    slower = f"the {FOLLOWING_STEPS} steps after the save, slower by"
    # both are differences from the steps without a save: near zero, either sign, compared as differences
    rows = [comparison_row("training blocked by one save", "s", samples("blocked"), sync_check,
                           {"gap_without_save": samples("gap_without_save", runs),
                            "usual_step": samples("usual_step", runs),
                            "following_steps_slower_by": samples("following_steps_slower_by", runs)},
                           kind="difference"),
            comparison_row(slower, "s", samples("following_steps_slower_by"), sync_check, kind="difference")]
    if ASYNC in replies:
        def with_async(key):  # loopkit's column holds its async run
            return {**samples(key), "loopkit": samples(key, [ASYNC])[ASYNC]}

        async_check = check_for_row(check, ASYNC)
        rows.append(comparison_row("training blocked by one save, loopkit async_save=True", "s",
                                   with_async("blocked"), async_check, kind="difference"))
        rows.append(comparison_row(f"{slower}, loopkit async_save=True", "s",
                                   with_async("following_steps_slower_by"), async_check, kind="difference"))
    rows.append(comparison_row("checkpoint size", "MB", samples("total_bytes", scale=1 / 2**20), sync_check,
                               {"files": {name: replies[name][-1]["files"] for name in runs}}))
    return rows


def check_for_row(check: dict, loopkit_run: str) -> dict:
    """The merged check as one row sees it: `loopkit_run` ("loopkit" or the async run) stands for loopkit there."""
    mismatched = []
    for name in check["mismatched"]:
        if name not in ("loopkit", ASYNC):
            mismatched.append(name)
        elif name == loopkit_run:
            mismatched.append("loopkit")
    return {**check, "mismatched": mismatched, "ok": not mismatched}


def markdown(section: dict) -> str:
    from ..reports.tables import comparison_table, fmt

    runs = section.get("runs", list(CONTENDERS))
    files = section["rows"][-1]["extra"]["files"]
    names = sorted({name for listing in files.values() for name in listing})
    lines = [comparison_table(section["rows"]), "\nFiles (MB):\n",
             "| file | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(fmt(files[r][name] / 2**20) if name in files[r] else "-"
                                               for r in runs) + " |")
    extra = section["rows"][0]["extra"]
    lines.append("\n| median seconds | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
    lines.append("| step-to-step gap without a save | " +
                 " | ".join(fmt(median(extra["gap_without_save"][r])) for r in runs) + " |")
    lines.append("| one step without a save | " +
                 " | ".join(fmt(median(extra["usual_step"][r])) for r in runs) + " |")
    lines.append(f"| the {FOLLOWING_STEPS} steps after the save, slower by | " +
                 " | ".join(fmt(median(extra["following_steps_slower_by"][r])) for r in runs) + " |")
    return "\n".join(lines)
