"""Issue 14: per-step work hoisted off the hot path keeps exact results.

The NaN/Inf filter of the logged loss now runs where the sum is read (`RunningLoss.settle`), not per micro-batch;
the column filter takes a fast lane for rows with nothing to drop. Both are compared here, value for value, with
the per-micro-batch / per-row versions they replace (HF's rules).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from loopkit.batches import without_columns
from loopkit.schedule import UNSETTLED_RUN, RunningLoss
from loopkit.columns import RemoveColumnsCollator


class OneProcess:
    num_processes = 1


def hf_running_sums(start, micro_losses, steps, reads, last_logged_step):
    """HF's `_tr_loss` with `logging_nan_inf_filter`, one micro-batch at a time: a NaN/Inf loss adds the running
    mean since the last log instead. Returns the logged mean at each read (reads come after the index's micro-batch
    and end its optimizer step)."""
    since_log, means, logged = torch.full((), start), [], last_logged_step
    for index, (loss, step) in enumerate(zip(micro_losses, steps)):
        since = 1 + step - logged
        since_log += torch.where(torch.isfinite(loss), loss, since_log / since)
        if index in reads:
            means.append(since_log.item() / (step + 1 - logged))
            since_log.zero_()
            logged = step + 1
    return means


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["finite", "nan-and-inf", "long-between-logs"])
def test_nan_filter_at_the_read_equals_hfs_per_micro_batch_filter(pattern, dtype):
    rng = random.Random(0)
    count = 3 * UNSETTLED_RUN + 7 if pattern == "long-between-logs" else 200
    grad_accum = 2
    values = [rng.uniform(0.1, 3.0) for _ in range(count)]
    if pattern != "finite":
        for index in rng.sample(range(count), 9):
            values[index] = rng.choice([math.nan, math.inf, -math.inf])
    losses = [torch.tensor(v, dtype=dtype) for v in values]
    steps = [index // grad_accum for index in range(count)]  # the global step before each micro-batch
    reads = {count - 1} if pattern == "long-between-logs" else {39, 99, 101, count - 1}
    expected = hf_running_sums(0.25, losses, steps, reads, last_logged_step=0)

    running = RunningLoss()
    running.start("cpu", 0, {"tr_loss": 0.25, "last_logged_step": 0}, nan_inf_filter=True)
    got = []
    for index, (loss, step) in enumerate(zip(losses, steps)):
        running.add(loss, step)
        if index == 60:  # a checkpoint in between reads the sum too, and must not change what follows
            running.state_dict()
        if index in reads:
            got.append(running.read_for_log(OneProcess(), step + 1))
    assert got == expected and all(math.isfinite(mean) for mean in got)  # bit for bit
    if pattern == "long-between-logs":
        assert len(running.unsettled) == 0


def test_column_filter_fast_lane_matches_the_per_key_filter():
    from transformers import BatchEncoding

    keep = {"input_ids", "attention_mask", "labels"}
    rows = [{"input_ids": [1, 2], "labels": 1}, {"input_ids": [3], "text": "dropped", "labels": 0},
            BatchEncoding({"input_ids": [4], "attention_mask": [1]}),
            BatchEncoding({"input_ids": [5], "token_type_ids": [0]}), ("not", "a", "mapping")]
    seen = []
    collator = RemoveColumnsCollator(lambda features: seen.extend(features) or features, keep)
    collator(rows)
    reference = [{k: v for k, v in dict(row).items() if k in keep} if not isinstance(row, tuple) else row
                 for row in rows]
    assert seen == reference and [type(f) for f in seen] == [dict] * 4 + [tuple]
    assert all(f is not row for f, row in zip(seen[:4], rows))  # copies: a collator popping keys spares the rows
    assert [without_columns(row, keep) for row in rows] == reference


def test_flops_counted_once_per_shape_equal_hfs_count_with_an_uneven_last_batch(tmp_path):
    """`total_flos` (HF's 6 x tokens x non-embedding parameters, per micro-batch) from the per-shape cache equals HF
    Trainer's, run live, over batches of 4, 4 and 2 rows; an overridden `floating_point_ops` is still called for
    every micro-batch."""
    from transformers import Trainer

    from helpers import hf_args, lm_data, tiny_llama
    from loopkit import Loop

    args = dict(max_steps=3, per_device_train_batch_size=4, logging_steps=1, save_strategy="no")
    hf = Trainer(model=tiny_llama(), args=hf_args(tmp_path / "hf", **args), train_dataset=lm_data(10))
    hf.train()
    loop = Loop(model=tiny_llama(), args=hf_args(tmp_path / "lk", **args), train_dataset=lm_data(10))
    loop.train()
    assert loop.state.total_flos == hf.state.total_flos > 0
    assert len(loop.step.work_by_shape) == 2  # batches of 4 and of 2 rows

    calls = []

    class CountingLoop(Loop):
        def floating_point_ops(self, inputs):
            calls.append(inputs["input_ids"].shape[0])
            return 1

    counting = CountingLoop(model=tiny_llama(), args=hf_args(tmp_path / "c", **args), train_dataset=lm_data(10))
    counting.train()
    assert calls == [4, 4, 2] and counting.state.total_flos == 3
