"""Padding-free packing (`loopkit.PackingDataStage`, loopkit/stages/packing.py): rows, exactness against padding,
sample isolation, the setup check, a user's `DataCollatorWithFlattening`, iterable data and exact resume."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertForMaskedLM, DataCollatorWithFlattening

from loopkit import Loop, LoopArgs, PackingDataStage
from loopkit import row_packing as packing

from helpers import small_run, tiny_llama, wait_for

datasets = pytest.importorskip("datasets")


def ragged_samples(n: int, seed: int = 0) -> list[dict]:
    """Causal-LM samples of 3 to 12 tokens, labels = input ids with an occasional -100 (a masked prompt token)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(3, 13, (1,), generator=g))
        ids = torch.randint(1, 64, (length,), generator=g)
        labels = ids.clone()
        labels[1] = -100 if length > 6 else labels[1]
        samples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return samples


def pad_collator(features) -> dict:
    """The padded reference: right padding, attention mask, -100 labels on the padding."""
    width = max(len(f["input_ids"]) for f in features)
    batch = {"input_ids": torch.zeros(len(features), width, dtype=torch.long),
             "attention_mask": torch.zeros(len(features), width, dtype=torch.long),
             "labels": torch.full((len(features), width), -100)}
    for j, f in enumerate(features):
        n = len(f["input_ids"])
        batch["input_ids"][j, :n] = torch.as_tensor(f["input_ids"])
        batch["attention_mask"][j, :n] = 1
        batch["labels"][j, :n] = torch.as_tensor(f["labels"])
    return batch


def quiet_args(tmp_path, **kwargs) -> LoopArgs:
    kwargs.setdefault("learning_rate", 1e-2)
    return LoopArgs(output_dir=str(tmp_path), report_to="none", disable_tqdm=True, logging_steps=1,
                    save_strategy="no", **kwargs)


def losses(loop) -> list[float]:
    return [h["loss"] for h in loop.state.log_history if "loss" in h]


def tiny_bert(dropout: float = 0.1):
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=dropout,
                                      attention_probs_dropout_prob=dropout))


# ---------------------------------------------------------------------------------------------------------------
# Rows
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
        assert row["input_ids"][start:start + n].tolist() == samples[i]["input_ids"]
        assert row["labels"][start].item() == -100  # no prediction across the boundary
        assert row["labels"][start + 1:start + n].tolist() == samples[i]["labels"][1:]
        start += n
    assert (row["labels"][start:] == -100).all()
    with pytest.raises(ValueError, match="row_tokens=4: sample .* samples are never split"):
        packing.pack_samples(samples, row_tokens=4)
    with pytest.raises(ValueError, match="row_tokens=0: a row holds"):
        PackingDataStage(row_tokens=0)
    with pytest.raises(ValueError, match="pack='rows': packing is across the dataset or within each batch"):
        PackingDataStage(pack="rows")


def test_a_stream_packs_in_order_into_rows_of_the_budget():
    samples = ragged_samples(15)  # token ids 1..63: the padding id 0 marks each row's padding
    rows = list(packing.PackedStream(samples, row_tokens=16))
    assert all(r["input_ids"].shape == (16,) for r in rows)
    kept = [t for r in rows for t in r["input_ids"].tolist() if t != 0]
    assert kept == [t for s in samples for t in s["input_ids"]]  # stream order, nothing lost
    starts = sum(int((r["position_ids"] == 0).sum()) for r in rows)
    assert len(samples) <= starts <= len(samples) + len(rows)  # each sample restarts (+ one padding segment)
    for r, nxt in zip(rows, rows[1:]):  # next-fit: a row closes only when the next sample does not fit
        first = int(nxt["position_ids"][1:].eq(0).nonzero()[0]) + 1 if nxt["position_ids"][1:].eq(0).any() else 16
        assert int(r["input_ids"].ne(0).sum()) + first > 16


# ---------------------------------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------------------------------
def test_a_sample_never_attends_across_a_boundary():
    """Change one sample of a packed row: the other samples' logits do not move; the changed one's do."""
    model = tiny_llama().eval()
    samples = ragged_samples(4, seed=3)
    changed = [dict(s) for s in samples]
    changed[1] = {"input_ids": [(t + 7) % 63 + 1 for t in samples[1]["input_ids"]], "labels": samples[1]["labels"]}
    width = sum(len(s["input_ids"]) for s in samples) + 3
    with torch.no_grad():
        logits = [model(**{k: v for k, v in packing.collate_packed_rows(
            [packing.packed_row(data, range(4), width, 0)]).items() if k != "labels"}).logits[0] for data in
            (samples, changed)]
    bounds = [0]
    for s in samples:
        bounds.append(bounds[-1] + len(s["input_ids"]))
    for i in range(4):
        difference = (logits[0][bounds[i]:bounds[i + 1]] - logits[1][bounds[i]:bounds[i + 1]]).abs().max().item()
        assert (difference > 1e-3) if i == 1 else (difference == 0.0), (i, difference)


