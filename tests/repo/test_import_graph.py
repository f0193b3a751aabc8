"""The shape of the capsroute package, read from its source (nothing is imported): the modules import
each other without a cycle and only downwards through the layers, the library (ops, nn, models)
never imports the application, and no module outgrows a reader (the library's 450 lines, any
module's 600, of at most 100 columns)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "capsroute"
# ruff format holds lines to 100 columns (scripts/lint.sh).
MAX_LINES = 600
MAX_LIBRARY_LINES = 450

# The layers, lowest first, and the layers each may import. Private helpers (_utils) sit at the
# bottom and import nothing of capsroute; the package's __init__ loads _C and the library.
LAYERS = {
    "utils": set(),
    "ops": {"ops"},
    "nn": {"ops", "nn"},  # the layers and the losses beside them
    "models": {"ops", "nn", "models"},
    "datasets": {"utils", "datasets"},
    "testing": {"ops", "testing"},
    "root": {"ops", "nn", "models", "root"},
    "train": {"root", "ops", "nn", "models", "datasets", "utils", "train"},
    # The model benchmark times the training step as `capsroute train` makes it (train.metrics).
    "bench": {"root", "ops", "nn", "models", "testing", "utils", "train", "bench"},
    "doctor": {"root", "ops", "testing", "utils", "bench"},  # bench.timing times each op
    "cli": {"root", "utils", "train", "bench", "doctor", "cli"},
}
LIBRARY = ("ops", "nn", "models")


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


def layer(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in ("_cpu_arch", "_build_config"):
        return "root"
    if parts[1] == "_utils":
        return "utils"
    return "nn" if parts[1] == "losses" else parts[1]


def test_the_graph_is_read():
    """Guards the test itself: edges that exist today are found, every module has a layer."""
    assert "capsroute.ops" in GRAPH["capsroute.nn._base"]
    assert "capsroute._utils.runinfo" in GRAPH["capsroute.train.trainer"]
    assert "capsroute.bench.cases" in GRAPH["capsroute.bench.floor"]
    assert "capsroute.models" in GRAPH["capsroute.bench.model_bench"]
    assert {layer(m) for m in MODULES} <= set(LAYERS)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers(name):
    upward = sorted(m for m in GRAPH[name] if layer(m) not in LAYERS[layer(name)])
    assert not upward, f"{name} ({layer(name)}) imports {upward}"


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
    assert GRAPH["capsroute._utils.runinfo"] == set()


@pytest.mark.parametrize(
    "name", ["capsroute.train", "capsroute.train.plot", "capsroute.bench.plot"]
)
def test_trainer_and_figures_do_not_import_the_benchmark(name):
    bench = {m for m in reachable(name) if m.startswith("capsroute.bench")}
    assert not bench, f"{name} imports {sorted(bench)}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    cap = MAX_LIBRARY_LINES if layer(name) in LIBRARY else MAX_LINES
    assert lines <= cap, f"{MODULES[name].relative_to(PACKAGE.parent)}: {lines} lines > {cap}"
