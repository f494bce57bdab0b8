"""The optimizer that `args.optim` names and the learning-rate schedule, built as HF Trainer 5.24 builds them.

Which class and keyword arguments each `optim` value means (with `optim_args`, GaLore/APOLLO target-module groups,
layer-wise optimizers, LOMO's model) is transformers' own answer: the handlers of `transformers.trainer_optimizer`,
the table `Trainer.get_optimizer_cls_and_kwargs` dispatches to. `build_optimizer` adds what
`Trainer.create_optimizer` does around the handlers.

Quiet by default: `transformers.trainer_optimizer` and `transformers.optimization` import
`transformers.trainer_utils`, which imports peft, which imports bitsandbytes (on a machine without its kernels it
prints warnings at import). So the optimizers of plain torch (`TORCH_HANDLERS`: adamw_torch, adamw_torch_fused, sgd,
adagrad, rmsprop) and the common schedules (`LOCAL_SCHEDULES`: linear, cosine, constant, constant_with_warmup) are
built here, exactly as transformers' handlers and `get_scheduler` build them (tests/test_quiet_imports.py compares
them live); every other value goes through transformers, which imports what that value needs.

What each value needs to run on a machine (a package, a device) is this module's table: transformers says it only
by failing at `train()`, and loopkit refuses at construction instead, naming what is missing.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from functools import partial

from .errors import config_error, plain
from .private_api import own_parameter_names, scheduler_last_lrs

PLAIN_TORCH = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
BITSANDBYTES = ("adamw_bnb_8bit", "adamw_8bit", "ademamix", "ademamix_8bit", "lion_8bit", "lion_32bit",
                "paged_adamw_32bit", "paged_adamw_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit",
                "paged_lion_32bit", "paged_lion_8bit", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")
GALORE = ("galore_adamw", "galore_adamw_8bit", "galore_adafactor", "galore_adamw_layerwise",
          "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise")
APOLLO = ("apollo_adamw", "apollo_adamw_layerwise")
SCHEDULE_FREE = ("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd")
LOMO = ("lomo", "adalomo")
# The packages of `pip install loopkit[optim]`: optim value -> (module imported, package to install).
OPTIM_EXTRA = {
    **dict.fromkeys(BITSANDBYTES, ("bitsandbytes", "bitsandbytes")),
    **dict.fromkeys(GALORE, ("galore_torch", "galore-torch")),
    **dict.fromkeys(APOLLO, ("apollo_torch", "apollo-torch")),
    **dict.fromkeys(SCHEDULE_FREE, ("schedulefree", "schedulefree")),
    **dict.fromkeys(LOMO, ("lomo_optim", "lomo-optim")),
    **dict.fromkeys(("adamw_torch_4bit", "adamw_torch_8bit"), ("torchao", "torchao")),
    "grokadamw": ("grokadamw", "grokadamw"),
    "stable_adamw": ("optimi", "torch-optimi"),
}
# Values whose package is not in the extra: it only works on other hardware, or is not on PyPI.
OTHER_PACKAGES = {
    "adamw_torch_xla": ("torch_xla", "a TPU machine with PyTorch/XLA (the torch_xla package) installed"),
    "adamw_torch_npu_fused": ("torch_npu", "an Ascend NPU machine with the torch_npu package installed"),
    "adamw_anyprecision": ("torchdistx", "torchdistx, built from source (pytorch/torchdistx; it is not on PyPI)"),
}
# Implementations that call CUDA directly, whatever device the model is on.
NEEDS_CUDA = {
    "galore_adamw_8bit": "galore_torch's 8-bit AdamW calls torch.cuda.synchronize() in every step",
    "galore_adamw_8bit_layerwise": "galore_torch's 8-bit AdamW calls torch.cuda.synchronize() in every step",
    "adalomo": "lomo_optim's AdaLomo allocates its state with .cuda()",
}
# transformers 5.24 builds this one with arguments its class refuses, so HF Trainer cannot train with it either.
BROKEN_IN_TRANSFORMERS = {
    "galore_adafactor_layerwise": (
        "transformers' handler gives GaLore's Adafactor a learning rate without turning off relative_step "
        "(it does so only for 'galore_adafactor'), and Adafactor raises 'Cannot combine manual `lr` and "
        "`relative_step=True`': HF Trainer fails the same way",
        "use optim='galore_adafactor' (not layer-wise), or 'galore_adamw_layerwise'"),
}
KNOWN_OPTIMS = frozenset(PLAIN_TORCH) | OPTIM_EXTRA.keys() | OTHER_PACKAGES.keys()


def check_optim(args) -> None:
    """Refuse, at construction, an `optim` value that cannot train on the user's machine (checked there, now),
    naming the package or hardware it lacks; and GaLore/APOLLO settings transformers would refuse only at
    `train()`."""
    name = plain(args.optim)
    if name not in KNOWN_OPTIMS:
        raise config_error("optim", name, "loopkit does not know this optimizer (the values of transformers 5.24's "
                           "OptimizerNames are reviewed one by one)", "choose one of " + ", ".join(sorted(KNOWN_OPTIMS))
                           + "; or pass optimizer_cls_and_kwargs=(cls, kwargs) to Loop")
    if name in BROKEN_IN_TRANSFORMERS:
        raise config_error("optim", name, *BROKEN_IN_TRANSFORMERS[name])
    if name in OPTIM_EXTRA and importlib.util.find_spec(OPTIM_EXTRA[name][0]) is None:
        module, package = OPTIM_EXTRA[name]
        raise config_error("optim", name, f"it needs the {package} package ({module}), which is not installed",
                           f"pip install {package} (or loopkit[optim], which installs every optimizer package)")
    if name in OTHER_PACKAGES and importlib.util.find_spec(OTHER_PACKAGES[name][0]) is None:
        module, needed = OTHER_PACKAGES[name]
        raise config_error("optim", name, f"it needs {needed}, and {module} is not installed",
                           "install it where that hardware is, or choose an optim value that needs no such package "
                           "(e.g. adamw_torch)")
    if name in NEEDS_CUDA:
        import torch

        if not torch.cuda.is_available():
            raise config_error("optim", name, f"it needs a CUDA GPU ({NEEDS_CUDA[name]}), and torch sees none "
                               "(torch.cuda.is_available() is False)", "run where torch sees a CUDA GPU, or use the "
                               "same optimizer without 8 bits / AdaLomo (e.g. galore_adamw, lomo)")
    if name == "stable_adamw":
        check_optimi_triton()
    check_low_rank_settings(args, name)


def check_optimi_triton() -> None:
    """torch-optimi 0.3's StableAdamW runs its Triton kernels whenever triton is installed, on CPU tensors too, and
    Triton then fails at the first step ("0 active drivers", under Trainer as well): refuse that machine now."""
    import torch

    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        raise config_error("optim", "stable_adamw", "torch-optimi's StableAdamW runs Triton kernels whenever the "
                           "triton package is installed, and Triton finds no GPU here (torch.cuda.is_available() is "
                           "False): its first step would fail with '0 active drivers', as under Trainer",
                           "run where torch sees a CUDA GPU, uninstall triton from this environment, or use "
                           "optim='adamw_torch'")


def check_low_rank_settings(args, name: str) -> None:
    if name not in GALORE + APOLLO:
        return
    if args.optim_target_modules is None:
        raise config_error("optim_target_modules", None, f"optim={name!r} projects the gradients of chosen Linear "
                           "modules, and none are named", "set optim_target_modules to module names, a regex, or "
                           "'all-linear' (e.g. ['q_proj', 'v_proj'])")
    if name.endswith("layerwise") and args.gradient_accumulation_steps != 1:
        raise config_error("gradient_accumulation_steps", args.gradient_accumulation_steps, f"optim={name!r} "
                           "updates each weight inside its backward, so gradients cannot accumulate",
                           "set gradient_accumulation_steps=1, or use the optimizer without '_layerwise'")


def parse_optim_args(optim_args: str | None) -> dict[str, str]:
    """`optim_args` ("momentum=0.9,nesterov=True") as a dict (copied from `transformers.trainer_optimizer._parse_optim_args`)."""
    if not optim_args:
        return {}
    return dict(mapping.split("=") for mapping in optim_args.replace(" ", "").split(","))


def optim_args_as(optim_args: dict, floats: tuple, flags: tuple = ()) -> dict:
    """The `optim_args` a torch optimizer's handler reads: `floats` as floats, `flags` as booleans (HF's rule)."""
    kwargs = {key: float(optim_args[key]) for key in floats if key in optim_args}
    kwargs.update({key: optim_args[key].lower() in ("true", "1", "yes") for key in flags if key in optim_args})
    return kwargs


def torch_optimizer(args, lr_and_adam: dict) -> tuple:
    """transformers' handlers for the optimizers of plain torch, spelled out (`TORCH_HANDLERS`)."""
    import torch

    name, lr = plain(args.optim), {"lr": args.learning_rate}
    if name in ("adamw_torch", "adamw_torch_fused"):
        return torch.optim.AdamW, {**lr_and_adam, **({"fused": True} if name == "adamw_torch_fused" else {})}
    optim_args = parse_optim_args(args.optim_args)
    if name == "sgd":
        return torch.optim.SGD, {**lr, **optim_args_as(optim_args, ("momentum", "dampening", "weight_decay"),
                                                        ("nesterov",))}
    if name == "adagrad":
        return torch.optim.Adagrad, {**lr, **optim_args_as(optim_args, ("lr_decay", "weight_decay", "eps"))}
    return torch.optim.RMSprop, {**lr, **optim_args_as(optim_args, ("momentum", "alpha", "eps", "weight_decay"),
                                                        ("centered",))}


