"""Benchmark 11, TRL: TRL's `SFTTrainer` and `DPOTrainer` against loopkit's `SFTLoop` and `DPOLoop` on the same work.

Three workloads, each a small Llama from a config (MiniLM's 30,522-token vocabulary) trained fp32 (`bf16=False`:
TRL's configs default to bf16 autocast; their gradient checkpointing is kept), seed 0, on real
Rotten Tomatoes reviews with MiniLM's WordPiece tokenizer (eos `[SEP]`), the same TRL config for both contenders:

* `sft`: SFT on the reviews as plain text (`{"text": ...}`), padded batches;
* `sft-packed`: the same with `packing=True` (TRL's best-fit packing into `max_length` rows, position ids reset per
  review);
* `dpo`: DPO (sigmoid loss, beta 0.1) on preference pairs made from the reviews: the prompt is a review's first
  words, the chosen completion the rest of a fresh review, the rejected one the rest of a rotten review; an explicit
  reference model (a copy of the initial policy).

Each runs again on a second real text, `<workload>@debates`: the 1,122 statements of the 2016 US presidential debates
(a few words to several hundred tokens, a far longer tail than the reviews), for DPO each statement's opening as the
prompt, its rest as chosen and the next statement's rest as rejected.

Contenders: TRL's trainer (`trl`), and loopkit's (`loopkit`: `loopkit.trl.SFTLoop` / `DPOLoop`, TRL's class over
loopkit's loop: TRL's data preparation, collator and loss, loopkit's run, and loopkit's fused LM head under TRL's
loss, loopkit/trl/fused.py). Each run is a fresh process; rounds
alternate the contenders (trl, loopkit, trl, loopkit, ...), one process at a time, so the machine's drift hits both
alike. Per run:

* CPU time per optimizer step: the training process's CPU time (`time.process_time`, all its threads) from the end
  of the last warm-up step to the end of the last step, over the timed steps (logging steps included), read by a
  callback at `on_step_end` (`benchmarks.contenders.clock.StepClock`, the clock of every other benchmark);
* peak memory: the process's resident-set high-water mark (Linux VmHWM), read at the end of `train()`: over the whole
  process (imports, model, TRL's data preparation, training: what a user's process needs), and over `train()` alone
  (the mark reset through /proc/self/clear_refs just before `train()`, minus the resident set then). The process
  holds one contender only, so its peak is that contender's;
* every logged loss: both contenders must log the same losses (rtol 1e-5), the precondition of a fair race.

Verdict per workload and measure: "below TRL in every round" only when loopkit's value is below TRL's in every round
(round-by-round ratios loopkit / TRL all under 1); rounds that disagree are printed and give no verdict. The load
average is recorded at every run. `python -m benchmarks --only trl` (results: `results.json` / `results.md` in
`--out`; the committed run is benchmarks/results/trl/); docs/performance.md and docs/trl.md are generated from it.
"""

from __future__ import annotations

import os

from ..reports.tables import with_range
from ..reports.verdicts import direction, fmt, median, paired_ratio

MODULE = "benchmarks.suite.trl"
TITLE = "TRL: SFT (plain, packed) and DPO, TRL's trainers vs loopkit's (CPU per step, peak memory)"
# A workload is `<kind>` on the reviews, `<kind>@debates` on the debate statements: the ratio depends on the lengths
# of the texts and on which tokens are scored, so every kind runs on both.
KINDS = {"sft": ("SFT, plain text, padded batches", "SFT plain"), "sft-packed": ("SFT, packing=True", "SFT packed"),
         "dpo": ("DPO, sigmoid loss, explicit reference model", "DPO")}
TEXTS = {"": ("", ""), "@debates": (", debate statements", " (debates)")}
WORKLOADS = {kind + text: label + long for text, (long, _) in TEXTS.items() for kind, (label, _) in KINDS.items()}
SHORT = {kind + text: short + brief for text, (_, brief) in TEXTS.items() for kind, (_, short) in KINDS.items()}
# The tiny size (the smoke test's): both trainers and both texts in 2 workloads (packed SFT on the debates, DPO on
# the reviews)
TINY_WORKLOADS = ["sft-packed@debates", "dpo"]
CONTENDERS = ("trl", "loopkit")
LABELS = {"trl": "TRL's trainer", "loopkit": "loopkit"}
TRAINER_NAMES = {("sft", "trl"): "SFTTrainer", ("sft", "loopkit"): "SFTLoop", ("dpo", "trl"): "DPOTrainer",
                 ("dpo", "loopkit"): "DPOLoop"}
