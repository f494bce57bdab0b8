"""`python -m benchmarks`: run the benchmarks and write results.json, results.md and charts to a results folder.

    python -m benchmarks                      # everything, full size
    python -m benchmarks --quick              # everything, reduced sizes and rounds
    python -m benchmarks --only overhead,resume --out /tmp/bench
    python -m benchmarks --out benchmarks/results   # publish: replace the committed results

Results go to benchmarks/local-results/ (not tracked by git) unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

from . import BENCHMARKS
from .harness.environment import describe
from .harness.runner import LOCAL_RESULTS, SIZES, Suite
from .reports.tables import CHARTS_HINT, noisy_rows, slow_rows, write_charts, write_json, write_markdown


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_const", const="quick", dest="size",
                        help="reduced sizes and fewer rounds")
    parser.add_argument("--size", choices=SIZES,
                        help="full (default), quick, or tiny (seconds; only keeps the harness working)")
    parser.set_defaults(size="full")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help=f"run only these benchmarks (comma-separated or repeated): {', '.join(BENCHMARKS)}")
    parser.add_argument("--out", type=Path, default=LOCAL_RESULTS,
                        help="results folder (default: benchmarks/local-results/, untracked; the committed "
                             "benchmarks/results/ is the last published run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per worker process (default 1: steadier timings; the loop's "
                             "overhead does not depend on it). 0 keeps torch's default.")
    parser.add_argument("--rounds", type=int, default=None, metavar="N",
                        help="measured rounds of the per-step benchmark (overhead), instead of its size's "
                             "(full 7, quick 3)")
    args = parser.parse_args(argv)
    selected = [name.strip() for item in args.only for name in item.split(",") if name.strip()]
    unknown = [name for name in selected if name not in BENCHMARKS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such benchmark; choose from {', '.join(BENCHMARKS)}")
    args.selected = [name for name in BENCHMARKS if name in selected] if selected else list(BENCHMARKS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    suite = Suite(size=args.size, out_dir=args.out, threads=args.threads, rounds_wanted=args.rounds)
    results = {"environment": {}, "benchmarks": {}}
    try:
        environment = describe(suite.threads)
        environment.update(size=suite.size, selected=args.selected,
                           started_at=time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(suite.started)),
                           load_average={"start": os.getloadavg()[0]}, command=" ".join(sys.argv))
        results["environment"] = suite.environment = environment
        for name in args.selected:
            module = importlib.import_module(f"benchmarks.suite.{name}")
            started = time.time()
            try:
                section = module.run(suite)
            except Exception:
                section = {"title": module.TITLE, "error": traceback.format_exc()}
                suite.say(f"{name} FAILED:\n{section['error']}")
            section["seconds"] = time.time() - started
            results["benchmarks"][name] = section
            write_json(results, suite.out_dir / "results.json")  # partial results survive a later failure
        environment["load_average"]["end"] = os.getloadavg()[0]
        environment["seconds"] = time.time() - suite.started
        write_json(results, suite.out_dir / "results.json")
        charts = write_charts(results, suite.out_dir)
        write_markdown(results, suite.out_dir / "results.md", charts)
    finally:
        suite.cleanup()
    suite.say(f"wrote {suite.out_dir / 'results.json'}, {suite.out_dir / 'results.md'}"
              + (f" and {len(charts)} charts" if charts else f". {CHARTS_HINT}"))
    for line in slow_rows(results):
        suite.say(line)
    for line in noisy_rows(results):
        suite.say(f"too noisy for a verdict: {line[2:]}")
    failed = [name for name, section in results["benchmarks"].items() if "error" in section]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
