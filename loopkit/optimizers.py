"""The optimizer that `args.optim` names, built as HF Trainer 5.24 builds it.

Which class and keyword arguments each `optim` value means (with `optim_args`, GaLore/APOLLO target-module groups,
layer-wise optimizers, LOMO's model) is transformers' own answer: the handlers of `transformers.trainer_optimizer`,
the table `Trainer.get_optimizer_cls_and_kwargs` dispatches to. That module imports `training_args`, `trainer_utils`
and `trainer_pt_utils`, never `transformers.trainer`, and only when an optimizer is built (`import loopkit` stays
free of HF Trainer's modules). `build_optimizer` adds what `Trainer.create_optimizer` does around the handlers.

What each value needs to run on a machine (a package, a device) is this module's table: transformers says it only
by failing at `train()`, and loopkit refuses at construction instead, naming what is missing.
"""

from __future__ import annotations

import importlib.util

from .args import config_error, plain

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
    check_low_rank_settings(args, name)


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


def optimizer_cls_and_kwargs(args, model=None) -> tuple:
    """`Trainer.get_optimizer_cls_and_kwargs(args, model)`, through transformers' own handlers."""
    from transformers.trainer_optimizer import _OPTIMIZER_HANDLERS, OptimizerContext, _parse_optim_args

    handler = _OPTIMIZER_HANDLERS.get(plain(args.optim))
    if handler is None:
        raise config_error("optim", plain(args.optim), "transformers has no handler for it",
                           "choose another optim value, or pass optimizer_cls_and_kwargs=(cls, kwargs) to Loop")
    context = OptimizerContext(
        args=args, model=model, optimizer_kwargs={"lr": args.learning_rate},
        adam_kwargs={"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon},
        optim_args=_parse_optim_args(args.optim_args))
    return handler(context)


def build_optimizer(args, model, decay_parameter_names, cls_and_kwargs: tuple):
    """`Trainer.create_optimizer`'s optimizer from `cls_and_kwargs` (Loop's `optimizer_cls_and_kwargs`, or else
    `get_optimizer_cls_and_kwargs(args, model)`): decay / no-decay groups of the trainable parameters (one group per
    device mesh when they span several), replaced by the handler's own `params` / `model` / `optimizer_dict` (GaLore
    and APOLLO target groups, LOMO, layer-wise optimizers); a factory is called with the model."""
    from transformers.trainer_optimizer import has_mixed_dtensor, is_optimizer_factory

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


def steps_on_metrics(scheduler) -> bool:
    """`ReduceLROnPlateau` and transformers' `GreedyLR` step on an evaluation metric, not after every optimizer step
    (HF Trainer steps them after each evaluation, with `metric_for_best_model`)."""
    import torch

    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    from transformers.optimization import GreedyLR

    return isinstance(scheduler, GreedyLR)

