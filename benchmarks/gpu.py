"""The GPU variant: bf16 training of a GPT-2-small-sized Llama (124 M parameters, tied embeddings, 50,304-token
vocabulary, 1,024-token sequences) under the hand-written loop, HF Trainer and loopkit, alternating run by run;
tokens/s, MFU against the device's peak bf16 throughput, peak CUDA memory and host syncs per step.

Run it on any CUDA machine, from the repository root, after the README's set-up (loopkit installed, plus a CUDA
build of torch):

    python -m benchmarks.gpu                          # writes benchmarks/results/gpu-<device>.{json,md}
    python -m benchmarks.gpu --peak-tflops 989        # when the device is not in PEAK_BF16_TFLOPS below
    python -m benchmarks.gpu --device cpu --tiny      # a seconds-long dry run of the same code on a CPU
    python -m benchmarks.gpu --fsdp 8                 # loopkit sharded (FSDP2) on 8 GPUs: gpu-fsdp-<device>.{json,md}
    python -m benchmarks.gpu --device cpu --tiny --fsdp 2   # its dry run on 2 CPU processes (gloo)
    python -m benchmarks.gpu --liger                  # HF Trainer and loopkit with use_liger_kernel: gpu-liger-<device>
    python -m benchmarks.gpu --device cpu --tiny --liger    # its dry run (every Liger kernel off: Triton needs a GPU)

The FSDP2 variant launches `torchrun --nproc_per_node N -m benchmarks.gpu --fsdp-worker ...` (with
`ACCELERATE_USE_CPU=1` on a CPU): loopkit with Accelerate's FSDP2 plugin (one unit per decoder layer, sharded
state dict, bf16 mixed precision), the same model, data and steps; per rank it reports tokens/s, peak CUDA memory
and the bytes of the local shards of parameters, gradients and AdamW state. One GPU (`--fsdp 1`) runs the same path
without sharding anything: the per-rank memory falls only with N.

The Liger variant trains the same model with HF Trainer and loopkit, each with `use_liger_kernel=True` (Liger's
Triton kernels: RMSNorm, SwiGLU, RoPE and the fused linear cross-entropy, applied by transformers'
`apply_liger_kernel` at `train()`) and without, one worker process per run kind (Liger patches transformers' Llama
module for the whole process). It reports time per step and peak CUDA memory for each, how many modules run a Liger
forward, and checks that Trainer and loopkit with Liger end at the same probe loss. On a CPU (`--device cpu`) the
kernels cannot run (Triton has no CPU driver), so the dry run passes a `liger_kernel_config` that turns every kernel
off: it checks the script, not the kernels (tests/test_liger.py checks that both apply the same kernels).

MFU = achieved model FLOP/s / the device's dense bf16 peak, with model FLOPs per token = 6 N + 12 L H T (N: the
parameters that take part in matmuls, the tied output projection included; L layers, H hidden size, T sequence
length; the PaLM / nanoGPT estimate, forward + backward, no activation recomputation).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .contenders.names import CONTENDERS
from .harness.environment import describe
from .harness.runner import REPO_ROOT, Suite
from .reports.verdicts import check_runs, comparison_row, median, merge_checks
from .workloads.spec import TrainSpec

MODULE = "benchmarks.gpu"
TITLE = "GPU: bf16, GPT-2-small-sized Llama"

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, in TFLOP/s. The first match wins, so the
# more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0),
    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0),
)


def device_peak_tflops(name: str) -> float | None:
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in name:
            return tflops
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def flops_per_token(model, seq_len: int) -> float:
    config = model.config
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings().weight
    matmul_parameters = sum(p.numel() for p in model.parameters() if p is not embedding)
    if output is embedding:  # tied: the output projection is a matmul with the embedding's weights
        matmul_parameters += embedding.numel()
    return 6 * matmul_parameters + 12 * config.num_hidden_layers * config.hidden_size * seq_len


def gpu_train_steps(contender: str, spec: dict, warmup_steps: int, output_dir: str, count_syncs: bool = False) -> dict:
    """Train `spec.max_steps` steps; time those after `warmup_steps`, synchronizing the device at both ends."""
    import gc

    import torch

    from .contenders.clock import StepClock
    from .contenders.run import train
    from .harness.syncs import HostReadCounter
    from .workloads.checks import probe_loss
    from .workloads.data import heldout_rows

    spec = TrainSpec.from_dict(spec)
    cuda = spec.device.startswith("cuda")
    synchronize = torch.cuda.synchronize if cuda else None
    clock = StepClock(sync_at=(warmup_steps, spec.max_steps), synchronize=synchronize)
    counter = HostReadCounter()
    if count_syncs:
        clock.listeners.append(lambda step: setattr(counter, "active", warmup_steps <= step < spec.max_steps))
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if count_syncs:
        with counter:
            result = train(contender, spec, clock, output_dir)
    else:
        result = train(contender, spec, clock, output_dir)
    timed_steps = spec.max_steps - warmup_steps
    seconds_per_step = (clock.ends[-1] - clock.ends[warmup_steps - 1]) / timed_steps
    reply = {
        "seconds_per_step": seconds_per_step,
        "tokens_per_second": spec.samples_per_step * spec.seq_len / seconds_per_step,
        "flops_per_token": flops_per_token(result.model, spec.seq_len),
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "global_step": result.global_step,
        "probe_loss": probe_loss(result.model, heldout_rows(spec, 8), spec.device),
        "syncs_per_step": counter.total() / timed_steps if count_syncs else None,
        "sync_sites": counter.per_site(timed_steps) if count_syncs else None,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
    }
    del result  # free the device for the next contender: the three workers share one GPU
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return reply


def fsdp_train_steps(args) -> dict:
    """One rank of the FSDP2 variant (run under torchrun): train the spec sharded; time the steps after warm-up."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    from loopkit.memory import ShardBytes
    from loopkit.stages.setup import SetupStage

    from .contenders.clock import ClockCallback, StepClock
    from .contenders.hf import build_trainer
    from .workloads.data import train_dataset
    from .workloads.models import build_model

    spec, warmup = spec_from(args), warmup_steps_of(args)
    cuda = spec.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    clock = StepClock(sync_at=(warmup, spec.max_steps), synchronize=torch.cuda.synchronize if cuda else None)
    shards = ShardBytes()  # this rank's bytes of parameters, gradients and optimizer state

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            state_dict_type="SHARDED_STATE_DICT")
    loop = build_trainer("loopkit", spec, build_model(spec), args.fsdp_worker + ".run",
                         train_dataset(spec), callbacks=[ClockCallback(clock), shards],
                         setup=SetupStage(fsdp_plugin=plugin))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    loop.train()
    seconds_per_step = (clock.ends[-1] - clock.ends[warmup - 1]) / (spec.max_steps - warmup)
    acc = loop.accelerator
    return {"rank": acc.process_index, "num_processes": acc.num_processes, "is_fsdp2": acc.is_fsdp2,
            "distributed_type": str(acc.distributed_type), "seconds_per_step": seconds_per_step,
            "tokens_per_second": spec.samples_per_step * acc.num_processes * spec.seq_len / seconds_per_step,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "shard_bytes": shards.bytes, "losses": [e["loss"] for e in loop.state.log_history if "loss" in e],
            "device_name": torch.cuda.get_device_name() if cuda else "cpu"}


