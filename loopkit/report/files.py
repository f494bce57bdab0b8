"""The report's files: `run_report.json` / `.md` and `run_status.json`, each written atomically, and read back."""

from __future__ import annotations

import json
import os

from .text import summary_text

REPORT_NAME, REBUILT_NAME = "run_report", "run_report.rebuilt"  # .json and .md
STATUS_JSON = "run_status.json"  # how the latest train() ended (`write_run_status`)


def write_atomically(path: str, text: str) -> None:
    """`text` into `path`, whole or not at all: written beside it, then renamed over it (a reader or a crash of the
    process never sees half a file; a failure, e.g. a full disk, leaves the previous file and no temporary one).
    Not forced to disk: an fsync costs tens of milliseconds on a busy disk, most of the report's cost at the end of a
    short run, and these files are derived: after a power loss `python -m loopkit report` rebuilds the report from
    the checkpoints, which are forced to disk."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            data = memoryview(text.encode("utf-8"))
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_report(report: dict, folder: str, echo: bool = True, name: str = REPORT_NAME) -> dict:
    """`name`.json and `name`.md (each written atomically) and the console summary; the charts are already drawn."""
    os.makedirs(folder, exist_ok=True)
    text = summary_text(report)
    charts = report.get("charts")
    markdown = "```\n" + text + "\n```\n" + "".join(
        f"\n![{chart}]({chart})\n" for chart in (charts if isinstance(charts, list) else []))
    write_atomically(os.path.join(folder, name + ".json"), json.dumps(report, indent=2, default=str))
    write_atomically(os.path.join(folder, name + ".md"), markdown)
    if echo:
        print(text)
    return report


def write_run_status(folder: str, status: dict) -> None:
    """`run_status.json`: how the latest `train()` in `folder` ended ("running" from its start until its end), for
    a report rebuilt from a checkpoint (`report_from_files`) to say what the run's own report said."""
    os.makedirs(folder, exist_ok=True)
    write_atomically(os.path.join(folder, STATUS_JSON), json.dumps(status, indent=2))


def read_json(path: str) -> dict | None:
    """A JSON file's object; None when it is missing or unreadable (a file from a run killed mid-write: none of
    loopkit's, which are written atomically)."""
    try:
        with open(path, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