def test_packed_training_equals_padded_training_with_the_same_samples_per_step(tmp_path):
    """`pack="batch"` packs each padded batch's samples: loss per real token after one step within 1e-5
    (relative), weights after 20 steps with accumulation within float tolerance; the data is a `datasets.Dataset`."""
    data = datasets.Dataset.from_list(ragged_samples(48))
    common = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=20)
    padded = Loop(tiny_llama(), quiet_args(tmp_path / "padded", **common), train_dataset=data,
                  data_collator=pad_collator)
    padded.train()
    packed = Loop(tiny_llama(), quiet_args(tmp_path / "packed", **common), train_dataset=data,
                  data=PackingDataStage(row_tokens=20, pack="batch"))
    packed.train()
    assert losses(packed)[0] == pytest.approx(losses(padded)[0], rel=1e-5)
    assert losses(packed)[-1] < losses(packed)[0] - 0.1  # it trained
    for (name, p), q in zip(padded.model.named_parameters(), packed.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)


def test_a_user_flattening_collator_is_made_exact(tmp_path):
    """HF's `DataCollatorWithFlattening` gets `use_cache=False`: its first step's loss is the padded one's."""
    data = ragged_samples(8)
    results = {}
    for name, collator in (("padded", pad_collator), ("flattened", DataCollatorWithFlattening())):
        loop = Loop(tiny_llama(), quiet_args(tmp_path / name, per_device_train_batch_size=8, max_steps=1),
                    train_dataset=data, data_collator=collator)
        batch = next(iter(loop.get_train_dataloader()))
        loop.train()
        results[name] = (batch, losses(loop)[0])
    assert results["flattened"][0]["use_cache"] is False and "attention_mask" not in results["flattened"][0]
    assert results["flattened"][1] == pytest.approx(results["padded"][1], rel=1e-5)