# Every Liger kernel off (apply_liger_kernel_to_llama's switches): the CPU dry run, where Triton cannot run.
LIGER_OFF = {"rope": False, "cross_entropy": False, "fused_linear_cross_entropy": False, "rms_norm": False,
             "swiglu": False}
LIGER_RUNS = {"hf": ("hf", True), "loopkit": ("loopkit", True), "hf-plain": ("hf", False),
              "loopkit-plain": ("loopkit", False)}


def liger_modules(model) -> int:
    """Modules whose forward is Liger's (the model's own forward counts too, for the fused loss)."""
    return sum(getattr(module.forward, "__module__", "").startswith("liger_kernel") for module in model.modules())


def liger_train_steps(run_kind: str, spec: dict, warmup_steps: int, output_dir: str) -> dict:
    """One run of the Liger variant: `run_kind` names the contender and whether Liger is on (LIGER_RUNS)."""
    import torch

    from .contenders.clock import ClockCallback, StepClock
    from .contenders.hf import build_trainer
    from .workloads.checks import probe_loss
    from .workloads.data import heldout_rows, train_dataset
    from .workloads.models import build_model

    contender, liger = LIGER_RUNS[run_kind]
    spec = TrainSpec.from_dict(spec)
    cuda = spec.device.startswith("cuda")
    clock = StepClock(sync_at=(warmup_steps, spec.max_steps), synchronize=torch.cuda.synchronize if cuda else None)
    overrides = {"use_liger_kernel": liger, "liger_kernel_config": None if cuda or not liger else LIGER_OFF}
    model = build_model(spec)
    trainer = build_trainer(contender, spec, model, output_dir, train_dataset(spec),
                            callbacks=[ClockCallback(clock)], args_overrides=overrides)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    seconds_per_step = (clock.ends[-1] - clock.ends[warmup_steps - 1]) / (spec.max_steps - warmup_steps)
    reply = {"seconds_per_step": seconds_per_step,
             "tokens_per_second": spec.samples_per_step * spec.seq_len / seconds_per_step,
             "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
             "liger_modules": liger_modules(trainer.model), "global_step": trainer.state.global_step,
             "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
             "probe_loss": probe_loss(trainer.model, heldout_rows(spec, 8), spec.device),
             "device_name": torch.cuda.get_device_name(0) if cuda else "cpu"}
    del trainer, model
    if cuda:
        torch.cuda.empty_cache()
    return reply


