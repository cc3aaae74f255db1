"""The architecture, read from the source: folders of at most 12 modules, modules of at most 300 lines, no
import cycle between modules, layers that point down (the runtime imports nothing above it; reports
read DataFrames and import neither harness nor strategies; strategies never import the harness), and no
class deeper than three of the project's classes (Executor → Strategy → a concrete strategy): a strategy
is composed of the parts it is given, not inherited through a chain.

Every import counts, wherever it stands: at module level, inside a function (a lazy import still runs,
and a cycle through one is a cycle), or under ``TYPE_CHECKING``."""

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("harness", "strategies", "reports")
MAX_MODULES_PER_FOLDER = 12
MAX_LINES = 300
MAX_CLASS_DEPTH = 3


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


def class_bases(modules: dict[str, str]) -> dict[str, list[str]]:
    """``module.Class`` → its bases among the project's classes, resolved through the module's own classes, its
    ``from m import Name`` imports and module-level aliases (``Worker = InflightStrategy``)."""
    classes: dict[str, list[str]] = {}  # qualified class → qualified bases (unresolved ones dropped)
    for m, text in modules.items():
        tree = ast.parse(text)
        names: dict[str, str] = {}  # a name in m → the qualified name it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                names[node.name] = f"{m}.{node.name}"
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                names[node.targets[0].id] = names.get(node.value.id, node.value.id)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[f"{m}.{node.name}"] = [names[b.id] for b in node.bases
                                               if isinstance(b, ast.Name) and b.id in names]
    return classes


def class_depths(modules: dict[str, str]) -> dict[str, int]:
    """``module.Class`` → how many of the project's classes its longest chain of bases holds, itself included
    (a class whose bases are all outside ``modules`` — object, ABC, Protocol, list, torch's — has depth 1)."""
    classes = class_bases(modules)
    depth: dict[str, int] = {}

    def of(c: str) -> int:
        if c not in depth:
            depth[c] = 1 + max((of(b) for b in classes[c] if b in classes), default=0)
        return depth[c]

    return {c: of(c) for c in classes}


def test_class_hierarchies_are_at_most_three_deep():
    """Executor → Strategy → InflightStrategy is the deepest chain a strategy may have; speculation, fleet
    roles and scheduling policies are parts. The walk finds the chains it is meant to (two assertions below),
    so an empty answer is not a parse that found nothing."""
    depths = class_depths({m: p.read_text() for m, p in source_files().items()})
    deep = {c: d for c, d in depths.items() if d > MAX_CLASS_DEPTH}
    assert not deep, deep
    assert depths["strategies.inflight.executor.InflightStrategy"] == 3
    assert depths["strategies.disagg.executor.DisaggStrategy"] == 3


def test_the_depth_walk_follows_imports_and_aliases():
    """Four classes over two modules, one base reached through an alias: depth 4 is seen."""
    a = "class A:\n    pass\nclass B(A):\n    pass\n"
    b = "from pkg.a import B\nAlias = B\nclass C(Alias):\n    pass\nclass D(C, list):\n    pass\n"
    assert class_depths({"pkg.a": a, "pkg.b": b}) == {"pkg.a.A": 1, "pkg.a.B": 2, "pkg.b.C": 3, "pkg.b.D": 4}


# Private members of the libraries the project calls (not the project's: those it may not reach into).
FOREIGN_PRIVATE = {"os._exit", "atexit._run_exitfuncs", "argparse._SubParsersAction", "torch.cuda._sleep"}


def private_reaches(modules: dict[str, str]) -> list[str]:
    """``x._name`` (not ``self``/``cls``, not a dunder) where no class or function of the module itself
    defines ``_name``: one object reaching into another's private member across modules."""
    found = []
    for m, text in modules.items():
        tree = ast.parse(text)
        own = set()  # private names this module defines: methods, classes, functions, attributes it assigns
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, ast.Assign):
                own |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own and ast.unparse(node) not in FOREIGN_PRIVATE:
                found.append(f"{m}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_object_reaches_into_another_modules_private_members():
    """A fleet drives its workers through their public calls, a role its worker through the strategy's, a
    stream its work through ``DeviceWork``'s: what another module's object keeps private stays so."""
    assert not private_reaches({m: p.read_text() for m, p in source_files().items()})


def test_the_private_reach_finder_finds_one():
    a = "class W:\n    def _launch(self):\n        pass\n"
    b = "def drive(w):\n    w._launch()\n    self_like = w\n    return self_like._wait\n"
    c = "class F:\n    def _launch(self):\n        pass\n    def go(self, w):\n        w._launch()\n"
    found = private_reaches({"pkg.a": a, "pkg.b": b, "pkg.c": c})
    assert sorted(found) == ["pkg.b:2: w._launch", "pkg.b:4: self_like._wait"]  # (pkg.c defines its own _launch)


# The engine core's calls: the parts of a step (its own) and its step queue's (its own loop's, and a fleet's,
# which drives several cores).
STEP_CALLS = {"schedule_step": {"strategies.core.engine_core"}, "postprocess": {"strategies.core.engine_core"},
              "launch_next": {"strategies.core.engine_core", "strategies.fleet"},
              "finish_oldest": {"strategies.core.engine_core", "strategies.fleet"}}


def test_the_engine_core_is_the_one_loop():
    """Every strategy runs the engine core's loop (``strategies/core/engine_core.py``): only it makes a step of
    the parts, only it and the fleet drive a step queue, and no strategy defines a ``run`` or a loop of its own
    — a strategy is its depth, its policy and its hooks."""
    modules = {m: p.read_text() for m, p in source_files().items()}
    wrong = []
    for m, text in modules.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STEP_CALLS \
                    and m not in STEP_CALLS[node.func.attr]:
                wrong.append(f"{m}:{node.lineno}: {node.func.attr}")
    assert not wrong, wrong
    bases = class_bases(modules)
    strategy = "strategies.base.Strategy"

    def is_strategy(c: str) -> bool:
        return c == strategy or any(is_strategy(b) for b in bases.get(c, []))

    concrete = [c for c in bases if is_strategy(c) and c != strategy]
    assert len(concrete) >= 4, concrete  # static, inflight, overlap, pipeline
    for c in concrete:
        m, _, name = c.rpartition(".")
        cls = next(n for n in ast.walk(ast.parse(modules[m])) if isinstance(n, ast.ClassDef) and n.name == name)
        loops = [n.lineno for n in ast.walk(cls) if isinstance(n, ast.While | ast.For)
                 and "launch" in ast.unparse(n)]
        defs = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        assert not defs & {"run", "_loop", "step"} and not loops, (c, defs & {"run", "_loop", "step"}, loops)
