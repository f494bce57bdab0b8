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
"""

import importlib
import json
import os
import random
import runpy
import select
import sys

POLL_S = 0.05  # how often a child's exit is looked for while no request arrives


def run_child(request: dict, replies: int) -> None:
    """In the forked child: become `python argv...` with the request's environment and output files, then run it.
    Raises SystemExit (or the script's exception), which ends this process through the interpreter's exit."""
    os.close(replies)
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = out if request["stderr"] == request["stdout"] else \
        os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    random.seed()  # a fresh interpreter's `random` is seeded from the OS, not shared with its siblings
    argv = request["argv"]
    if argv[0] == "-m":  # `python -m module args`: sys.path starts with the working directory
        sys.argv, sys.path[0] = argv[1:], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


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
                run_child(request, replies)
            running[pid] = request["id"]
            answer(replies, {"id": request["id"], "pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            answer(replies, {"id": running.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
