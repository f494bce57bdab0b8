"""Run chosen tests again and again on a busy machine and count, per test, how often each passed and failed.

    python tests/under_load.py --rounds 10 --parallel 2 tests/test_x.py::test_y ...
    python tests/under_load.py --rounds 10 --parallel 2 --listed       # every test in tests/load_sensitive.txt

While it runs, `--burners` processes (default: one per core) spin on the CPU at the default priority, and each round
starts `--parallel` pytest processes at once, each running every given test once (so a round is `--parallel` runs
of each test, and the pytest processes load the machine too). The summary (JSON, and a table on stdout) gives, per
test id, the runs, passes, failures and skips, the load average seen (sampled every 5 s), the burners, the wall
time, and for each failure the round and the first lines of pytest's report; `--out` keeps it. `--stop-after`
starts no round after that many seconds, so a run fits a deadline (the summary then says how many rounds ran).
Each pytest process gets its own `--basetemp`, removed when it ends (the tests write checkpoints).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LISTED = os.path.join(REPO, "tests", "load_sensitive.txt")
BURNER = "while True: pass"


def listed_ids(path: str = LISTED) -> list[str]:
    """The test ids of the list file: the first word of each line that is not blank or a comment."""
    with open(path) as f:
        return [line.split()[0] for line in f if line.strip() and not line.lstrip().startswith("#")]


def node_id(case: ElementTree.Element) -> str:
    """pytest's id of a junit-xml test case: classname `tests.test_x` (or `tests.test_x.Class`) and its name."""
    parts = case.get("classname", "").split(".")
    files = [i for i in range(len(parts)) if parts[i].startswith("test_")]
    cut = files[0] + 1 if files else len(parts)
    return "/".join(parts[:cut]) + ".py::" + "::".join(parts[cut:] + [case.get("name", "")])


def outcomes(junit_path: str) -> dict[str, tuple[str, str, float]]:
    """{test id: (passed | failed | error | skipped, first lines of the report, seconds)} from a junit-xml file."""
    found = {}
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        result, text = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                result = "failed" if kind == "failure" else kind
                text = ((element.get("message") or "") + "\n" + (element.text or ""))[:3000]
                break
        # a test that failed in its call and errored in its teardown is both: the failure counts
        if found.get(node_id(case), ("passed",))[0] == "passed":
            found[node_id(case)] = (result, text, float(case.get("time", 0)))
    return found


class LoadSampler:
    """The 1-minute load average every `every` seconds, on a daemon thread, until `stop()`."""

    def __init__(self, every: float = 5.0):
        self.samples, self.every, self.done = [], every, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        while not self.done.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self.done.set()
        self.thread.join()
        values = self.samples or [os.getloadavg()[0]]
        return {"min": round(min(values), 2), "mean": round(sum(values) / len(values), 2),
                "max": round(max(values), 2), "samples": len(values)}


def start_burners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(count)]


def run_pytest(ids: list[str], work: str, label: str, pytest_args: list[str]) -> subprocess.Popen:
    basetemp, junit = os.path.join(work, f"tmp-{label}"), os.path.join(work, f"{label}.xml")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}",
               f"--junitxml={junit}", *pytest_args, *ids]
    log = open(os.path.join(work, f"{label}.log"), "w")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    process.label, process.junit, process.basetemp, process.log = label, junit, basetemp, log
    return process


def collect(process: subprocess.Popen, round_index: int, counts, failures, keep: str | None) -> None:
    """Wait for one pytest process and count what its junit file says; a process that wrote none (it crashed)
    counts as one failure of every id it was given."""
    process.wait()
    process.log.close()
    found = outcomes(process.junit) if os.path.exists(process.junit) else {}
    if not found:
        tail = open(process.log.name, errors="replace").read()[-3000:]
        found = {"<pytest process>": ("failed", f"exit {process.returncode}, no junit report:\n{tail}", 0.0)}
    for test_id, (result, text, seconds) in found.items():
        counts[test_id][result] += 1
        counts[test_id]["seconds"] += seconds
        if result in ("failed", "error"):
            failures.append({"test": test_id, "round": round_index, "process": process.label, "result": result,
                             "report": text})
    shutil.rmtree(process.basetemp, ignore_errors=True)
    if keep is not None:
        shutil.copy(process.log.name, keep)


def summary_table(summary: dict) -> str:
    lines = [f"{'runs':>5} {'pass':>5} {'fail':>5} {'error':>5} {'skip':>5} {'mean s':>7}  test"]
    for test_id, c in sorted(summary["tests"].items()):
        lines.append(f"{c['runs']:>5} {c['passed']:>5} {c['failed']:>5} {c['error']:>5} {c['skipped']:>5} "
                     f"{c['mean_s']:>7}  {test_id}")
    load = summary["load_average"]
    lines.append(f"{summary['rounds_run']} rounds x {summary['parallel']} pytest processes, {summary['burners']} "
                 f"burners on {summary['cores']} cores; load average min {load['min']}, mean {load['mean']}, max "
                 f"{load['max']}; wall {summary['wall_s']:.0f} s; {len(summary['failures'])} failed runs")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ids", nargs="*", help="pytest test ids or files")
    parser.add_argument("--listed", action="store_true", help=f"add every id in {os.path.relpath(LISTED, REPO)}")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--parallel", type=int, default=2, help="pytest processes at once in each round")
    parser.add_argument("--burners", type=int, default=os.cpu_count(), help="CPU-spinning processes (default: cores)")
    parser.add_argument("--stop-after", type=float, default=None, help="seconds after which no round starts")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    parser.add_argument("--logs", default=None, help="keep every pytest process's output in this folder")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. '--durations=10'")
    args = parser.parse_args(argv)
    ids = args.ids + (listed_ids() if args.listed else [])
    if not ids:
        parser.error("give test ids, or --listed")
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)

    counts = defaultdict(lambda: defaultdict(int))
    failures, rounds_run, start = [], 0, time.monotonic()
    burners, sampler = start_burners(args.burners), LoadSampler()
    work = tempfile.mkdtemp(prefix="under_load-")
    try:
        for round_index in range(args.rounds):
            if args.stop_after is not None and time.monotonic() - start > args.stop_after:
                break
            processes = [run_pytest(ids, work, f"r{round_index}p{p}", args.pytest_args.split())
                         for p in range(args.parallel)]
            for process in processes:
                keep = os.path.join(args.logs, process.label + ".log") if args.logs else None
                collect(process, round_index, counts, failures, keep)
            rounds_run += 1
            print(f"round {round_index + 1}: {sum(c['failed'] + c['error'] for c in counts.values())} failed runs "
                  f"so far, {time.monotonic() - start:.0f} s", flush=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        load = sampler.stop()
        shutil.rmtree(work, ignore_errors=True)

    tests = {}
    for test_id, c in counts.items():
        runs = sum(c[k] for k in ("passed", "failed", "error", "skipped"))
        tests[test_id] = {"runs": runs, **{k: c[k] for k in ("passed", "failed", "error", "skipped")},
                          "mean_s": round(c["seconds"] / runs, 1)}  # junit's time: call plus its share of setup
    summary = {"ids": ids, "rounds_asked": args.rounds, "rounds_run": rounds_run, "parallel": args.parallel,
               "burners": args.burners, "cores": os.cpu_count(), "load_average": load,
               "wall_s": round(time.monotonic() - start, 1), "tests": tests, "failures": failures}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    print(summary_table(summary))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
