"""``server_priority="auto"``, the default: on a machine with fewer CPUs than busy threads (the
workers, the event loop, the server's thread) the server's thread runs under ``SCHED_IDLE`` and the
workers are kept off this process's first CPU, which is what keeps the event loop's lag low while
serving; a server thread that starves there goes back to normal priority by itself (collection
never stalls, no warning); with CPUs to spare, or ``server_priority="normal"``, nothing is changed;
``worker_cpus`` given wins over the automatic placement. No timing is asserted."""

from __future__ import annotations

import logging
import os
import threading

import anyio
import pytest
import torch

from aiocollect import Collector, CollectorConfig
from aiocollect._collector.inference_server import StarvationWatch
from aiocollect._collector.pool import server_priority, worker_cpus
from aiocollect._core.affinity import crowded, spare_one_cpu

from test_affinity import threads_cpus
from test_user_programs import Greedy, check_batch

ALLOWED = sorted(os.sched_getaffinity(0))
#: workers enough to crowd this machine (fewer CPUs than workers + 2), whatever its size
CROWDING = max(1, len(ALLOWED) - 1)
needs_few_cpus = pytest.mark.skipif(len(ALLOWED) > 4, reason="crowding this machine takes too many workers")


def fell_back(caplog: pytest.LogCaptureFixture) -> bool:
    """Whether the server's thread said it went back to normal priority (it says so first)."""
    return any("normal priority from now on" in r.getMessage() for r in caplog.records)


def server_thread() -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == "aiocollect inference server"]
    return thread


def test_auto_is_the_default_and_decides_from_the_cpus_of_this_process():
    """The default is "auto": on fewer CPUs than workers + 2 the server's thread is "auto" (idle,
    falling back) and the workers get every CPU but the first (none is kept on one CPU); with CPUs
    to spare, "normal" and no placement. "normal" and "idle" given are kept, and place nothing;
    worker_cpus given is kept."""
    assert CollectorConfig.__dataclass_fields__["server_priority"].default == "auto"
    for workers in (1, 2, len(ALLOWED) + 1):
        config = CollectorConfig("CartPole-v1", Greedy(), frames_per_batch=4 * workers, num_workers=workers,
                                 envs_per_worker=4, inference="server")
        assert config.server_priority == "auto"
        busy = len(ALLOWED) < workers + 2
        assert crowded(workers) is busy
        assert server_priority(config) == ("auto" if busy else "normal")
        expected = tuple(ALLOWED[1:]) if busy and len(ALLOWED) > 1 else None
        assert spare_one_cpu(workers) == expected
        assert [worker_cpus(config, i) for i in range(workers)] == [expected] * workers
    many = len(ALLOWED) + 1
    for given in ("normal", "idle"):
        config = CollectorConfig("CartPole-v1", Greedy(), frames_per_batch=4 * many, num_workers=many,
                                 envs_per_worker=4, inference="server", server_priority=given)
        assert server_priority(config) == given and worker_cpus(config, 0) is None
    placed = CollectorConfig("CartPole-v1", Greedy(), frames_per_batch=4 * many, num_workers=many,
                             envs_per_worker=4, inference="server", worker_cpus=[ALLOWED[0]])
    assert worker_cpus(placed, 0) == (ALLOWED[0],)
    worker_inference = CollectorConfig("CartPole-v1", Greedy(), frames_per_batch=4 * many, num_workers=many,
                                       envs_per_worker=4)
    assert worker_cpus(worker_inference, 0) is None  # (no server: nothing to keep a CPU for)


@needs_few_cpus
@pytest.mark.timeout(120)
async def test_by_default_a_crowded_machine_gets_an_idle_server_and_workers_off_the_first_cpu(caplog):
    """Default options, server inference, more busy threads than CPUs: the server's thread (only
    it) runs under SCHED_IDLE, every thread of every worker runs on every CPU of this process but
    the first (where it has two or more), and this process keeps all of its CPUs. (On a machine
    busy with other work the idle thread may starve and go back to normal priority, as the next
    test makes it do: only then, and only with the line that says so, is it found at normal.)"""
    caplog.set_level(logging.INFO, logger="aiocollect")
    with anyio.fail_after(90):
        async with Collector("CartPole-v1", Greedy(), frames_per_batch=CROWDING * 4 * 8, total_frames=CROWDING * 4 * 8 * 2,
                             num_workers=CROWDING, envs_per_worker=4, inference="server", seed=0) as c:
            async for batch in c:
                check_batch(batch)
                policy = os.sched_getscheduler(server_thread().native_id)
                assert policy == os.SCHED_IDLE or (policy == os.SCHED_OTHER and fell_back(caplog)), policy
                assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
                if len(ALLOWED) > 1:
                    for pid in c.worker_pids:
                        assert set(threads_cpus(pid).values()) == {frozenset(ALLOWED[1:])}, pid
                assert os.sched_getaffinity(0) == set(ALLOWED)


@needs_few_cpus
@pytest.mark.timeout(150)
async def test_a_starved_auto_server_goes_back_to_normal_priority_without_a_warning(caplog, monkeypatch):
    """Default options beside threads that keep every CPU busy (a trainer on the CPU): the server's
    thread, starved under SCHED_IDLE, goes back to SCHED_OTHER by itself and says so once at the
    INFO level (no warning); collection goes on and closes cleanly."""
    monkeypatch.setattr(StarvationWatch, "WINDOW", 1.0)
    stop = threading.Event()

    def busy() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            torch.mm(a, a)

    trainers = [threading.Thread(target=busy, daemon=True) for _ in ALLOWED]
    caplog.set_level(logging.INFO, logger="aiocollect")
    try:
        with anyio.fail_after(120):
            async with Collector("CartPole-v1", Greedy(), frames_per_batch=CROWDING * 4 * 4, num_workers=CROWDING,
                                 envs_per_worker=4, inference="server") as c:
                it = aiter(c)
                check_batch(await anext(it))
                tid = server_thread().native_id
                # idle; already back at normal (saying so) only where other work keeps this machine busy
                policy = os.sched_getscheduler(tid)
                assert policy == os.SCHED_IDLE or (policy == os.SCHED_OTHER and fell_back(caplog)), policy
                for t in trainers:
                    t.start()
                while not fell_back(caplog):
                    check_batch(await anext(it))
                assert os.sched_getscheduler(tid) == os.SCHED_OTHER
                for _ in range(3):
                    check_batch(await anext(it))
    finally:
        stop.set()
        for t in trainers:
            if t.is_alive():
                t.join()
    records = [r for r in caplog.records if r.name == "aiocollect"]
    assert len(records) == 1 and records[0].levelno == logging.INFO, [r.getMessage() for r in records]
    assert "server_priority='auto'" in records[0].getMessage()
