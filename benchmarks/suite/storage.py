"""Checkpoint storage cost (issue 26): how long training is blocked by one save, and how much slower the 8 steps
after it run, for each storage: `DCPStorage` (async and sync), `HFStorage` (the HF layout, sync and async) and HF
Trainer, on the real MiniLM classifier (22.7 M parameters, with its AdamW state) in one process, and for a
2-process FSDP2 run on CPU processes (gloo; HF Trainer has no FSDP on CPU processes, so its cell is absent there and
the FSDP2 rows' ratios are to HF Trainer's one-process sync save of the same run: `ratio_to_one_process_hf_trainer`).

The measure is bench_checkpoint.py's (the save after step 4; blocked = the step-to-step gap with the save - the
median gap before it; slower by = the 8 following steps - 8 x the median step before). Every measurement is a new
process (a `torchrun` launch for FSDP2), and the contenders alternate round by round (A B C D E, A B C D E, ...).

    python -m benchmarks.suite.storage [--rounds 4] [--fsdp-rounds 2] [--out benchmarks/results/storage.json]
    BENCH_STORAGE_DEVICE=cuda python -m benchmarks.suite.storage ...   # the same on GPUs (2 for FSDP2)

Writes the raw rounds and the summary (median, min-max, the median of the round-by-round ratios to HF Trainer's
sync save) to `--out`, and prints the rows of docs/performance.md's storage table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ..harness.environment import cpu_model
from ..workloads.spec import TrainSpec
from .checkpoint import FOLLOWING_STEPS, SAVE_AFTER_STEP, save_timings

ONE_PROCESS = ["hf-trainer", "hf-layout", "hf-layout-async", "dcp", "dcp-async"]
FSDP2 = ["hf-layout", "hf-layout-async", "dcp", "dcp-async"]
LABELS = {"hf-trainer": "HF Trainer (sync)", "hf-layout": "loopkit HFStorage, sync",
          "hf-layout-async": "loopkit HFStorage, async_save", "dcp": "loopkit DCPStorage, sync",
          "dcp-async": "loopkit DCPStorage, async_save"}


def spec() -> TrainSpec:
    return TrainSpec(model="minilm", num_train=64, seq_len=32, batch_size=4, grad_accum=1, max_steps=20,
                     learning_rate=5e-5, warmup_steps=2, logging_steps=50,
                     device=os.environ.get("BENCH_STORAGE_DEVICE", "cpu"))


# ---------------------------------------------------------------------------------------------------------------------
# One measurement (its own process; under torchrun for FSDP2)
# ---------------------------------------------------------------------------------------------------------------------
def trainer_kwargs(name: str, sharded: bool) -> dict:
    if name == "hf-trainer":
        return {}
    from loopkit.storage import DCPStorage, HFStorage

    kwargs = {"storage": (DCPStorage if name.startswith("dcp") else HFStorage)(async_save=name.endswith("async"))}
    if sharded:
        from accelerate.utils import FullyShardedDataParallelPlugin

        from loopkit import SetupStage

        kwargs["setup"] = SetupStage(fsdp_plugin=FullyShardedDataParallelPlugin(
            fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True))
    return kwargs


def measure(name: str, output_dir: str) -> dict:
    import torch

    from ..contenders.clock import StepClock
    from ..contenders.run import train

    torch.set_num_threads(1)
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    steps = range(1, SAVE_AFTER_STEP + FOLLOWING_STEPS + 1)
    on_gpu = spec().device == "cuda"  # the host runs ahead of the device: each measured step ends synchronised
    clock = StepClock(save_at=[SAVE_AFTER_STEP], stop_at=SAVE_AFTER_STEP + FOLLOWING_STEPS,
                      sync_at=steps if on_gpu else (), synchronize=torch.cuda.synchronize if on_gpu else None)
    result = train("hf" if name == "hf-trainer" else "loopkit", spec(), clock, output_dir,
                   trainer_kwargs=trainer_kwargs(name, sharded))
    timings = save_timings(clock)
    following = FOLLOWING_STEPS * timings["usual_step"]
    return {**timings, "following_relative": timings["following_steps_slower_by"] / following,
            "global_step": result.global_step,
            "saved": sorted(os.listdir(os.path.join(output_dir, f"checkpoint-{SAVE_AFTER_STEP}")))}


def measure_in_new_process(name: str, processes: int, scratch: str) -> dict:
    reply = os.path.join(scratch, f"{name}-{processes}.json")
    output_dir = tempfile.mkdtemp(prefix=f"{name}-", dir=scratch)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    module = [sys.executable, "-m", "benchmarks.suite.storage", "--one", name, "--dir", output_dir, "--reply", reply]
    if processes > 1:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if os.environ.get("BENCH_STORAGE_DEVICE", "cpu") == "cpu":
            env["ACCELERATE_USE_CPU"] = "1"
        command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(processes),
                   "--master_port", str(port), "-m", *module[2:]]
    else:
        command = module
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name} on {processes} process(es) failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    with open(reply) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------------------
# Alternated rounds and the summary
# ---------------------------------------------------------------------------------------------------------------------
def summary(rounds: list[dict], names: list[str], reference: str | None) -> dict:
    out = {}
    for name in names:
        blocked = [r[name]["blocked"] for r in rounds]
        slower = [r[name]["following_relative"] for r in rounds]
        row = {"blocked_median": statistics.median(blocked), "blocked_min": min(blocked), "blocked_max": max(blocked),
               "following_median": statistics.median(slower), "following_min": min(slower),
               "following_max": max(slower), "usual_step_median": statistics.median(r[name]["usual_step"]
                                                                                     for r in rounds)}
        if reference is not None:
            ratios = [r[name]["blocked"] / r[reference]["blocked"] for r in rounds]
            row.update(ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        out[name] = row
    return out


def rows(results: dict) -> str:
    lines = ["| storage | processes | training blocked by one save | vs HF Trainer's sync save | the 8 following "
             "steps, slower by |", "|---|---|---|---|---|"]
    for setting, processes in (("one_process", 1), ("fsdp2", 2)):
        for name, row in results[setting]["summary"].items():
            ratio = (f"{row['ratio_median']:.2f}x ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
                     if "ratio_median" in row else
                     f"{row['ratio_to_one_process_hf_trainer']:.3f}x (median over HF Trainer's 1-process median)")
            lines.append(f"| {LABELS[name]} | {processes} | {row['blocked_median']:.3f} s ({row['blocked_min']:.3f}-"
                         f"{row['blocked_max']:.3f}) | {ratio} | {100 * row['following_median']:+.0f}% "
                         f"({100 * row['following_min']:+.0f}% to {100 * row['following_max']:+.0f}%) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite.storage")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--fsdp-rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/local-results/storage.json")
    parser.add_argument("--one"), parser.add_argument("--dir"), parser.add_argument("--reply")
    options = parser.parse_args()
    if options.one:  # a worker
        result = measure(options.one, options.dir)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(options.reply, "w") as f:
                json.dump(result, f)
        return 0
    results, load_at_start = {}, os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-storage-") as scratch:
        for setting, names, processes, count in (("one_process", ONE_PROCESS, 1, options.rounds),
                                                  ("fsdp2", FSDP2, 2, options.fsdp_rounds)):
            rounds = []
            for index in range(count):
                rounds.append({name: measure_in_new_process(name, processes, scratch) for name in names})
                print(f"{setting} round {index + 1}/{count}: " + ", ".join(
                    f"{n} {r['blocked']:.3f} s" for n, r in rounds[-1].items()), flush=True)
            results[setting] = {"rounds": rounds, "summary": summary(
                rounds, names, "hf-trainer" if "hf-trainer" in names else None)}
    reference = results["one_process"]["summary"]["hf-trainer"]["blocked_median"]
    for row in results["fsdp2"]["summary"].values():  # no HF Trainer under FSDP2 on CPU: its 1-process save instead
        row["ratio_to_one_process_hf_trainer"] = row["blocked_median"] / reference
    results["note"] = ("blocked = step gap with the save - median gap before; following = (8 steps after the save - "
                       "8 x median step before) / (8 x median step)")
    results["machine"] = {"cores": os.cpu_count(), "cpu_model": cpu_model(),
                          "load_average": [round(load_at_start, 2), round(os.getloadavg()[0], 2)]}
    os.makedirs(os.path.dirname(os.path.abspath(options.out)), exist_ok=True)
    with open(options.out, "w") as f:
        json.dump(results, f, indent=1)
    print(rows(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
