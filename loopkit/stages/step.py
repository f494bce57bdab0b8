"""Stage 3, step: one optimizer step over an accumulation window.

Contract (HF Trainer 5.24 semantics: when each event fires; loss, gradients, optimizer and scheduler):
* `create_optimizer(model=None)`, `create_scheduler(num_training_steps, optimizer=None)`: HF's defaults (AdamW with
  decay / no-decay groups, `get_scheduler(lr_scheduler_type)` with warmup), built by loopkit/optimizers.py; `Loop`
  exposes both under those names.
* `prepare(max_steps, checkpoint)`: optimizer, `accelerator.prepare`, scheduler, and optimizer/scheduler state of a
  resumed run.
* `compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None)` and
  `training_step(model, inputs, num_items_in_batch=None)` with HF's signatures and loss scaling.
* `run_step(window, epoch, steps_in_epoch) -> StepResult`: `on_step_begin` -> forward/backward per micro-batch
  (`on_substep_end` between) -> `on_gradients_ready` -> clip -> `on_pre_optimizer_step` -> `optimizer.step()` ->
  `on_optimizer_step` -> `lr_scheduler.step()` -> `zero_grad` -> `global_step += 1` -> `on_step_end`.

Reads `run.args`, `run.model`, `run.model_accepts_loss_kwargs`, `run.compute_loss_func`, `run.label_smoother`,
`run.processing_class` (its pad token, for `include_num_input_tokens_seen="non_padding"`), `run.optimizers_given`,
`run.optimizer_cls_and_kwargs`; uses `context.accelerator`, `context.checkpointer`, `context.clock`,
`context.events`; writes `run.model_wrapped`, `run.optimizer`, `run.lr_scheduler`, and `run.state.global_step` /
`epoch`. Owns HF's overridable
`create_optimizer`, `get_optimizer_cls_and_kwargs`, `create_scheduler`, `get_decay_parameter_names`, `compute_loss`,
`compute_loss_context_manager`, `autocast_smart_context_manager`, `training_step`, `floating_point_ops`, and
loopkit's `count_loss_items`.

Which losses count as normalised over the accumulated batch (`loss_is_scaled_for_ga`), what `num_items_in_batch`
counts and where the loss comes from: HF's rules, in loopkit/loss.py. The FLOPs, tokens and samples each micro-batch
adds to the `StepResult`: loopkit/work.py. What the step reads off the model (a causal LM? a plain `train()`?):
loopkit/models.py.

Hot path: nothing here calls `.item()` or otherwise waits for the device, except once per `train()`: the labels of
the first micro-batch are checked against the model's own loss (loopkit/first_batch.py), behind a flag. A step's
losses, token counts and gradient norm stay device tensors in the `StepResult` until a logging point reads them.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field

import torch

from ..errors import config_error, plain
from ..first_batch import check_labels
from ..guards import NONFINITE_POLICIES, NonFiniteWatch
from ..loss import compute_loss, count_loss_items, implicit_scaling_warning, loss_is_scaled, model_loss
from ..models import (PLAIN_TRAIN_METHODS, base_model, causal_lm_class_names, has_plain_train, is_causal_lm,
                      is_causal_lm_class)
from ..optimizers import (add_param_group, backward_kwargs, build_optimizer, build_scheduler, decay_parameter_names,
                          optimizer_cls_and_kwargs, steps_on_metrics, updates_in_backward)
from ..private_api import (forget_accelerate_prepared, record_optimizer_step, skip_fused_step_if,
                           sync_gradients_setter)
from ..work import WorkCounter, hf_floating_point_ops, non_embedding_parameters
from .base import Stage

# Re-exported: these lived here before loss semantics, model introspection and work counting had modules of their own.
__all__ = ["StepStage", "StepResult", "TrainMode", "NO_CONTEXT", "has_train_mode", "model_loss", "is_causal_lm",
           "is_causal_lm_class", "causal_lm_class_names", "has_plain_train", "PLAIN_TRAIN_METHODS", "base_model",
           "check_labels"]

NO_CONTEXT = contextlib.nullcontext()  # reusable: the context of a micro-batch that needs none


def has_train_mode(optimizer) -> bool:
    """Whether `optimizer` (or a DeepSpeed-style optimizer inside it) has `train()` (schedule-free optimizers),
    which Accelerate's `AcceleratedOptimizer.train` forwards to."""
    return callable(getattr(optimizer, "train", None)) or \
        callable(getattr(getattr(optimizer, "optimizer", None), "train", None))