# (key in a run's reply, row label, unit)
MEASURES = (("cpu_ms_per_step", "CPU time per optimizer step", "ms"),
            ("peak_rss_mb", "peak RSS of the process", "MB"),
            ("train_peak_mb", "peak RSS growth during train()", "MB"))
LOSS_RTOL = 1e-5


def plan(suite) -> dict:
    """Sizes: full, a 2-layer 128-wide Llama, batch 8, 64 tokens, 3 warm-up + 20 timed steps, 3 rounds (1,024 reviews:
    the packed rows last the run in one epoch; a round is a few minutes of CPU on a quiet machine); quick, a 64-wide
    Llama and fewer steps; tiny (the smoke test), seconds."""
    return {"model": suite.pick(dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4),
                                dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2),
                                dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2)),
            "batch_size": suite.pick(8, 8, 2), "max_length": suite.pick(64, 64, 32),
            "warmup_steps": suite.pick(3, 2, 1), "timed_steps": suite.pick(20, 10, 2),
            "logging_steps": suite.pick(5, 5, 1), "num_reviews": suite.pick(1024, 256, 16),
            "rounds": suite.measured_rounds(3, 3, 1), "learning_rate": 1e-4, "seed": 0,
            "workloads": suite.pick(list(WORKLOADS), list(WORKLOADS), TINY_WORKLOADS)}


# ---------------------------------------------------------------------------------------------------------------------
# Worker side (imports inside: the parent never loads torch)
# ---------------------------------------------------------------------------------------------------------------------
def tokenizer():
    from transformers import AutoTokenizer

    from ..workloads.models import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    tok.eos_token = "[SEP]"  # MiniLM's WordPiece tokenizer has no eos; TRL appends one to each text
    return tok


def reviews(count: int | None) -> list:
    """The first `count` (text, label) Rotten Tomatoes reviews (label 1 = fresh), in the corpus' order (all: None)."""
    from ..workloads.data import rotten_tomatoes_rows

    return rotten_tomatoes_rows()[:count]


def debate_pairs(count: int) -> tuple[list, list]:
    """The first `count` debate statements of over 5 words, as (chosen, rejected) word lists: each statement against
    the next one (the prompt is the chosen one's opening; the rejected completion goes on with another speaker)."""
    from ..workloads.data import debate_statements

    statements = [text.split() for text in debate_statements() if len(text.split()) > 5][:count + 1]
    return statements[:-1], statements[1:]


def dataset(workload: str, count: int):
    """TRL's input format for the workload: `{"text"}` for SFT (the first `count` reviews or debate statements),
    `{"prompt", "chosen", "rejected"}` for DPO (reviews: the i-th of the first `count` fresh reviews against the i-th
    rotten one; debates: `debate_pairs`)."""
    from datasets import Dataset

    from ..workloads.data import debate_statements

    on_debates = workload.endswith("@debates")
    if not workload.startswith("dpo"):
        texts = debate_statements()[:count] if on_debates else [text for text, _ in reviews(count)]
        return Dataset.from_list([{"text": text} for text in texts])
    if on_debates:
        fresh, rotten = debate_pairs(count)
    else:
        rows = reviews(None)
        fresh = [text.split() for text, label in rows if label == 1][:count]
        rotten = [text.split() for text, label in rows if label == 0][:count]
    pairs = [{"prompt": " ".join(good[:4]), "chosen": " " + " ".join(good[4:]), "rejected": " " + " ".join(bad[4:])}
             for good, bad in zip(fresh, rotten) if len(good) > 5 and len(bad) > 5]
    return Dataset.from_list(pairs)


