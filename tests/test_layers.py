"""The package's wings import one way: a module imports only from its own wing and the wings
below it (lazy imports inside functions count, and so do names imported under
``if TYPE_CHECKING:``: a lower wing that needs an upper one's type names a small ``Protocol`` of
its own, what it really uses, that the upper class meets), sibling wings on one floor never import
each other, no two modules import each other in a circle when they run (an import under
``if TYPE_CHECKING:`` never runs, so it makes no circle), and only a few modules sit directly in
``aiocollect/``."""

from __future__ import annotations

import ast
import pathlib

import pytest

import aiocollect

PACKAGE = pathlib.Path(aiocollect.__file__).parent

# Floors from the bottom up; the wings of one floor are siblings that must not import each other.
FLOORS: list[tuple[str, ...]] = [
    ("aiocollect.events",),  # typed events (public): imports nothing of ours
    ("aiocollect._core",),  # what both sides of the process boundary share
    ("aiocollect._worker",),  # what runs in a worker process or a Ray actor
    ("aiocollect._service",),  # what the collector and the evaluator share in the parent
    ("aiocollect._backends",),  # the parent's side of each kind of worker
    ("aiocollect._collector", "aiocollect._evaluator", "aiocollect._replay"),
    ("aiocollect.testing",),  # public test helpers
    ("aiocollect",),  # the public face (its names are loaded lazily)
    ("aiocollect._cli",),  # the command line
    ("aiocollect.__main__",),  # python -m aiocollect
]
MAX_TOP_LEVEL_MODULES = 12


def _module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(sub) for sub in ast.walk(stmt))
    return skip


def import_graph(package: pathlib.Path = PACKAGE, *, type_checking: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (at module level or inside functions;
    under ``if TYPE_CHECKING:`` too, unless ``type_checking=False``: what runs)."""
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if type_checking else _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in files]
                targets = subs + ([module] if len(subs) < len(node.names) else [])
            for target in targets:
                while target and target not in files:  # `import aiocollect._core.errors` etc.
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _floor(module: str) -> tuple[int, str]:
    best: tuple[int, str] | None = None
    for level, wings in enumerate(FLOORS):
        for wing in wings:
            if module == wing or module.startswith(wing + "."):
                if best is None or len(wing) > len(best[1]):
                    best = (level, wing)
    assert best is not None, f"{module} is in no wing of FLOORS: add its wing to tests/test_layers.py"
    return best


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        level, wing = _floor(module)
        for target in sorted(targets):
            target_level, target_wing = _floor(target)
            if target_level > level:
                bad.append(f"{module} imports {target}, a floor above it")
            elif target_level == level and target_wing != wing:
                bad.append(f"{module} imports {target}, a sibling wing on its floor")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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


@pytest.mark.timeout(60)
def test_every_import_runs_down_the_floors_or_within_a_wing() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the whole package was read
    assert backward_imports(graph) == []


@pytest.mark.timeout(60)
def test_no_two_modules_import_each_other_in_a_circle() -> None:
    """Not even for type checking: a circle drawn by ``TYPE_CHECKING`` imports is one a reader
    of the code walks all the same."""
    assert cycles(import_graph()) == []


@pytest.mark.timeout(60)
def test_only_a_few_modules_sit_directly_in_the_package() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    wings = {wing for floor in FLOORS for wing in floor}
    for sub in PACKAGE.iterdir():
        if sub.is_dir() and (sub / "__init__.py").exists():
            assert f"aiocollect.{sub.name}" in wings, f"{sub.name}/ is in no floor of tests/test_layers.py"


@pytest.mark.timeout(60)
def test_the_checks_find_a_backward_import_a_sibling_import_and_a_circle(tmp_path: pathlib.Path) -> None:
    """The checks above can fail: a package with each fault is caught."""
    root = tmp_path / "aiocollect"
    for wing in ("_core", "_worker", "_collector", "_evaluator"):
        (root / wing).mkdir(parents=True)
        (root / wing / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "_core" / "errors.py").write_text("def f():\n    from .._worker import rollout\n")
    (root / "_worker" / "rollout.py").write_text("from .._core import errors\n")
    (root / "_collector" / "run.py").write_text("from .._evaluator.run import x\n")
    (root / "_core" / "profiling.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._collector.run import RunState\n"
    )
    (root / "_evaluator" / "run.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .._collector.run import y\n"
    )
    graph = import_graph(root)
    assert graph["aiocollect._core.errors"] == {"aiocollect._worker.rollout"}
    assert graph["aiocollect._core.profiling"] == {"aiocollect._collector.run"}  # an annotation's import counts
    assert backward_imports(graph) == [
        "aiocollect._collector.run imports aiocollect._evaluator.run, a sibling wing on its floor",
        "aiocollect._core.errors imports aiocollect._worker.rollout, a floor above it",
        "aiocollect._core.profiling imports aiocollect._collector.run, a floor above it",
        "aiocollect._evaluator.run imports aiocollect._collector.run, a sibling wing on its floor",
    ]
    assert cycles(graph) == [
        ["aiocollect._collector.run", "aiocollect._evaluator.run"],
        ["aiocollect._core.errors", "aiocollect._worker.rollout"],
    ]
    # what runs: the imports under TYPE_CHECKING make no circle
    assert cycles(import_graph(root, type_checking=False)) == [["aiocollect._core.errors", "aiocollect._worker.rollout"]]
