"""`skip_memory_metrics=False`: HF's memory metrics (`TrainerMemoryTracker`'s keys and rules) with explicit stages.

HF's tracker finds its stage from the caller's function name, so it cannot be called from loopkit's stages; this is
a small equivalent. Stages are "init" (the `Loop` constructor), "train", "eval" and "test" (`predict`). A stage
started while another runs is ignored (an evaluation during training), and the first stage to report its metrics
also reports "init"'s, as HF does. Keys: `<stage>_mem_cpu_alloc_delta` / `_peaked_delta` (resident set size, bytes),
`_mem_gpu_*` the same for CUDA memory when CUDA is available, and `before_init_mem_cpu` / `_gpu`.

The CPU peak is Linux's peak resident set size (`VmHWM`, reset through `/proc/self/clear_refs`), which costs nothing
while the stage runs; where that is not available a thread samples the resident set size every millisecond (HF's
thread samples without pausing, which would take a whole core from training).
"""

from __future__ import annotations

import gc
import threading

CLEAR_REFS, STATUS = "/proc/self/clear_refs", "/proc/self/status"


class MemoryTracker:
    def __init__(self, skip_memory_metrics: bool = True):
        self.skip = skip_memory_metrics
        self.cur_stage, self.init_reported = None, False
        self.cpu, self.gpu = {}, {}
        self.sampler = None
        if not self.skip:
            import psutil
            import torch

            self.process = psutil.Process()
            self.cuda = torch.cuda if torch.cuda.is_available() else None

    def rss(self) -> int:
        return self.process.memory_info().rss

    def start(self, stage: str) -> None:
        if self.skip or (self.cur_stage is not None and self.cur_stage != stage):
            return
        self.cur_stage = stage
        gc.collect()
        if self.cuda is not None:
            self.cuda.reset_peak_memory_stats()
            self.cuda.empty_cache()
            self.gpu_begin = self.cuda.memory_allocated()
        self.cpu_begin = self.rss()
        self.start_peak_watch()

    def stop(self, stage: str) -> None:
        if self.skip or (self.cur_stage is not None and self.cur_stage != stage):
            return
        peak = self.stop_peak_watch()
        gc.collect()
        if self.cuda is not None:
            self.cuda.empty_cache()
            now, gpu_peak = self.cuda.memory_allocated(), self.cuda.max_memory_allocated()
            self.gpu[self.cur_stage] = {"begin": self.gpu_begin, "alloc": now - self.gpu_begin,
                                        "peaked": max(0, gpu_peak - now)}
        now = self.rss()
        self.cpu[self.cur_stage] = {"begin": self.cpu_begin, "alloc": now - self.cpu_begin,
                                    "peaked": max(0, max(peak, now) - now)}
        self.cur_stage = None

    def update_metrics(self, stage: str, metrics: dict) -> None:
        """Add the memory keys of `stage` (and of "init", the first time) to `metrics`."""
        if self.skip or (self.cur_stage is not None and self.cur_stage != stage):
            return
        stages = [stage]
        if not self.init_reported:
            stages.insert(0, "init")
            self.init_reported = True
        for name in stages:
            for kind in ("alloc", "peaked"):
                if kind in self.cpu.get(name, {}):
                    metrics[f"{name}_mem_cpu_{kind}_delta"] = self.cpu[name][kind]
                if self.cuda is not None and kind in self.gpu.get(name, {}):
                    metrics[f"{name}_mem_gpu_{kind}_delta"] = self.gpu[name][kind]
        if stages[0] == "init" and "init" in self.cpu:
            metrics["before_init_mem_cpu"] = self.cpu["init"]["begin"]
            if self.cuda is not None:
                metrics["before_init_mem_gpu"] = self.gpu["init"]["begin"]

    def stop_and_update_metrics(self, stage: str, metrics: dict | None = None) -> None:
        if self.skip:
            return
        self.stop(stage)
        if metrics is not None:
            self.update_metrics(stage, metrics)

    # -- the CPU peak --
    def start_peak_watch(self) -> None:
        try:
            with open(CLEAR_REFS, "w") as f:
                f.write("5")  # resets the peak resident set size (Linux >= 4.0)
            self.sampler = None
            return
        except OSError:
            pass
        self.peak, self.sampling = self.rss(), True

        def sample():
            while self.sampling:
                self.peak = max(self.peak, self.rss())
                threading.Event().wait(0.001)

        self.sampler = threading.Thread(target=sample, daemon=True)
        self.sampler.start()

    def stop_peak_watch(self) -> int:
        if self.sampler is None:
            with open(STATUS) as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            return kib * 1024
        self.sampling = False
        self.sampler.join()
        return self.peak


def local_bytes(tensor) -> int:
    """Bytes this process holds of `tensor`: its local shard for a DTensor (FSDP2), else all of it."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class ShardBytes:
    """A callback that records the bytes this process holds in parameters, gradients (before the optimizer step
    clears them) and optimizer state (once it exists), in `self.bytes`: under sharding, this rank's shards."""

    def __init__(self):
        self.bytes = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.bytes["parameters"] = sum(local_bytes(p) for p in model.parameters())
        self.bytes["gradients"] = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.bytes["optimizer"] = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                                      if hasattr(v, "element_size"))