def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def uses_direct_engine(accelerator, args) -> bool:
    """Plain engines (one process, DDP) without a loss scaler: Accelerate's backward, clip and optimizer wrappers
    then only forward to torch, but cost ~250 us a step on a CPU (an optional-package lookup in every
    `AcceleratedOptimizer.step`, a per-parameter DTensor scan in every clip), so the step calls torch directly there,
    with identical numerics; every other engine keeps Accelerate's path. LOMO keeps it too: its backward takes the
    learning rate, and only Accelerate skips its step(). Tensor parallelism too: its DTensor gradients beside plain
    ones need Accelerate's clip."""
    from accelerate.utils import DistributedType

    mesh = getattr(accelerator, "parallelism_config", None)
    return accelerator.scaler is None and not updates_in_backward(args) and accelerator.distributed_type in (
        DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU) and not (
        mesh is not None and mesh.tp_enabled)


class TrainMode:
    """HF's `model.train()` before every micro-batch, skipped when it would change nothing: every module already
    trains and none has a `train()` of its own (Module.train walks the whole module tree: ~40 us a call on a small
    Llama). An evaluation, or a callback that puts a module in eval mode, makes the next call a real one."""

    def __init__(self, model):
        self.model, self.modules = model, list(model.modules())
        self.skippable = all(has_plain_train(module) for module in self.modules)

    def enter(self, model) -> None:
        if model is self.model and self.skippable:
            for module in self.modules:
                if not module.training:
                    break
            else:
                return
        model.train()


@dataclass(eq=False)
class StepResult:
    """What one optimizer step produced, handed back to the `Loop`: the micro-batch losses (detached device
    tensors, already scaled for accumulation), the pre-clip gradient norm (a device tensor), the learning rate the
    step used, and the work done (HF's FLOP estimate, input tokens, samples: tensor metadata, no device sync).
    `completed` is False when a callback stopped training or the epoch inside the window (no optimizer step).
    `seconds`: the window's host time, fetching it included, which the `Loop` adds (loopkit/observers/)."""

    completed: bool
    losses: list = field(default_factory=list)
    grad_norm: torch.Tensor | None = None
    learning_rate: float | None = None
    flos: float = 0.0
    tokens: int = 0
    samples: int = 0
    input_tokens_seen: torch.Tensor | int = 0  # HF's count for include_num_input_tokens_seen (this process)
    seconds: float = 0.0


