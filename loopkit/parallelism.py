"""`parallelism_config` (Accelerate's `ParallelismConfig`): the device mesh of data-parallel replicas, FSDP2 shards
and tensor-parallel groups, handed to Accelerate as HF Trainer hands it.

Trainer passes `args.parallelism_config` to `Accelerator(parallelism_config=...)`; for a model loaded tensor-parallel
(`from_pretrained(..., tp_plan="auto")` or a `DistributedConfig`, so `model.tp_size > 1`) it sets the config's
`tp_size` and `dp_shard_size` from the model, creating one when none was given (`Trainer._build_accelerator_args`).
loopkit does the same (`accelerator_parallelism`), and Accelerate builds the mesh, shards the model
(`fsdp2_prepare_model` over the mesh's data-parallel dimensions) and gives each data-parallel rank its own batches
(tensor-parallel ranks share theirs).

On CPU processes (gloo), Accelerate refuses any mesh larger than one process: its check accepts only FSDP2, an
accelerator process group or DeepSpeed, and on `MULTI_CPU` FSDP is only set after the `Accelerator` exists
(loopkit/distributed.py, `shard_on_cpu_processes`). There `attach_on_cpu_processes` does, after that, what
`Accelerator.__init__` does with the config (build the mesh on the process's device type, run Accelerate's own
check). That is how the CPU test suite proves it (tests/test_parallelism.py), a step beyond Trainer, which raises
Accelerate's ValueError on CPU processes.

Where the ranks share their batches (tensor parallel over the whole launch), the evaluation keeps each rank's outputs
instead of gathering copies (`local_gather`), and loopkit's streaming metrics are refused when an evaluation starts
(`check_streaming_metrics`). Resuming a tensor-parallel run is refused at `train()` (`check_resume`): its
checkpoint's optimizer state holds rank 0's shards only, as Trainer writes it.

Refused at construction, naming what they need (`check_parallelism`): context parallelism (`cp_size > 1`: torch's
ring attention over SDPA on CUDA GPUs, with FSDP2) and sequence parallelism (`sp_size > 1`: DeepSpeed's Ulysses, on
GPUs), whose per-step input splitting loopkit does not implement; `dp_shard_size > 1` without FSDP (Accelerate
would run plain DDP and shard nothing); and tensor parallelism with FSDP2 where Accelerate's preparation of it fails
with the installed transformers (Accelerate 1.15 imports a class transformers 5.24 removed; Trainer fails there at
`train()`).
"""

from __future__ import annotations

from .distributed import env_flag
from .errors import config_error
from .private_api import set_parallel_size, validate_parallelism


def check_parallelism(config, args, engines: list[str]) -> None:
    """What the run's `ParallelismConfig` (`accelerator_parallelism`) asks for that this machine or this run cannot
    give, refused at construction. `engines`: the engines the run asks for (distributed.py `requested_engines`)."""
    if config is None:
        return
    from accelerate import ParallelismConfig

    if not isinstance(config, ParallelismConfig):
        raise config_error("parallelism_config", type(config).__name__, "it must be Accelerate's ParallelismConfig",
                           "pass accelerate.ParallelismConfig(dp_replicate_size=..., dp_shard_size=..., tp_size=...)")
    if config.cp_size > 1:
        machine = "" if cuda_processes(args) else "; it also needs CUDA GPUs, and this run's processes have none"
        raise config_error("parallelism_config.cp_size", config.cp_size, "context parallelism (torch's ring attention "
                           "over SDPA, with FSDP2) splits every batch along the sequence inside the training step "
                           f"(Trainer's _prepare_context_parallel_inputs), which loopkit does not implement{machine}",
                           "set cp_size=1, or train with transformers.Trainer on CUDA GPUs")
    if config.sp_size > 1:
        machine = "" if "DeepSpeed" in engines else "; it also needs DeepSpeed, on GPUs, which this run does not use"
        raise config_error("parallelism_config.sp_size", config.sp_size, f"sequence parallelism (sp_backend="
                           f"{config.sp_backend!r}: DeepSpeed's Ulysses) needs its own loss and data loader adapter "
                           f"in the training step, which loopkit does not implement{machine}",
                           "set sp_size=1, or train with transformers.Trainer and DeepSpeed on GPUs")
    if config.tp_size > 1 and "FSDP" in engines and not replicate_parallel_available():
        # Accelerate's `_prepare_tp` under FSDP2 imports transformers' ReplicateParallel, which this transformers no
        # longer has: HF Trainer fails there at train().
        raise config_error("parallelism_config.tp_size", config.tp_size, "tensor parallelism combined with FSDP2 "
                           "(dp_shard_size > 1) fails in Accelerate's preparation with the installed transformers "
                           "(Accelerate imports transformers.integrations.tensor_parallel.ReplicateParallel, which "
                           "it no longer has)", "run tensor parallelism without FSDP (dp_shard_size=1, no fsdp), or "
                           "FSDP2 / HSDP without tensor parallelism, or install an Accelerate and transformers that "
                           "agree on it")
    if config.dp_shard_size > 1 and "FSDP" not in engines:
        raise config_error("parallelism_config.dp_shard_size", config.dp_shard_size, "the dp_shard dimension shards "
                           "the model with FSDP2, and FSDP is not configured, so Accelerate would run plain DDP",
                           "add fsdp='full_shard' and fsdp_config={'version': 2} to the training arguments (or "
                           "SetupStage(fsdp_plugin=...), or `accelerate launch --use_fsdp`), or set dp_shard_size=1")