def run_liger(args) -> dict:
    """HF Trainer and loopkit, with and without Liger, alternating round by round (one worker per run kind)."""
    suite = Suite(size="full", out_dir=args.out, threads=0 if args.device.startswith("cuda") else 1)
    spec, warmup = spec_from(args), warmup_steps_of(args)
    rounds = (1, args.rounds) if not args.tiny else (0, 1)
    try:
        with suite.workers(names=tuple(LIGER_RUNS), prefix="gpu-liger-") as workers:
            replies = measured_replies(suite, workers, rounds, "liger_train_steps", "run_kind", spec, warmup)
    finally:
        suite.cleanup()
    with_liger = {c: replies[c] for c in ("hf", "loopkit")}
    # bf16 on a GPU is not bitwise reproducible across differently ordered kernels: a loose tolerance.
    check = merge_checks(*check_runs(with_liger, "probe_loss", 2e-2, "final probe loss"),
                         *check_runs(with_liger, "global_step", 0, "optimizer steps"))
    rows = [comparison_row("time per optimizer step, Liger on", "ms/step",
                           {c: [r["seconds_per_step"] * 1e3 for r in with_liger[c]] for c in with_liger}, check)]
    summary = {kind: {"ms_per_step": median([r["seconds_per_step"] * 1e3 for r in runs]),
                      "peak_memory_gb": max((r["peak_memory_gb"] or 0) for r in runs) or None,
                      "liger_modules": runs[0]["liger_modules"], "probe_loss": runs[-1]["probe_loss"]}
               for kind, runs in replies.items()}
    return {"title": "GPU: Liger kernels (use_liger_kernel) under HF Trainer and loopkit, bf16", "rows": rows,
            "runs": summary, "kernels_off": not args.device.startswith("cuda"),
            "device_name": replies["hf"][0]["device_name"], "spec": spec.to_dict(),
            "environment": describe(0),
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(suite.started))}


