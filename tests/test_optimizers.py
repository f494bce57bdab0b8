"""Every `optim` value of TrainingArguments, against HF Trainer run live in the same test.

HF Trainer is the oracle of what runs here: where it trains, Loop must build the same optimizer (class, defaults,
param groups by parameter name, after training too) and end with the same weights and logs; where it fails (a missing
package, a device this machine lacks, a transformers bug), Loop must refuse at construction, naming what HF's failure
names. The optimizer packages come with `pip install loopkit[optim]` (and the test extra).
"""

import importlib.util
import json
import sys

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers.training_args import OptimizerNames

from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, lm_data, tiny_llama

from loopkit import Loop, LoopArgs
from loopkit.args import LoopConfigError
from loopkit.optimizers import build_optimizer, optimizer_cls_and_kwargs
from loopkit.optimizers import decay_parameter_names

pytestmark = [IGNORE_PIN_MEMORY_WARNING,
              # bitsandbytes on a CPU says its paged optimizers fall back to ordinary memory (as under Trainer).
              pytest.mark.filterwarnings("ignore:Paged optimizers are not supported on CPU:UserWarning")]

ALL_OPTIMS = [o.value for o in OptimizerNames]


# What HF's failure names, for each reason a value cannot run: Loop's refusal must name the same thing.
FAILURE_KEYWORDS = ("CUDA", "torch_xla", "torch_npu", "torchdistx", "bitsandbytes", "galore_torch", "apollo_torch",
                    "lomo_optim", "grokadamw", "torchao", "schedulefree", "optimi", "relative_step",
                    "active drivers")


def settings(name: str) -> dict:
    """TrainingArguments for a 3-step run with `name`, exercising its `optim_args` and target modules, weight decay
    (the decay / no-decay split) and warmup (schedule-free reads warmup_steps)."""
    args = dict(optim=name, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, weight_decay=0.01,
                warmup_steps=1, logging_steps=1, save_strategy="no", seed=3)
    optim_args = {"sgd": "momentum=0.9,nesterov=True", "adagrad": "lr_decay=0.01",
                  "rmsprop": "momentum=0.5,centered=True", "grokadamw": "gamma=0.2,lamb=1.5"}
    if name in optim_args:
        args["optim_args"] = optim_args[name]
    elif "ademamix" in name:
        args["optim_args"] = "alpha=4.0,beta3=0.999,t_alpha=3"
    elif name.startswith("galore"):
        args["optim_args"] = "rank=4,update_proj_gap=2,scale=0.5"
    elif name.startswith("apollo"):
        args["optim_args"] = "rank=2,update_proj_gap=2,scale_type=tensor"
    elif name.startswith("schedule_free"):
        args.update(optim_args="weight_lr_power=1.5", eval_strategy="steps", eval_steps=2)  # eval: optimizer.eval()
    # The three forms transformers accepts: a list of names, a regex, "all-linear".
    targets = {"galore_adamw": ["q_proj", "v_proj"], "galore_adafactor": "all-linear",
               "galore_adamw_layerwise": r".*\.mlp\..*_proj", "apollo_adamw": "all-linear",
               "apollo_adamw_layerwise": ["up_proj"]}
    if name.startswith(("galore", "apollo")):
        args["optim_target_modules"] = targets.get(name, ["q_proj"])
    if name == "lomo":
        args["gradient_accumulation_steps"] = 2  # LOMO updates in every micro-batch's backward
    return args


