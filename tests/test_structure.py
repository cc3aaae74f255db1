"""The architecture's layering, read from the source: no import cycles between modules; the runtime
imports nothing above it; reports read DataFrames and import neither harness nor strategies; strategies
never import the harness. Imports inside functions (lazy, e.g. the registry's engines) are not edges."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "strategies", "reports")


def module_graph() -> dict[str, set[str]]:
    files = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            files[name.removesuffix(".__init__")] = p
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, p in files.items():
        for node in ast.parse(p.read_text()).body:  # module level only
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            graph[m] |= {n for n in names if n in files}
    return graph


def test_no_import_cycles():
    graph, state, cycles = module_graph(), {}, []

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
    assert not cycles, cycles


def test_layers_point_down():
    wrong = [(m, n) for m, deps in module_graph().items() for n in deps
             if (m.startswith("strategies.runtime") and not n.startswith("strategies.runtime"))
             or (m.startswith("reports") and not n.startswith("reports"))
             or (m.startswith("strategies") and n.startswith("harness"))]
    assert not wrong, wrong
    assert len(module_graph()) > 40  # the walk found the tree
