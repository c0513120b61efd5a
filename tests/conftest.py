"""Test configuration: every async test runs on one loop of the asyncio family, plain asyncio or
uvloop, picked by its id (the modules in BOTH_LOOPS_MODULES on both; those in TRIO_MODULES on
trio too); after every test, no worker process, shared-memory segment or thread of ours may be
left behind."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import threading
import time
import zlib

import pytest
from procs import alive as _alive

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


try:
    import trio
except ImportError:  # pragma: no cover
    trio = None

# The modules whose async tests also run on trio (through anyio): the collector, the Evaluator,
# the events, and the programs users write.
TRIO_MODULES = {
    "test_collector", "test_evaluator", "test_evaluator_restart", "test_events", "test_lifecycle",
    "test_lifecycle_states", "test_weights", "test_user_programs", "test_restart", "test_trajs", "test_leaks",
    "test_queues", "test_consumers", "test_memory_ownership", "test_child_messages",
}
# AIOCOLLECT_TEST_TRIO=all: every module's async tests on trio as well (about 2x the suite's time)
TRIO_EVERYWHERE = os.environ.get("AIOCOLLECT_TEST_TRIO") == "all"
# asyncio and uvloop run the same code of ours (anyio's asyncio backend) on two implementations of
# one loop API: each async test variant runs on one of them, picked by a hash of its id without
# the loop (stable from run to run, about half each, so most modules and parametrised tests run
# on both). The modules that test our code facing the loop itself (a child's socket, a thread
# waking the loop, the event bus and queues, an HTTP server in the loop) run on both, and so does
# a test marked `asyncio_and_uvloop`. AIOCOLLECT_TEST_LOOPS=all: every async test on both (about
# 1.25x the suite's time).
BOTH_LOOPS_MODULES = {"test_child_messages", "test_own_thread", "test_bus", "test_events", "test_queues",
                      "test_training_server"}
BOTH_LOOPS_EVERYWHERE = os.environ.get("AIOCOLLECT_TEST_LOOPS") == "all"


def on_trio() -> asyncio.AbstractEventLoop:
    """The "trio" loop factory: pytest-asyncio still makes (and closes) an asyncio loop for the
    test, unused; `pytest_pyfunc_call` below runs the test's coroutine with trio instead."""
    return asyncio.new_event_loop()


def pytest_asyncio_loop_factories(config, item):
    factories = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    if trio is not None and (TRIO_EVERYWHERE or item.module.__name__.rpartition(".")[2] in TRIO_MODULES):
        factories["trio"] = on_trio
    loops = item.get_closest_marker("loops")
    if loops is not None:  # @pytest.mark.loops("asyncio", ...): these loops only (trio too if named)
        if trio is not None and "trio" in loops.args:
            factories["trio"] = on_trio
        factories = {name: f for name, f in factories.items() if name in loops.args}
    return factories


def _runs_on_trio(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("_asyncio_loop_factory") is on_trio


def _asyncio_family_loop(item) -> str | None:
    """``"asyncio"`` or ``"uvloop"`` for a variant run on that loop, else None."""
    factory = getattr(getattr(item, "callspec", None), "params", {}).get("_asyncio_loop_factory")
    if factory is asyncio.new_event_loop:
        return "asyncio"
    if uvloop is not None and factory is uvloop.new_event_loop:
        return "uvloop"
    return None


def _without_loop(item) -> str:
    """The node id with the loop's name taken out of its parameters."""
    return re.sub(r"(?<=[\[-])(asyncio|uvloop)(?=[\]-])", "", item.nodeid, count=1)


def _left_to_the_other_loop(item, key: str, loop: str, variants: set[tuple[str, str]]) -> bool:
    """True for a variant (``key``: its node id without the loop) whose twin on the other
    asyncio-family loop was collected too and is the one the key's hash picked (see
    BOTH_LOOPS_MODULES): the same pick in every xdist worker and from run to run."""
    if BOTH_LOOPS_EVERYWHERE or item.module.__name__.rpartition(".")[2] in BOTH_LOOPS_MODULES:
        return False
    if item.get_closest_marker("asyncio_and_uvloop") is not None:
        return False
    other = "uvloop" if loop == "asyncio" else "asyncio"
    return (key, other) in variants and ("asyncio", "uvloop")[zlib.crc32(key.encode()) % 2] == other


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "asyncio_only: the test uses asyncio itself (task.cancel(), loop timers): not run on trio"
    )
    config.addinivalue_line(
        "markers", "loops(*names): run the async test on these loops only ('asyncio', 'uvloop', 'trio'), for "
        "slow modules whose loop-specific code is covered by a few tests"
    )
    config.addinivalue_line(
        "markers", "asyncio_and_uvloop: run on both loops of the asyncio family (a test of code facing the loop "
        "itself: another thread waking it), not on the one its id picks"
    )


