"""What agreeing on a preemption costs per optimizer step on CPU processes (gloo), for docs/distributed.md.

Usage: ACCELERATE_USE_CPU=1 OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 tests/scripts/agreement_cost.py [CALLS]

Times, per call, on rank 0: loopkit's agreement (`PreemptionWatch.agreed`: the flag's all-reduce started after one
step and read after the next, on a gloo group of its own), the same all-reduce waited at once, and the earlier check
(`accelerator.reduce` of a flag on the training group and `.item()`, which loopkit ran every 10 steps).
"""

import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from accelerate import Accelerator

from loopkit.guards import PreemptionWatch

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
accelerator = Accelerator(cpu=True)
watch = PreemptionWatch(SimpleNamespace(), SimpleNamespace(accelerator=accelerator))
watch.__enter__()
flag = torch.zeros(1, dtype=torch.int32)


def per_call(what) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        what()
    dist.barrier()
    return (time.perf_counter() - start) / calls * 1e6


timings = {
    "loopkit's agreement (started after a step, read after the next)": per_call(watch.agreed),
    "the same all-reduce, waited at once": per_call(
        lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=watch.group)),
    "accelerator.reduce + .item() on the training group": per_call(
        lambda: accelerator.reduce(torch.zeros(()), reduction="max").item()),
}
watch.__exit__(None, None, None)
if accelerator.is_main_process:
    for what, us in timings.items():
        print(f"{what}: {us:.0f} us per call")
