"""The ladder's workload (benchmarks 7 and 8): its texts and their sizes (`DATASETS`), its rungs (`RUNGS`), the
plan per suite size, and the model and packed rows every rung trains on. benchmarks/suite/ladder.py runs it.
"""

from __future__ import annotations


DATASET = "reviews"


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
    "hamlet": {"label": "Hamlet's speeches", "num_train": (224, 128, 24), "num_heldout": (128, 64, 8),
               "max_length": (128, 128, 112), "row_tokens": (560, 576, 160)},
}


# name -> (label, what it is). Order: the alternation within a round, and the table's rows.
RUNGS = {
    "hf-default": ("HF Trainer default", "padding collator (DataCollatorForLanguageModeling, labels -100 at pads)"),
    "hf-best": ("HF Trainer best", "DataCollatorWithFlattening + torch_compile=True (use_cache=False: Trainer's "
                "default in 5.x)"),
    "hf-best-cache": ("HF flattening with use_cache=True", "DataCollatorWithFlattening with TrainingArguments("
                      "use_cache=True), not compiled: a correctness rung (its loss and logits)"),
    "hf-group": ("HF Trainer + length grouping", "the padding collator + train_sampling_strategy='group_by_length': "
                 "the reference of loopkit's length grouping (the same batches in the same order)"),
    "raw": ("hand-written loop", "packed rows + torch.compile + use_cache=False, written by hand"),
    "loopkit-pad": ("loopkit: padding", "the padding collator (the HF default's)"),
    "loopkit-group": ("loopkit: + length grouping", "train_sampling_strategy='group_by_length' (HF's order)"),
    "loopkit-pack": ("loopkit: packing", "PackingDataStage(row_tokens=...) instead of padding"),
    "loopkit-compile": ("loopkit: packing + compile", "torch_compile=True"),
    "loopkit-chunked": ("loopkit: + chunked loss", "step=ChunkedLossStep()"),
    "loopkit-per-text": ("loopkit: + per-text attention", "use_per_text_attention(model): each packed text's "
                         "attention computed alone, not the whole row's under a block mask"),
    "loopkit-checkpointing": ("loopkit: packing + chunked loss + gradient checkpointing",
                              "gradient_checkpointing=True, not compiled (memory vs speed)"),
}


# The correctness and memory rungs are not compiled: compiling them costs minutes of the 15-minute budget and
# measures nothing the compiled rungs do not.
COMPILED = ("hf-best", "raw", "loopkit-compile", "loopkit-chunked", "loopkit-per-text")


PACKED_ROWS = ("raw", "loopkit-pack", "loopkit-compile", "loopkit-chunked", "loopkit-per-text",
               "loopkit-checkpointing")


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

    from .data import debate_statements, hamlet_speeches, rotten_tomatoes_rows
    from .models import minilm_path, quiet_transformers

    quiet_transformers()
    from transformers import AutoTokenizer

    texts = {"reviews": lambda: [text for text, _ in rotten_tomatoes_rows()], "debates": debate_statements,
             "hamlet": hamlet_speeches}[plan["dataset"]]()
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
