"""A profile's measurement in a fresh process (`python -m MODULE --worker REQUEST`), and its results files.

Shared by the profiles (overhead, ladder, trl): each is its own command and worker entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..harness.runner import REPO_ROOT


def run_worker(module: str, request: dict, path_first=(), **env_vars) -> dict:
    """`python -m MODULE --worker REQUEST` in a new process (one thread, offline, this checkout's `benchmarks`
    importable after `path_first`, `env_vars` added): the JSON its last line prints."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1", **env_vars,
               PYTHONPATH=os.pathsep.join(list(path_first) + [str(REPO_ROOT)] +
                                          [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-m", module, "--worker", json.dumps(request)],
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{module} worker {request} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_results(out: Path, results: dict, text: str) -> None:
    """`results` to OUT.json and `text` to OUT.md (`out` with or without either suffix); `text` printed too."""
    out = out.with_suffix("") if out.suffix in (".json", ".md") else out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)
