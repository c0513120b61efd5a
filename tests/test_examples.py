"""Every example runs, as a user would run it, in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.timeout(180)
def test_demo_prints_layout_fps_and_leaves_nothing():
    out = run_example("demo.py", "--frames", "16384", "--frames-per-batch", "2048")
    assert "batch layout:" in out and "frames/s" in out and "TensorDict(" in out
    assert "worker processes still running: 0" in out and "collector state: closed" in out


@pytest.mark.timeout(120)
def test_events_example():
    out = run_example("events.py", "--frames", "8192")
    assert "stopped (total_frames) after 8192 frames" in out and "episodes" in out


@pytest.mark.timeout(120)
def test_profiling_example(tmp_path):
    out = run_example("profiling.py", "--out", str(tmp_path))
    assert "trace of worker 0" in out and "trace of the collector" in out
    with open(tmp_path / "worker_0.json") as f:
        assert json.load(f)["traceEvents"]


# examples/training_server.py (a real uvicorn serving it, talked to with httpx): tests/test_training_server.py


@pytest.mark.timeout(120)
def test_sync_loop_example():
    out = run_example("sync_loop.py")
    assert out.count("batch ") == 10


# examples/notebook.ipynb is executed in a real kernel (nbclient on an ipykernel): tests/test_notebook.py
