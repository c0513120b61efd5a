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
