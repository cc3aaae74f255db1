"""The architecture, read from the source: folders of at most 12 modules, modules of at most 300 lines, no
import cycle between modules, and layers that point down (the runtime imports nothing above it; reports
read DataFrames and import neither harness nor strategies; strategies never import the harness).

Every import counts, wherever it stands: at module level, inside a function (a lazy import still runs,
and a cycle through one is a cycle), or under ``TYPE_CHECKING``."""

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "strategies", "reports")
MAX_MODULES_PER_FOLDER = 12
MAX_LINES = 300


def source_files() -> dict[str, Path]:
    """Module name → file, for every module of the three packages."""
    files = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = p
    return files


def imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement brings in (a relative import resolved against ``module``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join([*parts, base] if base else parts)
    # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` the module mod
    return [base] + [f"{base}.{a.name}" for a in node.names]


def module_graph() -> dict[str, set[str]]:
    files = source_files()
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, p in files.items():
        for node in ast.walk(ast.parse(p.read_text())):  # every import, at any depth
            graph[m] |= {n for n in imported(node, m, p.name == "__init__.py") if n in files and n != m}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state, cycles = {}, []

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append([*path[path.index(n):], n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles():
    assert not find_cycles(module_graph()), find_cycles(module_graph())


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import(tmp_path):
    """The walk sees imports inside functions: a graph built the same way from two modules that import each
    other, one of them lazily, has a cycle."""
    a = "import pkg.b\n"
    b = "def f():\n    from pkg import a\n    return a\n"
    graph = {"pkg.a": set(), "pkg.b": set()}
    for m, text in (("pkg.a", a), ("pkg.b", b)):
        for node in ast.walk(ast.parse(text)):
            graph[m] |= {n for n in imported(node, m, False) if n in graph and n != m}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_layers_point_down():
    wrong = [(m, n) for m, deps in module_graph().items() for n in deps
             if (m.startswith("strategies.runtime") and not n.startswith("strategies.runtime"))
             or (m.startswith("reports") and not n.startswith("reports"))
             or (m.startswith("strategies") and n.startswith("harness"))]
    assert not wrong, wrong
    assert len(module_graph()) > 60  # the walk found the tree


def test_folders_hold_at_most_12_modules():
    """A folder listing reads like the architecture only while it is short: a 13th module means a concept
    wants a folder of its own. (``__init__.py`` is the folder itself, not a module in it.)"""
    per_folder = Counter(p.parent.relative_to(ROOT).as_posix() for p in source_files().values()
                         if p.name != "__init__.py")
    crowded = {folder: n for folder, n in per_folder.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, crowded
    assert per_folder["strategies/runtime"] >= 3  # counted where the modules are


def test_modules_have_at_most_300_lines():
    long = {m: n for m, p in source_files().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
