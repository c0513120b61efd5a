"""``CollectorClosedError`` names what closed this collector (``aclose()``, the end of its ``async
with`` or ``with`` block, a cancellation, the block's own error, its failed start, a plain ``for``
that ran to the end), not a list of every possible closer; and ``Run.closed_error(what)`` (for
every method that refuses a closed or stopped collector) also says why a run stopped: its
``total_frames`` delivered, or an error."""

from __future__ import annotations

import anyio
import pytest

from aiocollect import Collector, CollectorClosedError
from aiocollect.testing import CountingEnv


def make(**kwargs):
    return Collector(lambda: CountingEnv(episode_length=5), frames_per_batch=8, num_workers=0, **kwargs)


async def closed_message(collector) -> str:
    with pytest.raises(CollectorClosedError) as info:
        await collector.collect()
    return str(info.value)


async def test_aclose_is_named():
    c = make()
    await c.collect()
    await c.aclose()
    message = await closed_message(c)
    assert message.startswith("collect(): this collector was closed by aclose(); create a new Collector"), message


async def test_a_never_started_collector_closed_by_aclose_says_so():
    c = make()
    await c.aclose()
    assert "closed by aclose()" in await closed_message(c)


async def test_the_end_of_async_with_is_named_not_aclose():
    async with make() as c:
        await c.collect()
    message = await closed_message(c)
    assert "closed by the end of its `async with` block;" in message, message
    assert "aclose()" not in message, message


async def test_an_async_with_block_that_raised_is_named_with_its_error():
    c = make()
    with pytest.raises(ValueError):
        async with c:
            await c.collect()
            raise ValueError("the user's own error")
    assert "closed by the end of its `async with` block, which raised ValueError" in await closed_message(c)


async def test_a_cancelled_async_with_block_is_named_cancelled():
    c = make()
    with anyio.move_on_after(0.5):
        async with c:
            await c.collect()
            await anyio.sleep_forever()
    assert "closed by the end of its `async with` block, cancelled" in await closed_message(c)


async def test_start_after_close_names_the_closer_too():
    async with make() as c:
        pass
    with pytest.raises(CollectorClosedError, match=r"start\(\): this collector was closed by the end of its `async "
                                                   r"with` block, and a closed collector cannot be reopened"):
        await c.start()


async def test_a_failed_start_is_named():
    def broken():
        raise RuntimeError("no licence server")

    c = Collector(broken, frames_per_batch=8, num_workers=0)
    with pytest.raises(Exception, match="no licence server"):
        async with c:
            pass  # pragma: no cover
    message = await closed_message(c)
    assert "closed by its failed start (" in message, message


def test_the_end_of_a_with_block_is_named():
    with make() as c:
        next(iter(c))
    with pytest.raises(CollectorClosedError, match=r"closed by the end of its `with` block;"):
        next(iter(c))


def test_close_is_named():
    c = make()
    next(iter(c))
    c.close()
    with pytest.raises(CollectorClosedError, match=r"closed by close\(\);"):
        next(iter(c))


async def test_closed_error_says_a_run_delivered_its_total_frames():
    """The helper other methods call (``update_weights`` on a stopped run): ``total_frames`` reached."""
    async with make(total_frames=16) as c:
        async for _ in c:
            pass
        error = c._run.closed_error("update_weights()")
        assert isinstance(error, CollectorClosedError)
        assert str(error) == ("update_weights(): this collector delivered its total_frames=16 and stopped; "
                              "create a new Collector"), str(error)


async def test_closed_error_names_the_error_that_stopped_the_run():
    c = Collector(lambda: CountingEnv(episode_length=5, fail_at_step=3), frames_per_batch=8, num_workers=0)
    with pytest.raises(Exception):
        async with c:
            async for _ in c:
                pass
    # closed after the error: the closer is named (the block ended by the worker's error)
    message = await closed_message(c)
    assert "closed by the end of its `async with` block, which raised " in message, message
    # before it was closed, the stopped run's error is named
    c2 = Collector(lambda: CountingEnv(episode_length=5, fail_at_step=3), frames_per_batch=8, num_workers=0)
    await c2.start()
    with pytest.raises(Exception) as info:
        while True:
            await c2.collect()
    with anyio.fail_after(10):
        while c2._run.shared.errors.error is None:  # pragma: no cover - set before the error is raised
            await anyio.sleep(0.01)
    message = str(c2._run.closed_error("update_weights()"))
    assert message.startswith(f"update_weights(): this collector stopped on an error ({type(info.value).__name__}"), message
    await c2.aclose()  # (its error was seen: aclose() raises nothing more)
