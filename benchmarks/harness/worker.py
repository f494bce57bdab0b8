"""A benchmark worker process: `python -m benchmarks.harness.worker`, started by `benchmarks.harness.Worker`.

Reads one JSON request per line on stdin (`{"module", "function", "kwargs", "spawned_at"}`), calls
`module.function(**kwargs)` and answers one JSON line (`{"result": ...}` or `{"error": traceback}`) on the original
stdout. Everything else the contenders print goes to stderr, which the parent writes to a log file.

Only the standard library is imported before the first request, so a fresh worker's import timings are the task's
own. `spawned_at` (the parent's `time.time()` just before starting this process) is passed to tasks that take it.
"""

import importlib
import json
import os
import sys
import traceback


def ready() -> dict:
    return {"pid": os.getpid()}


def call(request: dict):
    """Run one request: `module.function(**kwargs)`, plus `spawned_at` if the function takes it."""
    function = getattr(importlib.import_module(request["module"]), request["function"])
    code = function.__code__
    kwargs = dict(request["kwargs"])
    if "spawned_at" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
        kwargs["spawned_at"] = request["spawned_at"]
    return function(**kwargs)


def main() -> None:
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # contenders' prints -> the log, never into the replies
    for line in sys.stdin:
        try:
            reply = {"result": call(json.loads(line))}
        except BaseException:  # report, keep serving: the parent decides what a failure means
            reply = {"error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
