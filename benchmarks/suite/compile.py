"""Benchmark 9, compile: what `torch_compile=True` costs and gives a loopkit run, with and without shape buckets, and
whether a compiled optimizer step beats the eager ones (docs/performance.md, "Compile").

Model runs (`MODEL_RUNS`): a `LlamaForCausalLM` from a config trained by loopkit on random token ids of ragged
lengths, padded by `DataCollatorForLanguageModeling` (MiniLM's tokenizer), a fixed number of steps: not compiled,
compiled (the collator's own padding: a new length nearly every batch), compiled with buckets of 64
(`DataStage(compile_pad_to_multiple_of=64)`), and the same with `ACCELERATE_DYNAMO_USE_DYNAMIC=0` (a static graph
per shape). Each run is a fresh process with an empty inductor cache (every compilation is cold), the contenders
alternate round by round, and every run must end with the same training loss. Measured per run: compilations and
compile seconds (loopkit's run report: dynamo's compilation callbacks) and the median step (step begin to step end,
every step; the few that compile are outliers the median leaves out).

Optimizer steps (`OPTIMIZERS`): AdamW over a Llama's parameters with fixed gradients, fused (loopkit's default
`adamw_torch_fused`), foreach, and `torch.compile(optimizer.step)` (torch's recipe). One persistent process per
contender and model size (the first call, with the compilation, is timed apart: a fresh process and an empty
inductor cache), then alternated rounds of timed steps. Separately, in a fresh process, how many times dynamo
compiles the step in `LR_STEPS` steps whose learning rate changes every step (a scheduler, as in every run);
dynamo decides recompilations from its guards, before any backend runs, so this count uses the `eager` backend.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from ..reports.verdicts import check_equal, comparison_row, direction, fmt, fmt_comparison, median, paired_ratio

MODULE = "benchmarks.suite.compile"
TITLE = "Compile: torch_compile, shape buckets and a compiled optimizer step (loopkit)"
# name -> (label, what it is). Order: the alternation within a round, and the table's rows.
MODEL_RUNS = {
    "eager": ("not compiled", "torch_compile=False"),
    "compiled": ("compiled, the collator's padding", "torch_compile=True"),
    "buckets": ("compiled, buckets of 64", "+ DataStage(compile_pad_to_multiple_of=64)"),
    "buckets-static": ("compiled, buckets of 64, `ACCELERATE_DYNAMO_USE_DYNAMIC=0`",
                       "+ a static graph per shape"),
}
OPTIMIZERS = {"fused": "fused (loopkit's default `adamw_torch_fused`)", "foreach": "foreach",
              "compiled": "compiled (`torch.compile(optimizer.step)`)"}
# Optimizer model sizes: the tests' tiny Llama's shape (with a 1,024-token vocabulary) and a 128-wide one.
OPTIMIZER_MODELS = {
    "small": dict(vocab_size=1024, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2),
    "wide": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4),
}
LR_STEPS = 20
FIRST_PLAIN_ID = 104  # MiniLM's special tokens are 0 and 100-103
BUCKET = 64
LOSS_RTOL = 1e-3  # inductor's kernels round differently from eager ones


def plan(suite) -> dict:
    """Full: the 2-layer, 128-wide Llama, 40 steps of 8 samples of 16-256 tokens, two rounds of every model run;
    optimizer steps at both sizes, 7 rounds of 50 steps. Quick: a 1-layer, 64-wide Llama, 16 steps of 16-128 tokens
    and one round without the static-graph run; optimizer steps at both sizes, 3 rounds of 30 steps. Tiny: dynamo's
    eager backend (nothing code-generated), a few steps."""
    model = dict(vocab_size=suite.pick(30522, 2048, 512), hidden_size=suite.pick(128, 64, 16),
                 intermediate_size=suite.pick(512, 128, 32), num_hidden_layers=suite.pick(2, 1, 1),
                 num_attention_heads=suite.pick(4, 2, 2), num_key_value_heads=suite.pick(4, 2, 2))
    model_runs = list(MODEL_RUNS) if suite.size != "quick" else [n for n in MODEL_RUNS if n != "buckets-static"]
    return {
        "model": model, "model_runs": model_runs, "steps": suite.pick(40, 16, 4), "batch_size": suite.pick(8, 8, 2),
        "shortest": suite.pick(16, 16, 4), "longest": suite.pick(256, 128, 40), "rounds": suite.pick(2, 1, 1),
        "backend": suite.pick("inductor", "inductor", "eager"), "seed": 42,
        "optimizer_sizes": list(OPTIMIZER_MODELS) if suite.size != "tiny" else ["small"],
        "optimizer_rounds": suite.pick(7, 3, 1), "optimizer_steps": suite.pick(50, 30, 3),
        "lr_steps": suite.pick(LR_STEPS, LR_STEPS, 4),
    }


def put_environ(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextmanager
def environ(**values):
    """Set (a str) or unset (None) environment variables for the block, then put them back."""
    saved = {name: os.environ.get(name) for name in values}
    put_environ(values)
    try:
        yield
    finally:
        put_environ(saved)


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def set_threads() -> None:
    import torch

    threads = int(os.environ.get("LOOPKIT_BENCH_THREADS", "0"))  # set by the suite for its workers
    if threads > 0:
        torch.set_num_threads(threads)


def ragged_samples(plan: dict) -> list[dict]:
    """Random token ids (none of MiniLM's special tokens) of lengths spread over shortest..longest."""
    import random

    rng = random.Random(plan["seed"])
    count = plan["steps"] * plan["batch_size"]
    return [{"input_ids": [rng.randrange(FIRST_PLAIN_ID, plan["model"]["vocab_size"])
                           for _ in range(rng.randint(plan["shortest"], plan["longest"]))]} for _ in range(count)]


def train_run(run_name: str, plan: dict, output_dir: str) -> dict:
    """One loopkit run of `run_name` (a MODEL_RUNS key) in this (fresh) process."""
    import json

    import torch
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling, LlamaConfig, LlamaForCausalLM

    from loopkit import Loop, LoopArgs
    from loopkit.stages.data import DataStage

    from ..contenders.clock import ClockCallback, StepClock
    from ..workloads.models import minilm_path, quiet_transformers

    set_threads()
    torch._dynamo.reset()  # in-process (the smoke test): no graphs from an earlier run
    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(plan["seed"])
    positions = -(-plan["longest"] // BUCKET) * BUCKET
    model = LlamaForCausalLM(LlamaConfig(**plan["model"], max_position_embeddings=positions, use_cache=False,
                                         attn_implementation="sdpa"))
    args = LoopArgs(output_dir=output_dir, per_device_train_batch_size=plan["batch_size"], max_steps=plan["steps"],
                    learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=plan["steps"],
                    save_strategy="no", report_to="none", disable_tqdm=True, seed=plan["seed"], use_cpu=True,
                    # a backend alone turns torch_compile on (Trainer's rule): the uncompiled run names none
                    **({} if run_name == "eager" else {"torch_compile": True,
                                                       "torch_compile_backend": plan["backend"]}))
    stages = {"data": DataStage(compile_pad_to_multiple_of=BUCKET)} if run_name.startswith("buckets") else {}
    clock = StepClock()
    with environ(ACCELERATE_DYNAMO_USE_DYNAMIC="0" if run_name == "buckets-static" else None):
        loop = Loop(model=model, args=args, train_dataset=ragged_samples(plan),
                    data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                    callbacks=[ClockCallback(clock)], **stages)
        training_loss = loop.train().training_loss
    with open(os.path.join(output_dir, "run_report.json")) as f:
        compiled = json.load(f)["compile"] or {"compilations": 0, "seconds": 0.0}
    steps = [end - begin for begin, end in zip(clock.begins, clock.ends)]
    return {"name": run_name, "steps": len(steps), "median_step_ms": 1000 * median(steps),
            "compilations": compiled["compilations"], "compile_seconds": compiled["seconds"],
            "training_loss": training_loss}


def optimizer_model(size: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**OPTIMIZER_MODELS[size]))
    for parameter in model.parameters():  # fixed gradients: every step does the same arithmetic
        parameter.grad = torch.randn_like(parameter) * 1e-3
    return model


def build_step(kind: str, model, backend: str, learning_rate=1e-3):
    """(optimizer, step function) for an OPTIMIZERS kind."""
    import torch

    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "compiled": {"foreach": False}}[kind]
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, **options)
    step = torch.compile(optimizer.step, backend=backend) if kind == "compiled" else optimizer.step
    return optimizer, step