def build_trainer(workload: str, contender: str, settings: dict, output_dir: str, callbacks: list):
    """TRL's trainer or loopkit's for the workload: the same config, model, data and callbacks."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer()
    torch.manual_seed(settings["seed"])
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), max_position_embeddings=settings["max_length"],
                                         attention_dropout=0.0, pad_token_id=tok.pad_token_id, **settings["model"]))
    fields = dict(output_dir=output_dir, per_device_train_batch_size=settings["batch_size"],
                  max_length=settings["max_length"], max_steps=settings["warmup_steps"] + settings["timed_steps"],
                  logging_steps=settings["logging_steps"], learning_rate=settings["learning_rate"],
                  seed=settings["seed"], report_to="none", disable_tqdm=True, save_strategy="no", use_cpu=True,
                  dataloader_num_workers=0, bf16=False)  # fp32: TRL's configs default to bf16 autocast
    data = dataset(workload, settings["num_reviews"])
    kind = "dpo" if workload.startswith("dpo") else "sft"
    trainer_class = trainer_class_for(kind, contender)
    if kind == "sft":
        from trl import SFTConfig

        config = SFTConfig(packing=workload.startswith("sft-packed"), **fields)
        return trainer_class(model=model, args=config, train_dataset=data, processing_class=tok, callbacks=callbacks)
    from trl import DPOConfig

    reference = copy.deepcopy(model)
    config = DPOConfig(beta=0.1, loss_type=["sigmoid"], **fields)
    return trainer_class(model=model, ref_model=reference, args=config, train_dataset=data, processing_class=tok,
                         callbacks=callbacks)


def trainer_class_for(kind: str, contender: str):
    if contender == "trl":
        import trl

        return getattr(trl, TRAINER_NAMES[kind, contender])
    import loopkit.trl

    return getattr(loopkit.trl, TRAINER_NAMES[kind, contender])


def train_once(workload: str, contender: str, settings: dict, output_dir: str, threads: int = 1) -> dict:
    """One run in this (fresh) process: CPU ms per timed step, peak RSS (whole process and train() alone), losses."""
    import time

    import torch

    from ..contenders.clock import ClockCallback, StepClock, as_hf_callback
    from .eval_memory import current_rss_mb, peak_rss_mb, reset_peak_rss

    if threads > 0:
        torch.set_num_threads(threads)
    clock = StepClock()
    trainer = build_trainer(workload, contender, settings, output_dir, [as_hf_callback(ClockCallback(clock))])
    process_peak_before = peak_rss_mb(False)  # the lifetime mark so far (getrusage): imports, model, data
    reset = reset_peak_rss()
    rss_at_train = current_rss_mb()
    started = time.process_time()
    trainer.train()
    train_cpu = time.process_time() - started
    train_peak = peak_rss_mb(reset)
    warmup, timed = settings["warmup_steps"], settings["timed_steps"]
    ends = clock.cpu_ends
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"workload": workload, "contender": contender, "trainer": type(trainer).__name__,
            "global_step": trainer.state.global_step, "timed_steps": timed,
            "cpu_ms_per_step": (ends[-1] - ends[warmup - 1]) / timed * 1e3,
            "wall_ms_per_step": (clock.ends[-1] - clock.ends[warmup - 1]) / timed * 1e3,
            "train_cpu_s": train_cpu, "rss_at_train_mb": rss_at_train,
            "peak_rss_mb": max(process_peak_before, train_peak) if reset else peak_rss_mb(False),
            "train_peak_mb": train_peak - rss_at_train if reset else None,
            "peak_method": "VmHWM, reset before train()" if reset else "getrusage lifetime peak",
            "losses": losses, "log_history": [{k: v for k, v in entry.items() if not timing_key(k)}
                                              for entry in trainer.state.log_history],
            "load_average": os.getloadavg()[0]}


def timing_key(key: str) -> bool:
    """Keys of a log entry that differ between any two runs (wall-clock rates); every other key must agree."""
    return key == "train_runtime" or key.endswith("_per_second")


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def parity(reference: list, other: list, rtol: float = LOSS_RTOL) -> dict:
    """Do two log histories agree, entry by entry and key by key (numbers within `rtol` relative)? The largest
    relative difference of the losses, and the first disagreement found."""
    if [sorted(e) for e in reference] != [sorted(e) for e in other]:
        return {"ok": False, "detail": "different log entries or keys", "max_loss_relative": None}
    worst, problem = 0.0, None
    for index, (a, b) in enumerate(zip(reference, other)):
        for key in a:
            x, y = a[key], b[key]
            if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
                same, relative = x == y, 0.0 if x == y else float("inf")
            else:
                relative = 0.0 if x == y else abs(x - y) / max(abs(x), abs(y))
                same = relative <= rtol
            if key == "loss":
                worst = max(worst, relative)
            if not same and problem is None:
                problem = f"entry {index} {key}: {x!r} vs {y!r}"
    losses = sum("loss" in e for e in reference)
    detail = problem or f"{losses} logged losses and every other logged key equal within {rtol:g} relative"
    return {"ok": problem is None, "detail": detail, "max_loss_relative": worst}


def verdict(loopkit: list, trl: list, same_work: bool = True) -> dict:
    """loopkit against TRL on one measure, from paired rounds: "below TRL in every round" only when every round's
    loopkit / TRL ratio is under 1; rounds that disagree say how many rounds each way."""
    ratio = paired_ratio(loopkit, trl)
    rounds = len([1 for a, b in zip(loopkit, trl) if a is not None and b is not None])
    below = sum(1 for a, b in zip(loopkit, trl) if a is not None and b is not None and a < b)
    result = {"ratio": ratio, "rounds": rounds, "rounds_below": below, "below_every_round": False}
    if not same_work:
        return dict(result, text="no verdict: the contenders did not log the same numbers (not the same work)")
    if ratio is None:
        return dict(result, text="no verdict: no positive values to compare")
    span = f"{ratio['min']:.3f}-{ratio['max']:.3f}x" if rounds > 1 else f"{ratio['median']:.3f}x, one round"
    way = direction(ratio, 1.0)
    if way == -1:
        return dict(result, below_every_round=True, text=f"below TRL in every round ({span})")
    if way == 1:
        return dict(result, text=f"ABOVE TRL in every round ({span})")
    if way == 0:
        return dict(result, text="equal to TRL in every round")
    return dict(result, text=f"rounds disagree: below TRL in {below} of {rounds} rounds ({span}): no verdict")


def missing_trl() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("trl") else "trl is not installed (pip install -e '.[trl]')"


def run(suite) -> dict:
    missing = missing_trl()
    if missing:
        suite.say(f"trl: skipped: {missing}")
        return {"title": TITLE, "rows": [], "skipped": missing}
    settings = plan(suite)
    runs = {w: {c: [] for c in CONTENDERS} for w in settings["workloads"]}
    for round_index in range(settings["rounds"]):
        for workload in runs:
            for contender in CONTENDERS:  # alternated: trl, loopkit, trl, loopkit, ...
                load_before = os.getloadavg()[0]
                reply = suite.fresh(f"trl-{workload}-{contender}-{round_index}", MODULE, "train_once",
                                    workload=workload, contender=contender, settings=settings, threads=suite.threads,
                                    output_dir=suite.scratch_dir(f"trl-{workload}-{contender}"))
                reply["load_average_before"] = load_before
                runs[workload][contender].append(reply)
                suite.say(f"trl round {round_index + 1}/{settings['rounds']} {workload} {reply['trainer']}: "
                          f"{reply['cpu_ms_per_step']:.1f} ms CPU/step ({reply['wall_ms_per_step']:.1f} wall), peak "
                          f"RSS {reply['peak_rss_mb']:.0f} MB (train() +{fmt(reply['train_peak_mb'])}), load "
                          f"{load_before:.1f}-{reply['load_average']:.1f}")
    section = {"title": TITLE, "rows": [], "plan": settings, "runs": runs, "workloads": {}}
    for workload in runs:
        section["workloads"][workload] = summarise(runs[workload])
        for measure, result in section["workloads"][workload]["verdicts"].items():
            if not result["below_every_round"]:
                suite.say(f"trl {workload} {measure}: {result['text']}")
    return section


def summarise(runs: dict) -> dict:
    """One workload's parity per round and its verdict per measure."""
    checks = [parity(t["log_history"], k["log_history"]) for t, k in zip(runs["trl"], runs["loopkit"])]
    same_work = all(check["ok"] for check in checks)
    verdicts = {key: verdict([r[key] for r in runs["loopkit"]], [r[key] for r in runs["trl"]], same_work)
                for key, _, _ in MEASURES}
    return {"parity": checks, "same_work": same_work, "verdicts": verdicts}


