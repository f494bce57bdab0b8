"""The pip constraints of the suite's two extra environments (`make test-newest`, `make test-oldest`, docs/versions.md).

    python constraints/versions.py newest   # torch pinned to the CPU build on the machines' disk, uv (the installer)
                                            # as in constraints/dev.txt; the rest free
    python constraints/versions.py oldest   # the same, and transformers and accelerate at setup.cfg's floors

The floors are read from setup.cfg, so raising one there moves the oldest environment with it: nothing is kept by hand.
"""

from __future__ import annotations

import configparser
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
OLDEST_OF = ("transformers", "accelerate")  # the libraries whose every release since the floor loopkit follows


PINNED_AS_IN_DEV = ("torch", "uv")  # the CPU build on disk (any other torch is a multi-GB CUDA download); the installer


def dev_pins() -> list[str]:
    """The development constraints' lines for PINNED_AS_IN_DEV."""
    pins = {line.split("==")[0]: line for line in (HERE / "dev.txt").read_text().splitlines() if "==" in line}
    missing = [name for name in PINNED_AS_IN_DEV if name not in pins]
    if missing:
        raise SystemExit(f"constraints/dev.txt pins no {', '.join(missing)}")
    return [pins[name] for name in PINNED_AS_IN_DEV]


def floors() -> dict[str, str]:
    """`name>=version` of setup.cfg's install_requires, for each library of OLDEST_OF."""
    config = configparser.ConfigParser()
    config.read(HERE.parent / "setup.cfg")
    found = {}
    for requirement in config["options"]["install_requires"].split("\n"):
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*).*", requirement)
        if match and match.group(1).lower() in OLDEST_OF:
            found[match.group(1).lower()] = match.group(2)
    missing = [name for name in OLDEST_OF if name not in found]
    if missing:
        raise SystemExit(f"setup.cfg declares no '>=' floor for {', '.join(missing)}")
    return found


def constraints(kind: str) -> list[str]:
    if kind == "newest":
        return dev_pins()
    if kind == "oldest":
        return dev_pins() + [f"{name}=={version}" for name, version in floors().items()]
    raise SystemExit(f"usage: python constraints/versions.py newest|oldest (got {kind!r})")


if __name__ == "__main__":
    print("\n".join(constraints(sys.argv[1] if len(sys.argv) > 1 else "")))
