"""The README's first example, the first code a user copies, runs as it is in a fresh process."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
from procs import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def first_python_block(path: pathlib.Path) -> str:
    found = re.search(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)
    assert found, f"no python code block in {path.name}"
    return found.group(1)


@pytest.mark.timeout(240)
def test_the_readmes_first_example_runs_as_written(tmp_path):
    script = tmp_path / "readme_example.py"
    script.write_text(first_python_block(ROOT / "README.md"))
    proc = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True, text=True, timeout=200,
                          cwd=tmp_path, env=child_env(ROOT))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 10, proc.stdout  # total_frames=20_480 in batches of 2048
    for line in lines:
        found = re.fullmatch(r"torch\.Size\(\[16, 128\]\) (\d+\.\d+)", line)
        assert found and 0 < float(found.group(1)) <= 2048, line


# The README is a first screen; what contributors need is in CONTRIBUTING.md, and both link only
# to files that exist.

MAX_README_LINES = 220
TEST_COMMAND = "bash scripts/run.sh test"
WINGS = ("_core/", "_worker/", "_service/", "_backends/", "_collector/", "_evaluator/", "_replay/", "_cli/")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def broken_relative_links(path: pathlib.Path) -> list[str]:
    """The relative link targets of a Markdown file (``[text](target)``, images too) that name no
    file or folder beside it; web addresses and in-page anchors are not checked."""
    broken = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.partition("#")[0]).exists():
            broken.append(target)
    return broken


def layout_modules(text: str) -> dict[str, set[str]]:
    """The modules the "Repository" section names in each wing of the package: in its bullet list,
    each `name.py` after a `_wing/` belongs to that wing."""
    section = text[text.index("## Repository"):]
    named: dict[str, set[str]] = {}
    wing = None
    for line in section.splitlines():
        if not line.startswith(("- ", "  ")):
            wing = None
            continue
        for token in re.findall(r"`([^`]+)`", line):
            if re.fullmatch(r"_\w+/", token):
                wing = token.rstrip("/")
                named.setdefault(wing, set())
            elif wing and re.fullmatch(r"\w+\.py", token):
                named[wing].add(token)
    return named


def test_the_readme_is_a_first_screen():
    """README.md: at most 220 lines, the install command in its first 60, the test command named."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    assert any("pip install torch==" in line for line in lines[:60]), "no install command in README's first 60 lines"
    assert any(TEST_COMMAND in line for line in lines), f"README.md does not name {TEST_COMMAND!r}"
    assert any("CONTRIBUTING.md" in line for line in lines), "README.md does not point to CONTRIBUTING.md"


def test_contributing_holds_the_set_up_and_the_package_layout():
    """CONTRIBUTING.md names the test command CI runs and lays out every wing of the package."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert TEST_COMMAND in text
    assert "## Repository" in text
    for wing in WINGS:
        assert f"`{wing}`" in text, f"CONTRIBUTING.md's layout does not name {wing}"


def test_the_package_layout_names_every_module_and_only_modules_that_exist():
    """Each wing in CONTRIBUTING.md's "Repository" section lists exactly the modules in that folder."""
    named = layout_modules((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8"))
    assert set(named) == {wing.rstrip("/") for wing in WINGS}, sorted(named)
    for wing, modules in named.items():
        present = {p.name for p in (ROOT / "aiocollect" / wing).glob("*.py") if p.name != "__init__.py"}
        assert not modules - present, f"CONTRIBUTING.md names modules that aiocollect/{wing}/ lacks: {sorted(modules - present)}"
        assert not present - modules, (f"aiocollect/{wing}/ has modules that CONTRIBUTING.md's Repository "
                                       f"section does not name (add them there): {sorted(present - modules)}")


@pytest.mark.parametrize("name", ["README.md", "CONTRIBUTING.md"])
def test_every_relative_link_points_to_a_file_that_exists(name):
    broken = broken_relative_links(ROOT / name)
    assert not broken, f"{name} links to files that do not exist: {broken}"


def test_the_link_and_layout_checks_can_fail(tmp_path):
    """A missing file is a broken link (a web address, an anchor or an existing file is not); a
    module named under a wing is found in that wing only."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("")
    page = tmp_path / "page.md"
    page.write_text("[a](docs/page.md#part) [b](docs/gone.md) ![c](img/x.png) [d](https://example.org) [e](#top)")
    assert broken_relative_links(page) == ["docs/gone.md", "img/x.png"]
    text = "## Repository\n\n- `_core/`: `a.py`,\n  `b.py`; `_cli/`: `c.py`\n\n`d.py`\n"
    assert layout_modules(text) == {"_core": {"a.py", "b.py"}, "_cli": {"c.py"}}