def markdown(section: dict) -> str:
    if "skipped" in section:
        return f"Not run: {section['skipped']}."
    settings, runs = section["plan"], section["runs"]
    model = settings["model"]
    loads = [r[key] for w in runs.values() for c in w.values() for r in c
             for key in ("load_average_before", "load_average")]
    lines = [f"A {model['num_hidden_layers']}-layer, {model['hidden_size']}-wide Llama from a config (MiniLM's "
             f"30,522-token vocabulary), fp32, seed 0; batch {settings['batch_size']}, max_length "
             f"{settings['max_length']}, {settings['warmup_steps']} warm-up + {settings['timed_steps']} timed "
             f"optimizer steps, logging every {settings['logging_steps']}; the first {settings['num_reviews']:,} "
             f"Rotten Tomatoes reviews (DPO: as many fresh/rotten pairs), and as many 2016 debate statements (@debates; "
             f"DPO: each against the next); {settings['rounds']} round(s), each run a "
             f"fresh process, alternated TRL, loopkit; load average (1 min) {min(loads):.1f}-{max(loads):.1f} over "
             f"the runs. CPU: the process's CPU time per timed step (all threads). Peak RSS: the process's resident "
             f"high-water mark (VmHWM) at the end of train(), over its whole life and over train() alone (above "
             f"its resident set when train() began). Values: median (min-max of the rounds).", "",
             "| workload | measure | TRL's trainer | loopkit | loopkit / TRL, per round | verdict |",
             "|---|---|---|---|---|---|"]
    for workload in runs:
        label, summary = SHORT[workload], section["workloads"][workload]
        for key, name, unit in MEASURES:
            values = {c: [r[key] for r in runs[workload][c]] for c in CONTENDERS}
            result = summary["verdicts"][key]
            ratios = ", ".join(f"{a / b:.3f}" for a, b in zip(values["loopkit"], values["trl"]) if a and b)
            lines.append(f"| {label} | {name}, {unit} | " + " | ".join(
                with_range(median(values[c]), values[c]) for c in CONTENDERS) + f" | {ratios} | {result['text']} |")
    lines += ["", "Same work (TRL's log history against loopkit's, every key but the timing ones, per round):"]
    for workload in runs:
        checks = section["workloads"][workload]["parity"]
        lines.append(f"- {WORKLOADS[workload]}: " + ("; ".join(dict.fromkeys(c["detail"] for c in checks)))
                     + f"; largest relative loss difference {max(c['max_loss_relative'] or 0 for c in checks):.1e}.")
    disagree = [f"{WORKLOADS[w]}, {name}" for w in runs for key, name, _ in MEASURES
                if not section["workloads"][w]["verdicts"][key]["below_every_round"]]
    lines += ["", "Rounds where loopkit is not below TRL, or that disagree: " + ("; ".join(disagree) or "none") + ".",
              "", rounds_table(section)]
    return "\n".join(lines)


def rounds_table(section: dict) -> str:
    """Every run: its round, load average before and after, CPU per step, wall per step, peak RSS."""
    lines = ["| round | workload | contender | load before-after | CPU ms/step | wall ms/step | peak RSS MB | "
             "train() RSS growth MB |", "|---|---|---|---|---|---|---|---|"]
    runs = section["runs"]
    for index in range(section["plan"]["rounds"]):
        for workload in runs:
            for contender in CONTENDERS:
                r = runs[workload][contender][index]
                lines.append(f"| {index + 1} | {workload} | {r['trainer']} | {r['load_average_before']:.1f}-"
                             f"{r['load_average']:.1f} | {fmt(r['cpu_ms_per_step'])} | {fmt(r['wall_ms_per_step'])} "
                             f"| {fmt(r['peak_rss_mb'])} | {fmt(r['train_peak_mb'])} |")
    return "\n".join(lines)


def chart(section: dict, plt):
    return None  # the table gives every round
