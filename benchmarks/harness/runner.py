"""The parent side: the suite's settings, its worker processes and the alternating schedule.

The parent never imports torch or transformers. Contenders run in worker processes (`benchmarks.harness.worker`), one
JSON request per line:
* persistent workers, one per contender, for throughput-style benchmarks: no contender shares a process with
  another, and rounds alternate A B C A B C ... so slow drift of the machine hits every contender alike;
* fresh processes, one per measurement, where the process's own history matters (time to first step, import
  cost, peak memory).

The statistics, rows and verdicts the parent makes of the replies: benchmarks/reports/verdicts.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..contenders.names import CONTENDERS

REPO_ROOT = Path(__file__).resolve().parents[2]
PUBLISHED_RESULTS = REPO_ROOT / "benchmarks" / "results"  # the committed runs (--out benchmarks/results)


SIZES = ("full", "quick", "tiny")


# A run's own results: ignored by git, so a run never overwrites the published benchmarks/results/ by accident.
LOCAL_RESULTS = REPO_ROOT / "benchmarks" / "local-results"


class WorkerError(RuntimeError):
    """A task failed inside a worker; the message carries the worker's traceback."""


class Worker:
    """One Python process answering `request()`s in order. Its own prints go to a log file."""

    def __init__(self, name: str, log_dir: Path, env: dict):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.log = open(self.log_path, "a")
        self.spawned_at = time.time()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.harness.worker"], cwd=REPO_ROOT, env=env, text=True, bufsize=1,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def send(self, module: str, function: str, **kwargs) -> None:
        request = {"module": module, "function": function, "kwargs": kwargs, "spawned_at": self.spawned_at}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise WorkerError(f"worker {self.name} exited with code {code}; see {self.log_path}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"{self.name}: {reply['error']}\n(log: {self.log_path})")
        return reply["result"]

    def request(self, module: str, function: str, **kwargs) -> dict:
        self.send(module, function, **kwargs)
        return self.receive()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@dataclass
class Suite:
    """Settings and services shared by the benchmarks of one `python -m benchmarks` run."""

    size: str = "full"
    out_dir: Path = LOCAL_RESULTS
    threads: int = 1
    rounds_wanted: int | None = None  # --rounds: measured rounds of the benchmarks that take it (overhead)
    started: float = field(default_factory=time.time)
    environment: dict = field(default_factory=dict)  # benchmarks.harness.environment.describe(), filled in by __main__

    def __post_init__(self):
        if self.size not in SIZES:
            raise ValueError(f"size={self.size!r}: choose one of {', '.join(SIZES)}")
        self.out_dir = Path(self.out_dir)
        self.log_dir = self.out_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix="loopkit-bench-"))

    def pick(self, full, quick, tiny=None):
        """The value for this run's size (`tiny` defaults to `quick`)."""
        return {"full": full, "quick": quick, "tiny": quick if tiny is None else tiny}[self.size]

    def measured_rounds(self, full, quick, tiny=None):
        """How many measured rounds: `rounds` where the run sets it (`--rounds`), else the size's."""
        return self.rounds_wanted or self.pick(full, quick, tiny)

    def env(self) -> dict:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        if self.threads > 0:
            env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads),
                       LOOPKIT_BENCH_THREADS=str(self.threads))
        return env

    def say(self, message: str) -> None:
        print(f"[{time.time() - self.started:6.1f}s] {message}", file=sys.stderr, flush=True)

    def scratch_dir(self, name: str) -> str:
        path = self.scratch / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return str(path)

    def cleanup(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    @contextmanager
    def workers(self, names=CONTENDERS, prefix: str = ""):
        """One persistent worker per name, started together (their imports overlap), closed at the end."""
        started = {name: Worker(f"{prefix}{name}", self.log_dir, self.env()) for name in names}
        try:
            for worker in started.values():
                worker.request("benchmarks.harness.worker", "ready")
            yield started
        finally:
            for worker in started.values():
                worker.close()

    def fresh(self, name: str, module: str, function: str, **kwargs) -> dict:
        """Run one task in a brand-new process; `spawned_at` in the task is that process's start."""
        worker = Worker(name, self.log_dir, self.env())
        try:
            return worker.request(module, function, **kwargs)
        finally:
            worker.close()

    def fresh_many(self, jobs: list, parallel: int = 2) -> list:
        """`fresh()` for each (name, module, function, kwargs) job, `parallel` processes at a time, results in job
        order. Only for measurements that other processes cannot disturb (peak memory), never for timings."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            futures = [pool.submit(self.fresh, name, module, function, **kwargs)
                       for name, module, function, kwargs in jobs]
            return [future.result() for future in futures]

    def rounds(self, warmup: int, measured: int):
        """(round number, is_warmup) for an alternating schedule: warm-up rounds first, then measured ones."""
        for index in range(warmup + measured):
            yield index, index < warmup
