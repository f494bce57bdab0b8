"""Where the numbers come from: versions, CPU, threads. Standard library only (the parent process calls it), so
describing the machine costs no torch import."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform

PACKAGES = ("torch", "transformers", "accelerate", "loopkit", "numpy", "safetensors")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(threads: int) -> dict:
    """`threads`: the torch intra-op threads each worker was given (0: torch's default, one per core)."""
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(), "torch_threads": threads if threads > 0 else os.cpu_count(),
        "device": "cpu", "versions": {package: version(package) for package in PACKAGES},
        # The streaming metrics API (`loopkit.metrics`, `Loop(metrics=[...])`), benchmarked when it exists.
        "loopkit_metrics": importlib.util.find_spec("loopkit.metrics") is not None,
    }
