"""Other libraries' private attributes that loopkit reads or writes, in one place.

torch, Accelerate and transformers do not promise to keep a name that starts with `_` (or an undocumented
protocol attribute) from one release to the next. Every one loopkit uses is listed in `PRIVATE_ATTRIBUTES`, with
why loopkit uses it and what happens where it is missing, and every use in loopkit goes through a function here.
tests/test_private_api.py checks, on the installed versions, that each still exists and means what loopkit relies
on (CI runs it on the pinned, newest and oldest transformers / Accelerate), and that no other module of loopkit
touches one of them itself.

Imports of torch's submodules, Accelerate and transformers are made inside the functions: `import loopkit` stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateAttribute:
    owner: str  # the class or module that has them
    names: tuple  # the private names (attributes, methods, modules) loopkit uses there
    why: str  # what loopkit needs it for
    if_missing: str  # what loopkit does on a version without it


PRIVATE_ATTRIBUTES = (
    # -- the data stage: worker processes and the loader's copies --
    PrivateAttribute("torch.utils.data.DataLoader", ("_iterator",), "the persistent workers' iterator, to stop them",
                     "the workers are left to torch, which stops them when the loader is collected"),
    PrivateAttribute("torch.utils.data.dataloader._MultiProcessingDataLoaderIter", ("_shutdown_workers",),
                     "stops the persistent workers when training ends (teardown), not at garbage collection",
                     "as for _iterator"),
    PrivateAttribute("torch.utils.data.dataloader._MultiProcessingDataLoaderIter",
                     ("_index_queues", "_worker_result_queue"),
                     "the workers' queues, whose pipes torch leaves open after _shutdown_workers",
                     "the pipes close when the garbage collector reaches the iterator"),
    PrivateAttribute("accelerate.data_loader.DataLoaderShard", ("_non_blocking",),
                     "the loader's own non-blocking copy setting, applied when loopkit moves the batches itself",
                     "blocking copies (the default)"),
    # -- the step stage: the direct (torch-only) engine path, Accelerate's flags --
    PrivateAttribute("torch.optim.lr_scheduler.LRScheduler (on the optimizer)", ("_opt_called",),
                     "the direct path calls the inner optimizer's step, which the scheduler did not wrap: loopkit "
                     "records the call as the wrapper does", "torch warns once that the scheduler stepped first"),
    PrivateAttribute("accelerate.state.GradientState", ("_set_sync_gradients",),
                     "Accelerate's setter of sync_gradients (with its TPU step), which HF's loop calls every "
                     "micro-batch", "sync_gradients is set directly (no TPU mark_step)"),
    PrivateAttribute("accelerate.Accelerator (on the model)", ("_is_accelerate_prepared",),
                     "dropped so that a model an evaluation prepared bare is wrapped for training",
                     "nothing to drop: prepare wraps the model"),
    PrivateAttribute("torch.optim (fused Adam / AdamW)", ("grad_scale", "found_inf"),
                     "GradScaler's protocol: a fused optimizer skips its step on device when found_inf is 1 "
                     "(nonfinite='skip' / 'stop')", "the test fails: the step would be applied"),
    PrivateAttribute("accelerate.Accelerator", ("_models", "_optimizers", "_schedulers", "_dataloaders"),
                     "whether an earlier train() left prepared objects (free_memory then)", "free_memory is skipped"),
    # -- Accelerate's process-wide state --
    PrivateAttribute("accelerate.state (PartialState, AcceleratorState, GradientState)",
                     ("_shared_state", "_reset_state"),
                     "Accelerate's state per process: saved, restored and reset between runs in one process",
                     "the test fails: a second Loop in a process would inherit the first one's state"),
    PrivateAttribute("accelerate.parallelism_config.ParallelismConfig", ("_validate_accelerator", "_set_size"),
                     "what Accelerator.__init__ does with the config, done once FSDP2 is set on CPU processes",
                     "the test fails: FSDP2 / tensor parallelism on CPU processes cannot be set up"),
    # -- torch --
    PrivateAttribute("torch.optim.lr_scheduler.LRScheduler", ("_last_lr",),
                     "a new parameter group's learning rate, so that get_last_lr() covers it", "not extended"),
    PrivateAttribute("torch.nn.Module", ("_parameters",), "a module's own parameters (not its children's), as "
                     "HF's get_parameter_names reads them", "the test fails: the decay groups cannot be built"),
    PrivateAttribute("torch._dynamo (OptimizedModule, callback_handler)", ("_dynamo", "_orig_mod"),
                     "a compiled model's original module; the compilations counted in the run report",
                     "the test fails"),
    PrivateAttribute("torch.serialization, torch.distributed.checkpoint (_traverse, filesystem, metadata)",
                     ("_get_layout", "_traverse", "_StorageInfo", "_MEM_FORMAT_ENCODING"),
                     "the globals DCP's pickled metadata names, allowed when loopkit reads it without running "
                     "arbitrary code; DCP's own nesting of flattened keys",
                     "the test fails: DCP folders cannot be read"),
    PrivateAttribute("torch.ops.mkldnn", ("_linear_pointwise", "_reorder_linear_weight"),
                     "oneDNN's float32 matrix product with a weight laid out for it once (inductor's CPU kernels): "
                     "the chunked loss's products with the output head on a CPU",
                     "torch.mm computes them (BLAS)"),
    PrivateAttribute("torch.ops.aten", ("_softmax",), "the softmax written over a chunk's logits in place on a CPU "
                     "(its kernel reads each row before it writes it): no second chunk-sized block",
                     "the test fails: the chunked loss needs it"),
    # -- transformers --
    PrivateAttribute("transformers.GenerationConfig", ("_from_model_config", "_get_default_generation_params"),
                     "the generation lengths HF fills in after every generate()", "the test fails"),
    PrivateAttribute("transformers.PretrainedConfig", ("_attn_implementation",), "named in the packing refusal",
                     "None is named"),
    PrivateAttribute("transformers.TrainingArguments", ("_VALID_DICT_FIELDS",),
                     "the fields that take a JSON string for a dict (also read from its source)", "the test fails"),
    PrivateAttribute("transformers.DataCollatorForLanguageModeling", ("_generator_pid",),
                     "the process that owns a seeded collator's generator, kept with it", "nothing to keep"),
)


# -- the chunked loss --
def onednn_linear():
    """oneDNN's linear product `(x, weight, bias) -> x @ weight.T + bias` and its weight layout
    `(weight, rows) -> weight laid out for products of that many rows`, or None where torch has no oneDNN."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return None
    try:
        linear, layout = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
    except (AttributeError, RuntimeError):
        return None
    return (lambda x, weight, bias=None: linear(x, weight, bias, "none", [], "")), layout


