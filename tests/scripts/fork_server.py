"""A fork server for the tests' child scripts: `python fork_server.py MODULE...`, started by `helpers.ForkServer`.

It imports MODULE... once (torch, transformers, loopkit: about 5 s of CPU per interpreter), then reads one JSON
request per line on stdin (`{"id", "argv": [script, *args], "env": {...}, "stdout": path, "stderr": path}`; the
argv may also be `["-m", module, *args]`) and forks a child that runs the script as `__main__` with that argv and
environment, its stdout and stderr going to the two files. It answers `{"id", "pid"}` at once and
`{"id", "returncode"}` when the child ended (negative: killed by that signal, as `subprocess` says it); several
children may run at once. The server has one thread, so a fork copies no
lock another thread holds.

The child is the script's process as a fresh `python script args` would be, minus the imports already done: it
exits through the interpreter's own exit (atexit handlers, non-daemon threads joined, exit code from `sys.exit` or 1
on an uncaught exception), and signals reach it with the handlers a fresh interpreter has. What differs is only what
the imports read from the environment: the server's environment, which the helper makes the test's own.

A request with `"ranks": N` (and `"master_port"`) is a launch, what `torchrun --nproc_per_node N script args` does on
one machine: the server forks an agent, which forks N ranks of the script, each with the environment torchrun gives
its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...; rank 0 hosts the rendezvous store, as
`init_process_group("gloo")` does with `env://`). The ranks share the agent's two output files (torchrun's ranks share
its stdout). As torchrun's agent, it passes SIGTERM and SIGINT on to the ranks, and when a rank fails it stops the
others (SIGTERM, then SIGKILL after 30 s), says which rank failed and how, and exits 1; it exits 0 when every rank
did. The agent's `returncode` is the launch's. A rank dies with its agent (PR_SET_PDEATHSIG), and the agent stays in
the server's process group, so a Ctrl-C at the terminal reaches it and its ranks as it reaches torchrun's.
"""

import importlib
import json
import os
import random
import runpy
import select
import signal
import sys
import time

POLL_S = 0.05  # how often a child's exit is looked for while no request arrives


STOP_GRACE_S = 30  # torchrun's agent waits this long after SIGTERM before it SIGKILLs a rank


def redirect(request: dict) -> None:
    """stdin from /dev/null, stdout and stderr to the request's files (one file when they are the same path)."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if request["stderr"] == request["stdout"] else \
        os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)


def run_child(request: dict, replies: int) -> None:
    """In the forked child: become `python argv...` with the request's environment and output files, then run it.
    Raises SystemExit (or the script's exception), which ends this process through the interpreter's exit."""
    os.close(replies)
    redirect(request)
    run_script(request["argv"], request["env"])


def run_script(argv: list, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    random.seed()  # a fresh interpreter's `random` is seeded from the OS, not shared with its siblings
    if argv[0] == "-m":  # `python -m module args`: sys.path starts with the working directory
        sys.argv, sys.path[0] = argv[1:], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def rank_env(env: dict, rank: int, ranks: int, master_port: int) -> dict:
    """What torchrun's agent sets for worker `rank` of a one-node launch (its static rendezvous, no agent store)."""
    launched = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=ranks, LOCAL_WORLD_SIZE=ranks, GROUP_RANK=0,
                    GROUP_WORLD_SIZE=1, ROLE_RANK=rank, ROLE_WORLD_SIZE=ranks, ROLE_NAME="default",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port, TORCHELASTIC_RUN_ID="none",
                    TORCHELASTIC_RESTART_COUNT=0, TORCHELASTIC_MAX_RESTARTS=0)
    env = {**env, **{name: str(value) for name, value in launched.items()}}
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun, when several ranks share the machine
    return env


def die_with_parent(parent: int) -> None:
    """A rank gets SIGKILL when its agent dies (Linux's PR_SET_PDEATHSIG): a test that gives up on a launch kills the
    agent, and no rank is left behind writing into the test's folders."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before the call
        os._exit(1)


def signal_name(returncode: int) -> str:
    return f"Signal {-returncode} ({signal.Signals(-returncode).name})" if returncode < 0 else f"exit {returncode}"


def run_launch(request: dict, replies: int) -> None:
    """In the forked agent: fork the ranks, pass signals on, stop the others when one fails; exit as torchrun."""
    os.close(replies)
    redirect(request)
    ranks, pids, agent = request["ranks"], {}, os.getpid()
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            die_with_parent(agent)
            run_script(request["argv"], rank_env(request["env"], rank, ranks, request["master_port"]))
        pids[pid] = rank

    def pass_on(signum, frame):
        for pid in pids:
            os.kill(pid, signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    failed, stop_at = None, None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if stop_at is not None and time.monotonic() > stop_at:
                pass_on(signal.SIGKILL, None)
                stop_at = None
            time.sleep(POLL_S)
            continue
        rank, returncode = pids.pop(pid), os.waitstatus_to_exitcode(status)
        if returncode != 0 and failed is None:
            failed = (rank, pid, returncode)
            pass_on(signal.SIGTERM, None)
            stop_at = time.monotonic() + STOP_GRACE_S
    if failed is not None:
        rank, pid, returncode = failed
        print(f"forked launch of {ranks} ranks: rank {rank} (pid {pid}) failed first, {signal_name(returncode)} "
              f"received by PID {pid}" if returncode < 0 else
              f"forked launch of {ranks} ranks: rank {rank} (pid {pid}) failed first with exitcode {returncode}",
              file=sys.stderr, flush=True)
    os._exit(0 if failed is None else 1)


def answer(replies: int, reply: dict) -> None:
    os.write(replies, (json.dumps(reply) + "\n").encode())


def main() -> None:
    for module in sys.argv[1:]:
        importlib.import_module(module)
    replies = os.dup(1)
    os.dup2(2, 1)  # anything printed here goes to the log, never into the replies
    running, pending, open_input = {}, b"", True
    while open_input or running:
        readable, _, _ = select.select([0] if open_input else [], [], [], POLL_S)
        if readable:
            chunk = os.read(0, 65536)
            open_input = bool(chunk)
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                (run_launch if request.get("ranks") else run_child)(request, replies)
            running[pid] = request["id"]
            answer(replies, {"id": request["id"], "pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            answer(replies, {"id": running.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