class StepStage(Stage):
    """Forward, backward, accumulation, clipping, optimizer and scheduler."""

    #: Whether `compute_loss` already normalises over the accumulated batch: None = HF's rule (module docstring).
    loss_is_scaled_for_ga = None

    def __init__(self, nonfinite: str = "ignore"):
        """`nonfinite`: what to do with a non-finite loss or gradient ("ignore", "skip", "stop", "raise"; see
        `loopkit/guards.py`)."""
        if nonfinite not in NONFINITE_POLICIES:
            raise config_error("nonfinite", nonfinite, f"it must be one of {NONFINITE_POLICIES}", "pick one of those")
        self.nonfinite = NonFiniteWatch(nonfinite) if nonfinite != "ignore" else None
        self.current_gradient_accumulation_steps = 1
        self.prepared_model = None  # the model the optimizer was built for and `accelerator.prepare` wrapped
        # Decided once per train() by `prepare_hot_path`; these defaults serve an evaluation before any training.
        self.label_shift, self.main_input, self.num_non_embedding_params = None, "input_ids", 0
        self.labels_unchecked = False
        self.work = None  # a WorkCounter (loopkit/work.py): the FLOPs, tokens and samples of each micro-batch
        self.train_mode = self.optimizer_train = self.no_sync = self.forward_context = None
        self.engine_backward = {}  # what the engine's backward takes beyond the loss (DeepSpeed: scale_wrt_gas)

    # -- optimizer and scheduler (HF's create_optimizer / create_scheduler) --
    def get_decay_parameter_names(self, model) -> list[str]:
        return decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None) -> tuple:
        """HF's static method: the optimizer class and keyword arguments for `args.optim` (loopkit/optimizers.py)."""
        return optimizer_cls_and_kwargs(args, model)

    def create_optimizer(self, model=None):
        """`run.optimizer`: the one passed in `optimizers=`, else HF's (`args.optim` through transformers' own
        handlers, decay / no-decay groups; loopkit/optimizers.py)."""
        run = self.run
        model = run.model if model is None else model
        if run.optimizer is None and run.optimizers_given[0] is not None:
            run.optimizer = run.optimizers_given[0]
        if run.optimizer is None:
            cls_and_kwargs = run.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(run.args, model)
            run.optimizer = build_optimizer(run.args, model, self.get_decay_parameter_names(model), cls_and_kwargs)
        return run.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """`run.lr_scheduler`: the one passed in `optimizers=`, else `get_scheduler(lr_scheduler_type)`."""
        run, args = self.run, self.run.args
        if run.lr_scheduler is None and run.optimizers_given[1] is not None:
            run.lr_scheduler = run.optimizers_given[1]
        if run.lr_scheduler is None:
            run.lr_scheduler = build_scheduler(
                str(plain(args.lr_scheduler_type)),
                run.optimizer if optimizer is None else optimizer, args.get_warmup_steps(num_training_steps),
                num_training_steps, args.lr_scheduler_kwargs)
        return run.lr_scheduler

    def prepare(self, max_steps: int, checkpoint: str | None) -> None:
        """Optimizer, `accelerator.prepare`, scheduler, resume. A new model (the first `train()`, or `model_init`)
        gets a new optimizer; a scheduler the user did not pass is created anew by every `train()` (its length
        depends on that call's max_steps), through `create_scheduler`, overridden or not."""
        run, context, acc = self.run, self.context, self.context.accelerator
        new_model = run.model is not self.prepared_model
        if new_model:
            run.optimizer = None
        run.lr_scheduler = None
        self.create_optimizer()
        if new_model or run.model_wrapped is run.model:
            # An evaluation before training prepared the bare model for evaluation only (no DDP wrapper), and
            # Accelerate then treats it as prepared: without dropping that mark, `prepare` would return it
            # unwrapped and each process would train its own copy.
            forget_accelerate_prepared(run.model)
            run.model_wrapped, run.optimizer = acc.prepare(run.model, run.optimizer)
        else:
            run.optimizer = acc.prepare(run.optimizer)
        self.prepared_model = run.model
        self.create_scheduler(num_training_steps=max_steps)
        if checkpoint is not None:
            context.checkpointer.load_optimizer_and_scheduler(checkpoint)
        self.prepare_hot_path()
        self.warn_if_override_scaling_is_implicit()

    def prepare_hot_path(self) -> None:
        """What every step needs, decided once per `train()`: the step's inputs and counters, then one of the two
        engine paths (`prepare_direct_engine` or `prepare_accelerate_engine`), then the non-finite watch."""
        self.prepare_step_values()
        self.direct = uses_direct_engine(self.context.accelerator, self.run.args)
        if self.direct:
            self.prepare_direct_engine()
        else:
            self.prepare_accelerate_engine()
        self.prepare_nonfinite_watch()

    def prepare_step_values(self) -> None:
        """What every engine's step reads: the model's main input, the label shift, the scheduler's kind, the work
        counter, the forward's context, the optimizer's train(), the model's train mode, `no_sync`."""
        run, acc = self.run, self.context.accelerator
        self.num_non_embedding_params = non_embedding_parameters(run.model)
        self.main_input = getattr(run.model, "main_input_name", "input_ids")
        self.label_shift = is_causal_lm(run.model)
        self.scheduler_steps_on_metrics = steps_on_metrics(run.lr_scheduler)
        # HF's _get_learning_rate: a metric-driven scheduler's LR is the optimizer's.
        self.lr_from_scheduler = not self.scheduler_steps_on_metrics and hasattr(run.lr_scheduler, "get_last_lr")
        # The labels of the first micro-batch are checked against the model's own loss (loopkit/first_batch.py).
        self.labels_unchecked = run.compute_loss_func is None and not self.compute_loss_overridden()
        # HF's FLOP estimate depends on the main input's shape only: computed once per shape, unless overridden.
        self.work = WorkCounter(self.main_input, self.floating_point_ops, cache_by_shape=not self.overrides(
            "floating_point_ops"), input_tokens=run.args.include_num_input_tokens_seen,
            pad_token_id=getattr(run.processing_class, "pad_token_id", None))
        # The forward's context: HF's autocast_smart_context_manager (a no-op here: Accelerate wraps the forward)
        # unless a subclass overrides it or compute_loss_context_manager; then theirs, at every micro-batch.
        self.forward_context = None if self.overrides("compute_loss_context_manager") or \
            self.overrides("autocast_smart_context_manager") else NO_CONTEXT
        self.clip_params = list(run.model_wrapped.parameters())
        self.inner_optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
        # optimizer.train() reaches only schedule-free style optimizers (Accelerate forwards it when the wrapped
        # optimizer has one); decided once instead of a getattr chain per micro-batch.
        self.optimizer_train = run.optimizer.train if has_train_mode(self.inner_optimizer) else None
        self.train_mode = TrainMode(run.model_wrapped)
        # Accelerate's no_sync asks the process state whether it is distributed at every call (a PartialState
        # built and environment variables read); it is a plain nullcontext on one process. DeepSpeed accumulates
        # (and reduces) gradients in its engine: HF's loop syncs every micro-batch there, as this does.
        self.no_sync = acc.no_sync if acc.use_distributed and not is_deepspeed(acc) else None
        self.gradient_state = acc.gradient_state

    def prepare_direct_engine(self) -> None:
        """One process or DDP, no loss scaler: the step calls torch itself (`loss.backward()`, torch's clip, the
        inner optimizer's `step()`, `grad = None`), with Accelerate's numerics, and sets `sync_gradients` as a
        plain attribute (Accelerate's setter only adds a TPU check; these engines are never on a TPU)."""
        self.set_sync_gradients = None
        self.engine_backward = {}

    def prepare_accelerate_engine(self) -> None:
        """Every other engine (FSDP, DeepSpeed, tensor parallelism, a loss scaler, LOMO): the step goes through
        Accelerate's backward, clip, optimizer and scheduler wrappers, and its `sync_gradients` setter."""
        acc = self.context.accelerator
        self.set_sync_gradients = sync_gradients_setter(acc.gradient_state)
        # The loss is already divided by the micro-batches of the window (or normalised over its tokens): DeepSpeed's
        # engine would divide it by its gradient_accumulation_steps again (HF's training_step passes the same).
        self.engine_backward = {"scale_wrt_gas": False} if is_deepspeed(acc) else {}

    def prepare_nonfinite_watch(self) -> None:
        """The `nonfinite` policy's device-side watch; "skip" and "stop" need a fused optimizer (or a scaler)."""
        acc = self.context.accelerator
        if self.nonfinite is None:
            return
        self.nonfinite.start(acc.device)
        if self.nonfinite.policy in ("skip", "stop") and acc.scaler is None and \
                not self.inner_optimizer.defaults.get("fused"):
            raise config_error("nonfinite", self.nonfinite.policy, f"skipping a step without waiting for the "
                               f"device needs a fused optimizer, and {type(self.inner_optimizer).__name__} is "
                               f"not fused", "use optim='adamw_torch_fused' (the default), or nonfinite='raise'")

    def warn_if_override_scaling_is_implicit(self) -> None:
        """Say which loss-scaling rule an overridden `compute_loss` falls under, where the choice matters."""
        run = self.run
        if not self.compute_loss_overridden() or self.loss_is_scaled_for_ga is not None or \
                run.args.gradient_accumulation_steps == 1:
            return
        message = implicit_scaling_warning(run)
        if message is not None:
            warnings.warn(message)

    def compute_loss_overridden(self) -> bool:
        return self.overrides("compute_loss")

    def overrides(self, name: str) -> bool:
        """Whether HF's overridable method `name` is not the step stage's own (a subclass's, or a `Loop`
        subclass's bound onto this stage: loopkit/trainer/overridable.py)."""
        return name in vars(self) or getattr(type(self), name) is not getattr(StepStage, name)

    # -- loss (HF's rules: loopkit/loss.py) --
    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        return NO_CONTEXT  # Accelerate applies autocast by wrapping model.forward, as in Trainer

    def compute_loss_context_manager(self):
        """The context of every forward, training and evaluation: `autocast_smart_context_manager`'s (HF)."""
        return self.autocast_smart_context_manager()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """HF's: the model's loss, or `compute_loss_func`'s, or the label smoother's (loopkit/loss.py)."""
        loss, outputs = compute_loss(self.run, self.context.accelerator, model, inputs, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def count_loss_items(self, batches) -> torch.Tensor | None:
        """`num_items_in_batch`: label tokens != -100 over the whole window (summed over processes), a device
        tensor, or None when the loss does not take it (loopkit/loss.py)."""
        return count_loss_items(self.run, self.context.accelerator, batches, self.label_shift)

    def loss_is_scaled(self, num_items_in_batch) -> bool:
        return loss_is_scaled(self.run, self.loss_is_scaled_for_ga, num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Forward and backward of one micro-batch; returns the detached loss scaled for accumulation."""
        run, context = self.run, self.context
        if self.train_mode is not None:
            self.train_mode.enter(model)
        else:
            model.train()
        if self.optimizer_train is not None:
            self.optimizer_train()
        forward_context = self.forward_context
        if forward_context is NO_CONTEXT:  # the usual case: no context to enter
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        else:
            with forward_context if forward_context is not None else self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        every = run.args.torch_empty_cache_steps
        if every is not None and run.state.global_step % every == 0:  # HF: at every micro-batch of such a step
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()
            if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
                torch.mps.clear_graph_cache()
        if not self.loss_is_scaled(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        with context.clock.span("backward"):
            if self.direct:
                loss.backward()  # = accelerator.backward here (it divides by its accumulation steps, 1)
            else:
                context.accelerator.backward(loss, **self.engine_backward,
                                             **backward_kwargs(run.args, run.lr_scheduler, run.optimizer))
        return loss.detach()

    # -- one optimizer step --
    def run_step(self, window, epoch: int, steps_in_epoch: int) -> StepResult:
        """Train on one window of micro-batches (see the module docstring for the order of events)."""
        run, events, clock = self.run, self.context.events, self.context.clock
        model, batches = run.model_wrapped, window.batches
        if self.labels_unchecked:  # once per train(): one flag test per step after that
            self.labels_unchecked = False
            check_labels(run.model, batches[0], self.label_shift)
        num_items = self.count_loss_items(batches)
        last = len(batches) - 1
        self.current_gradient_accumulation_steps = last + 1
        result = StepResult(completed=False)
        events.fire("on_step_begin")
        for i, inputs in enumerate(batches):
            self.sync_gradients(i == last)
            if i == last or self.no_sync is None:
                with clock.span("forward"):
                    result.losses.append(self.training_step(model, inputs, num_items))
            else:
                with self.no_sync(model), clock.span("forward"):
                    result.losses.append(self.training_step(model, inputs, num_items))
            self.work.count(inputs, result)
            if i != last:
                events.fire("on_substep_end")
                if run.control.should_epoch_stop or run.control.should_training_stop:
                    return result
        with clock.span("optimizer"):
            self.optimizer_step(model, result, (epoch, window.first_index, last + 1))
        state = run.state
        state.global_step += 1
        state.epoch = epoch + (window.first_index + last + 1) / steps_in_epoch
        result.completed = True
        events.fire("on_step_end")
        return result

    def sync_gradients(self, sync: bool) -> None:
        """Accelerate's `sync_gradients` flag (HF's loop sets it for every micro-batch; callbacks may read it)."""
        if self.set_sync_gradients is None:
            self.gradient_state.sync_gradients = sync
        else:
            self.set_sync_gradients(sync)

    @property
    def work_by_shape(self) -> dict | None:
        """The work counter's cache: main input shape -> (FLOPs, tokens, samples); None when FLOPs are not cached
        (an overridden `floating_point_ops`) or before training."""
        return self.work.by_shape if self.work is not None else None

    def floating_point_ops(self, inputs) -> int:
        """HF's estimate for one forward + backward: 6 x elements of the main input x non-embedding parameters; 0
        for a model without `num_parameters` (loopkit/work.py)."""
        return hf_floating_point_ops(inputs, self.main_input, self.num_non_embedding_params)

    def clip_gradients(self, model) -> torch.Tensor:
        """Pre-clip total norm; clips to `max_grad_norm` when it is positive (HF logs the norm either way). Read at
        every step, as HF does (a callback may change it)."""
        max_norm = self.run.args.max_grad_norm if self.run.args.max_grad_norm > 0 else math.inf
        if self.direct:
            return torch.nn.utils.clip_grad_norm_(self.clip_params, max_norm)
        return self.context.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def optimizer_step(self, model, result: StepResult, where=None) -> None:
        run, acc, events = self.run, self.context.accelerator, self.context.events
        if events.has_listeners("on_gradients_ready"):
            acc.unscale_gradients()  # fp16: listeners see true gradients; no-op otherwise
            events.fire("on_gradients_ready")
        result.grad_norm = self.clip_gradients(model)
        if self.nonfinite is not None:
            found_inf = self.nonfinite.observe(run.state.global_step + 1, sum(result.losses), result.grad_norm, where)
            if self.nonfinite.policy in ("skip", "stop") and acc.scaler is None:
                # The fused optimizer reads these and leaves parameters and state untouched when found_inf is 1.
                skip_fused_step_if(self.inner_optimizer, found_inf)
        events.fire("on_pre_optimizer_step")
        if self.direct:
            self.inner_optimizer.step()  # what AcceleratedOptimizer.step calls
            record_optimizer_step(run.optimizer)  # what the scheduler's wrapper of optimizer.step records
        else:
            run.optimizer.step()
        events.fire("on_optimizer_step")
        scheduler = run.lr_scheduler
        result.learning_rate = scheduler.get_last_lr()[0] if self.lr_from_scheduler else \
            run.optimizer.param_groups[0]["lr"]
        # Only Accelerate's optimizer wrapper skips a step (fp16 overflow); the direct path never calls it.
        skipped = False if self.direct else acc.optimizer_step_was_skipped
        if not skipped and not self.scheduler_steps_on_metrics:
            scheduler.step()  # a metric-driven scheduler steps after each evaluation instead (loopkit/schedule.py)
        if self.direct:
            for param in self.clip_params:  # = model.zero_grad(), without walking the module tree every step
                param.grad = None
        else:
            model.zero_grad()

    def check_nonfinite(self) -> bool:
        """One host sync: act on the non-finite steps since the last check by the `nonfinite` policy (raise, or
        warn); returns True when training must stop (policy "stop")."""
        watch = self.nonfinite
        report = watch.check() if watch is not None else None
        if report is None:
            return False
        if watch.policy == "raise":
            raise FloatingPointError(report + " (nonfinite='raise').")
        warnings.warn(report + f" (nonfinite={watch.policy!r}: those steps were not applied"
                      + (", stopping with a checkpoint)." if watch.policy == "stop" else ")."))
        return watch.policy == "stop"

    def add_param_group(self, params, **group_options) -> None:
        """Add newly trainable parameters to the optimizer and extend the scheduler to cover the new group
        (loopkit/optimizers.py: `add_param_group`), e.g. for progressive unfreezing."""
        run = self.run
        if run.optimizer is None:
            raise config_error("optimizer", None, "there is no optimizer yet", "call this from on_train_begin or later")
        add_param_group(run.optimizer, run.lr_scheduler, params, **group_options)

