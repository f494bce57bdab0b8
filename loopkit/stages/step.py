"""Stage 3, step: one optimizer step over an accumulation window.

Contract (HF Trainer 5.24 semantics, facts file sections 1.2 and 4):
* `create_optimizer(model=None)`, `create_scheduler(num_training_steps, optimizer=None)`: HF's defaults (AdamW with
  decay / no-decay groups, `get_scheduler(lr_scheduler_type)` with warmup); `Loop` exposes both under those names.
* `prepare(max_steps, checkpoint)`: optimizer, `accelerator.prepare`, scheduler, and optimizer/scheduler state of a
  resumed run.
* `compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None)` and
  `training_step(model, inputs, num_items_in_batch=None)` with HF's signatures and loss scaling.
* `run(window)`: `on_step_begin` -> forward/backward per micro-batch (`on_substep_end` between) ->
  `on_gradients_ready` -> clip -> `on_pre_optimizer_step` -> `optimizer.step()` -> `on_optimizer_step` ->
  `lr_scheduler.step()` -> `zero_grad` -> `global_step += 1` -> `on_step_end`.

Hot path: nothing here calls `.item()` or otherwise waits for the device. The running loss, the token count and the
gradient norm stay device tensors until the evaluation stage reads them at a logging point.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Mapping

import torch
from torch import nn

from ..args import config_error
from ..guards import NONFINITE_POLICIES, NonFiniteWatch
from .base import Stage, base_model

NO_DECAY_PATTERNS = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                               r"_norm(?:$|\.)")]


def decay_parameter_names(module: nn.Module) -> list[str]:
    """HF's `get_decay_parameter_names`: parameters outside `nn.LayerNorm` whose name has no bias/norm pattern.
    Embeddings are decayed."""
    result = []
    for name, child in module.named_children():
        if isinstance(child, nn.LayerNorm):
            continue
        result += [f"{name}.{n}" for n in decay_parameter_names(child)
                   if not any(p.search(f"{name}.{n}".lower()) for p in NO_DECAY_PATTERNS)]
    result += [k for k in module._parameters if not any(p.search(k.lower()) for p in NO_DECAY_PATTERNS)]
    return result


def is_causal_lm(model) -> bool:
    """Causal LMs shift labels inside their loss, so their token count is `labels[..., 1:]`. Unlike HF Trainer
    (which keys this on `loss_type` and so miscounts GPT-2), loopkit counts shifted labels for every causal LM."""
    base = base_model(model)
    config = getattr(base, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    if getattr(base, "loss_type", None) == "ForCausalLM":
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(base).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


class StepStage(Stage):
    """Forward, backward, accumulation, clipping, optimizer and scheduler."""

    def __init__(self, nonfinite: str = "ignore"):
        """`nonfinite`: what to do with a non-finite loss or gradient ("ignore", "skip", "stop", "raise"; see
        `loopkit/guards.py`)."""
        if nonfinite not in NONFINITE_POLICIES:
            raise config_error("nonfinite", nonfinite, f"it must be one of {NONFINITE_POLICIES}", "pick one of those")
        self.nonfinite = NonFiniteWatch(nonfinite) if nonfinite != "ignore" else None
        self.tr_loss = None  # device tensor: sum of step losses since the last log
        self.grad_norm = None  # device tensor: pre-clip norm of the last optimizer step
        self.learning_rate = None  # float: the LR the last optimizer step used
        self.current_gradient_accumulation_steps = 1
        self.restored_loss = 0.0

    # -- optimizer and scheduler (HF's create_optimizer / create_scheduler) --
    def create_optimizer(self, model=None):
        loop, args = self.loop, self.loop.args
        model = loop.model if model is None else model
        if loop.optimizer is None:
            decay = set(loop.get_decay_parameter_names(model))
            groups = [
                {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
                 "weight_decay": args.weight_decay},
                {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
                 "weight_decay": 0.0},
            ]
            if loop.optimizer_cls_and_kwargs is not None:
                cls, kwargs = loop.optimizer_cls_and_kwargs
            else:
                cls = torch.optim.AdamW
                kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                          "eps": args.adam_epsilon}
                if str(getattr(args.optim, "value", args.optim)) == "adamw_torch_fused":
                    kwargs["fused"] = True
            loop.optimizer = cls(groups, **kwargs)
        return loop.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        loop, args = self.loop, self.loop.args
        if loop.lr_scheduler is None:
            from transformers.optimization import get_scheduler

            loop.lr_scheduler = get_scheduler(
                str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
                optimizer=loop.optimizer if optimizer is None else optimizer,
                num_warmup_steps=args.get_warmup_steps(num_training_steps),
                num_training_steps=num_training_steps,
                scheduler_specific_kwargs=args.lr_scheduler_kwargs,
            )
        return loop.lr_scheduler

    def prepare(self, max_steps: int, checkpoint: str | None):
        """Optimizer, `accelerator.prepare`, scheduler, resume. A scheduler the user did not pass in
        `optimizers=(opt, sched)` is created anew by every `train()` (its length depends on that call's max_steps),
        through `create_scheduler`, overridden or not."""
        loop = self.loop
        if not loop.scheduler_given:
            loop.lr_scheduler = None
        loop.create_optimizer()
        if loop.model_wrapped is loop.model:
            # An evaluation before training prepared the bare model for evaluation only (no DDP wrapper), and
            # Accelerate then treats it as prepared: without dropping that mark, `prepare` would return it
            # unwrapped and each process would train its own copy.
            vars(loop.model).pop("_is_accelerate_prepared", None)
            loop.model_wrapped, loop.optimizer = loop.accelerator.prepare(loop.model, loop.optimizer)
        else:
            loop.optimizer = loop.accelerator.prepare(loop.optimizer)
        loop.create_scheduler(num_training_steps=max_steps)
        if checkpoint is not None:
            loop.checkpointer.load_optimizer_and_scheduler(checkpoint)
        self.num_non_embedding_params = (loop.model.num_parameters(exclude_embeddings=True)
                                         if hasattr(loop.model, "num_parameters") else 0)
        self.label_shift = is_causal_lm(loop.model)
        # Plain engines (one process, DDP) without a loss scaler: Accelerate's backward, clip and optimizer wrappers
        # then only forward to torch, but cost ~250 us a step on a CPU (an optional-package lookup in every
        # `AcceleratedOptimizer.step`, a per-parameter DTensor scan in every clip). Call torch directly there, with
        # identical numerics; every other engine keeps Accelerate's path.
        from accelerate.utils import DistributedType

        acc = loop.accelerator
        self.direct = acc.scaler is None and acc.distributed_type in (
            DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        self.clip_params = list(loop.model_wrapped.parameters())
        if checkpoint is None:
            self.restored_loss = 0.0
        self.tr_loss = torch.full((), self.restored_loss, device=loop.accelerator.device)
        if self.nonfinite is not None:
            self.nonfinite.start(loop.accelerator.device)
            inner = getattr(loop.optimizer, "optimizer", loop.optimizer)
            if self.nonfinite.policy in ("skip", "stop") and loop.accelerator.scaler is None and \
                    not inner.defaults.get("fused"):
                raise config_error("nonfinite", self.nonfinite.policy, f"skipping a step without waiting for the "
                                   f"device needs a fused optimizer, and {type(inner).__name__} is not fused",
                                   "use optim='adamw_torch_fused' (the default), or nonfinite='raise'")
        self.loss_scale_tokens = loop.args.average_tokens_across_devices and loop.accelerator.num_processes > 1

    # -- loss --
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loop = self.loop
        labels = inputs.pop("labels") if loop.compute_loss_func is not None and "labels" in inputs else None
        if loop.model_accepts_loss_kwargs and num_items_in_batch is not None:
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
        outputs = model(**inputs)
        if loop.compute_loss_func is not None:
            loss = loop.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        elif isinstance(outputs, dict):
            if outputs.get("loss") is None:
                raise ValueError(
                    f"The model returned no loss (its outputs: {', '.join(outputs.keys())}; its inputs: "
                    f"{', '.join(inputs.keys())}). Fix: pass labels in the batch (check label_names and the "
                    f"collator), or give Loop a compute_loss_func, or override compute_loss.")
            loss = outputs["loss"]
        elif isinstance(outputs, torch.Tensor):
            # HF would index it (outputs[0]) and fail far from the cause; a bare tensor is never (loss, ...).
            raise ValueError(
                f"The model returned a bare tensor of shape {tuple(outputs.shape)}, not outputs with a loss. Fix: "
                f"return a dict (or ModelOutput) with a 'loss' entry, or give Loop a compute_loss_func, or override "
                f"compute_loss.")
        else:
            loss = outputs[0]
        if (loop.args.average_tokens_across_devices and num_items_in_batch is not None
                and (loop.model_accepts_loss_kwargs or loop.compute_loss_func is not None)):
            # The token count is global, and DDP averages gradients over processes: undo that average.
            loss = loss * loop.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def count_loss_items(self, batches) -> torch.Tensor | None:
        """`num_items_in_batch`: label tokens != -100 over the whole window (summed over processes), a device
        tensor, or None when the loss does not take it."""
        loop = self.loop
        if not batches or "labels" not in batches[0]:
            return None
        if not (loop.model_accepts_loss_kwargs or loop.compute_loss_func is not None):
            return None
        try:
            count = sum(
                (b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:] if self.label_shift
                 else b["labels"]).ne(-100).sum() for b in batches)
        except (TypeError, AttributeError):
            return None
        if self.loss_scale_tokens:
            count = loop.accelerator.gather(count.to(loop.accelerator.device)).sum()
        return count.to(loop.accelerator.device)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward and backward of one micro-batch; returns the detached loss scaled for accumulation."""
        loop = self.loop
        model.train()
        if callable(getattr(loop.optimizer, "train", None)):
            loop.optimizer.train()
        with loop.compute_loss_context_manager():
            loss = loop.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        scaled = loop.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (loop.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                loop.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        with loop.clock.span("backward"):
            if self.direct:
                loss.backward()  # = accelerator.backward here (it divides by its accumulation steps, 1)
            else:
                loop.accelerator.backward(loss)
        return loss.detach()

    # -- one optimizer step --
    def run(self, window, epoch: int, steps_in_epoch: int) -> bool:
        """Train on one window. Returns False if a callback stopped training or the epoch mid-window."""
        loop, acc = self.loop, self.loop.accelerator
        fire, model = loop.fire, loop.model_wrapped
        batches = window.batches
        num_items = loop.count_loss_items(batches)
        self.current_gradient_accumulation_steps = len(batches)
        fire("on_step_begin")
        last = len(batches) - 1
        window_loss = 0.0
        for i, inputs in enumerate(batches):
            acc.gradient_state._set_sync_gradients(i == last)
            context = contextlib.nullcontext() if i == last else acc.no_sync(model)
            with context, loop.clock.span("forward"):
                step_loss = loop.training_step(model, inputs, num_items)
            if self.nonfinite is not None:
                window_loss = window_loss + step_loss
            self.accumulate_loss(step_loss)
            self.count_flos(inputs)
            if i != last:
                fire("on_substep_end")
                if loop.control.should_epoch_stop or loop.control.should_training_stop:
                    return False
        with loop.clock.span("optimizer"):
            self.optimizer_step(model, window_loss, (epoch, window.first_index, len(batches)))
        state = loop.state
        state.global_step += 1
        state.epoch = epoch + (window.first_index + len(batches)) / steps_in_epoch
        fire("on_step_end")
        return True

    def accumulate_loss(self, step_loss: torch.Tensor) -> None:
        if self.loop.args.logging_nan_inf_filter:
            # HF replaces a NaN/Inf loss by the running mean; torch.where does it without a host sync.
            since = 1 + self.loop.state.global_step - self.loop.evaluation.last_logged_step
            step_loss = torch.where(torch.isfinite(step_loss), step_loss, self.tr_loss / since)
        self.tr_loss += step_loss

    def floating_point_ops(self, inputs) -> int:
        """HF's estimate for one forward + backward: 6 x elements of the main input x non-embedding parameters; 0
        for a model without `num_parameters`. Any mapping counts (collators return `BatchEncoding`, not a dict)."""
        main = getattr(self.loop.model, "main_input_name", "input_ids")
        if isinstance(inputs, Mapping) and main in inputs and self.num_non_embedding_params:
            return 6 * inputs[main].numel() * self.num_non_embedding_params
        return 0

    def count_flos(self, inputs) -> None:
        """FLOPs (HF's estimate), and the input tokens and samples the run report divides by time. Sizes are
        tensor metadata: no device sync."""
        loop = self.loop
        loop.current_flos += float(loop.floating_point_ops(inputs))
        main = inputs.get(getattr(loop.model, "main_input_name", "input_ids")) if isinstance(inputs, Mapping) \
            else None
        if isinstance(main, torch.Tensor):
            loop.tokens_seen += main.numel()
            loop.samples_seen += main.shape[0] if main.ndim else 1

    def clip_gradients(self, model) -> torch.Tensor:
        """Pre-clip total norm; clips to `max_grad_norm` when it is positive (HF logs the norm either way)."""
        max_norm = self.loop.args.max_grad_norm if self.loop.args.max_grad_norm > 0 else math.inf
        if self.direct:
            return torch.nn.utils.clip_grad_norm_(self.clip_params, max_norm)
        return self.loop.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def optimizer_step(self, model, window_loss=None, where=None) -> None:
        loop, acc, fire = self.loop, self.loop.accelerator, self.loop.fire
        if loop.callback_handler.has_listeners("on_gradients_ready"):
            acc.unscale_gradients()  # fp16: listeners see true gradients; no-op otherwise
            fire("on_gradients_ready")
        self.grad_norm = self.clip_gradients(model)
        if self.nonfinite is not None:
            found_inf = self.nonfinite.observe(loop.state.global_step + 1, window_loss, self.grad_norm, where)
            if self.nonfinite.policy in ("skip", "stop") and acc.scaler is None:
                # The fused optimizer reads these and leaves parameters and state untouched when found_inf is 1.
                inner = getattr(loop.optimizer, "optimizer", loop.optimizer)
                inner.grad_scale, inner.found_inf = None, found_inf
        fire("on_pre_optimizer_step")
        if self.direct:
            getattr(loop.optimizer, "optimizer", loop.optimizer).step()  # what AcceleratedOptimizer.step calls
            loop.optimizer._opt_called = True  # what the scheduler's wrapper of optimizer.step records (else: a warning)
        else:
            loop.optimizer.step()
        fire("on_optimizer_step")
        scheduler = loop.lr_scheduler
        self.learning_rate = scheduler.get_last_lr()[0] if hasattr(scheduler, "get_last_lr") else \
            loop.optimizer.param_groups[0]["lr"]
        if not acc.optimizer_step_was_skipped and not isinstance(
                scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
        model.zero_grad()

    def add_param_group(self, params, **group_options) -> None:
        """Add newly trainable parameters to the optimizer and extend the scheduler to cover the new group.

        For parameters frozen before the optimizer was built (so it does not hold them), e.g. progressive
        unfreezing. A plain `optimizer.add_param_group` breaks `LambdaLR`, which keeps one lambda per group.
        """
        loop = self.loop
        if loop.optimizer is None:
            raise config_error("optimizer", None, "there is no optimizer yet", "call this from on_train_begin or later")
        group = {"params": list(params), **group_options}
        group.setdefault("weight_decay", 0.0)
        loop.optimizer.add_param_group(group)
        new = loop.optimizer.param_groups[-1]
        new.setdefault("initial_lr", new["lr"])
        scheduler = loop.lr_scheduler
        if hasattr(scheduler, "lr_lambdas"):
            scheduler.lr_lambdas.append(scheduler.lr_lambdas[0])
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs.append(new["initial_lr"])
            factor = scheduler.lr_lambdas[-1](scheduler.last_epoch) if hasattr(scheduler, "lr_lambdas") else 1.0
            new["lr"] = new["initial_lr"] * factor
            if hasattr(scheduler, "_last_lr"):
                scheduler._last_lr.append(new["lr"])

    def state_dict(self) -> dict:
        return {"tr_loss": float(self.tr_loss) if self.tr_loss is not None else 0.0}

    def load_state_dict(self, state: dict) -> None:
        # The loss summed since the last log before the checkpoint, so the first log after a resume is exact
        # (HF Trainer restarts it at 0). `restored_loss` keeps it out of this call's `train_loss`.
        self.restored_loss = state.get("tr_loss", 0.0)
