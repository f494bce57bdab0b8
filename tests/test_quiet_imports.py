"""Quiet by default: a `Loop` built with `LoopArgs(optim="adamw_torch")` (and the default linear schedule) imports no
optimizer handler, peft, bitsandbytes, kernels, torchao or quantization module, nor `transformers.trainer_utils` and
HF's callback module (which import peft), even with the optimizer extras installed (their import prints warnings on a
machine without their kernels), neither when built nor when trained; measured through `sys.modules` in a fresh
process. It still builds exactly what HF Trainer builds: the optimizers and schedules loopkit builds itself are
compared live with transformers' own. Its default callbacks are loopkit's stand-ins for HF's classes until user code
can see them (loopkit/default_callbacks.py; tests/test_stand_in_callbacks.py compares them with HF's live)."""

import json
import os
import sys
import textwrap
from importlib.util import find_spec

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers.optimization import get_scheduler

from loopkit.optimizers import LOCAL_SCHEDULES, TORCH_HANDLERS, build_scheduler, optimizer_cls_and_kwargs
from helpers import run_process

# transformers.trainer_utils imports peft, which imports bitsandbytes and torchao; HF's callback module and
# training_args import trainer_utils; transformers' optimizer handlers and model code import the rest.
NOISY = ("transformers.trainer_optimizer", "transformers.trainer_utils", "transformers.trainer_callback",
         "transformers.training_args", "transformers.optimization", "peft", "bitsandbytes", "kernels", "torchao",
         "transformers.quantizers", "transformers.integrations.peft")

CHILD = textwrap.dedent("""
    import json, sys, tempfile
    import torch
    from torch import nn
    from loopkit import Loop, LoopArgs

    NOISY = {noisy!r}

    def noisy():
        return sorted(name for name in sys.modules if name in NOISY or name.split(".")[0] in ("peft", "torchao",
                      "bitsandbytes", "kernels"))

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x, labels=None):
            return {{"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}}

    if {hf_model!r}:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2))
        data = [{{"input_ids": torch.randint(0, 32, (6,)), "labels": torch.randint(0, 32, (6,))}} for _ in range(8)]
    else:
        model = Regression()
        data = [{{"x": torch.randn(2), "labels": torch.tensor(1.0)}} for _ in range(8)]
    seen = {{"before": noisy()}}
    with tempfile.TemporaryDirectory() as out:
        loop = Loop(model=model, args=LoopArgs(output_dir=out, optim="adamw_torch", max_steps=2, save_steps=1,
                                               per_device_train_batch_size=4, disable_tqdm={disable_tqdm!r},
                                               report_to="none"),
                    train_dataset=data)
        seen["after Loop()"] = noisy()
        loop.train()
        seen["after train()"] = noisy()
    print(json.dumps(seen))
""")


def modules_seen(hf_model: bool, disable_tqdm: bool = True) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    child = CHILD.format(noisy=NOISY, hf_model=hf_model, disable_tqdm=disable_tqdm)
    result = run_process([sys.executable, "-c", child], "a fresh interpreter building a Loop", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def the_extras_are_installed():
    missing = [name for name in ("peft", "bitsandbytes", "torchao") if find_spec(name) is None]
    assert not missing, f"this test needs the optimizer extras installed (as `make test` has them): {missing}"


@pytest.mark.parametrize("disable_tqdm", [True, False], ids=["printer", "progress bars"])
def test_a_loop_on_a_plain_module_imports_none_of_them(disable_tqdm):
    assert modules_seen(hf_model=False, disable_tqdm=disable_tqdm) == \
        {"before": [], "after Loop()": [], "after train()": []}


def test_a_loop_on_a_transformers_model_adds_none_of_them():
    """transformers' model code imports its quantizers (and torchao) itself; the Loop adds nothing to them."""
    seen = modules_seen(hf_model=True)
    assert seen["after Loop()"] == seen["after train()"] == seen["before"], seen
    assert not {"transformers.trainer_utils", "transformers.trainer_callback", "peft"} & set(seen["after train()"])


OPTIM_ARGS = {"adamw_torch": [None], "adamw_torch_fused": [None],
              "sgd": [None, "momentum=0.9,nesterov=True", "dampening=0.1,weight_decay=0.01,nesterov=no"],
              "adagrad": [None, "lr_decay=0.01,eps=1e-8"], "rmsprop": [None, "momentum=0.5,alpha=0.9,centered=1"]}


@pytest.mark.parametrize("name", TORCH_HANDLERS)
def test_the_optimizers_built_here_are_trainers(tmp_path, name):
    for optim_args in OPTIM_ARGS[name]:
        args = TrainingArguments(str(tmp_path), optim=name, optim_args=optim_args, learning_rate=3e-4,
                                 adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-7, use_cpu=True)
        assert optimizer_cls_and_kwargs(args) == Trainer.get_optimizer_cls_and_kwargs(args), optim_args


@pytest.mark.parametrize("name", LOCAL_SCHEDULES)
@pytest.mark.parametrize("warmup,total", [(0, 20), (5, 20), (7, 7), (0, 1)])
def test_the_schedules_built_here_are_transformers(name, warmup, total):
    def learning_rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = make(optimizer)
        rates = []
        for _ in range(total + 3):
            rates.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return rates, scheduler.state_dict()

    ours = learning_rates(lambda optimizer: build_scheduler(name, optimizer, warmup, total, None))
    theirs = learning_rates(lambda optimizer: get_scheduler(name, optimizer, num_warmup_steps=warmup,
                                                            num_training_steps=total))
    assert ours == theirs


def test_the_resume_hint_does_not_guess_the_objects_name(monkeypatch):
    from loopkit.guards import resume_call

    monkeypatch.setattr(sys, "argv", ["notebook"])
    assert resume_call("/runs/a/checkpoint-3") == \
        'train(resume_from_checkpoint="/runs/a/checkpoint-3") on a Loop built as before'
