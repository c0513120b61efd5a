"""The Python code of the docs (``docs/**/*.md``, README.md, CONTRIBUTING.md): every ``python``
block compiles (top-level ``await`` allowed, as in a notebook), and every block that is a program
(it ends in ``anyio.run(...)``, ``asyncio.run(...)`` or ``trio.run(...)`` at the left margin) runs
as written in a fresh interpreter: after the page's earlier blocks when a
``<!-- continues the code above -->`` comment stands before it, else alone.

A block that is not a program is a fragment shown inside a program of the reader's (it may use
``collector`` or ``policy`` from around it): compiled, not run. A block that is no Python at all
(a signature, a log) is fenced as ``text``, not ``python``.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest
from procs import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([*ROOT.joinpath("docs").rglob("*.md"), ROOT / "README.md", *ROOT.glob("CONTRIBUTING.md")])
PROGRAM = re.compile(r"^(anyio|asyncio|trio)\.run\(", re.M)
CONTINUES = "<!-- continues the code above -->"


def blocks(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """``(line, code, continues)`` of each python block of a page."""
    text = path.read_text()
    found = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        found.append((line, match.group(1), before.strip() == CONTINUES))
    return found


CASES = [(path, line, code, cont) for path in PAGES for line, code, cont in blocks(path)]
# each distinct program once; the README's first one is run (and its output checked) by test_readme.py
PROGRAMS = []
_seen = {blocks(ROOT / "README.md")[0][1]}
for path in PAGES:
    earlier: list[str] = []
    for line, code, cont in blocks(path):
        program = "\n".join([*earlier, code]) if cont else code
        if PROGRAM.search(code) and program not in _seen:
            _seen.add(program)
            PROGRAMS.append(pytest.param(path, line, program, id=f"{path.relative_to(ROOT)}:{line}"))
        earlier.append(code)


def test_the_pages_have_code_and_programs():
    assert len(CASES) > 30 and len(PROGRAMS) >= 2, (len(CASES), len(PROGRAMS))


@pytest.mark.parametrize(("path", "line", "code", "cont"), CASES,
                         ids=[f"{p.relative_to(ROOT)}:{n}" for p, n, _, _ in CASES])
def test_every_python_block_compiles(path, line, code, cont):
    try:
        compile(code, f"{path.relative_to(ROOT)}:{line}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        pytest.fail(f"{path.relative_to(ROOT)}, the python block at line {line}: {exc} (fence it as text if it "
                    f"is not Python)")


# (the longest program, a training script of 100 batches, takes about 30 s on a quiet 2-core
# machine, and has taken over 280 s on one loaded many times over)
@pytest.mark.timeout(480)
@pytest.mark.parametrize(("path", "line", "code"), PROGRAMS)
def test_every_program_runs_as_written(path, line, code, tmp_path):
    script = tmp_path / "docs_program.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True, text=True,
                          timeout=450, cwd=tmp_path, env=child_env(ROOT))
    assert proc.returncode == 0, (f"{path.relative_to(ROOT)}, the program at line {line}, failed:\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def test_a_fragment_is_compiled_and_a_program_is_found(tmp_path):
    """The checks above can fail: a block with a syntax error does not compile, and a program
    block is recognised (alone, or after the page's earlier blocks)."""
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n" + CONTINUES + "\n```python\nimport anyio\nanyio.run(f)\n```\n"
                    "```python\nCollector(a, *, b)\n```\n")
    found = blocks(page)
    assert [cont for _, _, cont in found] == [False, True, False]
    assert PROGRAM.search(found[1][1]) and not PROGRAM.search(found[0][1])
    with pytest.raises(SyntaxError):
        compile(found[2][1], "page.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