TORCH_HANDLERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop")


def optimizer_cls_and_kwargs(args, model=None) -> tuple:
    """`Trainer.get_optimizer_cls_and_kwargs(args, model)`: the optimizers of plain torch built here, the others
    through transformers' own handlers."""
    lr_and_adam = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if plain(args.optim) in TORCH_HANDLERS:
        return torch_optimizer(args, lr_and_adam)
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS, OptimizerContext

    handler = _OPTIMIZER_HANDLERS.get(plain(args.optim))
    if handler is None:
        raise config_error("optim", plain(args.optim), "transformers has no handler for it",
                           "choose another optim value, or pass optimizer_cls_and_kwargs=(cls, kwargs) to Loop")
    context = OptimizerContext(
        args=args, model=model, optimizer_kwargs={"lr": args.learning_rate},
        adam_kwargs={"betas": lr_and_adam["betas"], "eps": lr_and_adam["eps"]},
        optim_args=parse_optim_args(args.optim_args))
    return handler(context)


def is_optimizer_factory(cls) -> bool:
    """A factory called with the model, not an optimizer class (copied from `transformers.trainer_optimizer`)."""
    import torch

    return not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer))


def has_mixed_dtensor(tensors) -> bool:
    """Whether `tensors` span several device meshes (copied from `transformers.trainer_optimizer`)."""
    from torch.distributed.tensor import DTensor

    return len({t.device_mesh if isinstance(t, DTensor) else None for t in tensors}) > 1