def plain_value(value, names: dict):
    """Optimizer defaults / group options in a comparable form: tensors as values, parameters (GrokAdamW keys its
    per-group state by them) as their names, dtypes as text."""
    if isinstance(value, dict):
        return {names.get(id(k), k): plain_value(v, names) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v, names) for v in value]
    if isinstance(value, torch.Tensor):
        return names.get(id(value)) or ("tensor", value.tolist())
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def describe(optimizer, model):
    """Class, defaults and param groups (parameters by name) of the optimizer Accelerate wraps; for a layer-wise
    optimizer, the same for each parameter's own optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    inner = getattr(optimizer, "optimizer", optimizer)
    if getattr(inner, "optimizer_dict", None):
        return type(inner), [(names[id(p)], describe(sub, model)) for p, sub in inner.optimizer_dict.items()]
    groups = [plain_value(group, names) for group in inner.param_groups]
    assert all(isinstance(n, str) for group in groups for n in group["params"]), "a parameter outside the model"
    return type(inner), plain_value(inner.defaults, names), groups


# 320 x 16 = 5120 embedding values: above bitsandbytes' 4096 minimum for 8-bit state, so the 32-bit override HF
# registers for embeddings changes the result.
VOCAB = 320


def tiny_model():
    return tiny_llama(vocab_size=VOCAB)


def tiny_data(n: int, seed: int = 0):
    return lm_data(n, vocab_size=VOCAB, seed=seed)


def forget_bitsandbytes_overrides():
    """bitsandbytes keeps the 8-bit overrides (embeddings in 32 bits) in a process-wide manager keyed by parameter
    position, which a later optimizer inherits: reset it, so each run has only what its own runner registered."""
    bitsandbytes = sys.modules.get("bitsandbytes")
    if bitsandbytes is not None:
        bitsandbytes.optim.GlobalOptimManager.get_instance().initialize()


def train(runner, tmp_path, name: str):
    forget_bitsandbytes_overrides()
    args = hf_args(tmp_path / runner.__name__, **settings(name))
    eval_dataset = tiny_data(4, seed=1) if args.eval_strategy != "no" else None
    trainer = runner(model=tiny_model(), args=args, train_dataset=tiny_data(12), eval_dataset=eval_dataset)
    trainer.train()
    return trainer


def without_timings(log: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if not k.endswith(("_runtime", "_per_second"))} for entry in log]


@pytest.mark.parametrize("name", ALL_OPTIMS)
def test_optim_value_trains_as_in_trainer_or_is_refused_as_it_fails_there(tmp_path, monkeypatch, name):
    if name.startswith("adamw_torch_") and name.endswith("bit"):
        # torchao compiles its step once per parameter shape (dynamic=False): ~30 s of C++ builds on a cold CPU cache.
        # Both runners trace the same step with the eager backend instead; what is compared (the optimizer loopkit
        # builds, and its use) does not depend on the backend.
        compile_with_inductor = torch.compile
        monkeypatch.setattr(torch, "compile", lambda model=None, **options: compile_with_inductor(
            model, **{**options, "backend": "eager"}))
    try:
        hf = train(Trainer, tmp_path, name)
    except Exception as error:  # noqa: BLE001 - any failure of HF's: Loop must refuse, naming the same cause
        hf_message = f"{type(error).__name__}: {error}"
        keywords = [k for k in FAILURE_KEYWORDS if k in hf_message]
        assert keywords, f"HF Trainer failed with optim={name!r} for a reason this test does not know: {hf_message}"
        with pytest.raises(LoopConfigError) as refusal:
            Loop(model=tiny_model(), args=hf_args(tmp_path / "loop", **settings(name)), train_dataset=tiny_data(12))
        message = str(refusal.value)
        assert message.startswith(f"optim={name!r}") and keywords[0] in message and "Fix:" in message, (
            f"HF fails with {hf_message!r}; loopkit says {message!r}")
        return
    loop = train(Loop, tmp_path, name)
    assert describe(loop.optimizer, loop.model) == describe(hf.optimizer, hf.model)
    # As JSON: a log value of another type (a tensor for a float) fails too, as it would in trainer_state.json.
    assert json.dumps(without_timings(loop.state.log_history)) == json.dumps(without_timings(hf.state.log_history))
    hf_weights = hf.model.state_dict()
    for key, value in loop.model.state_dict().items():
        assert torch.equal(value, hf_weights[key]), f"{key} differs after 3 steps of {name}"


def test_count_of_refused_values(tmp_path):
    """Before this change Loop ran 2 of the 41 values (adamw_torch, adamw_torch_fused). With the optim extra on a
    CPU machine it runs 34 (33 where triton is installed): the 7 refused need a CUDA GPU, a TPU, an Ascend NPU, a package not on PyPI, or are
    broken in transformers itself (the test above shows HF Trainer failing on each)."""
    refused = []
    for name in ALL_OPTIMS:
        try:
            options = {k: v for k, v in settings(name).items() if k not in ("eval_strategy", "eval_steps")}
            Loop(model=tiny_model(), args=LoopArgs(output_dir=str(tmp_path), **options), train_dataset=tiny_data(12))
        except LoopConfigError:
            refused.append(name)
    if torch.cuda.is_available():
        pytest.skip("the count is for a CPU-only machine")
    assert len(ALL_OPTIMS) == 41
    # stable_adamw: torch-optimi runs Triton kernels on CPU tensors wherever triton is installed (liger-kernel's
    # dependency in the test extras), and they fail there (loopkit/optimizers.py, check_optimi_triton)
    triton_installed = importlib.util.find_spec("triton") is not None
    assert sorted(refused) == sorted(["adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision",
                                      "galore_adamw_8bit", "galore_adamw_8bit_layerwise", "adalomo",
                                      "galore_adafactor_layerwise"] + ["stable_adamw"] * triton_installed)


def test_missing_package_names_the_package_and_the_extra(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "schedulefree"
                        else real_find_spec(name, *a))
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_model(), args=hf_args(tmp_path, optim="schedule_free_adamw"), train_dataset=tiny_data(4))
    assert str(error.value).startswith("optim='schedule_free_adamw': it needs the schedulefree package")
    assert "pip install schedulefree" in str(error.value) and "loopkit[optim]" in str(error.value)


@pytest.mark.parametrize("field, value, needs", [
    ("optim_target_modules", None, "projects the gradients"),
    ("gradient_accumulation_steps", 2, "cannot accumulate"),
])
def test_low_rank_settings_refused_at_construction(tmp_path, field, value, needs):
    """HF Trainer raises these only inside train(); Loop at construction."""
    args = dict(optim="galore_adamw_layerwise", optim_target_modules=["q_proj"])
    args[field] = value
    with pytest.raises(LoopConfigError) as error:
        Loop(model=tiny_model(), args=hf_args(tmp_path, **args), train_dataset=tiny_data(4))
    assert str(error.value).startswith(f"{field}={value!r}") and needs in str(error.value)


@pytest.mark.parametrize("name", ["galore_adamw_layerwise", "apollo_adamw", "schedule_free_radam", "lomo",
                                  "adamw_8bit"])
def test_loop_args_build_the_optimizer_training_arguments_build(tmp_path, name):
    """LoopArgs go through the same handlers (they read `parallel_mode` and `optim_args` from it)."""
    options = {k: v for k, v in settings(name).items() if k not in ("eval_strategy", "eval_steps")}
    built = []
    for args in (LoopArgs(output_dir=str(tmp_path), **options), TrainingArguments(str(tmp_path), **options)):
        model = tiny_model()
        optimizer = build_optimizer(args, model, decay_parameter_names(model), optimizer_cls_and_kwargs(args, model))
        built.append(describe(optimizer, model))
    assert built[0] == built[1]


def test_an_overridden_get_optimizer_cls_and_kwargs_builds_the_optimizer(tmp_path):
    """As in Trainer, create_optimizer asks the (overridable) static method for the class and kwargs."""
    class SGDLoop(Loop):
        @staticmethod
        def get_optimizer_cls_and_kwargs(args, model=None):
            return torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}

    loop = SGDLoop(model=tiny_model(), args=hf_args(tmp_path), train_dataset=tiny_data(4))
    optimizer = loop.create_optimizer()
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.9
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.5]
    assert Loop.get_optimizer_cls_and_kwargs(hf_args(tmp_path, optim="sgd", optim_args="momentum=0.8")) == \
        Trainer.get_optimizer_cls_and_kwargs(hf_args(tmp_path, optim="sgd", optim_args="momentum=0.8"))
