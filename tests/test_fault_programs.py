"""The fault programs: complete user programs that each try one fault (a stopped worker, a factory
that never returns, a batch bigger than the machine, a TorchRL script ported as it is, ...), run
here as a stranger runs them: each script in its own process and session, with an outer timeout,
warnings as errors. Each must exit 0 with a last line ``ok: ...``, and leave nothing behind: no
process that it started (found by a marker in the environment every descendant inherits, whatever
session or process group it moved to) and no shared-memory file of ours.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from procs import alive

PROGRAMS = sorted((Path(__file__).parent / "fault_programs").glob("*.py"))
# the outer bound: far above a program's quiet-machine time (under 30 s), for a loaded machine
OUTER_TIMEOUT = 240 * float(os.environ.get("AIOCOLLECT_TEST_TIME_SCALE", "1"))


def marked(marker: str) -> list[int]:
    """The processes whose environment holds ``marker`` (every descendant of the program)."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:
            continue  # gone, or not ours to read
    return [pid for pid in found if alive(pid)]


def shm_files() -> set[str]:
    try:
        return {name for name in os.listdir("/dev/shm") if "aiocollect" in name}
    except FileNotFoundError:  # pragma: no cover
        return set()


def test_every_fault_program_is_collected():
    assert len(PROGRAMS) >= 8, [p.name for p in PROGRAMS]


@pytest.mark.timeout(OUTER_TIMEOUT + 60)
@pytest.mark.parametrize("program", PROGRAMS, ids=[p.stem for p in PROGRAMS])
def test_fault_program_runs_to_ok_and_leaves_nothing(program: Path, tmp_path: Path):
    marker = f"aiocollect-fault-program-{uuid.uuid4().hex}"
    env = dict(os.environ, AIOCOLLECT_FAULT_PROGRAM=marker, PYTHONWARNINGS="error")
    shm_before = shm_files()
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", str(program)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # as a terminal's job: its own session and process group
    )
    try:
        out, _ = proc.communicate(timeout=OUTER_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        for pid in marked(marker):
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"{program.name} did not end within {OUTER_TIMEOUT:.0f} s; its output:\n{out[-6000:]}")
    finally:
        if proc.poll() is None:  # (the test itself was interrupted)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # what it started may take a moment to be reaped by init once the program is gone
    deadline = time.monotonic() + 10
    while (left := marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    lines = out.strip().splitlines()
    assert proc.returncode == 0, f"{program.name} exited with {proc.returncode}; its output:\n{out[-6000:]}"
    assert lines and lines[-1].startswith("ok:"), f"{program.name} did not end with 'ok: ...':\n{out[-6000:]}"
    assert not left, f"{program.name} left processes running: {left}"
    assert not shm_files() - shm_before, f"{program.name} left shared memory: {shm_files() - shm_before}"