def liger_markdown(section: dict) -> str:
    from .reports.tables import comparison_table, fmt

    spec = section["spec"]
    lines = [f"# {section['title']}\n",
             f"- Device: {section['device_name']}"
             + ("; every Liger kernel off (a dry run: Triton needs a GPU)" if section["kernels_off"] else ""),
             f"- Work: batch {spec['batch_size']} x accumulation {spec['grad_accum']} x {spec['seq_len']} tokens "
             f"per step; run {section['started_at']}\n", comparison_table(section["rows"]), "",
             "| run | ms/step (median) | peak CUDA memory (GB) | modules on Liger's forward | probe loss |",
             "|---|---|---|---|---|"]
    for kind, run in section["runs"].items():
        lines.append(f"| {kind} | {fmt(run['ms_per_step'])} | {fmt(run['peak_memory_gb'])} | "
                     f"{run['liger_modules']} | {fmt(run['probe_loss'])} |")
    return "\n".join(lines)


def run_fsdp(args) -> dict:
    """Launch the FSDP2 variant on `args.fsdp` processes and collect each rank's reply."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-fsdp-") as scratch:
        out = os.path.join(scratch, "rank")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                      os.environ.get("PYTHONPATH")])))
        if not args.device.startswith("cuda"):
            env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
        forwarded = [a for a in argv_of(args) if a]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.fsdp),
                   "--master_port", str(free_port()), "--module", MODULE, "--fsdp-worker", out, *forwarded]
        started = time.time()
        subprocess.run(command, env=env, cwd=REPO_ROOT, check=True)
        ranks = [json.loads(Path(f"{out}{r}.json").read_text()) for r in range(args.fsdp)]
    spec = spec_from(args)
    return {"title": f"GPU: loopkit FSDP2 on {args.fsdp} process(es), bf16", "ranks": ranks, "spec": spec.to_dict(),
            "launch_seconds": time.time() - started, "environment": describe(0),
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started))}


def argv_of(args) -> list[str]:
    """The options that decide the work, for the workers' command line."""
    return ["--device", args.device, "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum),
            "--seq-len", str(args.seq_len), "--warmup-steps", str(args.warmup_steps), "--timed-steps",
            str(args.timed_steps), "--tiny" if args.tiny else ""]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_markdown(section: dict) -> str:
    from .reports.tables import fmt

    spec, ranks = section["spec"], section["ranks"]
    lines = [f"# {section['title']}\n",
             f"- Device: {ranks[0]['device_name']}; {ranks[0]['distributed_type']}, FSDP2: {ranks[0]['is_fsdp2']}",
             f"- Work: batch {spec['batch_size']} per process x accumulation {spec['grad_accum']} x {spec['seq_len']} "
             f"tokens; run {section['started_at']}\n",
             "| rank | ms/step | tokens/s (all ranks) | peak CUDA memory (GB) | local shards: params + grads + AdamW "
             "(MB) | last loss |", "|---|---|---|---|---|---|"]
    for r in ranks:
        shards = sum(r["shard_bytes"].values()) / 2**20
        lines.append(f"| {r['rank']} | {fmt(r['seconds_per_step'] * 1e3)} | {fmt(r['tokens_per_second'])} | "
                     f"{fmt(r['peak_memory_gb'])} | {fmt(shards)} | {fmt(r['losses'][-1] if r['losses'] else None)} |")
    return "\n".join(lines)


