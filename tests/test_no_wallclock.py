"""No test asserts a wall-clock figure, and no test gives a child process a tight time limit.

The suite runs on developers' own machines, often busy (load 10 on 2 cores): a step, an import, a launch takes 5-10x
longer than on a quiet machine, so `assert elapsed < 0.5` fails at random there. What such an assertion protects is
checked without a stopwatch instead (call counts, which modules an import loads, phase sums that add up, ordering,
`helpers.JumpingClock`), and how long things take is measured by the benchmarks, side by side in one run.

This test reads every file under tests/ (with `ast`, nothing is run) and refuses:

* an assertion (`assert`, `self.assertLess` and kin) comparing a duration to a constant other than 0. A duration is
  an expression that reads a clock (`time.time()`, `perf_counter()`, `monotonic()`, `process_time()`, ...), a name
  assigned from one (also through `.append`), or a name, attribute or string key that says it is one (`elapsed`,
  `duration`, `seconds`, `*_s`, `*_ms`, ...). A constant is a number or an UPPER_CASE name. Comparing two durations
  measured in the same run (`earliest <= total <= latest`) is allowed, and so is a sign check (`seconds > 0`).
* a `timeout=` of fewer seconds than `helpers.PROCESS_WAIT_S`: wait with `helpers.wait_for` / `helpers.run_process`,
  which use that generous limit and say what they waited for when it expires.

An assertion that must stay goes in ALLOWED below, with the reason.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import PROCESS_WAIT_S, run_process, wait_for

TESTS = os.path.dirname(os.path.abspath(__file__))
CLOCKS = {"time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time",
          "process_time_ns", "thread_time", "thread_time_ns", "default_timer", "now", "utcnow"}
DURATION_WORD = re.compile(r"(^|_)(elapsed|duration|durations|seconds|secs|runtime|took|latency|overhead)($|_)|"
                           r"[a-z0-9]_(s|ms|us|ns)$", re.IGNORECASE)
UNITTEST_COMPARISONS = {"assertLess", "assertLessEqual", "assertGreater", "assertGreaterEqual", "assertAlmostEqual"}

# (file relative to tests/, enclosing function, the assertion's source) -> why it may compare a duration to a constant.
# Empty: every wall-clock assertion the suite had is now a correctness check or a benchmark row.
ALLOWED: dict[tuple[str, str, str], str] = {
    # Not a clock read: the CPU share is a measurement the test injects (0.05), and the report must quote it.
    ("test_cpu_starvation.py", "test_a_starved_run_says_so_once_with_the_numbers_and_the_fix",
     'assert abs(starved["cpu_seconds_per_second"] - 0.05) < 0.01 and starved["suggested_threads"] == 1'):
        "an injected CPU share, not a wall-clock duration",
}


def is_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return is_constant(node.operand)
    if isinstance(node, ast.BinOp):
        return is_constant(node.left) and is_constant(node.right)
    return isinstance(node, ast.Name) and node.id.isupper()


def is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def reads_clock(call: ast.Call) -> bool:
    function = call.func
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    return name in CLOCKS


def says_duration(node: ast.AST) -> bool:
    """A name, attribute or string key that says it holds a duration (UPPER_CASE names are constants)."""
    if isinstance(node, ast.Name):
        return not node.id.isupper() and bool(DURATION_WORD.search(node.id))
    if isinstance(node, ast.Attribute):
        return bool(DURATION_WORD.search(node.attr))
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return isinstance(node.slice.value, str) and bool(DURATION_WORD.search(node.slice.value))
    return False


def is_duration(node: ast.AST, timed: set[str]) -> bool:
    for part in ast.walk(node):
        if isinstance(part, ast.Call) and reads_clock(part):
            return True
        if isinstance(part, ast.Name) and part.id in timed or says_duration(part):
            return True
    return False


def timed_names(scope: ast.AST) -> set[str]:
    """Names in `scope` that hold a duration or a clock reading: assigned (or `.append`ed) an expression that is
    one, repeated until nothing new is found (`end = perf_counter(); took = end - start`)."""
    timed: set[str] = set()
    while True:
        found = set(timed)
        for node in ast.walk(scope):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                if is_duration(node.value, found):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    found |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("append", "extend") and isinstance(node.func.value, ast.Name)
                  and any(is_duration(arg, found) for arg in node.args)):
                found.add(node.func.value.id)
        if found == timed:
            return timed
        timed = found


def absolute_pairs(node: ast.AST, timed: set[str]):
    """The (duration, constant) pairs an assertion compares."""
    pairs = []
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        pairs = list(zip(sides, sides[1:]))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in UNITTEST_COMPARISONS:
        pairs = [tuple(node.args[:2])] if len(node.args) >= 2 else []
    for a, b in pairs:
        for duration, constant in ((a, b), (b, a)):
            if is_constant(constant) and not is_zero(constant) and not is_constant(duration) \
                    and is_duration(duration, timed):
                yield duration, constant


def scopes(tree: ast.Module):
    """The module and each function (innermost first for nested ones), with the statements that are their own."""
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    owner = {}
    for function in sorted(functions, key=lambda f: -f.lineno):  # later (inner) definitions claim their nodes first
        for node in ast.walk(function):
            owner.setdefault(id(node), function)
    return owner


def wallclock_assertions(source: str, filename: str = "<source>") -> list[tuple[str, str, str]]:
    """Every assertion in `source` comparing a duration to a constant: (filename, function, assertion source)."""
    tree = ast.parse(source)
    owner, timed_in, found = scopes(tree), {}, []
    module_timed = timed_names(ast.Module(body=[s for s in tree.body if not isinstance(s, (ast.FunctionDef,
                                                                                       ast.ClassDef))],
                                          type_ignores=[]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            comparisons = [part for part in ast.walk(node.test) if isinstance(part, ast.Compare)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in UNITTEST_COMPARISONS:
            comparisons = [node]
        else:
            continue
        function = owner.get(id(node), tree)
        if id(function) not in timed_in:
            timed_in[id(function)] = timed_names(function) | module_timed
        if any(any(absolute_pairs(part, timed_in[id(function)])) for part in comparisons):
            found.append((filename, getattr(function, "name", "<module>"), ast.get_source_segment(source, node)))
    return found


# Waits whose first positional argument is the time limit (threading's Event, Condition, Thread; Popen.wait).
POSITIONAL_WAITS = {"wait", "join"}


def short_timeouts(source: str, filename: str = "<source>") -> list[tuple[str, int, str]]:
    """Every `timeout=` (or a wait's positional limit) below PROCESS_WAIT_S, a number or a module-level NAME =
    number: (filename, line, source)."""
    tree = ast.parse(source)
    numbers = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Constant) and isinstance(node.value.value, (int, float))
               for target in node.targets if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        limits = [keyword.value for keyword in node.keywords if keyword.arg == "timeout"]
        if isinstance(node.func, ast.Attribute) and node.func.attr in POSITIONAL_WAITS and node.args:
            limits.append(node.args[0])  # `event.wait(120)`, `thread.join(5)`: the limit given positionally
        for value in limits:
            seconds = value.value if isinstance(value, ast.Constant) else numbers.get(getattr(value, "id", None))
            if isinstance(seconds, (int, float)) and seconds < PROCESS_WAIT_S:
                found.append((filename, node.lineno, ast.get_source_segment(source, node)))
    return found


def python_files() -> list[str]:
    paths = []
    for folder, _, names in os.walk(TESTS):
        paths += [os.path.join(folder, name) for name in names if name.endswith(".py")]
    return sorted(paths)


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_no_test_asserts_a_wall_clock_figure():
    found = [hit for path in python_files() if os.path.abspath(path) != os.path.abspath(__file__)
             for hit in wallclock_assertions(read(path), os.path.relpath(path, TESTS))]
    refused = [hit for hit in found if hit not in ALLOWED]
    assert refused == [], (
        "These assertions compare a duration to a constant, which fails at random on a busy machine:\n"
        + "\n".join(f"  {file} ({function}): {text}" for file, function, text in refused)
        + "\nCheck what the time stands for instead (a call count, an order, a sum, helpers.JumpingClock) and measure "
          "speed in benchmarks/ side by side; or, if it must stay, add it to ALLOWED in tests/test_no_wallclock.py "
          "with the reason.")
    assert sorted(set(ALLOWED) - set(found)) == [], "ALLOWED names assertions that no longer exist: remove them"


def test_no_child_process_gets_a_tight_time_limit():
    found = [hit for path in python_files() if os.path.abspath(path) != os.path.abspath(__file__)
             for hit in short_timeouts(read(path), os.path.relpath(path, TESTS))]
    assert found == [], (
        f"These waits give up in less than {PROCESS_WAIT_S} s, which a busy machine can need:\n"
        + "\n".join(f"  {file}:{line}: {text}" for file, line, text in found)
        + "\nUse helpers.wait_for(process, what) / helpers.run_process(command, what): a generous limit, and a "
          "failure that says what was waited for.")


# ---------------------------------------------------------------------------------------------------------------
# No test that launches a process lands in the fast tier: each is named in tests/load_sensitive.txt (or tests/slow.txt),
# which tests/conftest.py turns into the `slow` marker that `make test` leaves out.
# ---------------------------------------------------------------------------------------------------------------
# Calls that start a process, by the module they come from (`subprocess.run`, `from subprocess import Popen`,
# `mp.get_context`, `torch.multiprocessing.spawn`) or by the name of the tests' own helper.
LAUNCHERS = {
    "subprocess": {"run", "call", "Popen", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "spawnl",
           "spawnle", "spawnvp", "spawnlp", "execv", "execve", "execvp", "execl"},
    "multiprocessing": {"Process", "Pool", "get_context", "set_start_method"},
    "torch.multiprocessing": {"Process", "Pool", "get_context", "spawn", "start_processes"},
    "torch.distributed.run": {"main", "run"},
    "helpers": {"run_process", "wait_for"},
}
# A DataLoader with worker processes: a literal `dataloader_num_workers=N` (or `num_workers=N`), N > 0.
WORKER_KEYWORDS = {"dataloader_num_workers", "num_workers"}


def imported_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it is: `module` for `import module [as name]`, `module.attr` for `from module import attr`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # `import a.b` binds `a`; `import a.b as c` binds `c` to `a.b`
                top = alias.name.split(".")[0]
                names[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """`mp.get_context` -> `torch.multiprocessing.get_context` when `import torch.multiprocessing as mp`."""
    if isinstance(node, ast.Name):
        return names.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = dotted(node.value, names)
        return f"{base}.{node.attr}" if base else None
    return None


def starts_a_process(call: ast.Call, names: dict[str, str], launching: set[str]) -> bool:
    """Whether `call` launches: a launcher above, a function known to launch (`launching`, dotted names), or a
    DataLoader given worker processes."""
    target = dotted(call.func, names) or ""
    module, _, attr = target.rpartition(".")
    if attr in LAUNCHERS.get(module, ()) or target in launching:
        return True
    return any(keyword.arg in WORKER_KEYWORDS and isinstance(keyword.value, ast.Constant)
               and isinstance(keyword.value.value, int) and keyword.value.value > 0 for keyword in call.keywords)


def is_fixture(function: ast.AST) -> bool:
    for decorator in getattr(function, "decorator_list", []):
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (getattr(target, "attr", None) or getattr(target, "id", None)) == "fixture":
            return True
    return False


def is_autouse(function: ast.AST) -> bool:
    return any(isinstance(decorator, ast.Call) and any(k.arg == "autouse" and getattr(k.value, "value", False)
                                                       for k in decorator.keywords)
               for decorator in function.decorator_list)


def functions_of(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions by name, and methods as `Class::method`."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            found.update({f"{node.name}::{item.name}": item for item in node.body
                          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))})
    return found


def launching_functions(sources: dict[str, str]) -> dict[str, set[str]]:
    """Per module (`helpers`, `test_x`), the functions that launch a process: directly, through a function of this
    or another tests module they call, or through a fixture they take (an autouse one: every test of the module)."""
    trees = {module: ast.parse(source) for module, source in sources.items()}
    launching = {module: set() for module in trees}
    shared = {name for name, f in functions_of(trees["conftest"]).items() if is_fixture(f)} \
        if "conftest" in trees else set()  # tests/conftest.py's fixtures: any test may take them
    while True:
        grown = False
        for module, tree in trees.items():
            names, functions = imported_names(tree), functions_of(tree)
            known = {f"{other}.{name}" for other in launching for name in launching[other]}
            local = {name: f"{module}.{name}" for name in functions if "::" not in name}
            lookup = {**{name: f"conftest.{name}" for name in shared}, **names, **local}
            fixtures = shared | {name for name, f in functions.items() if is_fixture(f)} | {
                local_name for local_name, target in names.items() if target in known}
            autouse = any(is_fixture(f) and is_autouse(f) and name in launching[module]
                          for name, f in functions.items())
            for name, function in functions.items():
                if name in launching[module]:
                    continue
                arguments = {a.arg for a in function.args.args + function.args.kwonlyargs}
                takes = {lookup.get(a, f"{module}.{a}") for a in arguments & fixtures}
                if (autouse and name.split("::")[-1].startswith("test")) or takes & known or any(
                        isinstance(node, ast.Call) and starts_a_process(node, lookup, known)
                        for node in ast.walk(function)):
                    launching[module] |= {name, name.split("::")[0]}  # a method launches: so does its class
                    grown = True
        if not grown:
            return launching


def suite_sources() -> dict[str, str]:
    return {os.path.splitext(os.path.basename(path))[0]: read(path) for path in python_files()
            if os.path.dirname(path) == TESTS}


def launching_tests(sources: dict[str, str]) -> list[str]:
    """The ids (`tests/test_x.py::test_y`, `tests/test_x.py::TestZ::test_y`) of the tests that launch a process."""
    return sorted(f"tests/{module}.py::{name}" for module, names in launching_functions(sources).items()
                  if module.startswith("test_") for name in names
                  if name.split("::")[-1].startswith("test") and ("::" not in name or name.startswith("Test")))


def test_no_test_that_launches_a_process_is_in_the_fast_tier():
    from conftest import is_listed, slow_ids

    slow = slow_ids()
    unlisted = [test_id for test_id in launching_tests(suite_sources()) if not is_listed(test_id, slow)]
    assert unlisted == [], (
        "These tests launch a process (subprocess, torchrun, helpers.run_process, multiprocessing, DataLoader "
        "workers) but are not in the slow tier, so `make test` would run them:\n  " + "\n  ".join(unlisted)
        + "\nName each in tests/load_sensitive.txt with what it waits for (docs/testing.md).")


def test_every_test_the_tier_lists_name_exists():
    from conftest import SLOW_LISTS, listed_ids

    stale = []
    for list_name in SLOW_LISTS:
        for test_id in listed_ids(list_name):
            path, *name = test_id.split("::", 1)
            full = os.path.join(os.path.dirname(TESTS), path)
            if not os.path.isfile(full) or name and name[0] not in functions_of(ast.parse(read(full))):
                stale.append(f"{list_name}: {test_id}")
    assert stale == [], "These listed tests do not exist (renamed?): the tests they meant would run in the fast " \
                        "tier unnoticed:\n  " + "\n  ".join(stale)


# ---------------------------------------------------------------------------------------------------------------
# The checks themselves, on sources written for them
# ---------------------------------------------------------------------------------------------------------------
def refused(source: str) -> list[str]:
    return [text for _, _, text in wallclock_assertions(source)]


def test_the_check_refuses_an_elapsed_time_compared_to_a_constant():
    assert refused("def test_x():\n    assert elapsed < 0.5\n") == ["assert elapsed < 0.5"]
    assert refused("import time\ndef test_x():\n    start = time.perf_counter()\n    work()\n"
                   "    took = time.perf_counter() - start\n    assert took <= 2\n") == ["assert took <= 2"]
    assert refused("from time import monotonic\ndef test_x():\n    t0 = monotonic()\n"
                   "    assert monotonic() - t0 < LIMIT\n") == ["assert monotonic() - t0 < LIMIT"]
    assert refused("def test_x():\n    waits = []\n    waits.append(time.time() - t)\n"
                   "    assert statistics.median(waits) <= 0.05\n") == ["assert statistics.median(waits) <= 0.05"]
    assert refused("def test_x():\n    assert report['total_seconds'] < 30 and ok\n") == [
        "assert report['total_seconds'] < 30 and ok"]
    assert refused("def test_x(self):\n    self.assertLess(overhead_s, 0.3)\n") == ["self.assertLess(overhead_s, 0.3)"]
    assert refused("def test_x():\n    seconds = probe()\n    assert seconds > IMPORT_BUDGET_S\n") == [
        "assert seconds > IMPORT_BUDGET_S"]


def test_the_check_allows_relative_comparisons_sign_checks_and_other_numbers():
    allowed = ("def test_x():\n"
               "    start = time.perf_counter()\n"
               "    total = report['total_seconds']\n"
               "    assert earliest <= total <= time.perf_counter() - start\n"  # two durations of the same run
               "    assert seconds['setup'] > 0 and report['compile_seconds'] == 0\n"  # signs
               "    assert len(steps) < 300 and loss < 0.5 and count == 3\n")  # not durations
    assert refused(allowed) == []
    assert refused(allowed + "    assert elapsed < 0.5\n") == ["assert elapsed < 0.5"]


def test_the_check_refuses_a_short_timeout_and_allows_the_generous_one():
    source = ("LAUNCH_TIMEOUT = 150\n"
              "subprocess.run(command, timeout=300)\n"
              "process.communicate(timeout=LAUNCH_TIMEOUT)\n"
              "process.wait(timeout=PROCESS_WAIT_S)\n"
              f"process.communicate(timeout={PROCESS_WAIT_S})\n"
              "gate.wait(LAUNCH_TIMEOUT)\n"
              "thread.join(5)\n"
              "gate.wait(PROCESS_WAIT_S)\n"
              "thread.join()\n")
    assert [line for _, line, _ in short_timeouts(source)] == [2, 3, 6, 7]


def test_the_launch_check_follows_helpers_fixtures_and_imports_and_leaves_in_process_tests():
    sources = {
        "helpers": "import subprocess\ndef run_process(command, what):\n    return subprocess.run(command)\n",
        "test_a": ("import subprocess, pytest\nimport multiprocessing as mp\nimport torch.multiprocessing as tmp\n"
                   "from helpers import run_process\n"
                   "def child():\n    return run_process(['python'], 'a child')\n"
                   "@pytest.fixture\ndef launched():\n    return subprocess.Popen(['torchrun'])\n"
                   "def test_helper():\n    child()\n"
                   "def test_fixture(launched):\n    pass\n"
                   "def test_mp():\n    mp.get_context('spawn').Process(target=print).start()\n"
                   "def test_torch_spawn():\n    tmp.spawn(print, nprocs=2)\n"
                   "def test_workers(tmp_path):\n    hf_args(tmp_path, dataloader_num_workers=2)\n"
                   "class TestGroup:\n    def test_fork(self):\n        import os\n        os.fork()\n"
                   "def test_in_process(tmp_path):\n    hf_args(tmp_path, dataloader_num_workers=0).run()\n"
                   "    platform.system()\n"),
        "test_b": "from test_a import child, launched\ndef test_imported(launched):\n    child()\n"
                  "def test_other():\n    pass\n",
    }
    assert launching_tests(sources) == [
        "tests/test_a.py::TestGroup::test_fork", "tests/test_a.py::test_fixture", "tests/test_a.py::test_helper",
        "tests/test_a.py::test_mp", "tests/test_a.py::test_torch_spawn", "tests/test_a.py::test_workers",
        "tests/test_b.py::test_imported"]
    shared = {"helpers": "import subprocess\nclass Server:\n    def __init__(self):\n        subprocess.Popen(['x'])\n",
              "conftest": "import pytest\n@pytest.fixture\ndef forked():\n    from helpers import Server\n"
                          "    yield Server()\n",
              "test_d": "def test_forks(tmp_path, forked):\n    pass\ndef test_not(tmp_path):\n    pass\n"}
    assert launching_tests(shared) == ["tests/test_d.py::test_forks"]
    autouse = "import pytest, subprocess\n@pytest.fixture(autouse=True)\ndef up():\n    subprocess.run(['x'])\n" \
              "def test_one():\n    pass\n"
    assert launching_tests({"test_c": autouse}) == ["tests/test_c.py::test_one"]


def test_the_tiers_mark_a_listed_file_or_function_with_all_its_parameters():
    from conftest import is_listed

    listed = {"tests/test_a.py", "tests/test_b.py::test_y", "tests/test_c.py::TestZ"}
    assert is_listed("tests/test_a.py::test_anything[1-2]", listed)
    assert is_listed("tests/test_b.py::test_y[a/b::c]", listed) and not is_listed("tests/test_b.py::test_y2", listed)
    assert is_listed("tests/test_c.py::TestZ::test_w", listed) and not is_listed("tests/test_d.py::test_y", listed)


# ---------------------------------------------------------------------------------------------------------------
# The waits the check points to (helpers.wait_for / run_process): they return the output, or fail saying what they
# waited for. (This file is the one place a short limit may appear: the scan above skips it.)
# ---------------------------------------------------------------------------------------------------------------
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def test_the_waits_return_what_the_child_printed():
    assert run_process([sys.executable, "-c", "print('done')"], "an echo").stdout == "done\n"
    merged = run_process([sys.executable, "-c", "import sys; print('out', flush=True); sys.exit('err')"], "an exit",
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert merged.returncode == 1 and merged.stdout == "out\nerr\n"
    process = subprocess.Popen([sys.executable, "-c", "print('launched')"], stdout=subprocess.PIPE, text=True)
    assert wait_for(process, "a launch") == "launched\n" and process.returncode == 0


def test_a_wait_that_expires_kills_the_child_and_says_what_it_waited_for(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"a sleeper was still running after 1 s \(killed\)"):
        run_process(SLEEPER, "a sleeper", timeout=1)
    printed = tmp_path / "printed"
    code = f"import pathlib, time; print('started', flush=True); pathlib.Path({str(printed)!r}).touch(); time.sleep(600)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for _ in range(PROCESS_WAIT_S * 100):  # until the child has printed, so its output is in the message
        if printed.exists() or process.poll() is not None:
            break
        time.sleep(0.01)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)a launch was still running after 1 s \(killed\).*started"):
        wait_for(process, "a launch", timeout=1)
    assert process.returncode == -signal.SIGKILL
