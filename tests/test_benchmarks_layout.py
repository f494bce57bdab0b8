"""benchmarks/ imports: no circle among its modules (imports inside functions count), and the parent process's
modules (the runner, the suite's parent side, the reports) import no torch, as benchmarks/harness/runner.py promises.

The graph is tests/test_import_graph.py's, which checks itself on a circle closed only inside functions."""

import pathlib
import sys

from helpers import run_process
from test_import_graph import cycles, import_graph

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = REPO_ROOT / "benchmarks"


def test_benchmarks_import_no_circle():
    graph = import_graph(BENCHMARKS, package_edges=False)
    # the graph reads the subpackages' relative imports, inside functions too (else no circle proves nothing)
    assert "benchmarks.contenders.recipe" in graph["benchmarks.contenders.peers"]
    assert "benchmarks.contenders.peers" in graph["benchmarks.contenders.run"]  # imported inside train()
    found = cycles(graph)
    assert not found, "benchmarks modules importing each other: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_parent_side_imports_no_torch():
    """What `python -m benchmarks` and `python -m benchmarks.reports.docs` import before any worker starts."""
    parent = ["benchmarks.__main__", "benchmarks.reports.docs"] + [
        f"benchmarks.suite.{path.stem}" for path in sorted((BENCHMARKS / "suite").glob("*.py"))]
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({name!r})\n" for name in parent) + \
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    done = run_process([sys.executable, "-c", code], "the parent side's imports", cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the parent side imports {done.stdout.strip()}"