def device_versions() -> dict:
    import torch

    return {"device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda",
                        help="cuda (default; choose the GPU with CUDA_VISIBLE_DEVICES) or cpu for a dry run")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama and a few steps (checks the script)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps of each run not timed")
    parser.add_argument("--timed-steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one warm-up round first)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, TFLOP/s")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    parser.add_argument("--fsdp", type=int, default=None, metavar="N",
                        help="the FSDP2 variant: loopkit sharded over N processes (one per GPU)")
    parser.add_argument("--fsdp-worker", default=None, help=argparse.SUPPRESS)  # set by the FSDP2 launch
    parser.add_argument("--liger", action="store_true",
                        help="the Liger variant: HF Trainer and loopkit with and without use_liger_kernel")
    return parser.parse_args(argv)


def warmup_steps_of(args) -> int:
    return args.warmup_steps if not args.tiny else 2


def spec_from(args) -> TrainSpec:
    spec = TrainSpec(model="llama-gpt2-small", seq_len=args.seq_len, batch_size=args.batch_size,
                     grad_accum=args.grad_accum, max_steps=args.warmup_steps + args.timed_steps,
                     learning_rate=6e-4, warmup_steps=args.warmup_steps, weight_decay=0.1, max_grad_norm=1.0,
                     logging_steps=10, device=args.device, bf16=True)
    if args.tiny:
        spec = spec.replace(seq_len=32, batch_size=2, grad_accum=2, logging_steps=2,
                            model_overrides=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=2, num_key_value_heads=2, vocab_size=256),
                            max_steps=warmup_steps_of(args) + 4)
    return spec.replace(num_train=spec.samples_per_step * spec.max_steps)


def train_keywords(suite, name: str, spec: TrainSpec, warmup: int) -> dict:
    """What every timed training request of worker `name` is given: the spec, the warm-up steps, its scratch folder."""
    return {"spec": spec.to_dict(), "warmup_steps": warmup, "output_dir": suite.scratch_dir(f"gpu-{name}")}


def measured_replies(suite, workers: dict, rounds: tuple[int, int], function: str, keyword: str, spec: TrainSpec,
                     warmup: int) -> dict[str, list]:
    """Each worker's replies to `function` (given the worker's name as `keyword`), the workers taking turns within
    every round; the warm-up rounds' replies are dropped."""
    replies = {name: [] for name in workers}
    for _, is_warmup in suite.rounds(*rounds):
        for name, worker in workers.items():
            reply = worker.request(MODULE, function, **{keyword: name}, **train_keywords(suite, name, spec, warmup))
            if not is_warmup:
                replies[name].append(reply)
    return replies


def run(args) -> dict:
    suite = Suite(size="full", out_dir=args.out, threads=0 if args.device.startswith("cuda") else 1)
    spec = spec_from(args)
    warmup = warmup_steps_of(args)
    rounds = (1, args.rounds) if not args.tiny else (0, 1)
    try:
        with suite.workers(prefix="gpu-") as workers:
            device = workers["raw"].request(MODULE, "device_versions")
            suite.say(f"gpu: {device['device_name']}, {rounds[0]}+{rounds[1]} rounds of {spec.max_steps} steps")
            replies = measured_replies(suite, workers, rounds, "gpu_train_steps", "contender", spec, warmup)
            syncs = {c: workers[c].request(MODULE, "gpu_train_steps", contender=c, count_syncs=True,
                                           **train_keywords(suite, c, spec, warmup)) for c in CONTENDERS}
    finally:
        suite.cleanup()
    peak = args.peak_tflops or device_peak_tflops(device["device_name"])
    flops = replies["raw"][0]["flops_per_token"]
    # bf16 on a GPU is not bitwise reproducible across differently ordered kernels: a loose tolerance.
    check = merge_checks(*check_runs(replies, "probe_loss", 2e-2, "final probe loss"),
                         *check_runs(replies, "global_step", 0, "optimizer steps"))
    tokens = {c: [r["tokens_per_second"] for r in replies[c]] for c in CONTENDERS}
    rows = [comparison_row("time per optimizer step", "ms/step",
                           {c: [r["seconds_per_step"] * 1e3 for r in replies[c]] for c in CONTENDERS}, check)]
    mfu = {c: (median(tokens[c]) * flops / (peak * 1e12) if peak else None) for c in CONTENDERS}
    peak_memory = {c: max((r["peak_memory_gb"] or 0) for r in replies[c]) or None for c in CONTENDERS}
    return {"title": TITLE, "rows": rows, "device": device, "peak_tflops": peak, "flops_per_token": flops,
            "tokens_per_second": tokens, "mfu": mfu, "peak_memory_gb": peak_memory,
            "syncs_per_step": {c: syncs[c]["syncs_per_step"] for c in CONTENDERS},
            "sync_sites": {c: syncs[c]["sync_sites"] for c in CONTENDERS},
            "spec": spec.to_dict(), "environment": {**describe(0), "device": device["device_name"]},
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(suite.started))}