def softmax_in_place(logits):
    """The softmax of each row of `logits` (2-D, on a CPU), written over them."""
    import torch

    return torch.ops.aten._softmax.out(logits, -1, False, out=logits)


# -- the data stage --
def shut_down_persistent_workers(loader) -> None:
    """Stop the persistent worker processes of `loader` (a prepared loader or a plain `DataLoader`), now."""
    base = getattr(loader, "base_dataloader", loader)
    iterator = getattr(base, "_iterator", None)  # set only with persistent_workers
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        close_worker_queues(iterator)
        base._iterator = None


def close_worker_queues(iterator, wait_s: float = 10.0) -> None:
    """torch's `_shutdown_workers` joins the workers but leaves their queues' pipes to others: an index queue's feeder
    thread closes its pipe a moment later, and the result queue's pipe closes when the garbage collector reaches the
    iterator, both possibly after `train()` returned, while the user's process still holds them (a fd count after a
    run once found one such pipe). Close them now that no worker is left: each feeder is awaited first (bounded: one
    stuck on a full pipe is left to torch, as torch leaves it). The queues' own `_thread`, `_reader` and `_writer`
    are multiprocessing's."""
    queues = [*getattr(iterator, "_index_queues", ()), getattr(iterator, "_worker_result_queue", None)]
    for queue in filter(None, queues):
        feeder = getattr(queue, "_thread", None)  # multiprocessing.Queue's feeder, started by the first put
        if feeder is not None:
            feeder.join(wait_s)
            if feeder.is_alive():
                continue
        for end in (getattr(queue, "_reader", None), getattr(queue, "_writer", None)):
            if end is not None and not end.closed:
                end.close()


def non_blocking_copies(loader) -> bool:
    """Whether a prepared loader copies its batches to the device without blocking (`non_blocking` in Accelerate's
    `DataLoaderConfiguration`)."""
    return getattr(loader, "_non_blocking", False)


# -- the step stage --
def record_optimizer_step(optimizer) -> None:
    """What torch's scheduler-wrapped `optimizer.step` records (`_opt_called`): the direct engine path calls the
    inner optimizer's step, so the scheduler's first `step()` would otherwise warn that it ran first."""
    optimizer._opt_called = True


def sync_gradients_setter(gradient_state):
    """Accelerate's setter of `GradientState.sync_gradients` (it adds a TPU `mark_step`), or a plain setter."""
    setter = getattr(gradient_state, "_set_sync_gradients", None)
    return setter if setter is not None else lambda sync: setattr(gradient_state, "sync_gradients", sync)


