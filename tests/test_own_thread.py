"""``in_own_thread`` (a blocking call in a thread of its own that ends with the call, while the
event loop keeps running: imports and env factories at start-up) wakes its caller safely: under
a native task cancel the caller still waits for the call to return, and a loop stopped without
being closed does not keep the thread from ending."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aiocollect._service.resource import in_own_thread


@pytest.mark.loops("asyncio")
@pytest.mark.asyncio_only
async def test_in_own_thread_waits_for_its_thread_under_a_native_task_cancel():
    """``asyncio.timeout`` cancels the task natively (through anyio's shield): the caller still
    waits for ``fn`` to return (it cannot be interrupted), then raises the cancellation."""
    release, started, returned = threading.Event(), threading.Event(), threading.Event()

    def fn():
        started.set()
        release.wait(30)
        returned.set()
        return "result"

    async def call():
        return await in_own_thread(fn, "aiocollect test thread")

    task = asyncio.ensure_future(call())
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.1)  # (a task that ignored the wait would be done by now)
    assert not task.done(), "in_own_thread returned while its thread was still running fn"
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert returned.is_set()


def test_in_own_thread_ends_its_thread_when_the_loop_stopped_without_closing():
    """A loop stopped (not closed) while a caller waits: the thread still ends once ``fn`` has
    returned (it does not block on the loop), and the caller gets the result when the loop runs
    again."""
    release = threading.Event()
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(in_own_thread(lambda: release.wait(30) and "result", "aiocollect test thread"))
        loop.run_until_complete(asyncio.sleep(0.05))  # the loop stops: the task still waits
        threads = [t for t in threading.enumerate() if t.name == "aiocollect test thread"]
        assert len(threads) == 1
        release.set()
        threads[0].join(30)
        assert not threads[0].is_alive(), "the thread blocks on a loop that does not run"
        assert loop.run_until_complete(task) == "result"
    finally:
        release.set()
        loop.close()
