"""Per-text attention (loopkit/per_text_attention.py): packed rows give the numbers `sdpa` gives for the same rows
(and for each text run alone), padded batches are `sdpa`'s unchanged, a compiled model does not recompile per row,
and models it cannot serve are refused by name."""

from __future__ import annotations

import pytest
import torch

from loopkit import Loop, LoopArgs, PackingDataStage, use_per_text_attention
from loopkit import LoopConfigError as ConfigError

from helpers import tiny_llama

VOCAB = 100


def llama(kv_heads: int = 2, **config):
    """tiny_llama's shape with 4 heads, so that grouped-query attention (kv_heads < 4) is covered."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads,
                                        max_position_embeddings=64, attn_implementation="sdpa", **config))


def packed_row(lengths, seed: int = 0) -> dict:
    """One row of texts of `lengths` tokens, position ids restarting per text, each text's first label -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone()
    labels[positions == 0] = -100
    return {"input_ids": ids[None], "position_ids": positions[None], "labels": labels[None]}


def loss_and_gradients(model, batch):
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_rows_give_sdpa_s_loss_and_gradients_and_each_text_s_logits(kv_heads):
    batch = packed_row([5, 1, 9, 3, 6])
    reference, model = llama(kv_heads), use_per_text_attention(llama(kv_heads))
    assert model.config._attn_implementation == "sdpa_per_text"
    expected, expected_grads = loss_and_gradients(reference, batch)
    got, grads = loss_and_gradients(model, batch)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # and each text alone: the boundaries are where the position ids restart
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        start = 0
        for n in (5, 1, 9, 3, 6):
            alone = reference(input_ids=batch["input_ids"][:, start:start + n], use_cache=False).logits[0]
            torch.testing.assert_close(packed[start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def test_a_padded_batch_and_generation_are_sdpa_s():
    """Left padding with an attention mask (a 4D mask is built, as for sdpa) and greedy generation with a cache."""
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    reference, model = llama(2).eval(), use_per_text_attention(llama(2)).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, expected, rtol=1e-5, atol=1e-5)
        generated = model.generate(ids[1:], max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, reference.generate(ids[1:], max_new_tokens=4, do_sample=False))


def test_a_compiled_model_trains_alike_and_compiles_once_for_rows_of_other_texts():
    from torch._dynamo.utils import counters

    rows = [packed_row(lengths, seed) for seed, lengths in enumerate(([5, 11], [3, 3, 10], [16], [2, 7, 7]))]
    losses = {}
    for name in ("sdpa", "per_text"):
        torch._dynamo.reset()
        model = llama(2) if name == "sdpa" else use_per_text_attention(llama(2))
        compiled = torch.compile(model, backend="eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[name] = []
        for i, row in enumerate(rows):
            if i == 1:
                graphs = counters["stats"]["unique_graphs"]
            loss = compiled(**row, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
        assert counters["stats"]["unique_graphs"] == graphs, name  # no recompile for other text lengths
    assert losses["per_text"] == pytest.approx(losses["sdpa"], rel=1e-5)


def test_a_packed_loop_run_equals_sdpa_s(tmp_path):
    data = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (4, 9, 3, 12, 6, 5, 8, 2)]
    logged = {}
    for name in ("sdpa", "per_text"):
        model = llama(2) if name == "sdpa" else use_per_text_attention(llama(2))
        args = LoopArgs(output_dir=str(tmp_path / name), per_device_train_batch_size=1, num_train_epochs=1,
                        learning_rate=1e-2, logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no")
        loop = Loop(model, args, train_dataset=data, data=PackingDataStage(row_tokens=16))
        loop.train()
        logged[name] = [h["loss"] for h in loop.state.log_history if "loss" in h]
    assert len(logged["sdpa"]) >= 3 and logged["per_text"] == pytest.approx(logged["sdpa"], rel=1e-5)


def test_models_it_cannot_serve_are_refused_and_left_as_they_were(monkeypatch):
    windowed = llama(2, sliding_window=4, use_sliding_window=True)
    with pytest.raises(ConfigError, match="sliding_window") as refused:
        use_per_text_attention(windowed)
    assert "attn_implementation='sdpa'" in str(refused.value) and windowed.config._attn_implementation == "sdpa"
    # A model whose packed texts still saw each other after the switch (the packing check made to find it so):
    # refused by that check, and switched back
    from loopkit import row_packing

    monkeypatch.setattr(row_packing, "packed_logits_error", lambda model: 0.5)
    model = llama(2)
    with pytest.raises(ConfigError, match="crosses sample boundaries"):
        use_per_text_attention(model)
    assert model.config._attn_implementation == "sdpa"
    assert tiny_llama().config._attn_implementation != "sdpa_per_text"  # nothing global changed for other models


def test_an_encoder_s_packed_texts_each_attend_to_the_whole_of_themselves():
    from transformers import BertConfig, BertForMaskedLM

    def bert():
        torch.manual_seed(0)
        return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=32, attn_implementation="sdpa")).eval()

    batch = packed_row([4, 7, 2])
    model, reference = use_per_text_attention(bert()), bert()
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        alone = torch.cat([reference(input_ids=batch["input_ids"][:, a:b]).logits[0] for a, b in ((0, 4), (4, 11),
                                                                                                   (11, 13))])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_the_docs_example_trains_a_packed_run_with_per_text_attention(tmp_path):
    """docs/packing.md's example, run as printed on a small model, rows and arguments."""
    from test_docs import run_python_block

    data = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (4, 9, 3, 12, 6, 5, 8, 2)]
    args = LoopArgs(output_dir=str(tmp_path), per_device_train_batch_size=1, num_train_epochs=2, learning_rate=1e-2,
                    report_to="none", disable_tqdm=True, save_strategy="no")
    model = llama(2)
    before = model.lm_head.weight.detach().clone()
    run_python_block("docs/packing.md", "use_per_text_attention(model)", {"model": model, "args": args, "data": data})
    assert model.config._attn_implementation == "sdpa_per_text"
    assert not torch.equal(model.lm_head.weight, before)  # it trained