NO_DECAY_PATTERNS = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                               r"_norm(?:$|\.)")]


def decay_parameter_names(module) -> list[str]:
    """HF's `get_decay_parameter_names`: parameters outside `nn.LayerNorm` whose name has no bias/norm pattern.
    Embeddings are decayed."""
    from torch import nn

    result = []
    for name, child in module.named_children():
        if isinstance(child, nn.LayerNorm):
            continue
        result += [f"{name}.{n}" for n in decay_parameter_names(child)
                   if not any(p.search(f"{name}.{n}".lower()) for p in NO_DECAY_PATTERNS)]
    result += [k for k in own_parameter_names(module) if not any(p.search(k.lower()) for p in NO_DECAY_PATTERNS)]
    return result


def build_optimizer(args, model, decay_parameter_names, cls_and_kwargs: tuple):
    """`Trainer.create_optimizer`'s optimizer from `cls_and_kwargs` (Loop's `optimizer_cls_and_kwargs`, or else
    `get_optimizer_cls_and_kwargs(args, model)`): decay / no-decay groups of the trainable parameters (one group per
    device mesh when they span several), replaced by the handler's own `params` / `model` / `optimizer_dict` (GaLore
    and APOLLO target groups, LOMO, layer-wise optimizers); a factory is called with the model."""
    decay = set(decay_parameter_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    if has_mixed_dtensor(p for _, p in named):
        groups = split_by_mesh(groups)
    cls, kwargs = cls_and_kwargs
    kwargs = dict(kwargs)  # HF pops from the caller's dict; a copy leaves optimizer_cls_and_kwargs as passed
    if is_optimizer_factory(cls):
        return cls()(model, **kwargs)
    for key in ("params", "model", "optimizer_dict"):  # later keys win, in HF's order
        if key in kwargs:
            groups = kwargs.pop(key)
    optimizer = cls(groups, **kwargs)
    if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
        keep_embeddings_in_32_bits(model)
    return optimizer


def split_by_mesh(groups: list[dict]) -> list[dict]:
    """Parameters on different device meshes cannot share one fused/foreach kernel: one group per mesh (HF's)."""
    from torch.distributed.tensor import DTensor

    split = []
    for group in groups:
        by_mesh = {}
        for p in group["params"]:
            by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        split += [{**group, "params": params} for params in by_mesh.values()]
    return split


def keep_embeddings_in_32_bits(model) -> None:
    """bitsandbytes' 8-bit optimizers keep embedding weights' state in 32 bits, as HF Trainer registers it."""
    import bitsandbytes
    from torch import nn

    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def updates_in_backward(args) -> bool:
    """LOMO optimizers update the weights inside the backward pass, at a learning rate passed to it; their `step()`
    is a no-op through Accelerate only (HF keys this on `args.optim`, as here)."""
    return plain(args.optim) in LOMO


def backward_kwargs(args, lr_scheduler, optimizer) -> dict:
    """What `accelerator.backward(loss, ...)` takes beyond the loss: for LOMO, the learning rate the scheduler is at
    (HF's `_get_learning_rate`); nothing otherwise."""
    if not updates_in_backward(args):
        return {}
    if hasattr(lr_scheduler, "get_last_lr"):
        return {"learning_rate": lr_scheduler.get_last_lr()[0]}
    return {"learning_rate": optimizer.param_groups[0]["lr"]}


# The schedules built here (see the module docstring); the lambdas are copied from `transformers.optimization`.
def linear_lambda(current_step: int, *, num_warmup_steps: int, num_training_steps: int):
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))


