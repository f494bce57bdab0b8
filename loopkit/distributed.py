"""Distributed training through Accelerate: the checks that keep a launch honest, and FSDP / DeepSpeed configuration.

loopkit never builds the training process group. The launcher (`torchrun`, `accelerate launch`) starts the
processes, and the `Accelerator` that the setup stage creates joins them and decides the engine: DDP, FSDP or
DeepSpeed. The rest of the loop only asks the accelerator (`num_processes`, `gather`, `reduce`, `no_sync`,
`wait_for_everyone`); the guards' and the asynchronous writer's small gloo groups are made when `train()` starts.

Elastic restarts (docs/distributed.md): `agreed_checkpoint` gives every process the same checkpoint for
`resume_from_checkpoint="auto"`; `torchrun` is `python -m loopkit torchrun`, torchrun with a rendezvous store per
round and an exit status that says preempted.

Two ways a launch can silently train something other than what was asked, both refused here:
* **Processes that do not know each other.** On a machine without CUDA, `torchrun --nproc_per_node 2` (or
  `accelerate launch --multi_gpu`) without `ACCELERATE_USE_CPU=1` starts two processes whose `torch.distributed` is
  initialised, but Accelerate reports a single process (`DistributedType.NO`): each trains its own copy on its own
  data and the copies drift apart, with no error. `check_launch` raises instead.
* **An engine that was dropped.** Accelerate uses FSDP only under a distributed launch: with an FSDP plugin in a
  plain `python train.py` it runs one unsharded process, silently; a second `Accelerator` in a process ignores any
  plugin passed to it. `check_engines_active` raises when FSDP or DeepSpeed was asked for and is not active.

FSDP and DeepSpeed are configured as with HF Trainer (`TrainingArguments(fsdp=..., fsdp_config=...)`, which builds
`fsdp_plugin_args`, or `deepspeed=...`, which builds `deepspeed_plugin`), by Accelerate plugin objects
(`SetupStage(fsdp_plugin=..., deepspeed_plugin=...)`), or by the launcher (`accelerate launch --use_fsdp`, a config
file with DeepSpeed). FSDP2 runs on GPUs and, through `shard_on_cpu_processes`, on CPU processes (gloo): the same
Accelerate path, which is how the CPU test suite proves it (tests/test_fsdp.py). Checkpoints then hold the model and
the optimizer through Accelerate's FSDP functions or the DeepSpeed engine (loopkit/checkpoint/engines.py, used by
loopkit/storage/hf.py), as HF Trainer does; with FSDP's SHARDED_STATE_DICT each rank
writes its shards (`pytorch_model_fsdp_0/`, `optimizer_0/`), and such a checkpoint resumes at any number of
processes, sharded or not, as does an ordinary one in a sharded run. Sharded folders are read by loopkit, with
Accelerate's options, through loopkit/dcp_reading.py: torch's own reader, which Accelerate's `load_fsdp_*` build,
unpickles a folder's `.metadata`. DeepSpeed runs on GPUs and, through `deepspeed_on_cpu_processes`, on CPU processes
(gloo), where the CPU test suite runs the real engine against HF Trainer (tests/test_deepspeed.py).
"""

from __future__ import annotations

import os

from .private_api import (accelerate_shared_states, compiled_module, holds_prepared_objects, original_module,
                          reset_accelerate_state, set_original_module)


class DistributedSetupError(RuntimeError):
    """The processes, or the engine Accelerate chose, are not what the launch asked for. The message says how to
    launch correctly."""