def markdown(section: dict) -> str:
    from .reports.tables import comparison_table, fmt

    device = section["device"]
    spec = section["spec"]
    versions = ", ".join(f"{k} {v}" for k, v in section["environment"]["versions"].items())
    lines = [f"# {section['title']}\n",
             f"- Device: {device['device_name']} (CUDA {device['cuda']}), dense bf16 peak "
             f"{fmt(section['peak_tflops'])} TFLOP/s; host CPU {section['environment']['cpu_model']}",
             f"- Software: {versions}; run {section['started_at']}",
             f"- Work: batch {spec['batch_size']} x accumulation {spec['grad_accum']} x {spec['seq_len']} tokens "
             f"per step, {fmt(section['flops_per_token'] / 1e9)} GFLOP per token\n",
             comparison_table(section["rows"]), "",
             "| | " + " | ".join(CONTENDERS) + " |", "|---|" + "---|" * len(CONTENDERS),
             "| tokens/s (median) | " + " | ".join(fmt(median(section["tokens_per_second"][c])) for c in CONTENDERS)
             + " |",
             "| MFU | " + " | ".join(f"{section['mfu'][c]:.1%}" if section["mfu"][c] is not None else "n/a (pass "
                                    "--peak-tflops)" for c in CONTENDERS) + " |",
             "| peak CUDA memory (GB) | " + " | ".join(fmt(section["peak_memory_gb"][c]) for c in CONTENDERS) + " |",
             "| host syncs per step | " + " | ".join(fmt(section["syncs_per_step"][c]) for c in CONTENDERS) + " |"]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fsdp_worker is not None:  # one rank of the FSDP2 launch
        reply = fsdp_train_steps(args)
        Path(f"{args.fsdp_worker}{reply['rank']}.json").write_text(json.dumps(reply, indent=1))
        return 0
    if args.fsdp is not None:
        section = run_fsdp(args)
        name = "gpu-fsdp-" + "".join(ch if ch.isalnum() else "-" for ch in section["ranks"][0]["device_name"])
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(section, indent=1, default=str))
        (args.out / f"{name}.md").write_text(fsdp_markdown(section) + "\n")
        print(fsdp_markdown(section))
        return 0
    if args.liger:
        section = run_liger(args)
        name = "gpu-liger-" + "".join(ch if ch.isalnum() else "-" for ch in section["device_name"]).strip("-")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.json").write_text(json.dumps(section, indent=1, default=str))
        (args.out / f"{name}.md").write_text(liger_markdown(section) + "\n")
        print(liger_markdown(section))
        return 0 if all(row["check"]["ok"] for row in section["rows"]) else 1
    section = run(args)
    name = "gpu-" + "".join(ch if ch.isalnum() else "-" for ch in section["device"]["device_name"]).strip("-")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(section, indent=1, default=str))
    (args.out / f"{name}.md").write_text(markdown(section) + "\n")
    print(markdown(section))
    print(f"\nwrote {args.out / (name + '.json')} and {args.out / (name + '.md')}", file=sys.stderr)
    return 0 if all(row["check"]["ok"] for row in section["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
