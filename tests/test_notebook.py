"""The example notebook (examples/notebook.ipynb) runs as a user runs it: executed fresh, cell by
cell, by nbclient on a real ipykernel (this interpreter's), with top-level ``await``, a policy
class and an env factory defined in the notebook, a background task subscribed to episode ends,
and the collector closed at the end. The kernel is a process of its own, which the suite's leak
check does not see: this test checks that the notebook's workers stopped before the kernel shut
down, and that the kernel and its launcher are gone after it."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest
from procs import alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "notebook.ipynb")

# Cells the test adds around the notebook's own (to the copy it runs, not to the file).
FIRST_PROBE = 'import os, sys\nprint("KERNEL", os.getpid(), sys.prefix)'
LAST_PROBE = '''
import json, os

def _live_children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if state not in ("Z", "X"):
            children.setdefault(int(ppid), []).append(int(entry))
    return children

def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\\0", b" ").decode(errors="replace")
    except OSError:
        return "?"

def _workers(launcher: int) -> list[int]:  # (forked from the launcher or from its torch template)
    out = []
    for child in _children.get(launcher, []):
        is_torch_template = os.getpgid(child) == child  # (its child that leads a process group of its own)
        out += _children.get(child, []) if is_torch_template else [child]
    return out

_children = _live_children()
print("CHILDREN", json.dumps([[pid, _cmdline(pid), _workers(pid)] for pid in _children.get(os.getpid(), [])]))
'''


def _text(cell) -> str:
    """Everything a code cell printed or showed as text. A stream's chunks are joined as they
    came: the kernel sends what was printed when it flushes (on a timer), so one ``print("a", b)``
    may arrive as two outputs, ``"a"`` and ``" b\\n"``."""
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            if parts and parts[-1][0] == output["name"]:
                parts[-1] = (output["name"], parts[-1][1] + output["text"])
            else:
                parts.append((output["name"], output["text"]))
        elif output["output_type"] in ("execute_result", "display_data"):
            parts.append(("", output["data"].get("text/plain", "")))
    return "\n".join(text for _, text in parts)


NEEDS = "running the notebook needs nbclient, nbformat and ipykernel (the test extra: pip install -e '.[test]')"


def _wait_gone(pids: list[int], seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_notebook_is_committed_without_outputs():
    """The notebook in the repository is clean: users (and this test) run it fresh."""
    nbformat = pytest.importorskip("nbformat", reason=NEEDS)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.timeout(300)
def test_notebook_runs_in_a_kernel_and_leaves_nothing(monkeypatch):
    """Every cell runs without error in a fresh kernel of this venv: batches of the expected
    shape, episode returns counted by the background subscription while later cells ran, a
    weight version reaching the batches, the collector closed; then no worker is left before the
    kernel shuts down, and neither the kernel nor the launcher it started after."""
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")  # jupyter_core's paths, without its DeprecationWarning
    nbclient = pytest.importorskip("nbclient", reason=NEEDS)
    nbformat = pytest.importorskip("nbformat", reason=NEEDS)
    pytest.importorskip("ipykernel", reason=NEEDS)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    own = len(nb.cells)
    nb.cells.insert(0, nbformat.v4.new_code_cell(FIRST_PROBE))
    nb.cells.append(nbformat.v4.new_code_cell(LAST_PROBE))
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=120,  # per cell
        iopub_timeout=60,  # (a cell's output may trail its reply on a loaded machine: wait for it)
        raise_on_iopub_timeout=True,
        resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}},  # where Jupyter would run it
    )
    client.execute()  # raises CellExecutionError (with the cell's traceback) if a cell fails

    first, *cells, last = (_text(cell) for cell in nb.cells if cell.cell_type == "code")
    assert len(nb.cells) == own + 2
    kernel_pid, prefix = re.fullmatch(r"KERNEL (\d+) (.+)\n", first).groups()  # type: ignore[union-attr]
    kernel_pid = int(kernel_pid)
    assert prefix == sys.prefix, "the kernel must run this venv's interpreter"
    out = "\n".join(cells)
    stderr = [o["text"] for cell in nb.cells for o in cell.get("outputs", []) if o.get("name") == "stderr"]
    assert not stderr, f"the notebook wrote to stderr (a warning?): {stderr}"

    # the notebook's own outputs
    assert "Policy(" in out  # the class defined in the notebook
    workers = [int(p) for p in re.search(r"worker pids: \((\d+), (\d+)\)", out).groups()]  # type: ignore[union-attr]
    assert len(set(workers)) == 2 and kernel_pid not in workers
    assert re.findall(r"batch \d+: shape \((\d+), (\d+)\)", out) == [("8", "125")] * 3
    assert "TensorDict(" in out and "policy_version" in out
    assert re.search(r"published version 1\n", out)
    versions = re.findall(r"batch \d+: policy versions (\[[\d, ]+\])", out)
    assert versions and versions[-1] == "[1]" and all(v in ("[0]", "[0, 1]") for v in versions[:-1])
    assert "collector: closed" in out
    counted_midway = int(re.search(r"episodes counted by the background task so far: (\d+)", out).group(1))  # type: ignore[union-attr]
    counted = int(re.search(r"episodes counted: (\d+), mean return ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert 0 <= counted_midway <= counted and counted > 0
    stats = re.search(r"CollectorStats\(frames=(\d+), batches=(\d+),.*episodes=(\d+)", out)
    assert stats is not None
    frames, batches, episodes = map(int, stats.groups())
    assert frames == 1000 * batches and batches == 3 + len(versions) and episodes >= counted

    # before the kernel shut down: the kernel's only children are aiocollect launchers (kept for
    # the next collector), with no worker forked from them left running
    children = {pid: (cmdline, grandchildren) for pid, cmdline, grandchildren in json.loads(last.removeprefix("CHILDREN "))}
    assert all("aiocollect._backends.launcher" in cmdline and not grandchildren for cmdline, grandchildren in children.values()), (
        f"the kernel's child processes after aclose() (pid: command line, children): {children}")
    assert not set(workers) & set(children)

    # after: the kernel, its launcher and the workers are all gone
    left = _wait_gone([kernel_pid, *children, *workers])
    assert not left, f"processes left after the kernel shut down: {left}"