def replicate_parallel_available() -> bool:
    import transformers.integrations.tensor_parallel as tensor_parallel

    return hasattr(tensor_parallel, "ReplicateParallel")


def cuda_processes(args) -> bool:
    import torch

    return torch.cuda.is_available() and not args.use_cpu and not env_flag("ACCELERATE_USE_CPU")


def accelerator_parallelism(args, model) -> object | None:
    """The `ParallelismConfig` for the `Accelerator`, as `Trainer._build_accelerator_args` builds it: the
    arguments', with `tp_size` / `dp_shard_size` taken from a model loaded tensor-parallel."""
    config = getattr(args, "parallelism_config", None)
    model_tp_size = getattr(model, "tp_size", None) or 1
    if model_tp_size > 1:
        model_dp_size = model.config.distributed_config.dp_size
        if config is None:
            from accelerate import ParallelismConfig

            config = ParallelismConfig(tp_size=model_tp_size, dp_shard_size=model_dp_size)
        else:
            config.tp_size, config.dp_shard_size = model_tp_size, model_dp_size
    return config


def attach_on_cpu_processes(accelerator, config) -> None:
    """What `Accelerator.__init__` does with a `ParallelismConfig` (the device mesh, then Accelerate's check), done
    after the `Accelerator` exists, once FSDP2 is set on CPU processes."""
    shared = accelerator.state  # Accelerate's AcceleratorState (shared by every Accelerator of the process)
    shared.parallelism_config = config
    shared.device_mesh = config.get_device_mesh(accelerator.device.type)
    if accelerator.is_fsdp2:
        validate_parallelism(config, accelerator)  # Accelerate's own check, which FSDP2 passes on any device
        return
    # DDP replicas or tensor-parallel ranks: Accelerate's check knows neither on MULTI_CPU, so its size rule here.
    # (`prepare` wraps the replicas in DDP and leaves a tensor-parallel model as it is, on every distributed type.)
    if config.total_size == 1:
        set_parallel_size(config, "dp_replicate", accelerator.num_processes)
    if config.total_size != accelerator.num_processes:
        raise ValueError(f"ParallelismConfig total_size ({config.total_size}) does not match num_processes "
                         f"({accelerator.num_processes}). Please adjust dp_replicate_size/dp_shard_size/tp_size/"
                         f"cp_size/sp_size.")


def check_resume(accelerator, checkpoint: str) -> None:
    """Resuming a tensor-parallel run is refused: its checkpoint holds the whole model (`save_pretrained` gathers
    it), but `optimizer.pt` holds rank 0's DTensor shards only, as HF Trainer 5.24 writes it, and loading the whole
    weights into the sharded parameters fails."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is not None and config.tp_enabled:
        raise config_error("resume_from_checkpoint", checkpoint, f"this run is tensor parallel (tp_size="
                           f"{config.tp_size}), and resuming one is not supported: a checkpoint's optimizer.pt "
                           "holds rank 0's shards only (as HF Trainer writes it)", "start the run anew from the "
                           "checkpoint's weights: from_pretrained(checkpoint, tp_plan='auto'); its model.safetensors "
                           "holds the whole model")


def ranks_share_batches(accelerator) -> bool:
    """Tensor (or context) parallel over the whole launch: one data-parallel group, so every rank evaluates every
    sample and holds the same outputs."""
    config = getattr(accelerator, "parallelism_config", None)
    return (accelerator.num_processes > 1 and config is not None and config.non_data_parallel_size > 1
            and config.data_parallel_size == 1)


def local_gather(accelerator):
    """The evaluation's gather where the ranks share batches: each rank already holds every sample's outputs, and
    gathering them would repeat each sample once per rank (Accelerate's `gather_for_metrics` does: 25 rows from a
    13-sample set on 2 tensor-parallel ranks). What stays of `gather_for_metrics` is what it does on one process:
    the last batch cut to the samples the dataset has (`gradient_state.remainder`)."""
    from accelerate.utils import recursively_apply

    def gather(value, use_gather_object: bool = False):
        state = accelerator.gradient_state
        if not state.end_of_dataloader or state.remainder is None or state.remainder <= 0:
            return value
        cut = lambda part: part[:state.remainder]  # noqa: E731
        return cut(value) if use_gather_object else recursively_apply(cut, value)

    return gather


def check_streaming_metrics(accelerator, metrics) -> None:
    """loopkit's streaming metrics reduce their states over every process, which repeats each sample once per rank
    where the ranks share batches: refused there, before a wrong number."""
    if metrics and ranks_share_batches(accelerator):
        config = accelerator.parallelism_config
        raise config_error("metrics", [type(m).__name__ for m in metrics], f"the ranks share their batches "
                           f"(tensor/context parallel over all {accelerator.num_processes} processes, tp_size="
                           f"{config.tp_size}, cp_size={config.cp_size}), and streaming metrics would count each "
                           "sample once per rank", "use compute_metrics (its predictions are each sample's once), or "
                           "train without tensor parallelism")
