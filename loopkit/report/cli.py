"""`python -m loopkit report RUN_DIR [--force] [--storage module:Class]` (loopkit/__main__.py): print a run's report
and draw its charts, rebuilding it from the newest undamaged checkpoint when the run's own report does not cover the
newest checkpoint. A folder it cannot read (checkpoints in no known format, no checkpoint and no report) ends with
one line naming the fix and exit status 2, never a traceback."""

from __future__ import annotations

import os

from .charts import charts_drawn
from .files import REBUILT_NAME, REPORT_NAME, write_report
from .rebuild import UnknownCheckpointFormat, report_from_files
from .text import summary_text


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m loopkit", description="loopkit command-line tools")
    sub = parser.add_subparsers(dest="command", required=True)
    report_cmd = sub.add_parser("report", help="print the run report of RUN_DIR and draw its charts; rebuild it "
                                "from the newest checkpoint when the run's own report does not cover it")
    report_cmd.add_argument("run_dir")
    report_cmd.add_argument("--force", action="store_true", help="rebuild from the newest checkpoint and write "
                            "over the run's own run_report.* (otherwise a rebuilt report goes beside it)")
    report_cmd.add_argument("--storage", metavar="MODULE:CLASS", help="the checkpoint storage that wrote RUN_DIR, "
                            "when it is not a built-in one (HFStorage, DCPStorage)")
    args = parser.parse_args(argv)
    if args.storage:
        from ..checkpoint import register_format

        try:
            register_format(args.storage)
        except (ImportError, AttributeError, ValueError) as exc:
            parser.exit(2, f"python -m loopkit report: --storage {args.storage}: {type(exc).__name__}: {exc}. Name "
                           f"the storage class as module:Class, e.g. --storage mypackage.storages:MyStorage\n")
    try:
        report, own = report_from_files(args.run_dir, args.force)
    except (FileNotFoundError, UnknownCheckpointFormat) as exc:
        parser.exit(2, f"python -m loopkit report: {exc}\n")
    for name, problem in (report.get("damaged_checkpoints") or {}).items():
        print(f"  {name} is damaged ({problem}): not read")
    if own:  # the run's own report: printed, its charts drawn again, its files left as the run wrote them
        report["charts"] = charts_drawn(report, args.run_dir)
        print(summary_text(report))
        return 0
    beside = not args.force and os.path.isfile(os.path.join(args.run_dir, REPORT_NAME + ".json"))
    name = REBUILT_NAME if beside else REPORT_NAME
    report["charts"] = charts_drawn(report, args.run_dir, prefix=name + "." if beside else "")
    write_report(report, args.run_dir, name=name)
    if beside:
        print(f"  the run's own {REPORT_NAME}.json covers an earlier stretch and is kept; this rebuilt report is "
              f"{name}.json (--force writes it over the run's own)")
    return 0
