"""loopkit's import graph has no cycle, counting the imports made inside functions.

An import inside a function is a dependency the module-level graph does not show; a circle of them ties modules
together that read as independent. Every `import` / `from ... import` anywhere in a module counts (relative imports
resolved, `from pkg import submodule` as an edge to the submodule). A package's `__init__` running before its
submodules is Python's doing, not an edge.
"""

import ast
import pathlib

import loopkit

ROOT = pathlib.Path(loopkit.__file__).parent

# The one edge allowed to close a circle: loopkit/checkpoint/writing.py looks the file operations up in its package's
# namespace at call time (`checkpoint.write_text`, ...), so that wrapping one there reaches every save (the kill tests
# do); the package's __init__ only re-exports its modules' names. No other edge may close a circle.
KNOWN_CYCLE_EDGES = {
    ("loopkit.checkpoint.writing", "loopkit.checkpoint"),
}


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported(node, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement reaches (each `from X import name` as X.name, which may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[:len(package) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its source."""
    names = module_names(root)
    package = root.name
    graph = {}
    for module, path in names.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(node, module, path.name == "__init__.py"):
                    while target and target not in names:  # loopkit.args.plain -> loopkit.args
                        target = target.rpartition(".")[0]
                    if target and target != module and target.split(".")[0] == package:
                        edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions(tmp_path):
    """A circle closed only by imports inside functions, relative ones and `from package import module` among them,
    is found (else an acyclic verdict would mean nothing)."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import name\n")
    (package / "c.py").write_text("class C:\n    def g(self):\n        import pkg.a\n")
    (package / "d.py").write_text("from . import a\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub", "pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg", "pkg.a"}  # `from . import a` runs pkg too
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_loopkit_imports_form_no_cycle():
    graph = import_graph()
    listed = {edge for edge in KNOWN_CYCLE_EDGES if edge[1] in graph.get(edge[0], ())}
    for source, target in listed:
        graph[source] = graph[source] - {target}
    found = cycles(graph)
    assert not found, "modules importing each other (imports inside functions count): " + "; ".join(
        " <-> ".join(c) + " via " + ", ".join(f"{v}->{w}" for v in c for w in sorted(graph[v]) if w in c)
        for c in found)
