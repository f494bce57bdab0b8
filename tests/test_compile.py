"""torch.compile: a packed or bucketed run compiles a bounded number of graphs, bucketing leaves the loss as it is,
and the run report counts the compilations and their time apart from the step phases (loopkit/compilation.py).

The backend is "eager" (dynamo traces, nothing is code-generated): the counts are dynamo's, and the test stays fast.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import tiny_llama

from loopkit import Loop, LoopArgs
from loopkit.args import LoopConfigError
from loopkit.stages.data import DataStage
from loopkit.stages.packing import PackingDataStage

WORDS = [f"w{i}" for i in range(59)]  # with the 5 special tokens: tiny_llama's 64-token vocabulary


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def ragged_samples(n: int, shortest: int, longest: int, seed: int = 0) -> list[dict]:
    """Token-id samples of many different lengths (ids 5-63: no special token)."""
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(5, 64) for _ in range(rng.randrange(shortest, longest + 1))]}
            for _ in range(n)]


def compile_args(tmp_path, name: str, **fields) -> LoopArgs:
    return LoopArgs(output_dir=str(tmp_path / name), torch_compile=True, torch_compile_backend="eager",
                    per_device_train_batch_size=4, learning_rate=1e-3, save_strategy="no", disable_tqdm=True,
                    report_to="none", **fields)


def compile_report(loop) -> dict:
    with open(f"{loop.args.output_dir}/run_report.json") as f:
        report = json.load(f)
    seconds = report["time_by_phase"]["seconds"]
    assert seconds["compile"] == pytest.approx(report["compile"]["seconds"], abs=1e-5) and seconds["compile"] > 0
    # Compile time is left out of the phase it fell in (forward, mostly): each second is counted once.
    assert sum(seconds.values()) == pytest.approx(report["total_seconds"], rel=1e-4)
    return report["compile"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each run starts from dynamo's empty cache: counts do not depend on which test ran before."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_100_step_packed_run_compiles_a_bounded_number_of_graphs(tmp_path):
    # 402 samples of 3-30 tokens pack into rows of 32 tokens; the last batch holds fewer rows (a new batch size).
    samples = ragged_samples(402, 3, 30)
    args = compile_args(tmp_path, "packed", max_steps=100, logging_steps=50)
    loop = Loop(tiny_llama(), args, train_dataset=samples, data=PackingDataStage(row_tokens=32))
    assert len(loop.get_train_dataloader()) * 4 > len(loop.data.rows) > (len(loop.get_train_dataloader()) - 1) * 4
    loop.train()
    compiled = compile_report(loop)
    print(f"packed, 100 steps: {compiled['compilations']} compilations, {compiled['seconds']:.2f} s")
    assert 1 <= compiled["compilations"] <= 3
    assert "torch.compile: " in open(tmp_path / "packed" / "run_report.md").read()


def test_bucketed_padding_keeps_the_loss_and_bounds_the_shapes(tmp_path):
    """`DataStage(compile_pad_to_multiple_of=64)`: every batch of samples of 4-60 tokens has 64 tokens (one shape
    but for the short last batch), the loss per step is the one of the collator's own padding, and the graph count
    is bounded; without bucketing the run meets many lengths."""
    from transformers import DataCollatorForLanguageModeling

    tokenizer = word_tokenizer()
    samples = ragged_samples(4 * 30 + 2, 4, 60, seed=1)  # 31 batches, the last one of 2 samples
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    runs = {}
    for name, multiple in (("bucketed", 64), ("unbucketed", None)):
        torch._dynamo.reset()  # dynamo remembers which dimensions changed in the other run
        args = compile_args(tmp_path, name, num_train_epochs=1, logging_steps=1)
        loop = Loop(tiny_llama(), args, train_dataset=samples, data_collator=collator,
                    data=DataStage(compile_pad_to_multiple_of=multiple))
        loop.train()
        lengths = {batch["input_ids"].shape for batch in loop.get_train_dataloader()}
        runs[name] = ([h["loss"] for h in loop.state.log_history if "loss" in h], lengths, compile_report(loop))
        print(f"{name}: {len(lengths)} batch shapes, {runs[name][2]['compilations']} compilations, "
              f"{runs[name][2]['seconds']:.2f} s")
    assert collator.pad_to_multiple_of is None  # the user's collator is left alone
    bucketed, unbucketed = runs["bucketed"], runs["unbucketed"]
    assert bucketed[1] == {torch.Size([4, 64]), torch.Size([2, 64])}
    assert len(unbucketed[1]) > 10
    assert len(bucketed[0]) == 31 and bucketed[0] == pytest.approx(unbucketed[0], rel=1e-5, abs=1e-6)
    # Bucketed: the one shape, then the short last batch (2 measured). Unbucketed: the first length, the second one
    # (dynamo then makes the length dynamic), the short last batch (3 measured): bounded too, by dynamo.
    assert 1 <= bucketed[2]["compilations"] <= 2
    assert bucketed[2]["compilations"] < unbucketed[2]["compilations"] <= 3


def test_a_user_collator_pad_multiple_is_kept_and_a_bad_multiple_is_refused(tmp_path):
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(word_tokenizer(), mlm=False, pad_to_multiple_of=8)
    loop = Loop(tiny_llama(), compile_args(tmp_path, "own", max_steps=1), train_dataset=ragged_samples(8, 4, 20),
                data_collator=collator, data=DataStage(compile_pad_to_multiple_of=64))
    assert {batch["input_ids"].shape[1] % 8 for batch in loop.get_train_dataloader()} == {0}
    assert any(batch["input_ids"].shape[1] < 64 for batch in loop.get_train_dataloader())
    plain = Loop(tiny_llama(), compile_args(tmp_path, "default", max_steps=1), train_dataset=ragged_samples(8, 4, 20),
                 data_collator=DataCollatorForLanguageModeling(word_tokenizer(), mlm=False))
    assert any(batch["input_ids"].shape[1] % 8 for batch in plain.get_train_dataloader())  # no buckets by default
    with pytest.raises(LoopConfigError, match="compile_pad_to_multiple_of=0"):
        DataStage(compile_pad_to_multiple_of=0)


def test_a_run_after_a_compiled_one_in_the_same_process_is_not_compiled(tmp_path):
    """Accelerate keeps one state per process, with the first Accelerator's compile settings: a later Loop without
    torch_compile (a notebook, a test suite) must still train its model uncompiled."""
    from torch._dynamo.eval_frame import OptimizedModule

    data = ragged_samples(8, 4, 12)
    compiled = Loop(tiny_llama(), compile_args(tmp_path, "compiled", max_steps=1), train_dataset=data,
                    data=PackingDataStage(row_tokens=32))
    compiled.train()
    assert isinstance(compiled.model_wrapped, OptimizedModule)
    plain_args = LoopArgs(output_dir=str(tmp_path / "plain"), per_device_train_batch_size=4, max_steps=2,
                          save_strategy="no", disable_tqdm=True, report_to="none")
    plain = Loop(tiny_llama(), plain_args, train_dataset=data, data=PackingDataStage(row_tokens=32))
    plain.train()
    assert not isinstance(plain.model_wrapped, OptimizedModule)
    with open(tmp_path / "plain" / "run_report.json") as f:
        assert json.load(f)["compile"] is None
