"""Test configuration: every async test runs on plain asyncio and on uvloop; after every test,
no worker process, shared-memory segment or thread of ours may be left behind."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time

import pytest
from procs import alive as _alive

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


def pytest_asyncio_loop_factories(config, item):
    factories = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def _shm_in_use() -> list[str]:
    found = []
    with open("/proc/self/maps") as f:
        found += [line.strip() for line in f if "aiocollect" in line]
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "aiocollect" in target:
            found.append(f"fd {fd} -> {target}")
    return found


@pytest.fixture(scope="session", autouse=True)
def launcher_with_test_imports():
    """Test modules import tensordict, and workers unpickling envs or policies defined in a test
    module import that module: let the launcher import tensordict once, so that each worker
    forked from it does not pay for it again."""
    from aiocollect._launcher import get_launcher

    get_launcher().ensure_started(("torch", "tensordict"))
    yield


@pytest.fixture(autouse=True)
def no_leftovers():
    """Each test must leave no worker process, no shared memory and no extra thread."""
    from aiocollect import _workers

    threads_before = set(threading.enumerate())
    first_pid = len(_workers.started_pids)
    yield
    gc.collect()
    pids = _workers.started_pids[first_pid:]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    alive = [p for p in pids if _alive(p)]
    assert not alive, f"worker processes left running: {alive}"
    assert not _shm_in_use(), f"shared memory left mapped or open: {_shm_in_use()}"
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        if not extra:
            break
        time.sleep(0.01)
    assert not extra, f"threads left running: {extra}"
