"""What users read speaks of the product: docs, examples and benchmark scripts name no part of how
the project is made, every option of an example says what it does, and an example runs without a
warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Words about how the project is made, and a developer's own paths: none belongs in what users read.
# (A phrase may be cut by a line break: whitespace of any kind between its words.)
FORBIDDEN = re.compile(
    r"closing\s+notes?|\bstop\s+\d+|\bissue\s+\d+|\bissues\s+stops\b|/work/|/root/",
    re.IGNORECASE,
)


def user_facing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    files += sorted(p for p in (ROOT / "examples").iterdir() if p.is_file())
    files += sorted((ROOT / "benchmarks").glob("*.py"))
    return [p for p in files if p.exists()]


def test_user_facing_text_names_nothing_of_how_the_project_is_made():
    """README, CHANGELOG, docs, examples and benchmark scripts: no closing note, stop or issue
    number, no developer's absolute path (each hit named by file and line)."""
    hits = []
    for path in user_facing_files():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for match in FORBIDDEN.finditer(text):
            number = text.count("\n", 0, match.start()) + 1
            hits.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {lines[number - 1].strip()[:120]!r}")
    assert not hits, "user-facing text speaks of how the project is made:\n" + "\n".join(hits)


def test_the_forbidden_phrases_are_found():
    """The check above can fail: each kind of phrase is caught, an English 'stops' is not."""
    for text in ("source: stop 17's closing note", "Issue 9", "`issues stops` in the tracker",
                 "(/work/main/aiocollect)", "/root/.cache", "quoted from the closing\n    notes"):
        assert FORBIDDEN.search(text), text
    assert not FORBIDDEN.search("aclose() stops the workers; the issue is the pool's size")


def help_lines(script: str) -> list[str]:
    env = dict(os.environ, COLUMNS="100")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--help"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, f"{script} --help failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.splitlines()


def options_without_help(lines: list[str]) -> list[str]:
    """The option lines of argparse's help with no text, on the same line (after two spaces or
    more) or on the next one (indented, not an option)."""
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(":") and "options" in line)
    missing = []
    section = lines[start + 1:]
    for i, line in enumerate(section):
        if not re.match(r"^ {2}-", line):
            continue
        if len(re.split(r"\s{2,}", line.strip(), maxsplit=1)) == 2:
            continue
        following = section[i + 1] if i + 1 < len(section) else ""
        if following.strip() and re.match(r"^ {3,}\S", following) and not following.lstrip().startswith("-"):
            continue
        missing.append(line.strip())
    return missing


def test_the_help_parser_finds_an_option_without_help():
    lines = ["usage: x", "", "options:", "  -h, --help  show this help message and exit",
             "  --env ENV", "  --frames FRAMES  total frames", "  --frames-per-batch FRAMES_PER_BATCH",
             "                        frames in each batch", "  --quiet"]
    assert options_without_help(lines) == ["--env ENV", "--quiet"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", ["demo.py", "training_server.py"])
def test_every_option_of_an_example_has_help(script):
    """`examples/<script> --help`: each option says what it does."""
    if script == "training_server.py":  # it refuses to start without them (`.[test]` alone lacks them)
        pytest.importorskip("starlette", reason="the training server needs the server extra: pip install -e '.[server]'")
        pytest.importorskip("uvicorn", reason="the training server needs the server extra: pip install -e '.[server]'")
    lines = help_lines(script)
    missing = options_without_help(lines)
    assert not missing, f"examples/{script} --help: options without help text: {missing}\n" + "\n".join(lines)


@pytest.mark.timeout(180)
def test_evaluator_example_prints_no_warning():
    """A short run of examples/evaluator.py, as a user runs it: no warning on stderr (the training
    step's loss read as a number without torch's requires_grad warning)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "evaluator.py"), "--batches", "4", "--eval-every", "2",
         "--trajectories", "2", "--max-steps", "50", "--frames-per-batch", "256", "--workers", "1",
         "--envs-per-worker", "2", "--busy-policy", "queue"],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
    )
    assert proc.returncode == 0, f"evaluator.py failed:\n{proc.stdout}\n{proc.stderr}"
    assert "final evaluation (batch 4)" in proc.stdout, proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr
