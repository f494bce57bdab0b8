"""Stage 1, setup: seeding, the Accelerate state, the model (or `model_init`), and where a resumed run starts.

Contract:
* At construction, in this order (`Loop.__init__`): `begin(model)` seeds every RNG with `args.seed` (as
  `Trainer.__init__` does, so the same seed gives the same dropout masks) and notes the model given;
  `create_accelerator_and_gather()` returns the `Accelerator` and the gather function, which the `Loop`'s HF hook
  `create_accelerator_and_postprocess()` hands to the context; `track_memory()` returns the memory metrics, for the
  context too; `build(model)` builds the model from `model_init` if no model was given and moves it to the device.
* `resume_point(resume_from_checkpoint)` runs once at the start of `train()`: `"auto"` becomes the newest complete
  checkpoint in `output_dir` that every process holds (the processes agree on one), or None (a fresh start) where
  there is none; any other value is returned as given (`True` keeps Trainer's meaning: the newest, else an error).
  This is what a job restarted by its launcher or scheduler passes (docs/distributed.md, "Elastic restarts").
* `begin_training(resume_from_checkpoint, trial)` runs at the start of every `train()`: re-seeds and rebuilds the
  model when `model_init` is used, applies Liger's kernels (`use_liger_kernel`, through transformers' own
  `apply_liger_kernel`), turns on activation checkpointing, resolves the checkpoint to resume from and
  loads its weights (before `accelerator.prepare`, as HF does). It returns the checkpoint path or None. With
  With several processes and `async_save`, the asynchronous writer's process group is made here, by every process at
  the start of training, not at the first save. With `neftune_noise_alpha` it adds HF's NEFTune hook to the input embeddings (removed at `on_train_end`), with
  `debug="underflow_overflow"` HF's `DebugUnderflowOverflow` hooks, as `Trainer.train` does.
* Memory metrics (`skip_memory_metrics=False`, loopkit/memory.py): the "init" stage runs from `track_memory()` to
  `on_init_end`, the "train" stage starts in `begin_training`.
* With `torch_compile` (or a model compiled before), `begin_training` has `context.clock` count the compilations
  and their time (loopkit/compilation.py); the teardown stage stops it.

Reads `run.args`, `run.model_init`, `context.accelerator`, `context.checkpointer`, `context.clock`,
`context.memory`; writes `run.model`, `run.model_accepts_loss_kwargs`, `run.label_smoother`; makes (returns) the
context's `accelerator`, `gather_function` and `memory`. Owns HF's overridable `call_model_init(trial)`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import warnings
import sys

import torch

from ..args import LoopArgs, config_error
from ..checkpoint.lineage import checkpoints_by_recency
from ..compilation import should_watch
from ..distributed import (active_engine, agreed_checkpoint, check_deepspeed_launch, check_engines_active,
                           check_launch, deepspeed_on_cpu_processes, engine_plugins, engine_requests,
                           fill_deepspeed_config, launched_world_size, requested_engines, shard_on_cpu_processes,
                           warn_if_restarts_share_a_store)
from ..parallelism import (accelerator_parallelism, attach_on_cpu_processes, check_parallelism, check_resume,
                           cuda_processes, local_gather, ranks_share_batches)
from ..trainer import log_messages
from ..memory import MemoryTracker
from ..process import fresh_accelerate_state, mark_loop_state
from ..process_exit import settle_at_exit
from ..models import base_model
from .base import Stage
from ..errors import RuntimeConfigError, trainer_error

AUTO_RESUME = "auto"  # train(resume_from_checkpoint="auto"): resume if there is a checkpoint, else start fresh
logger = logging.getLogger("loopkit.setup")


def seed_everything(seed: int, full_determinism: bool = False) -> None:
    """Python, numpy, torch (CPU and every CUDA device): HF's `set_seed` / `enable_full_determinism`."""
    from accelerate.utils import set_seed

    if full_determinism:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    set_seed(seed)


def ddp_options(args, model) -> dict:
    """`DistributedDataParallel` keywords, as `Trainer._build_accelerator_args`: `find_unused_parameters` defaults
    to True, except for a transformers model with activation checkpointing (which it would break)."""
    find_unused = args.ddp_find_unused_parameters
    if find_unused is None:
        # A transformers model exists only once transformers.modeling_utils is imported; importing it here for a
        # plain module would import transformers' quantizers (and torchao, noisily) for nothing.
        modeling = sys.modules.get("transformers.modeling_utils")
        find_unused = modeling is None or not isinstance(model, modeling.PreTrainedModel) or not (
            getattr(model, "is_activation_checkpointing", False) or args.activation_checkpointing)
    options = {"find_unused_parameters": find_unused}
    for name in ("bucket_cap_mb", "broadcast_buffers", "static_graph"):
        if getattr(args, f"ddp_{name}") is not None:
            options[name] = getattr(args, f"ddp_{name}")
    return options


def apply_tf32(args) -> None:
    """TF32 mode as `TrainingArguments.__post_init__` sets it (for `LoopArgs`, which do it when the `Loop` is built):
    `tf32` when set; with `torch_compile` and `tf32=None`, on where the GPU has it (unless fp16 without bf16)."""
    from transformers.utils import is_torch_tf32_available
    from transformers.utils.import_utils import enable_tf32

    if args.tf32 is not None:
        if args.tf32 or is_torch_tf32_available():  # check_args refused tf32=True where it is not available
            enable_tf32(args.tf32)
    elif args.torch_compile and is_torch_tf32_available() and (not args.fp16 or args.bf16):
        enable_tf32(True)


def check_precision_runs(accelerator) -> None:
    """fp16 where Accelerate runs no float16 autocast and no gradient scaler (on a CPU): the run would be float32,
    silently, under Trainer too. Refuse it, naming what runs instead. (DeepSpeed takes fp16 from its own config.)"""
    if accelerator.mixed_precision != "fp16" or accelerator.native_amp or active_engine(accelerator) == "DeepSpeed":
        return
    raise config_error("fp16", True, f"Accelerate runs float16 mixed precision (autocast and a gradient scaler) only "
                       f"on an accelerator (a CUDA, XPU, NPU, MPS, HPU... device); on {accelerator.device.type} it "
                       f"would train in float32, silently, as Trainer does there", "set bf16=True and use_cpu=True "
                       "(bfloat16 autocast, which Accelerate runs on CPU) or leave fp16=False")