def forget_accelerate_prepared(model) -> None:
    """Drop Accelerate's mark that `model` was prepared, so that the next `prepare` wraps it (DDP, ...)."""
    vars(model).pop("_is_accelerate_prepared", None)


def skip_fused_step_if(optimizer, found_inf) -> None:
    """GradScaler's protocol with a fused optimizer: its next `step()` changes nothing where `found_inf` (a device
    tensor) is 1, without the host reading it."""
    optimizer.grad_scale, optimizer.found_inf = None, found_inf


def holds_prepared_objects(accelerator) -> bool:
    """Whether `accelerator` still holds objects an earlier `prepare` returned."""
    return any(getattr(accelerator, name, None) for name in ("_models", "_optimizers", "_schedulers", "_dataloaders"))


# -- Accelerate's process-wide state --
def accelerate_shared_states() -> list[dict]:
    """The dictionaries every `PartialState`, `AcceleratorState` and `GradientState` of this process share."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return [PartialState._shared_state, AcceleratorState._shared_state, GradientState._shared_state]


def reset_accelerate_state(gradient_state: bool = True) -> None:
    """Forget Accelerate's process state (as its tests do), so that the next one is built from scratch."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    if gradient_state:
        GradientState._reset_state()


def validate_parallelism(config, accelerator) -> None:
    """Accelerate's own check of a `ParallelismConfig` against the accelerator."""
    config._validate_accelerator(accelerator)


def set_parallel_size(config, dimension: str, size: int) -> None:
    """Set one dimension's size of a `ParallelismConfig` (e.g. "dp_replicate")."""
    config._set_size(dimension, size)


# -- torch --
def scheduler_last_lrs(scheduler) -> list | None:
    """The scheduler's list behind `get_last_lr()`, or None."""
    return getattr(scheduler, "_last_lr", None)


def own_parameter_names(module) -> list[str]:
    """The names of `module`'s own parameters, not its children's."""
    return list(module._parameters)


def compiled_module(model):
    """`model` if it is a `torch.compile` wrapper (`OptimizedModule`), or a module compiled in place; else None."""
    import torch

    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or "_orig_mod" in vars(model):
        return model
    return None


def original_module(compiled):
    """The module a `torch.compile` wrapper (or a module compiled in place) runs."""
    return vars(compiled)["_orig_mod"] if "_orig_mod" in vars(compiled) else compiled._orig_mod


def set_original_module(compiled, module) -> None:
    compiled._orig_mod = module


def dynamo_callbacks():
    """torch's compilation callbacks: the handler (`register_start_callback`, ...) and the trigger of a Dynamo
    compilation (not a lazily compiled backward)."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    return callback_handler, CallbackTrigger.DYNAMO


def torch_layout_lookup():
    """torch's `_get_layout`, which pickled DCP metadata names to rebuild a tensor layout."""
    import torch.serialization

    return torch.serialization._get_layout


def dcp_storage_info_class():
    """DCP's `_StorageInfo`: where a stored item lies (`relative_path`, `offset`, `length`)."""
    from torch.distributed.checkpoint import filesystem

    return filesystem._StorageInfo


def dcp_private_classes() -> dict:
    """(module, name) -> object, for the private globals DCP's pickled metadata names: its storage entry and the
    memory formats' enum."""
    from torch.distributed.checkpoint import metadata

    return {("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_storage_info_class(),
            ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): metadata._MEM_FORMAT_ENCODING}


def dcp_set_element():
    """DCP's `set_element(root, path, value)`: a value put back at its place in a nested state dict."""
    from torch.distributed.checkpoint._traverse import set_element

    return set_element


# -- transformers --
def fill_generation_defaults(config) -> None:
    """What `generate` does to a generation config: mark it as no longer the model config's, fill unset values."""
    if config._from_model_config:  # HF: so that `generate` does not rebuild it from the model config each time
        config._from_model_config = False
    config.update(**config._get_default_generation_params(), defaults_only=True)


def attention_implementation(config) -> str | None:
    return getattr(config, "_attn_implementation", None)


TRAINING_ARGUMENTS_DICT_FIELDS = "_VALID_DICT_FIELDS"  # the class attribute, also read from its source (args/fields.py)


def training_arguments_dict_fields() -> tuple:
    """`TrainingArguments`' fields that take a JSON string for a dict."""
    from transformers import TrainingArguments

    return tuple(getattr(TrainingArguments, TRAINING_ARGUMENTS_DICT_FIELDS))


COLLATOR_GENERATOR_ATTRIBUTES = ("generator", "_generator_pid")  # a seeded HF collator's generator and its owner
