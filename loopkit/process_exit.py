"""A script that trained on several processes exits 0: gloo's worker threads are let finish before the interpreter
shuts down.

The abort this prevents ("terminate called without an active exception", SIGABRT, exit status 134 or -6 under
torchrun, after all the work is done) is torch's, not a training loop's: two `torchrun` processes that only run
`dist.all_reduce(torch.ones(1000))` and end abort the same way (docs/distributed.md gives the counts). Each gloo
process group runs collectives on two worker threads (`pt_gloo_runloop`). When a collective completes, the caller
returns while the worker still holds the collective's tensors; the worker releases them a moment later, and a
tensor that Python created then needs the GIL to free its Python object. If the worker was descheduled in that
moment (a loaded machine) and the script has meanwhile ended, the release happens while the interpreter
finalizes: taking the GIL then ends the thread (`pthread_exit`) inside a C++ destructor, and the C++ runtime aborts
the process (the core's stack: `AsyncWork::~AsyncWork` -> `TensorImpl::decref_pyobject` -> `take_gil` ->
`PyThread_exit_thread`). `destroy_process_group()` does not help: the threads live as long as anything holds the
group (a DDP wrapper, a device mesh), which HF Trainer and loopkit runs alike still do at exit, and the release
is racing either way.

So at interpreter exit, while Python is still whole, `settle_collective_threads` waits (the GIL released) until
every gloo worker thread of the process is blocked, waiting for work, several polls in a row: by then each has
released what it held. It needs no other process (no collective, nothing to hang on if a peer died), and reads
the threads' states from /proc (Linux; elsewhere it returns at once). It is registered once per process by the
first `Loop` that runs with several processes.
"""

from __future__ import annotations

import atexit
import os
import time

WORKER_THREAD_NAMES = ("pt_gloo_runloop",)  # torch's gloo process-group workers (ProcessGroupGloo::runLoop)
SETTLED_POLLS, POLL_S, LIMIT_S = 5, 0.01, 10.0
_registered = False


def worker_thread_states(task_dir: str = "/proc/self/task") -> list[str]:
    """The scheduler states ("R" running or runnable, "S" blocked, ...) of this process's collective worker
    threads; [] where /proc is not there."""
    states = []
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return states
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "stat")) as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if name in WORKER_THREAD_NAMES:
            states.append(rest.split()[0])
    return states


def settle_collective_threads(states=worker_thread_states, sleep=time.sleep, limit_s: float = LIMIT_S) -> int:
    """Wait until every collective worker thread has been blocked for SETTLED_POLLS polls in a row (a thread that
    still has a tensor to release is running, runnable or, the GIL free while this sleeps, about to be), at most
    `limit_s` seconds of polling. Returns the number of polls."""
    settled, polls, most = 0, 0, max(1, round(limit_s / POLL_S))
    while settled < SETTLED_POLLS and polls < most:
        current = states()
        polls += 1
        if not current:  # no gloo process group (any more)
            break
        settled = settled + 1 if all(state == "S" for state in current) else 0
        if settled < SETTLED_POLLS:
            sleep(POLL_S)
    return polls


def settle_at_exit(num_processes: int) -> None:
    """Register `settle_collective_threads` to run at interpreter exit, once per process, when several processes
    train."""
    global _registered
    if num_processes > 1 and not _registered:
        atexit.register(settle_collective_threads)
        _registered = True