def env_flag(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes", "on")


def launched_world_size() -> int:
    """How many processes the launcher started: torch.distributed's world size once it is initialised, else the
    `WORLD_SIZE` the launcher exported (1 for a plain `python script.py`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


CPU_LAUNCH = ("ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {n} train.py   (or: ACCELERATE_USE_CPU=1 accelerate "
              "launch --multi_gpu --num_processes {n} --num_machines 1 --mixed_precision no --dynamo_backend no "
              "train.py)")


def check_launch(accelerator) -> None:
    """Refuse to train when the launcher started several processes but Accelerate joined a different number (on a
    CPU machine: one each, the silent trap described above)."""
    launched = launched_world_size()
    if launched <= 1 or accelerator.num_processes == launched:
        return
    import torch

    device = "torch sees a CUDA device" if torch.cuda.is_available() else "torch sees no CUDA device"
    raise DistributedSetupError(
        f"The launcher started {launched} processes (WORLD_SIZE={os.environ.get('WORLD_SIZE')}, torch.distributed "
        f"initialised: {_dist_initialised()}), but Accelerate runs "
        f"{accelerator.num_processes} process(es) (distributed_type={accelerator.distributed_type.value}, device "
        f"{accelerator.device}; {device}). Each process would train its own copy of the model on its own data and "
        f"the copies would drift apart, so loopkit refuses to train. Fix: on a machine without GPUs force "
        f"Accelerate's CPU mode: {CPU_LAUNCH.format(n=launched)}, or pass use_cpu=True in the training arguments. "
        f"On a GPU machine, check that every process sees a GPU (torch.cuda.is_available(), CUDA_VISIBLE_DEVICES) "
        f"and launch with `accelerate launch --num_processes {launched} train.py` or `torchrun --nproc_per_node "
        f"{launched} train.py`.")


def agreed_checkpoint(names: list[str], accelerator, output_dir: str) -> str | None:
    """The checkpoint every process resumes from, given this process's usable checkpoint folder names, newest first:
    the first of the main process's names that every process holds (one all-gather of the names), or None where no
    process holds any. Processes that hold checkpoints but none in common (an `output_dir` on node-local disks
    without `save_on_each_node`) are refused: each would resume a different step."""
    if accelerator.num_processes == 1:
        return names[0] if names else None
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, names)
    return common_checkpoint(every, output_dir)


def common_checkpoint(every: list[list[str]], output_dir: str) -> str | None:
    """`agreed_checkpoint`'s choice from each process's names (by process index, each newest first)."""
    common = [name for name in every[0] if all(name in held for held in every)]
    if common:
        return common[0]
    if any(every):
        held = "; ".join(f"process {rank}: {', '.join(names) or 'none'}" for rank, names in enumerate(every))
        raise DistributedSetupError(
            f'resume_from_checkpoint="auto": the processes hold no complete checkpoint in common in {output_dir} '
            f"({held}), so they cannot resume the same step. Fix: put output_dir on a disk every node shares, or "
            f"set save_on_each_node=True so that each node keeps its own copy; or resume from a path every node "
            f"holds.")
    return None


# torchrun's switch for a rendezvous store of each round's own (torch/distributed/elastic/rendezvous/
# dynamic_rendezvous.py): without it, restarted workers join over the agent's store, which still holds the killed
# attempt's keys.
OWN_STORE_PER_ROUND = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
PREEMPTED_EXIT_CODES = (128 + 15, 128 + 2)  # a worker that left after SIGTERM / SIGINT (loopkit/guards.py)


def warn_if_restarts_share_a_store() -> None:
    """Under torchrun with `--max-restarts` and its default shared rendezvous store, a restarted process reads the
    addresses the killed attempt's processes published when it joins the process group: gloo refuses them
    ("Connection refused") or, where a port was reused, waits until the group's timeout; each such restart spends
    one of `--max-restarts` (measured: docs/distributed.md, "Elastic restarts"). Say so, once, on the main process."""
    restarts = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not restarts.isdigit() or int(restarts) == 0 \
            or os.environ.get("RANK", "0") != "0":
        return
    import warnings

    warnings.warn(f"torchrun restarts these processes (--max-restarts {restarts}) over its shared rendezvous store, "
                  f"where a restarted process can read the killed attempt's addresses when it joins (gloo: "
                  f"'Connection refused', or a wait until ddp_timeout), spending further restarts. Launch with "
                  f"`python -m loopkit torchrun ...` (torchrun with {OWN_STORE_PER_ROUND}=1), or export "
                  f"{OWN_STORE_PER_ROUND}=1 for torchrun.")


def torchrun(argv: list[str]) -> int:
    """`python -m loopkit torchrun [torchrun's arguments]`: torchrun, with two changes a cluster needs
    (docs/distributed.md, "Elastic restarts" and "Preemption"): each rendezvous round gets a store of its own
    (`OWN_STORE_PER_ROUND`), and the exit status says preempted: when torchrun itself was signalled (by the
    scheduler), 128 + the signal (torchrun exits 1), and when its workers all left after SIGTERM or SIGINT with no
    restart left, their status. Any other failure ends as torchrun's does."""
    os.environ.setdefault(OWN_STORE_PER_ROUND, "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(argv)
    except SignalException as stop:
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        codes = {failure.exitcode for failure in failed.failures.values()}
        if len(codes) == 1 and codes <= set(PREEMPTED_EXIT_CODES):
            return codes.pop()
        raise
    return 0


def _dist_initialised() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def prepare_iterable_train_loader(accelerator, dataloader):
    """Prepare a training loader over an `IterableDataset` so that its plain iteration is already this process's
    share. With several processes Accelerate's default for iterable data dispatches (process 0 reads each global
    batch and sends the slices), but only inside its own iterator, which reads one batch ahead; the data stage
    iterates the underlying loader instead (loopkit/data_order.py), which would give every process the same batches.
    Without dispatching, Accelerate wraps the dataset in `IterableDatasetShard`: each process reads the stream and
    keeps its slice of every global batch, the same samples a single process with the global batch would see."""
    config = accelerator.dataloader_config
    dispatch = config.dispatch_batches
    config.dispatch_batches = False
    try:
        return accelerator.prepare(dataloader)
    finally:
        config.dispatch_batches = dispatch


# ---------------------------------------------------------------------------------------------------------------
# FSDP and DeepSpeed: what is handed to Accelerate, and the check that it took it
# ---------------------------------------------------------------------------------------------------------------
def engine_plugins(args, fsdp_plugin=None, deepspeed_plugin=None) -> dict:
    """`fsdp_plugin` / `deepspeed_plugin` keyword arguments for `Accelerator(...)`: the plugin objects passed to the
    setup stage, else the ones `TrainingArguments` built from `fsdp` / `fsdp_config` / `deepspeed` (HF Trainer's
    `FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)` and `args.deepspeed_plugin`). Only what is set is
    returned, so a run without them passes nothing and Accelerate falls back to the launcher's environment."""
    from .errors import config_error

    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if fsdp_plugin is not None and plugin_args:
        raise config_error("fsdp_plugin", type(fsdp_plugin).__name__, "the training arguments configure FSDP too "
                           "(fsdp / fsdp_config)", "configure FSDP in one place: the plugin or the arguments")
    if fsdp_plugin is None and plugin_args:
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
    args_deepspeed = getattr(args, "deepspeed_plugin", None)
    if deepspeed_plugin is not None and args_deepspeed is not None:
        raise config_error("deepspeed_plugin", type(deepspeed_plugin).__name__, "the training arguments configure "
                           "DeepSpeed too (deepspeed=...)", "configure DeepSpeed in one place: the plugin or the "
                           "arguments")
    deepspeed_plugin = deepspeed_plugin if deepspeed_plugin is not None else args_deepspeed
    if fsdp_plugin is not None:
        check_fsdp_version(fsdp_plugin)
    kwargs = {}
    if fsdp_plugin is not None:
        kwargs["fsdp_plugin"] = fsdp_plugin
    if deepspeed_plugin is not None:
        kwargs["deepspeed_plugin"] = deepspeed_plugin
    return kwargs


def check_fsdp_version(plugin) -> None:
    """loopkit builds the optimizer before `accelerator.prepare` wraps the model, which is right for FSDP2 only."""
    from .errors import config_error

    if getattr(plugin, "fsdp_version", 2) != 2:
        raise config_error("fsdp_config['version']", plugin.fsdp_version, "loopkit supports FSDP2 only (FSDP1 is "
                           "deprecated in transformers 5.x and needs the optimizer built after wrapping)",
                           "use fsdp_config={'version': 2} (the default), FullyShardedDataParallelPlugin("
                           "fsdp_version=2) or `accelerate launch --use_fsdp --fsdp_version 2`")


def requested_engines(plugins: dict) -> list[str]:
    """The engines asked for, by plugin or by the launcher's environment (`accelerate launch --use_fsdp` exports
    ACCELERATE_USE_FSDP=true). Read before the `Accelerator` exists: creating it with a plugin sets those variables."""
    requested = []
    if plugins.get("fsdp_plugin") is not None or env_flag("ACCELERATE_USE_FSDP"):
        requested.append("FSDP")
    if plugins.get("deepspeed_plugin") is not None or env_flag("ACCELERATE_USE_DEEPSPEED"):
        requested.append("DeepSpeed")
    return requested


def shard_on_cpu_processes(accelerator, plugins: dict, requested: list[str]) -> None:
    """FSDP2 on CPU processes (gloo), the way a GPU launch sets it up. Accelerate 1.15 turns an FSDP request into
    `DistributedType.FSDP` only in the `AcceleratorState` branch for accelerator process groups (MULTI_GPU, MULTI_NPU,
    ...; accelerate/state.py), so on `MULTI_CPU` the plugin is dropped and DDP runs. Everything downstream runs on
    CPU unchanged: `prepare` -> `fsdp2_prepare_model` (torch's `fully_shard`, a CPU device mesh over gloo), the
    DTensor-aware `clip_grad_norm_`, `save_fsdp_model` / `save_fsdp_optimizer` (torch's distributed checkpoint;
    loading mirrors `load_fsdp_*`: `load_engine_model`). So this sets, after the `Accelerator` exists, exactly what
    that branch sets: the distributed type (in both shared states, as Accelerate does), the plugin (built from the
    launcher's FSDP_* variables when FSDP was asked by `accelerate launch --use_fsdp`, as `Accelerator.__init__`
    builds it) and its mixed precision."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    shared = accelerator.state  # Accelerate's AcceleratorState (shared by every Accelerator of the process)
    if "FSDP" not in requested or shared.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = plugins.get("fsdp_plugin") or FullyShardedDataParallelPlugin()
    if shared.mixed_precision != "no":
        plugin.set_mixed_precision(shared.mixed_precision)
    shared.fsdp_plugin = plugin
    shared.distributed_type = DistributedType.FSDP
    accelerate_shared_states()[0]["distributed_type"] = DistributedType.FSDP  # PartialState's


def deepspeed_on_cpu_processes(args, deepspeed_plugin=None) -> None:
    """DeepSpeed on CPU processes (gloo), the way a GPU launch sets it up (nccl). Accelerate 1.15 picks a backend only
    for a device (its gloo branch is for `cpu=True`, which turns DeepSpeed off), so on a machine without one it hands
    DeepSpeed none: each process joins torch.distributed (DeepSpeed's CPU default, gloo), but Accelerate counts one
    process and DeepSpeed refuses the batch sizes (under HF Trainer too). Where DeepSpeed was asked for under a
    launch of several processes and torch sees no accelerator device, this builds Accelerate's process state with
    gloo, before the `Accelerator`: a state the user set up with a backend (`use_configured_state`) is kept, one set up
    without (`TrainingArguments` builds it) is reset, as `TrainingArguments` itself resets it. The DeepSpeed config
    that `TrainingArguments` filled for the one process it saw ("auto" batch sizes) is filled again for this world
    size, as `TrainingArguments.__post_init__` fills it."""
    import torch
    from accelerate.state import PartialState

    asked = (deepspeed_plugin is not None or getattr(args, "deepspeed_plugin", None) is not None
             or env_flag("ACCELERATE_USE_DEEPSPEED"))
    if not asked or launched_world_size() <= 1 or torch.accelerator.is_available():
        return
    if accelerate_shared_states()[0].get("backend") is not None:
        return
    from datetime import timedelta

    reset_accelerate_state(gradient_state=False)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as Accelerator(deepspeed_plugin=...) sets it for its state
    PartialState(backend="gloo", timeout=timedelta(seconds=getattr(args, "ddp_timeout", 1800)))
    if getattr(args, "hf_deepspeed_config", None) is not None and getattr(args, "deepspeed", None):
        from accelerate.utils import DeepSpeedPlugin
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(args.deepspeed)
        args.hf_deepspeed_config.trainer_config_process(args)
        args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)


def fill_deepspeed_config(accelerator, args) -> None:
    """A DeepSpeed plugin that `TrainingArguments(deepspeed=...)` did not build (the launcher's, from `accelerate launch
    --use_deepspeed` or its config file, or one passed to the setup stage): its "auto" values (batch sizes,
    accumulation, clipping, optimizer settings) filled from the training arguments, as HF Trainer's
    `propagate_args_to_deepspeed` does. `LoopArgs` has no `world_size`: the accelerator's process count stands in."""
    if active_engine(accelerator) != "DeepSpeed" or getattr(args, "hf_deepspeed_config", None) is not None:
        return
    from transformers.integrations.deepspeed import propagate_args_to_deepspeed

    propagate_args_to_deepspeed(accelerator, args if hasattr(args, "world_size") else
                                WithWorldSize(args, accelerator.num_processes))


class WithWorldSize:
    """`args`, read-only, with a `world_size`."""

    def __init__(self, args, world_size: int):
        self.args, self.world_size = args, world_size

    def __getattr__(self, name):
        return getattr(self.args, name)


def active_engine(accelerator) -> str | None:
    """"FSDP", "DeepSpeed" or None (DDP or a single process), as Accelerate runs it."""
    kind = getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))
    return {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed"}.get(kind)


def unwrap_model(accelerator, model, keep_torch_compile: bool = True):
    """`accelerator.unwrap_model(model)`, without the import of DeepSpeed it makes (where DeepSpeed is installed) to
    recognise DeepSpeed's engine: 0.6 s on a CPU, paid inside the first checkpoint save. When DeepSpeed is not the
    engine (or is imported already) nothing can be wrapped in its engine, and the wrappers left are those Accelerate
    strips without it: torch.compile's and DDP's (FSDP2 wraps nothing)."""
    import sys

    if active_engine(accelerator) == "DeepSpeed" or "deepspeed" in sys.modules:
        return accelerator.unwrap_model(model, keep_torch_compile=keep_torch_compile)
    import torch

    compiled = compiled_module(model)  # a torch.compile wrapper, or compiled regions: the top module compiled in place
    if compiled is not None:
        model = original_module(compiled)
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    while isinstance(model, wrappers):
        model = model.module
    if compiled is not None and keep_torch_compile:
        set_original_module(compiled, model)
        return compiled
    return model


def engine_requests(args, fsdp_plugin=None, deepspeed_plugin=None) -> dict[str, list[str]]:
    """Where each engine asked for comes from, as the refusals name it: the field and its value, the plugin object
    passed to the setup stage, or the variable in `os.environ` (exported by `accelerate launch --use_fsdp` /
    `--use_deepspeed`, or left behind by an earlier `Trainer` or `Accelerator` of this process). Read before the
    `Accelerator` exists: creating it with a plugin sets those variables."""
    requests = {}
    for engine, field, plugin in (("FSDP", "fsdp", fsdp_plugin), ("DeepSpeed", "deepspeed", deepspeed_plugin)):
        variable, value = f"ACCELERATE_USE_{engine.upper()}", getattr(args, field, None)
        found = [f"{field}={short_repr(value)}"] if value else []
        if plugin is not None:
            found.append(f"SetupStage({field}_plugin={type(plugin).__name__}(...))")
        if env_flag(variable):
            found.append(f"os.environ[{variable!r}]={os.environ[variable]!r}")
        if found:
            requests[engine] = found
    return requests


def short_repr(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + " ..."


def request_fix(engine: str, requests: dict[str, list[str]]) -> str:
    """The way out that each source of the request needs (a leftover variable: unset it)."""
    variable = f"ACCELERATE_USE_{engine.upper()}"
    fixes = []
    if any(source.startswith("os.environ") for source in requests.get(engine, [])):
        fixes.append(f"if no launcher exported {variable} (an earlier Trainer or Accelerator in this process left it "
                     f"set, e.g. a Trainer refused with 'Using fsdp only works in distributed training'), remove it: "
                     f"del os.environ[{variable!r}]")
    field = "fsdp" if engine == "FSDP" else "deepspeed"
    fixes.append(f"drop the {engine} configuration ({field}=..., {field}_plugin=...) to train without {engine}")
    return "; or ".join(fixes)


# What torchrun exports to each process, and what DeepSpeed needs to join a process group without a launcher of its
# own (deepspeed/comm/comm.py `init_distributed`; otherwise it asks MPI, through mpi4py, or AzureML / SageMaker).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ONE_PROCESS = ("os.environ.update(MASTER_ADDR='localhost', MASTER_PORT='29500', RANK='0', LOCAL_RANK='0', "
               "WORLD_SIZE='1')")
DEEPSPEED_FINDS_ITS_PROCESSES = ("AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV")  # its AzureML and SageMaker paths


def check_deepspeed_launch(requests: dict[str, list[str]]) -> None:
    """DeepSpeed asked for in a process no launcher started (a notebook, `python train.py`): Accelerate accepts it,
    and `train()` fails inside `deepspeed.initialize` (`No module named 'mpi4py'`: DeepSpeed looks for MPI), under HF
    Trainer too. Refused when the `Loop` is built instead, naming what asked for DeepSpeed and the fix. One process
    is legitimate with the variables a launcher sets (HF's recipe for DeepSpeed in a notebook), or under MPI."""
    import importlib.util

    if "DeepSpeed" not in requests or _dist_initialised() or all(name in os.environ for name in LAUNCHER_VARIABLES) \
            or any(name in os.environ for name in DEEPSPEED_FINDS_ITS_PROCESSES) \
            or importlib.util.find_spec("mpi4py") is not None:
        return
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    raise DistributedSetupError(
        f"DeepSpeed was asked for by {' and '.join(requests['DeepSpeed'])}, but no launcher started this process "
        f"({', '.join(missing)} not set, torch.distributed not initialised, no MPI), so DeepSpeed could not join a "
        f"process group and train() would fail inside deepspeed.initialize (No module named 'mpi4py'), as under HF "
        f"Trainer. Fix: launch the script with `torchrun --nproc_per_node N train.py` (or `python -m loopkit "
        f"torchrun ...`, or `accelerate launch --use_deepspeed ...`); for one process in a notebook, set what a "
        f"launcher sets before building the Loop: {ONE_PROCESS}; or {request_fix('DeepSpeed', requests)}.")


def check_engines_active(accelerator, requested: list[str], requests: dict[str, list[str]] | None = None) -> None:
    """Raise when FSDP or DeepSpeed was asked for but Accelerate is running something else. `requests`: where each
    was asked for (`engine_requests`), named in the message."""
    active = active_engine(accelerator)
    if active == "FSDP":  # also a plugin Accelerate built from the launcher's environment
        check_fsdp_version(accelerator.state.fsdp_plugin)
    missing = [engine for engine in requested if engine != active]
    if not missing:
        return
    engine, requests = missing[0], requests or {}
    asked = " and ".join(requests.get(engine, [])) or f"a plugin, the training arguments or ACCELERATE_USE_" \
                                                      f"{engine.upper()}"
    raise DistributedSetupError(
        f"{engine} was asked for by {asked}, but "
        f"Accelerate runs distributed_type={accelerator.distributed_type.value} with {accelerator.num_processes} "
        f"process(es) on {accelerator.device}, so training would silently run without {engine}. Accelerate uses "
        f"{engine} only under a distributed launch, and "
        f"only from the first Accelerator of a process. Fix: launch with `accelerate launch --num_processes 2 "
        f"{'--use_fsdp ' if engine == 'FSDP' else '--use_deepspeed '}train.py`"
        f"{' (on CPU: ' + CPU_LAUNCH.format(n=2) + ')' if engine == 'FSDP' else ''}; or "
        f"{request_fix(engine, requests)}.")


def release_earlier_run(accelerator) -> None:
    """HF's `accelerator.free_memory()` at the start of training, when an earlier `train()` / `evaluate()` left
    prepared objects to let go of. Its `gc.collect()` takes 0.1-0.6 s in a process that has imported transformers,
    for nothing on a first `train()`, where nothing was prepared yet."""
    if accelerator.step or holds_prepared_objects(accelerator):
        accelerator.free_memory()


# The FSDP / DeepSpeed checkpoint I/O that lived here is in loopkit/checkpoint/engines.py (the checkpoint layer,
# above this one). An earlier import from here answers with the new place.
MOVED_TO_CHECKPOINT_ENGINES = frozenset((
    "FSDP_MODEL_FOLDER", "FSDP_OPTIMIZER_FOLDER", "full_state_dict_saved", "sharded_model_saved",
    "model_loads_after_prepare", "deepspeed_keeps_weights", "deepspeed_checkpoint_present",
    "check_deepspeed_resumable", "save_engine_state", "load_engine_model", "sharded_state_dict_options",
    "load_sharded_model", "load_optimizer_state", "DEEPSPEED_STATE_CLASSES", "deepspeed_state_classes",
    "load_deepspeed_checkpoint", "weights_only_loads", "load_sharded_optimizer",
    "load_whole_optimizer_into_shards", "engine_checkpoint_present",
))


def __getattr__(name):
    if name in MOVED_TO_CHECKPOINT_ENGINES:
        raise ImportError(f"loopkit.distributed.{name} moved to loopkit.checkpoint.engines.{name}: import it from "
                          f"there (the checkpoint layer; loopkit.distributed holds the launch checks only).")
    raise AttributeError(f"module 'loopkit.distributed' has no attribute {name!r}")
