"""The stage in examples/stages/, written against the stage contract only: each is exercised on a small run
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
    run, _ = small_run(tmp_path, [stage], args=args, model=policy)
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
