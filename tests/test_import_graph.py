"""The shape of the capsroute package, read from its source (nothing is imported): the modules import
each other without a cycle, the trainer and the figures stay clear of the benchmark, and no module
outgrows a reader (600 lines of at most 100 columns)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "capsroute"
# ruff format holds lines to 100 columns (scripts/lint.sh): 600 of them hold about what 500
# lines of up to 132 columns held before the formatter.
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The capsroute modules that module `name` imports, at the top or inside a function. `from X import y`
    counts as importing X.y where that is a module, else X; a package's own __init__ is not counted as
    imported by its submodules (Python runs it first, but it is not the submodule's choice)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def reachable(start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for m in GRAPH[stack.pop()]:
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def test_the_graph_is_read():
    """Guards the test itself: edges that exist today are found."""
    assert "capsroute.ops" in GRAPH["capsroute.nn"]
    assert "capsroute._runinfo" in GRAPH["capsroute.train"]
    assert "capsroute.bench.cases" in GRAPH["capsroute.bench.floor"]
    assert "capsroute.models" in GRAPH["capsroute.bench.model_bench"]


def test_no_import_cycle():
    cycles = [[m, *path] for m in GRAPH for path in _paths_back(m)]
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _paths_back(start: str) -> list[list[str]]:
    """One import path from `start` back to itself, if there is one."""
    parent, stack = {}, [start]
    while stack:
        node = stack.pop()
        for m in GRAPH[node]:
            if m == start:
                path = [m]
                while node != start:
                    path.insert(0, node)
                    node = parent[node]
                return [path]
            if m not in parent:
                parent[m] = node
                stack.append(m)
    return []


def test_runinfo_is_a_leaf():
    assert GRAPH["capsroute._runinfo"] == set()


@pytest.mark.parametrize(
    "name", ["capsroute.train", "capsroute.train_plot", "capsroute.bench.plot"]
)
def test_trainer_and_figures_do_not_import_the_benchmark(name):
    bench = {m for m in reachable(name) if m.startswith("capsroute.bench")}
    assert not bench, f"{name} imports {sorted(bench)}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, (
        f"{MODULES[name].relative_to(PACKAGE.parent)}: {lines} lines > {MAX_LINES}"
    )
