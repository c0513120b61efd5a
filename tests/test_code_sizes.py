"""The package stays readable in parts: no module over about 550 lines of code, no class over
about 350, no function over about 60 (code lines: blank lines, comments and docstrings are not
counted), so that a newcomer who must change something finds it in a part of a size one reads."""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import pytest

import aiocollect

PACKAGE = pathlib.Path(aiocollect.__file__).parent
LIMITS = {"module": 550, "class": 350, "function": 60}


def _docstring_lines(tree: ast.Module) -> set[int]:
    """Lines of docstrings: of modules, classes and functions, and of attributes (a string
    right after an assignment, as the configs document their fields)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            is_string = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(
                stmt.value.value, str)
            if is_string and (i == 0 or isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))):
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def code_lines(source: str) -> set[int]:
    """The lines of ``source`` that hold code (not blank, not only a comment, not a docstring)."""
    docs = _docstring_lines(ast.parse(source))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docs)
    return lines


def oversized(package: pathlib.Path = PACKAGE) -> list[str]:
    """``kind name: lines`` for every module, class and function over its limit."""
    found = []
    for path in sorted(package.rglob("*.py")):
        source = path.read_text()
        code = code_lines(source)
        where = path.relative_to(package.parent)
        if len(code) > LIMITS["module"]:
            found.append(f"module {where}: {len(code)}")
        for node in ast.walk(ast.parse(source)):
            kind = ("class" if isinstance(node, ast.ClassDef)
                    else "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if kind is None:
                continue
            n = sum(1 for line in code if node.lineno <= line <= (node.end_lineno or node.lineno))
            if n > LIMITS[kind]:
                found.append(f"{kind} {where}:{node.name}: {n}")
    return found


@pytest.mark.timeout(120)
def test_no_module_class_or_function_is_over_its_size():
    assert oversized() == []


@pytest.mark.timeout(60)
def test_the_size_check_counts_code_not_docs_and_can_fail(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}  # a comment" for i in range(61))
    (package / "big.py").write_text(f'"""A module."""\n\n\ndef f():\n    """Docs.\n\n    More docs."""\n{body}\n')
    assert code_lines((package / "big.py").read_text()) == set(range(8, 69)) | {4}
    assert oversized(package) == ["function pkg/big.py:f: 62"]