def cosine_lambda(current_step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float,
                  min_lr_rate: float = 0.0):
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1, num_warmup_steps))
    progress = float(current_step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    factor = factor * (1 - min_lr_rate) + min_lr_rate
    return max(0, factor)


def constant_lambda(_=None):
    return 1


def constant_with_warmup_lambda(current_step: int, *, num_warmup_steps: int):
    if current_step < num_warmup_steps:
        return float(current_step) / float(max(1.0, num_warmup_steps))
    return 1.0


def local_schedule(name: str, warmup: int, total: int):
    """The LambdaLR multiplier `transformers.optimization.get_scheduler` builds for `name` without scheduler
    keywords, or None for the types left to it (`LOCAL_SCHEDULES` are built here)."""
    if name == "linear":
        return partial(linear_lambda, num_warmup_steps=warmup, num_training_steps=total)
    if name == "cosine":
        return partial(cosine_lambda, num_warmup_steps=warmup, num_training_steps=total, num_cycles=0.5)
    if name == "constant":
        return constant_lambda
    if name == "constant_with_warmup":
        return partial(constant_with_warmup_lambda, num_warmup_steps=warmup)
    return None


LOCAL_SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def build_scheduler(name: str, optimizer, num_warmup_steps: int, num_training_steps: int, kwargs: dict | None):
    """`transformers.optimization.get_scheduler(name, ...)`: `LOCAL_SCHEDULES` without scheduler keywords built
    here, the others (with keywords, and for layer-wise optimizers, which need one scheduler per parameter) through
    transformers."""
    import torch

    local = not kwargs and type(optimizer).__name__ != "LayerWiseDummyOptimizer"
    multiplier = local_schedule(name, num_warmup_steps, num_training_steps) if local else None
    if multiplier is None:
        from transformers.optimization import get_scheduler

        return get_scheduler(name, optimizer=optimizer, num_warmup_steps=num_warmup_steps,
                             num_training_steps=num_training_steps, scheduler_specific_kwargs=kwargs)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def steps_on_metrics(scheduler) -> bool:
    """`ReduceLROnPlateau` and transformers' `GreedyLR` step on an evaluation metric, not after every optimizer step
    (HF Trainer steps them after each evaluation, with `metric_for_best_model`)."""
    import torch

    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    optimization = sys.modules.get("transformers.optimization")  # a GreedyLR exists only once it is imported
    greedy = getattr(optimization, "GreedyLR", None)  # and only in transformers releases that have it
    return greedy is not None and isinstance(scheduler, greedy)


def add_param_group(optimizer, scheduler, params, **group_options) -> None:
    """Add newly trainable parameters to `optimizer` and extend `scheduler` to cover the new group.

    For parameters frozen before the optimizer was built (so it does not hold them), e.g. progressive
    unfreezing. A plain `optimizer.add_param_group` breaks `LambdaLR`, which keeps one lambda per group.
    """
    group = {"params": list(params), **group_options}
    group.setdefault("weight_decay", 0.0)
    optimizer.add_param_group(group)
    new = optimizer.param_groups[-1]
    new.setdefault("initial_lr", new["lr"])
    if hasattr(scheduler, "lr_lambdas"):
        scheduler.lr_lambdas.append(scheduler.lr_lambdas[0])
    if hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs.append(new["initial_lr"])
        factor = scheduler.lr_lambdas[-1](scheduler.last_epoch) if hasattr(scheduler, "lr_lambdas") else 1.0
        new["lr"] = new["initial_lr"] * factor
        last_lrs = scheduler_last_lrs(scheduler)
        if last_lrs is not None:
            last_lrs.append(new["lr"])