_OPTIMIZER_STATE: dict = {}  # (kind, size) -> (model, step, first call's seconds): one per persistent worker


def optimizer_round(kind: str, size: str, steps: int, backend: str, cache_dir: str) -> dict:
    """Time `steps` optimizer steps; the first request in a process also times the first call (the compilation)."""
    import time

    import torch

    if (kind, size) not in _OPTIMIZER_STATE:
        with environ(TORCHINDUCTOR_CACHE_DIR=cache_dir):  # cold: nothing compiled before in this folder
            set_threads()
            torch._dynamo.reset()
            model = optimizer_model(size)
            _, step = build_step(kind, model, backend)
            started = time.perf_counter()
            step()
            _OPTIMIZER_STATE[kind, size] = (model, step, time.perf_counter() - started)
    model, step, first_call = _OPTIMIZER_STATE[kind, size]
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    checksum = float(sum(p.detach().double().abs().sum() for p in model.parameters()))
    return {"median_step_ms": 1000 * median(times), "first_call_seconds": first_call,
            "parameters": sum(p.numel() for p in model.parameters()), "checksum": checksum}


def lr_recompiles(size: str, steps: int) -> int:
    """Compilations of a compiled AdamW step whose learning rate a linear schedule changes every step, counted as
    loopkit's run report counts them (dynamo's compilation callbacks, loopkit/compilation.py)."""
    import torch

    from loopkit.compilation import CompileWatch

    class Counter:
        compilations = 0

        def add(self, phase: str, seconds: float) -> None:
            pass

    set_threads()
    torch._dynamo.reset()
    counter = Counter()
    watch = CompileWatch(counter)
    try:
        optimizer = torch.optim.AdamW(optimizer_model(size).parameters(), lr=1e-3, foreach=False)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1,
                                                     total_iters=steps)
        step = torch.compile(optimizer.step, backend="eager")  # the step as the schedule wrapped it
        for _ in range(steps):
            step()
            schedule.step()
    finally:
        watch.stop()
    return counter.compilations


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    settings = plan(suite)
    replies = {name: [] for name in settings["model_runs"]}
    for round_index in range(settings["rounds"]):
        for name in settings["model_runs"]:
            suite.say(f"compile: round {round_index + 1}/{settings['rounds']}, {name}")
            with environ(TORCHINDUCTOR_CACHE_DIR=suite.scratch_dir(f"inductor-{name}-{round_index}")):
                replies[name].append(suite.fresh(f"compile-{name}", MODULE, "train_run", run_name=name,
                                                 plan=settings, output_dir=suite.scratch_dir(f"compile-{name}")))
    optimizers = {size: optimizer_rounds(suite, settings, size) for size in settings["optimizer_sizes"]}
    suite.say(f"compile: AdamW with a scheduled learning rate, {settings['lr_steps']} steps")
    recompiles = suite.fresh("compile-lr", MODULE, "lr_recompiles", size=settings["optimizer_sizes"][0],
                             steps=settings["lr_steps"])
    return summarize(settings, replies, optimizers, recompiles)