def resolve_accelerator_config(value):
    """`accelerator_config` as `TrainingArguments.__post_init__` turns it into transformers' `AcceleratorConfig` (a
    dict, a JSON file path, or None for the defaults). `LoopArgs` keeps the value as given and resolves it here, so
    that building a `LoopArgs` imports nothing from transformers."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    if value is None:
        return AcceleratorConfig()
    if isinstance(value, dict):
        return AcceleratorConfig(**value)
    if isinstance(value, str):
        return AcceleratorConfig.from_json_file(value)
    return value


def accelerator_options(args):
    """`args.accelerator_config` (HF's `AcceleratorConfig`, a dict or a JSON file) as Trainer's
    `create_accelerator_and_postprocess` reads it: Accelerate's `DataLoaderConfiguration` and the keywords of the
    `GradientAccumulationPlugin`."""
    from accelerate.utils import DataLoaderConfiguration

    config = resolve_accelerator_config(args.accelerator_config)
    options = config.to_dict()
    options.pop("use_configured_state", None)  # TrainingArguments hands it to AcceleratorState, as loopkit's do
    accumulation_kwargs = dict(options.pop("gradient_accumulation_kwargs") or {})
    # Its num_steps became gradient_accumulation_steps when the Loop was built (take_accumulation_steps, below).
    accumulation_kwargs.pop("num_steps", None)
    loader_keys = ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "non_blocking")
    dataloader_config = DataLoaderConfiguration(**{key: options.pop(key) for key in loader_keys},
                                                data_seed=args.data_seed)
    return dataloader_config, accumulation_kwargs


def dynamo_plugin(args):
    """This run's torch.compile settings for Accelerate: `torch_compile*` when set, else what the launcher exported
    (`accelerate launch --dynamo_backend ...`; none by default), as `Accelerator()` reads it."""
    from accelerate.utils import TorchDynamoPlugin

    if args.torch_compile:
        return TorchDynamoPlugin(backend=args.torch_compile_backend or "inductor", mode=args.torch_compile_mode)
    return TorchDynamoPlugin()


class SetupStage(Stage):
    """Seeding, the `Accelerator`, the model and the resume point.

    `fsdp_plugin` / `deepspeed_plugin`: Accelerate plugin objects (`accelerate.utils.FullyShardedDataParallelPlugin`,
    `DeepSpeedPlugin`) handed to the `Accelerator`, for `LoopArgs` (a `TrainingArguments` carries its own from
    `fsdp` / `fsdp_config` / `deepspeed`). See loopkit/distributed.py.
    """

    def __init__(self, fsdp_plugin=None, deepspeed_plugin=None):
        self.fsdp_plugin, self.deepspeed_plugin = fsdp_plugin, deepspeed_plugin
        self.neftune_hook = None  # the NEFTune forward hook of the current train()
        self.model_given = None  # the model passed to Loop: HF's default of ddp_find_unused_parameters reads it

    def begin(self, model) -> None:
        """Seed every RNG (first of all, as `Trainer.__init__` does) and note the model passed to the `Loop` (or None:
        `model_init`'s), whose class the accelerator's DDP options read."""
        self.model_given = model
        self.seed()

    def create_accelerator_and_gather(self) -> tuple:
        """The run's `Accelerator` and its gather function, returned for the context (the `Loop`'s HF hook
        `create_accelerator_and_postprocess` hands them over)."""
        accelerator = self.create_accelerator()
        # Tensor parallel over the whole launch: every rank already holds every sample (loopkit/parallelism.py).
        gather = local_gather(accelerator) if ranks_share_batches(accelerator) else accelerator.gather_for_metrics
        if self.run.args.eval_use_gather_object:  # HF: gather_for_metrics(use_gather_object=...) for non-tensor outputs
            gather = functools.partial(gather, use_gather_object=True)
        return accelerator, gather

    def track_memory(self) -> MemoryTracker:
        """The run's memory metrics (`skip_memory_metrics`, loopkit/memory.py), returned for the context with their
        "init" stage started: it ends at `on_init_end`."""
        memory = MemoryTracker(self.run.args.skip_memory_metrics)
        memory.start("init")
        return memory

    def build(self, model) -> None:
        """The model passed to the `Loop` (or `model_init`'s, for None), on the context's accelerator's device."""
        run = self.run
        check_launch(self.context.accelerator)  # processes that Accelerate did not join: refuse (distributed.py)
        warn_if_restarts_share_a_store()  # torchrun restarts over a store that keeps the killed attempt's keys
        settle_at_exit(self.context.accelerator.num_processes)  # gloo's threads done before exit (process_exit.py)
        if model is None:
            if run.model_init is None:
                raise trainer_error("`Trainer` requires either a `model` or `model_init` argument", "model", None,
                                    "Loop needs a model", "pass model=... or model_init=...", kind=RuntimeConfigError)
            model = self.call_model_init()
        self.set_model(model)

    def seed(self) -> None:
        """Seed every RNG from `args.seed` (at construction, and before each `model_init`)."""
        seed_everything(self.run.args.seed, self.run.args.full_determinism)

    def create_accelerator(self):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin

        args = self.run.args
        requests = engine_requests(args, self.fsdp_plugin, self.deepspeed_plugin)  # where FSDP / DeepSpeed was asked
        check_deepspeed_launch(requests)  # no launcher: refused now, not inside train() (distributed.py)
        # Nothing of a previous run's Accelerate state (loopkit/process.py); LoopArgs, unlike TrainingArguments, built
        # none, and keep the user's with accelerator_config={"use_configured_state": True}.
        loop_args = isinstance(args, LoopArgs)
        fresh_accelerate_state(args, args_build_no_state=loop_args, use_configured_state=loop_args and bool(
            resolve_accelerator_config(args.accelerator_config).use_configured_state))
        if loop_args:
            apply_tf32(args)
        deepspeed_on_cpu_processes(args, self.deepspeed_plugin)  # gloo where no GPU (distributed.py)
        plugins = engine_plugins(args, self.fsdp_plugin, self.deepspeed_plugin)
        requested = requested_engines(plugins)  # read before the Accelerator, which exports its own flags
        dataloader_config, accumulation_kwargs = accelerator_options(args)
        kwargs = dict(
            mixed_precision="bf16" if args.bf16 else "fp16" if args.fp16 else "no",
            cpu=args.use_cpu,
            dataloader_config=dataloader_config,
            # loopkit accumulates gradients itself (like HF Trainer), so Accelerate's own accumulation stays at 1.
            gradient_accumulation_plugin=GradientAccumulationPlugin(**accumulation_kwargs, num_steps=1),
            kwargs_handlers=[DistributedDataParallelKwargs(**ddp_options(args, self.model_given))],
        )
        kwargs["dynamo_plugin"] = dynamo_plugin(args)
        parallelism = accelerator_parallelism(args, self.model_given)  # as Trainer builds it (loopkit/parallelism.py)
        check_parallelism(parallelism, args, requested)
        on_cpu_processes = parallelism is not None and launched_world_size() > 1 and not cuda_processes(args)
        if parallelism is not None and not on_cpu_processes:
            kwargs["parallelism_config"] = parallelism  # as Trainer hands it over
        accelerator = Accelerator(**kwargs, **plugins)
        mark_loop_state()
        # Accelerate's state is one per process and keeps the first Accelerator's plugin: without this, a Loop after
        # one with torch_compile=True (a notebook, a test suite) would compile its model too.
        accelerator.state.dynamo_plugin = kwargs["dynamo_plugin"]
        shard_on_cpu_processes(accelerator, plugins, requested)  # FSDP2 on gloo processes (distributed.py)
        if on_cpu_processes:  # the device mesh on gloo processes (loopkit/parallelism.py)
            attach_on_cpu_processes(accelerator, parallelism)
        check_engines_active(accelerator, requested, requests)  # an engine Accelerate dropped silently: refuse instead
        fill_deepspeed_config(accelerator, args)  # a launcher's or plugin's "auto" values, as HF Trainer fills them
        check_precision_runs(accelerator)
        return accelerator

    def call_model_init(self, trial=None):
        model_init = self.run.model_init
        n_args = len(inspect.signature(model_init).parameters)
        if n_args > 1:
            raise config_error("model_init", model_init, "it must take no argument or one (the trial)",
                               "define model_init() or model_init(trial)")
        model = model_init(trial) if n_args == 1 else model_init()
        if model is None:
            raise config_error("model_init", model_init, "it returned None", "return the model from model_init")
        return model

    def set_model(self, model) -> None:
        """Make `model` the run's model: on the device, introspected for how its loss is computed."""
        run, context = self.run, self.context
        # A model split by device_map places itself; FSDP and DeepSpeed place (and shard) it in `prepare`.
        if getattr(model, "hf_device_map", None) is None and active_engine(context.accelerator) is None:
            model = model.to(context.accelerator.device)
        run.model = model
        if hasattr(getattr(model, "config", None), "use_cache"):
            model.config.use_cache = run.args.use_cache
        base = base_model(model)
        if hasattr(base, "accepts_loss_kwargs"):
            run.model_accepts_loss_kwargs = bool(base.accepts_loss_kwargs)
        else:
            params = inspect.signature(base.forward).parameters.values()
            run.model_accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        run.label_smoother = label_smoother(run.args, model)

    def resume_point(self, resume_from_checkpoint):
        """`resume_from_checkpoint` with `"auto"` resolved: the newest complete checkpoint in `output_dir` that every
        process holds (each lists its usable ones, newest first; the first of the main process's list that every
        process holds wins), or None where no process holds one. Other values are returned as given."""
        if not isinstance(resume_from_checkpoint, str) or resume_from_checkpoint != AUTO_RESUME:
            return resume_from_checkpoint
        checkpointer, output_dir = self.context.checkpointer, self.run.args.output_dir
        newest_first = reversed(checkpoints_by_recency(output_dir, checkpointer.format))
        usable = [os.path.basename(r.path) for r in newest_first if checkpointer.checkpoint_problem(r.path) is None]
        name = agreed_checkpoint(usable, self.context.accelerator, output_dir)
        if self.context.accelerator.is_main_process:
            logger.info(f'resume_from_checkpoint="auto": ' + (f"resuming from {name}, the newest complete checkpoint "
                        f"in {output_dir}" if name else f"no checkpoint in {output_dir}: starting fresh"))
        return os.path.join(output_dir, name) if name else None

    def begin_training(self, resume_from_checkpoint, trial=None):
        run, context, args = self.run, self.context, self.run.args
        context.memory.start("train")
        if should_watch(args):  # compilations and their time, for the run report (the teardown stops it)
            context.clock.watch_compilations()
        if run.model_init is not None:  # a new model: the step stage then builds a new optimizer for it
            self.seed()
            self.set_model(self.call_model_init(trial))
        if args.use_liger_kernel:  # where Trainer.train applies them: at every train(), on model_init's model too
            from transformers.integrations.liger import apply_liger_kernel  # Trainer's own (and its ImportError)

            apply_liger_kernel(run.model, args.liger_kernel_config)
        if args.activation_checkpointing:
            enable = (getattr(run.model, "activation_checkpointing_enable", None)
                      or getattr(run.model, "gradient_checkpointing_enable", None))
            if enable is None:
                raise config_error("gradient_checkpointing", True, f"{type(run.model).__name__} has no "
                                   "gradient_checkpointing_enable()", "use a transformers model or turn it off")
            kwargs = args.activation_checkpointing_kwargs or args.gradient_checkpointing_kwargs
            enable(gradient_checkpointing_kwargs=kwargs) if "gradient" in enable.__name__ else enable(
                activation_checkpointing_kwargs=kwargs)
        self.add_training_hooks()
        checkpoint = context.checkpointer.start(resume_from_checkpoint)  # also: which run the coming saves belong to
        if getattr(context.checkpointer, "async_save", False) and context.accelerator.num_processes > 1:
            context.checkpointer.async_group()  # now, by every process: a group made at a save can fail mid-run
        log_messages.log_loading_checkpoint(checkpoint)
        if checkpoint is not None:
            check_resume(context.accelerator, checkpoint)  # tensor parallel: refused (loopkit/parallelism.py)
            context.checkpointer.load_model_before_prepare(run.model, checkpoint)
        return checkpoint

    def add_training_hooks(self) -> None:
        """NEFTune's embedding noise and the underflow/overflow detector, where `Trainer.train` adds them. (HF adds
        a new detector at every `train()`, and so does this.)"""
        run, context, args = self.run, self.context, self.run.args
        if args.neftune_noise_alpha is not None:
            from transformers.integrations.neftune import activate_neftune

            self.neftune_hook = activate_neftune(run.model, args.neftune_noise_alpha, context.accelerator)
        if any(getattr(option, "value", option) == "underflow_overflow" for option in args.debug):
            from transformers.debug_utils import DebugUnderflowOverflow

            DebugUnderflowOverflow(run.model)

    def remove_training_hooks(self) -> None:
        """HF removes the NEFTune hook when training ends, so evaluation and inference see clean embeddings."""
        if self.neftune_hook is not None:
            from transformers.integrations.neftune import deactivate_neftune

            deactivate_neftune(self.run.model, self.neftune_hook, self.context.accelerator)
            self.neftune_hook = None

    # -- events (a stage hears each before the callbacks) --
    def on_init_end(self, args, state, control, **kwargs):
        self.context.memory.stop_and_update_metrics("init")

    def on_train_end(self, args, state, control, **kwargs):
        self.remove_training_hooks()

    def on_train_failed(self, args, state, control, **kwargs):
        self.remove_training_hooks()


def label_smoother(args, model):
    """HF's `LabelSmoother(epsilon=label_smoothing_factor)`, or None; HF turns it off (with a warning) for
    multi-label classification."""
    if not args.label_smoothing_factor:
        return None
    if getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification":
        warnings.warn("Label smoothing is not compatible with multi-label classification. Disabling label smoothing "
                      "for this training run.", UserWarning)
        return None
    from transformers.trainer_pt_utils import LabelSmoother

    return LabelSmoother(epsilon=args.label_smoothing_factor)


def take_accumulation_steps(args) -> None:
    """`accelerator_config`'s `gradient_accumulation_kwargs={"num_steps": n}`, as Trainer's
    `create_accelerator_and_postprocess` takes it at construction: `gradient_accumulation_steps` becomes n (and
    `num_steps` 1 in that dict, in place, as there), unless `gradient_accumulation_steps` is above 1 too."""
    if args.accelerator_config is None:
        return
    kwargs = resolve_accelerator_config(args.accelerator_config).gradient_accumulation_kwargs
    if not kwargs or "num_steps" not in kwargs:
        return
    if args.gradient_accumulation_steps > 1:
        raise trainer_error(
            "The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is greater than 1 in the "
            "passed `TrainingArguments`If using the passed `AcceleratorConfig` is desired, do not set the "
            "`TrainingArguments` `gradient_accumulation_steps`.",
            "accelerator_config", {"gradient_accumulation_kwargs": dict(kwargs)},
            f"num_steps is a second gradient-accumulation setting next to gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}", "drop num_steps, or leave gradient_accumulation_steps at 1")
    args.gradient_accumulation_steps = kwargs["num_steps"]
    kwargs["num_steps"] = 1