def pytest_collection_modifyitems(session, config, items):
    kept, deselected = [], []
    on_loop = {id(item): (_without_loop(item), loop) for item in items
               if (loop := _asyncio_family_loop(item)) is not None}
    variants = set(on_loop.values())
    for item in items:
        if id(item) in on_loop and _left_to_the_other_loop(item, *on_loop[id(item)], variants):
            deselected.append(item)
            continue
        if _runs_on_trio(item):
            if item.get_closest_marker("asyncio_only") is not None:
                deselected.append(item)
                continue
            item.trio_test = item.obj  # the coroutine function (pytest-asyncio swaps obj when it runs)
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A test of the "trio" variant: its coroutine runs in `trio.run` (through anyio)."""
    test = getattr(pyfuncitem, "trio_test", None)
    if test is None:
        return None
    import anyio

    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    anyio.run(lambda: test(**kwargs), backend="trio")
    return True


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
    from aiocollect._backends.launcher import get_launcher

    get_launcher().ensure_started(("torch", "tensordict"))
    yield


@pytest.fixture(scope="session", autouse=True)
def imports_left_out_of_gc():
    """What the imports made (torch, tensordict, gymnasium, the test modules: about 300,000
    objects) lives until the end: moved out of the collector's reach, so that the full collection
    after every test (:func:`no_leftovers`) walks only what the tests made (0.3-0.8 s a test,
    most of the suite's time on 2 cores, becomes milliseconds)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _torch_own_thread(thread: threading.Thread) -> bool:
    """A process-wide thread that torch.compile starts once and keeps for the next compilations:
    Inductor's compile-worker pool, the timer that quiets that pool once idle (started again by the
    next compilation, on a GPU), and the monitor of the tqdm bar it shows while compiling (torch's
    threads, not the collector's: they stay whatever the collector does)."""
    import sys

    if "torch._inductor" not in sys.modules:
        return False
    return (
        thread.name.startswith("InductorSubproc")
        or (thread.name == "tqdm_monitor" and type(thread).__module__.startswith("tqdm"))
        or (thread.name == "subproc_worker_timer"
            and type(getattr(getattr(thread, "_target", None), "__self__", None)).__module__.startswith("torch._inductor"))
        or _in_inductor_thread_pool(thread)
    )


def _in_inductor_thread_pool(thread: threading.Thread) -> bool:
    """A thread of Inductor's compile thread pool (``AsyncCompile.pool()``, a plain
    ``ThreadPoolExecutor`` kept for the process once built): its worker threads hold a weak reference
    to their executor as their first argument."""
    import sys

    module = sys.modules.get("torch._inductor.async_compile")
    pool_of = getattr(getattr(module, "AsyncCompile", None), "pool", None)
    if pool_of is None or not hasattr(pool_of, "cache_info") or pool_of.cache_info().currsize == 0:
        return False
    args = getattr(thread, "_args", ())
    owner = args[0]() if args and callable(args[0]) else None
    return owner is not None and owner is pool_of()


@pytest.fixture(autouse=True)
def no_leftovers():
    """Each test must leave no worker process, no shared memory and no extra thread."""
    from aiocollect._backends import workers as _workers

    threads_before = set(threading.enumerate())
    first_pid = len(_workers.started_pids)
    yield
    gc.collect()
    pids = _workers.started_pids[first_pid:]
    # (generous: only a test that leaves something waits, and a loaded machine is slow to end things)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    alive = [p for p in pids if _alive(p)]
    assert not alive, f"worker processes left running: {alive}"
    assert not _shm_in_use(), f"shared memory left mapped or open: {_shm_in_use()}"
    deadline = time.monotonic() + 20  # (an abandoned start-up thread ends when its import or factory returns)
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate()
                 if t not in threads_before and t.is_alive() and not _torch_own_thread(t)]
        if not extra:
            break
        time.sleep(0.01)
    assert not extra, f"threads left running: {extra}"
