"""`gradient_checkpointing=True` recomputes activations in the backward instead of keeping them: the gradients must
be the ones of the run without it, dropout included (the recomputation replays the forward's random state)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from loopkit import Loop, LoopArgs

from helpers import lm_data


class FirstGradients(TrainerCallback):
    """The gradients of the first optimizer step, as the optimizer is about to see them."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == 0:
            self.grads = {name: p.grad.clone() for name, p in model.named_parameters()}


def llama_with_dropout():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                        attention_dropout=0.2))


def test_gradients_are_the_same_with_and_without_gradient_checkpointing(tmp_path):
    grads = {}
    for checkpointing in (False, True):
        args = LoopArgs(output_dir=str(tmp_path / str(checkpointing)), per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, max_steps=1, report_to="none", disable_tqdm=True,
                        save_strategy="no", gradient_checkpointing=checkpointing)
        recorder = FirstGradients()
        loop = Loop(llama_with_dropout(), args, train_dataset=lm_data(8), callbacks=[recorder])
        loop.train()
        assert loop.model.is_gradient_checkpointing == checkpointing
        grads[checkpointing] = recorder.grads
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[True][name], grad, rtol=0, atol=1e-7, msg=name)