class CrossingLM(torch.nn.Module):
    """A causal LM whose attention ignores position_ids (a causal mask over the whole row), so two packed samples
    see each other under every transformers version: it needs none of transformers' attention code."""

    def __init__(self, vocab_size=64, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.config = type("Config", (), {"vocab_size": vocab_size, "_attn_implementation": "causal over the row"})()
        self.embed, self.positions = torch.nn.Embedding(vocab_size, width), torch.nn.Embedding(64, width)
        self.attention = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.head = torch.nn.Linear(width, vocab_size)

    def forward(self, input_ids, position_ids=None, labels=None, use_cache=None, attention_mask=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None].expand_as(input_ids)
        hidden = self.embed(input_ids) + self.positions(position_ids)
        causal = torch.ones(input_ids.shape[1], input_ids.shape[1], dtype=torch.bool).triu(1)
        hidden = hidden + self.attention(hidden, hidden, hidden, attn_mask=causal, need_weights=False)[0]
        logits = self.head(hidden)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return type("Output", (), {"loss": loss, "logits": logits})()


def test_a_model_whose_attention_crosses_samples_is_refused(tmp_path):
    """Checked on what the model does (its packed logits), not on a transformers version."""
    assert packing.packed_logits_error(CrossingLM()) > 1e-3
    for collator, stage in ((None, PackingDataStage(row_tokens=32)), (DataCollatorWithFlattening(), None)):
        loop = Loop(CrossingLM(), quiet_args(tmp_path, max_steps=1), train_dataset=ragged_samples(8),
                    data_collator=collator, data=stage)
        with pytest.raises(ValueError, match=r"model='CrossingLM .*attention crosses sample boundaries"):
            loop.train()
    assert packing.packed_logits_error(tiny_llama()) < 1e-6


def test_bert_packs_where_its_attention_keeps_samples_apart(tmp_path):
    """BERT (sdpa) reads restarting position_ids as sample boundaries in transformers 5.25, not in 5.24: whatever
    the installed version does, loopkit follows the model's behaviour. Exact: packed training gives the padded
    loss (dropout off: its masks would differ between the two layouts); crossing: refused."""
    data = ragged_samples(8)
    if packing.packed_logits_error(tiny_bert()) <= 1e-5:
        def padded_like_flattening(features):  # the flattening collator masks each sample's first label
            batch = pad_collator(features)
            batch["labels"][:, 0] = -100
            return batch

        results = {}
        for name, collator in (("padded", padded_like_flattening), ("flattened", DataCollatorWithFlattening())):
            args = quiet_args(tmp_path / name, per_device_train_batch_size=8, max_steps=1)
            loop = Loop(tiny_bert(dropout=0.0), args, train_dataset=data, data_collator=collator)
            loop.train()
            results[name] = losses(loop)[0]
        assert results["flattened"] == pytest.approx(results["padded"], rel=1e-5)
    else:
        loop = Loop(tiny_bert(), quiet_args(tmp_path, max_steps=1), train_dataset=data,
                    data_collator=DataCollatorWithFlattening())
        with pytest.raises(ValueError, match=r"model='BertForMaskedLM .*attention crosses sample boundaries"):
            loop.train()


# ---------------------------------------------------------------------------------------------------------------
# Loop runs: dataset-wide packing, iterable data, exact resume
# ---------------------------------------------------------------------------------------------------------------
def test_the_packing_stage_alone_serves_packed_windows(tmp_path):
    stage = PackingDataStage(row_tokens=16)
    args = LoopArgs(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                    num_train_epochs=1, report_to="none")
    samples = ragged_samples(20)
    run, _ = small_run(tmp_path, [stage], args=args, model=tiny_llama(), train_dataset=samples)
    run.label_names = ["labels"]
    run.train_dataloader = stage.get_train_dataloader()
    plan = stage.plan(run.train_dataloader)
    batches = [b for window in stage.windows(0, plan, None) for b in window.batches]
    assert len(batches) == plan.steps_in_epoch == (len(stage.rows) + 1) // 2
    assert all(b["input_ids"].shape[1] == 16 and b["use_cache"] is False and "attention_mask" not in b
               for b in batches)
    real = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert real == sum(sum(t != -100 for t in s["labels"][1:]) for s in samples)


class Stream(torch.utils.data.IterableDataset):
    """A stream that cannot seek: a resumed run re-reads and discards what it trained."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def source(kind: str, n: int = 40):
    samples = ragged_samples(n)
    if kind == "map":
        return samples
    if kind == "stream":
        return Stream(samples)
    return datasets.Dataset.from_list(samples).to_iterable_dataset(num_shards=2)


@pytest.mark.filterwarnings("ignore:Resuming mid-epoch on an iterable dataset that cannot seek")
@pytest.mark.parametrize("kind", ["map", "hf_iterable", "stream"])
def test_an_interrupted_packed_run_resumes_bit_identical(tmp_path, kind):
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6)
    whole = Loop(tiny_llama(), quiet_args(tmp_path / "whole", **common), train_dataset=source(kind),
                 data=PackingDataStage(row_tokens=24))
    whole.train()
    args = quiet_args(tmp_path / "cut", **common)
    args.save_strategy, args.save_steps = "steps", 3
    first = Loop(tiny_llama(), args, train_dataset=source(kind), data=PackingDataStage(row_tokens=24))
    first.train()
    resumed = Loop(tiny_llama(seed=1), args, train_dataset=source(kind), data=PackingDataStage(row_tokens=24))
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert losses(resumed)[-3:] == losses(whole)[-3:]
    assert all(torch.equal(p, q) for p, q in zip(whole.model.parameters(), resumed.model.parameters()))
    assert losses(whole)[-1] < losses(whole)[0]
    if kind == "hf_iterable":  # the resume seeked the stream, and a sample read but not yet placed waited
        state = json.loads((tmp_path / "cut" / "checkpoint-3" / "loopkit_state.json").read_text())
        assert state["data"]["position"]["dataset_state"]["pending"] is not None


def test_two_processes_train_the_packed_model_of_one_process(tmp_path, forked):
    """2 gloo processes x per-device batch 4 = 1 process x batch 8, each batch packed on its own: the ranks hold
    different token counts, so equal weights need the window's count summed across ranks. The ranks are what
    `torchrun --nproc_per_node 2` starts, forked from the session's fork server (helpers.ForkServer.launch)."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "packing_dist_child.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launch = forked.launch([script, tmp_path / "two"], 2, "the 2-process packing launch", env=env)
    spec = importlib.util.spec_from_file_location("packing_dist_child", script)
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    one = child.train(str(tmp_path / "one"))  # the reference, while the launch runs
    output = wait_for(launch, "the 2-process packing launch")
    assert launch.returncode == 0, output[-3000:]
    expected = {name: p.detach() for name, p in one.model.named_parameters()}
    assert json.loads((tmp_path / "two" / "losses_rank0.json").read_text()) == pytest.approx(
        [h["loss"] for h in one.state.log_history if "loss" in h], rel=1e-5)
    for rank in (0, 1):
        weights = load_file(str(tmp_path / "two" / f"weights_rank{rank}.safetensors"))
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-6, msg=name)


