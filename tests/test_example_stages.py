"""The two stages in examples/stages/, written against the stage contract only: each is exercised on a small run
state (no `Loop`) and in a `Loop` run."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from loopkit import Loop, LoopArgs
from loopkit.stages.data import Window

from helpers import lm_data, small_run, tiny_llama

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "stages"))

import dpo_step  # noqa: E402  (examples/stages/dpo_step.py)
import packing  # noqa: E402  (examples/stages/packing.py)


def ragged_samples(n: int, seed: int = 0) -> list[dict]:
    """Causal-LM samples of 3 to 12 tokens (labels = input ids)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(3, 13, (1,), generator=g))
        ids = torch.randint(1, 64, (length,), generator=g)
        samples.append({"input_ids": ids, "labels": ids.clone()})
    return samples


# ---------------------------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------------------------
def test_packed_rows_hold_every_token_once_with_positions_and_labels_per_sample():
    samples = ragged_samples(20)
    rows = packing.pack_samples(samples, row_tokens=16)
    assert sorted(i for row in rows for i in row) == list(range(20))  # every sample once, none split
    assert all(sum(len(samples[i]["input_ids"]) for i in row) <= 16 for row in rows)
    row = packing.packed_row(samples, rows[0], 16, pad_id=0)
    start = 0
    for i in rows[0]:
        n = len(samples[i]["input_ids"])
        assert row["position_ids"][start:start + n].tolist() == list(range(n))
        assert row["input_ids"][start:start + n].tolist() == samples[i]["input_ids"].tolist()
        assert row["labels"][start].item() == -100  # no prediction across the boundary
        assert row["labels"][start + 1:start + n].tolist() == samples[i]["labels"][1:].tolist()
        start += n
    assert (row["labels"][start:] == -100).all()
    with pytest.raises(ValueError, match="row_tokens=4: sample .* samples are never split"):
        packing.pack_samples(samples, row_tokens=4)


def test_a_packed_batch_computes_exactly_what_the_padded_samples_do():
    """Per-sample logits equal the sample run alone, and the token-mean loss equals the padded batch's."""
    model = tiny_llama().eval()
    samples = ragged_samples(6, seed=1)
    row_indices = packing.pack_samples(samples, row_tokens=40)
    batch = packing.collate_packed_rows([packing.packed_row(samples, r, 40, 0) for r in row_indices])
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        for r, indices in enumerate(row_indices):
            start = 0
            for i in indices:
                n = len(samples[i]["input_ids"])
                alone = model(input_ids=samples[i]["input_ids"][None], use_cache=False).logits[0]
                assert (logits[r, start:start + n] - alone).abs().max().item() < 1e-5
                start += n
        tokens = sum(len(s["input_ids"]) - 1 for s in samples)  # predicted tokens (each sample's first is not)
        packed = model(**batch, num_items_in_batch=torch.tensor(tokens)).loss
        width = max(len(s["input_ids"]) for s in samples)
        padded = {"input_ids": torch.zeros(6, width, dtype=torch.long),
                  "attention_mask": torch.zeros(6, width, dtype=torch.long),
                  "labels": torch.full((6, width), -100)}
        for j, s in enumerate(samples):
            n = len(s["input_ids"])
            padded["input_ids"][j, :n], padded["attention_mask"][j, :n] = s["input_ids"], 1
            padded["labels"][j, :n] = s["labels"]
        reference = model(**padded, num_items_in_batch=torch.tensor(tokens)).loss
    assert packed.item() == pytest.approx(reference.item(), rel=1e-5)


def test_the_packing_stage_alone_serves_packed_windows(tmp_path):
    stage = packing.PackingDataStage(row_tokens=16)
    args = LoopArgs(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    num_train_epochs=1, report_to="none")
    samples = ragged_samples(20)
    run = small_run(tmp_path, [stage], args=args, model=tiny_llama(), train_dataset=samples)
    run.label_names = ["labels"]
    run.train_dataloader = stage.get_train_dataloader()
    plan = stage.plan(run.train_dataloader)
    batches = [b for window in stage.windows(0, plan, None) for b in window.batches]
    assert len(batches) == plan.steps_in_epoch == (len(stage.rows) + 1) // 2
    assert all(b["input_ids"].shape[1] == 16 and b["use_cache"] is False and "attention_mask" not in b
               for b in batches)
    real = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert real == sum(len(s["input_ids"]) - 1 for s in samples)


def test_a_loop_trains_with_the_packing_stage(tmp_path):
    samples = ragged_samples(40)
    args = LoopArgs(output_dir=str(tmp_path), per_device_train_batch_size=4, num_train_epochs=3,
                    learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True)
    loop = Loop(tiny_llama(), args, train_dataset=samples, data=packing.PackingDataStage(row_tokens=24))
    loop.train()
    losses = [h["loss"] for h in loop.state.log_history if "loss" in h]
    assert loop.state.global_step == 3 * -(-len(loop.data.rows) // 4) and len(losses) == loop.state.global_step
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------------------------------------------
# Preference training with a frozen reference
# ---------------------------------------------------------------------------------------------------------------
def preference_batch(n: int, length: int = 10, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for side in ("chosen", "rejected"):
        batch[f"{side}_ids"] = torch.randint(1, 64, (n, length), generator=g)
        batch[f"{side}_attention_mask"] = torch.ones(n, length, dtype=torch.long)
        batch[f"{side}_response_mask"] = torch.cat([torch.zeros(n, 4), torch.ones(n, length - 4)], 1)
    batch["weight"] = torch.rand(n, generator=g) + 0.5
    return batch


def test_the_preference_step_alone_takes_a_dpo_step_against_a_frozen_reference(tmp_path):
    policy = tiny_llama()
    reference = copy.deepcopy(policy)
    policy.lm_head.weight.data += 0.01  # policy and reference differ, so the margin is not zero
    stage = dpo_step.PreferenceStep(reference, beta=0.5)
    args = LoopArgs(output_dir=str(tmp_path), learning_rate=1e-2, gradient_accumulation_steps=2,
                    remove_unused_columns=False, report_to="none")
    run = small_run(tmp_path, [stage], args=args, model=policy)
    stage.prepare(max_steps=1, checkpoint=None)
    batches = [preference_batch(3, seed=s) for s in (0, 1)]
    start, reference_before = copy.deepcopy(policy), copy.deepcopy(reference)
    with torch.no_grad():
        expected = sum((-torch.nn.functional.logsigmoid(0.5 * dpo_step.dpo_margin(start, reference, b))
                        * b["weight"]).mean() for b in batches) / 2  # per-batch means, divided by the window
    result = stage.run_step(Window(batches, 0), epoch=0, steps_in_epoch=2)
    assert sum(result.losses).item() == pytest.approx(expected.item(), rel=1e-5)
    assert run.state.global_step == 1
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), start.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(reference.parameters(), reference_before.parameters()))
    assert all(p.grad is None for p in reference.parameters())
