"""Every aiocollect name the docs' code uses is importable from where the code imports it: each
``from aiocollect[.x] import Y``, ``import aiocollect.x`` and ``aiocollect.x.Y`` in a ``python``
block of README.md, CONTRIBUTING.md and ``docs/**/*.md`` (fragments too, which are only compiled
elsewhere), and each ``from aiocollect import Y`` or ``aiocollect.x.Y`` in their prose's inline
code, checked in this interpreter."""

from __future__ import annotations

import ast
import importlib
import re
import types

import pytest
from test_docs_code import PAGES, ROOT, blocks


def _chain(node: ast.Attribute) -> str:
    """``x.y`` of the expression ``aiocollect.x.y`` that ``node`` (``aiocollect.x``) begins."""
    parts = [node.attr]
    parent = getattr(node, "parent", None)
    while isinstance(parent, ast.Attribute):
        parts.append(parent.attr)
        parent = getattr(parent, "parent", None)
    return ".".join(parts)


def resolve(module: str, name: str | None) -> None:
    """Import ``name`` from ``module`` as the docs write it; a dotted ``name`` (``events.X``)
    follows attributes as long as they are modules, as ``aiocollect.events.X`` does."""
    obj: object = importlib.import_module(module)
    if name is None:
        return
    for part in name.split("."):
        if not isinstance(obj, types.ModuleType):
            return  # (an attribute of a class or function: not a name the package exports)
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:  # a subpackage not imported yet (aiocollect._backends.seat)
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except ModuleNotFoundError:
                raise ImportError(f"cannot import name {part!r} from {obj.__name__!r}") from None


def uses_in(path) -> list[tuple[int, str, str | None]]:
    """``(line of the block, module, name)`` for each name a page's blocks take from aiocollect
    (``name`` None: the module itself)."""
    found = []
    for line, code, _ in blocks(path):
        tree = compile(code, "<block>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        for node in ast.walk(tree):  # (each attribute knows its parent, for the chains)
            for child in ast.iter_child_nodes(node):
                child.parent = node  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "aiocollect":
                found += [(line, node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(line, alias.name, None) for alias in node.names if alias.name.split(".")[0] == "aiocollect"]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "aiocollect"):
                found.append((line, "aiocollect", _chain(node)))
    # and inline code in the prose (`from aiocollect import X`, `aiocollect.events.X`), outside the blocks
    text = path.read_text()
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    for span in re.finditer(r"`([^`\n]+)`", prose):
        line = prose.count("\n", 0, span.start()) + 1
        for m in re.finditer(r"\bfrom (aiocollect[\w.]*) import ([\w, ]+)", span.group(1)):
            found += [(line, m.group(1), name.strip()) for name in m.group(2).split(",") if name.strip()]
        for m in re.finditer(r"(?<![\w./])aiocollect\.([A-Za-z_][\w.]*\w)", span.group(1)):
            found.append((line, "aiocollect", m.group(1)))
    return found


USES = [(path, line, module, name) for path in PAGES for line, module, name in uses_in(path)]


def test_the_docs_use_aiocollect_names():
    """(The scan finds what it looks for: the README's Collector and the events page's types.)"""
    names = {(module, name) for _, _, module, name in USES}
    assert ("aiocollect", "Collector") in names
    assert any(name and name.split(".")[-1] == "EpisodeEnded" for _, name in names), sorted(names)
    assert len(USES) > 15, len(USES)


@pytest.mark.parametrize(("path", "line", "module", "name"), USES,
                         ids=[f"{p.relative_to(ROOT)}:{n}:{m}{'.' + x if x else ''}" for p, n, m, x in USES])
def test_every_aiocollect_name_in_the_docs_imports(path, line, module, name):
    try:
        resolve(module, name)
    except ImportError as exc:
        written = f"import {module}" if name is None else (
            f"{module}.{name}" if "." in name else f"from {module} import {name}")
        pytest.fail(f"{path.relative_to(ROOT)}, the python block at line {line}: `{written}` fails: {exc}")


def test_the_scan_sees_from_imports_module_imports_and_attributes(tmp_path):
    code = "import aiocollect.events\nfrom aiocollect import Nope\nx = aiocollect.events.Missing\nawait c.collect()\n"
    path = tmp_path / "page.md"
    path.write_text(f"Use `from aiocollect import A, B` or `aiocollect.testing.C`.\n\n```python\n{code}```\n")
    found = [(module, name) for _, module, name in uses_in(path)]
    assert found[-3:] == [("aiocollect", "A"), ("aiocollect", "B"), ("aiocollect", "testing.C")], found
    found = found[:-3]
    assert sorted(found, key=str) == sorted(
        [("aiocollect.events", None), ("aiocollect", "Nope"), ("aiocollect", "events.Missing")], key=str)
    with pytest.raises(ImportError, match="'Nope'"):
        resolve("aiocollect", "Nope")
    with pytest.raises(ImportError, match="'Missing' from 'aiocollect.events'"):
        resolve("aiocollect", "events.Missing")
    resolve("aiocollect", "events.EpisodeEnded.ret")  # (past the class: not the package's to export)
