"""The consumers' side of delivery: a queue whose readers went away, or that the user closed,
stops the collector (and ``aclose()`` is clean); the user's queue is closed however the delivery
ends (a start that fails, is cancelled or is closed), so that its readers end; two tasks sharing
one collector (each batch once; with ``zero_copy`` a clear error); a second plain ``for`` after the
collector closed itself. The autouse fixture in conftest checks that nothing (process, thread,
shared memory) is left behind."""

from __future__ import annotations

import anyio
import pytest

from aiocollect import AiocollectError, Collector, CollectorState, WorkerError
from aiocollect.events import CollectorStopped
from aiocollect.testing import CountingEnv

FRAMES = 8


def counting_env():
    return CountingEnv(episode_length=20)


def long_episodes():
    return CountingEnv(episode_length=10_000)  # (an env's observation counts its steps)


def endless(**kwargs):
    options = dict(frames_per_batch=FRAMES, total_frames=-1, num_workers=1, seed=0)
    return Collector(counting_env, **{**options, **kwargs})


async def wait_for_state(c, state, limit=60):
    with anyio.fail_after(limit):
        while c.state is not state:
            await anyio.sleep(0.01)


# -- a queue whose consumers are gone ------------------------------------------------------------
async def test_an_anyio_stream_whose_receivers_were_closed_stops_the_collector_and_aclose_is_clean():
    send, receive = anyio.create_memory_object_stream(1)
    c = endless()
    reasons = []
    c.on(CollectorStopped, lambda e: reasons.append(e.reason))
    with anyio.fail_after(60):
        await c.start(queue=send)
        first = await receive.receive()
        assert first.batch_size[-1] == FRAMES // first.batch_size[0]
        del first
        receive.close()  # the consumer is done: it stops reading and closes its side
        await wait_for_state(c, CollectorState.STOPPED)  # the collector stops delivering
        await c.aclose()  # nothing to report: the consumer ended the delivery itself
    assert c.state is CollectorState.CLOSED
    assert reasons == ["queue_closed"]


@pytest.mark.loops("trio")
async def test_a_trio_channel_whose_receivers_were_closed_stops_the_collector_and_aclose_is_clean():
    import trio

    send, receive = trio.open_memory_channel(1)
    c = endless()
    with anyio.fail_after(60):
        await c.start(queue=send)
        await receive.receive()
        await receive.aclose()
        await wait_for_state(c, CollectorState.STOPPED)
        await c.aclose()
    assert c.state is CollectorState.CLOSED


async def test_a_stream_the_user_closed_on_the_send_side_stops_the_collector_too():
    send, receive = anyio.create_memory_object_stream(4)
    c = endless()
    with anyio.fail_after(60):
        await c.start(queue=send, close_queue=False)
        await receive.receive()
        send.close()  # "no more": the user closed the collector's side
        await wait_for_state(c, CollectorState.STOPPED)
        await c.aclose()
    receive.close()


# -- two consumer tasks --------------------------------------------------------------------------
async def test_two_tasks_taking_from_a_zero_copy_collector_get_a_clear_error():
    """With zero_copy=True a batch goes back to the workers when the next is asked for: a second
    task waiting for a batch beside the first would overwrite the other's batch. The second
    waiting call is refused with the fix; the first still gets its batch."""
    outcomes = []

    async def take(c):
        try:
            batch = await c.collect()
            outcomes.append(int(batch["observation"][0, 0, 0]))
        except AiocollectError as exc:
            outcomes.append(exc)

    with anyio.fail_after(60):
        async with endless(zero_copy=True) as c:
            async with anyio.create_task_group() as tg:
                async with c.pause():  # nothing is delivered: both calls wait (or one is refused)
                    tg.start_soon(take, c)
                    tg.start_soon(take, c)
                    while not outcomes and c._run.shared.delivery.counts.requested < 2:  # one refused, or both wait
                        await anyio.sleep(0.01)
    errors = [o for o in outcomes if isinstance(o, AiocollectError)]
    assert len(errors) == 1 and outcomes.count(0) == 1, outcomes
    assert "zero_copy=True" in str(errors[0]) and "zero_copy=False" in str(errors[0]), errors[0]


async def test_two_tasks_share_a_default_collector_every_batch_once():
    taken = []

    async def consume(c):
        async for batch in c:
            taken.append(int(batch["observation"][0, 0, 0]))
            await anyio.sleep(0.01)

    c = Collector(long_episodes, frames_per_batch=FRAMES, total_frames=FRAMES * 10, num_workers=1, seed=0)
    with anyio.fail_after(60):
        async with c, anyio.create_task_group() as tg:
            tg.start_soon(consume, c)
            tg.start_soon(consume, c)
    assert sorted(taken) == [FRAMES * i for i in range(10)], taken  # each batch once, none lost


# -- the user's queue is closed however the delivery ends ----------------------------------------
def no_licence():
    raise RuntimeError("no licence server")


async def test_a_start_that_fails_closes_the_queue_so_its_readers_end():
    send, receive = anyio.create_memory_object_stream(1)
    c = Collector(no_licence, frames_per_batch=FRAMES, total_frames=-1, num_workers=1)
    with anyio.fail_after(60):
        with pytest.raises(WorkerError, match="no licence server"):
            await c.start(queue=send)
        await c.aclose()
    with pytest.raises(anyio.EndOfStream):  # the readers' `async for` ends: they do not wait forever
        receive.receive_nowait()
    receive.close()


async def test_a_start_cancelled_or_closed_before_running_closes_the_queue():
    for cancel_after in (0, 0.05):
        send, receive = anyio.create_memory_object_stream(1)
        c = endless()
        with anyio.fail_after(60):
            with anyio.move_on_after(cancel_after):
                await c.start(queue=send)
            await c.aclose()
        with pytest.raises((anyio.EndOfStream, anyio.WouldBlock)) as info:
            receive.receive_nowait()
        assert info.type is anyio.EndOfStream, f"the queue was left open (start cancelled after {cancel_after} s)"
        receive.close()


def test_a_second_plain_for_after_the_end_says_the_collector_closed_itself():
    """A script's ``for batch in collector`` without ``with`` runs to the end: the collector closes
    itself (no worker outlives the loop), so a second ``for`` says why it is closed."""
    from aiocollect import CollectorClosedError

    collector = Collector(lambda: CountingEnv(episode_length=5), frames_per_batch=8, total_frames=16, num_workers=1)
    assert sum(batch.numel() for batch in collector) == 16
    assert collector.state is CollectorState.CLOSED
    with pytest.raises(CollectorClosedError, match=r"closed by its plain `for batch in collector` \(without `with`\), "
                                                   r"which closes it when total_frames are delivered; create a new"):
        for _ in collector:
            pass