def optimizer_rounds(suite, settings: dict, size: str) -> dict:
    """{kind: [reply per round]}: one persistent worker per kind, rounds alternating the kinds."""
    replies = {kind: [] for kind in OPTIMIZERS}
    cache = suite.scratch_dir(f"inductor-optimizer-{size}")
    with suite.workers(names=list(OPTIMIZERS), prefix=f"optimizer-{size}-") as workers:
        for round_index in range(settings["optimizer_rounds"]):
            suite.say(f"compile: AdamW steps, {size} model, round {round_index + 1}/{settings['optimizer_rounds']}")
            for kind in OPTIMIZERS:
                replies[kind].append(workers[kind].request(
                    MODULE, "optimizer_round", kind=kind, size=size, steps=settings["optimizer_steps"],
                    backend=settings["backend"], cache_dir=os.path.join(cache, kind)))
    return replies


def summarize(settings: dict, replies: dict, optimizers: dict, recompiles: int) -> dict:
    check = check_equal({name: median([r["training_loss"] for r in runs]) for name, runs in replies.items()},
                        LOSS_RTOL, "training loss")
    rows = [comparison_row("median step", "ms", {n: [r["median_step_ms"] for r in runs] for n, runs in
                                                 replies.items()}, check),
            comparison_row("compile time", "s", {n: [r["compile_seconds"] for r in runs] for n, runs in
                                                 replies.items() if n != "eager"}, check)]
    steps = {n: [r["median_step_ms"] for r in runs] for n, runs in replies.items()}
    ratios = {f"{a}/{b}": paired_ratio(steps[a], steps[b]) for a in steps if a != "eager"
              for b in ("eager", "compiled") if a != b and b in steps}
    optimizer_rows, optimizer_ratios = [], {}
    for size, by_kind in optimizers.items():
        samples = {kind: [r["median_step_ms"] for r in runs] for kind, runs in by_kind.items()}
        same = check_equal({kind: runs[-1]["checksum"] for kind, runs in by_kind.items()}, 1e-4,
                           "parameters after the same steps")
        row = comparison_row(f"AdamW step, {size} model", "ms", samples, same)
        row["extra"] = {"parameters": by_kind["fused"][0]["parameters"],
                        "first_call_seconds": {k: runs[0]["first_call_seconds"] for k, runs in by_kind.items()}}
        optimizer_rows.append(row)
        for other in ("fused", "foreach"):
            optimizer_ratios[f"{size}: compiled/{other}"] = paired_ratio(samples["compiled"], samples[other])
    return {"title": TITLE, "plan": settings, "runs": replies, "rows": rows + optimizer_rows, "ratios": ratios,
            "optimizer_ratios": optimizer_ratios, "lr_recompiles": recompiles, "loss_check": check}


