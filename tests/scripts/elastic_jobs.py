"""Elastic restarts under real torchrun: jobs of tests/scripts/elastic_child.py, each with one SIGKILL of a rank at a
moment drawn from a seed, each launched as `python -m loopkit torchrun --max-restarts 3 --rdzv-backend c10d` on 2 CPU
processes (gloo), and compared with the uninterrupted job's final weights (torch.equal).

Usage: python tests/scripts/elastic_jobs.py [--jobs 20] [--concurrency 4] [--seed 0] [--plain-torchrun]

`--plain-torchrun` launches with torchrun itself (its shared rendezvous store) instead, to see what that does.
Prints one line per job (the kill, the storage, the exit status, the attempts each rank started, whether the
weights equal the reference's) and a summary; exits 1 if any job failed. tests/test_elastic.py runs a few.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)
from helpers import PROCESS_WAIT_S, free_port  # noqa: E402

CHILD = os.path.join(TESTS, "scripts", "elastic_child.py")
MAX_STEPS, SAVE_STEPS = 8, 2  # elastic_child.py's
MOMENTS = ("step", "substep", "save", "saved")
JOB_TIMEOUT_S = PROCESS_WAIT_S  # a job: two attempts, 150-200 s in all on a 2-core machine at load 20


def job_plan(seed: int, index: int) -> tuple[str, str]:
    """The storage and the kill (`RANK:STEP:MOMENT`, elastic_child.py) of job `index`: the storages alternate; the
    rank, the moment and the step are drawn from Random(seed, index); a save's moments fall on a save step."""
    rng = random.Random(seed * 1000 + index)
    moment = rng.choice(MOMENTS)
    saving = moment in ("save", "saved")
    step = rng.randrange(SAVE_STEPS, MAX_STEPS, SAVE_STEPS) if saving else rng.randint(1, MAX_STEPS - 1)
    return ("hf", "dcp-async")[index % 2], f"{rng.randrange(2)}:{step}:{moment}"


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", ACCELERATE_USE_CPU="1",
               PYTHONPATH=os.path.dirname(TESTS))
    return env


def launch(out: str, storage: str, kill: str | None = None, plain_torchrun: bool = False,
           restarts: int = 3) -> subprocess.Popen:
    launcher = [os.path.join(os.path.dirname(sys.executable), "torchrun")] if plain_torchrun else \
        [sys.executable, "-m", "loopkit", "torchrun"]
    command = [*launcher, "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", str(restarts),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}", CHILD, out, storage,
               *([kill] if kill else [])]
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, "launch.log"), "w")
    return subprocess.Popen(command, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait(process: subprocess.Popen, timeout: float = JOB_TIMEOUT_S) -> int:
    """The launch's exit status; a launch past `timeout` is stopped and counts as -1: SIGTERM to the launcher, which
    stops its workers (SIGKILL after its 30 s grace period)."""
    try:
        return process.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        process.terminate()
        process.wait(timeout=PROCESS_WAIT_S)
        return -1


def attempts(out: str) -> list[int]:
    """The attempts (TORCHELASTIC_RESTART_COUNT) in which a worker got as far as training."""
    return sorted({int(p.rsplit("attempt", 1)[1].split(".")[0]) for p in glob.glob(os.path.join(out, "rank*.json"))})


def same_weights(out: str, reference: dict) -> bool:
    path = os.path.join(out, "final.safetensors")
    if not os.path.exists(path):
        return False
    final = load_file(path)
    return final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in reference)


def run_jobs(root: str, jobs: range, reference: dict, concurrency: int, seed: int, plain_torchrun: bool = False,
             report=print) -> list[dict]:
    """Jobs `jobs` of the seed's plan, `concurrency` at a time; one result per job."""
    pending, running, results = list(jobs), [], []
    while pending or running:
        while pending and len(running) < concurrency:
            index = pending.pop(0)
            storage, kill = job_plan(seed, index)
            out = os.path.join(root, f"job{index}")
            running.append((index, storage, kill, out, time.time(), launch(out, storage, kill, plain_torchrun)))
        index, storage, kill, out, started, process = running.pop(0)
        code = wait(process, JOB_TIMEOUT_S - (time.time() - started))
        result = dict(job=index, storage=storage, kill=kill, exit=code, attempts=attempts(out),
                      equal=same_weights(out, reference), seconds=round(time.time() - started))
        results.append(result)
        report(" ".join(f"{k}={v}" for k, v in result.items()))
    return results


def reference_weights(root: str, storage: str = "hf") -> dict:
    out = os.path.join(root, "reference")
    code = wait(launch(out, storage))
    assert code == 0, open(os.path.join(out, "launch.log")).read()[-4000:]
    return load_file(os.path.join(out, "final.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain-torchrun", action="store_true")
    options = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as root:
        reference = reference_weights(root)
        results = run_jobs(root, range(options.jobs), reference, options.concurrency, options.seed,
                           options.plain_torchrun, report=lambda line: print(line, flush=True))
    good = [r for r in results if r["exit"] == 0 and r["equal"]]
    restarts = sum(len(r["attempts"]) - 1 for r in results)
    print(f"{len(good)}/{len(results)} jobs finished by themselves with the uninterrupted run's weights; "
          f"{restarts} restarts in all; {time.time() - started:.0f} s with {options.concurrency} jobs at a time")
    return 0 if len(good) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