# ---------------------------------------------------------------------------------------------------------------------
# Report (results.md here; docs/performance.md through benchmarks/reports/docs.py)
# ---------------------------------------------------------------------------------------------------------------------
def verdict(comparison: dict | None, above: str, below: str) -> str:
    """A paired ratio in words: `above` (or `below`) 1 in every round, else no verdict."""
    if comparison is None:
        return "n/a"
    text = fmt_comparison(comparison, "amount", "")
    if comparison["n"] == 1:
        return f"{text} (one round: no verdict)"
    way = direction(comparison, 1.0)
    words = {1: f"{above} in all {comparison['n']} rounds", -1: f"{below} in all {comparison['n']} rounds",
             0: "equal"}.get(way, "rounds point both ways: no verdict")
    return f"{text}, {words}"


def rounds_above(first: list, second: list) -> str:
    """How many rounds `first` was above `second`: "6 of 7"."""
    pairs = list(zip(first, second))
    return f"{sum(a > b for a, b in pairs)} of {len(pairs)}"


def model_table(section: dict) -> str:
    runs, ratios = section["runs"], section["ratios"]
    lines = ["| run | compilations | compile time, s | median step, ms | vs not compiled | vs compiled, the "
             "collator's padding |", "|---|---|---|---|---|---|"]
    for name, replies in runs.items():
        counts = [r["compilations"] for r in replies]
        seconds = [r["compile_seconds"] for r in replies]
        steps = [r["median_step_ms"] for r in replies]
        cells = [MODEL_RUNS[name][0], f"{min(counts)}" if min(counts) == max(counts) else
                 f"{min(counts)}-{max(counts)}",
                 "" if name == "eager" else with_range(seconds), with_range(steps),
                 verdict(ratios.get(f"{name}/eager"), "slower", "faster") if name != "eager" else "",
                 verdict(ratios.get(f"{name}/compiled"), "slower", "faster") if f"{name}/compiled" in ratios else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def optimizer_table(section: dict) -> str:
    lines = ["| model | parameters | " + " | ".join(f"{kind}, ms" for kind in OPTIMIZERS) +
             " | compiled vs fused | compiled vs foreach | first compiled step, s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in section["rows"]:
        if not row["name"].startswith("AdamW"):
            continue
        size = row["name"].rsplit(", ", 1)[1].split()[0]
        ratios = section["optimizer_ratios"]
        cells = [size, f"{row['extra']['parameters'] / 1e6:.2f} M"]
        cells += [with_range(row["samples"][kind]) for kind in OPTIMIZERS]
        against_fused = ratios[f"{size}: compiled/fused"]
        mixed = against_fused and against_fused["n"] > 1 and direction(against_fused, 1.0) is None
        cells += [verdict(against_fused, "slower", "faster") + (
                  f" (slower in {rounds_above(row['samples']['compiled'], row['samples']['fused'])} rounds)"
                  if mixed else ""),
                  verdict(ratios[f"{size}: compiled/foreach"], "slower", "faster"),
                  fmt(row["extra"]["first_call_seconds"]["compiled"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def with_range(values: list) -> str:
    from ..reports.tables import with_range as median_with_range

    return median_with_range(median(values), values)


def markdown(section: dict) -> str:
    settings = section["plan"]
    model = settings["model"]
    return "\n".join([
        f"Llama {model['num_hidden_layers']} layer(s), hidden {model['hidden_size']}, vocabulary "
        f"{model['vocab_size']:,}; {settings['steps']} steps of {settings['batch_size']} samples of "
        f"{settings['shortest']}-{settings['longest']} tokens; {settings['rounds']} round(s), each run a fresh process "
        f"with an empty inductor cache; backend `{settings['backend']}`. Same work: {section['loss_check']['detail']}.",
        "", model_table(section), "",
        f"AdamW steps: {settings['optimizer_rounds']} alternated round(s) of {settings['optimizer_steps']} steps; "
        f"median per step (min-max of the rounds' medians).", "", optimizer_table(section), "",
        f"A compiled AdamW step whose learning rate changes every step (a linear schedule): "
        f"{section['lr_recompiles']} compilations in {settings['lr_steps']} steps."])


def chart(section: dict, plt):
    return None  # the tables say it; a bar per run adds nothing
