"""Delivery into a queue the user owns: ``start(queue=...)`` with an asyncio.Queue, an anyio
memory object stream, a trio memory channel."""

from __future__ import annotations

import asyncio
import sys

import anyio
import pytest
import torch

from aiocollect import AiocollectError, Collector, ConfigError, ReplayBuffer, WorkerError
from aiocollect.testing import CountingEnv, InjectedFailure

FRAMES, BATCHES = 8, 6


def counting_env():
    return CountingEnv(episode_length=20)


def make_collector(**kwargs):
    options = dict(frames_per_batch=FRAMES, total_frames=FRAMES * BATCHES, num_workers=1, seed=0)
    return Collector(counting_env, **{**options, **kwargs})


def check_every_batch_once_in_order(taken):
    """The batches, in the order the consumers took them, are the collection's whole stream:
    each env's observations continue from batch to batch (a batch lost, repeated or swapped
    breaks that), and there are as many as the collector delivered."""
    assert len(taken) == BATCHES, len(taken)
    obs = torch.cat([b["observation"][..., 0] for b in taken], dim=1)
    nxt = torch.cat([b["next", "observation"][..., 0] for b in taken], dim=1)
    done = torch.cat([b["next", "done"][..., 0] for b in taken], dim=1)
    assert torch.equal(obs[:, 1:][~done[:, :-1]], nxt[:, :-1][~done[:, :-1]])
    assert obs[0, 0] == 0  # from the first frame on


async def consume_stream(receive, taken, who, consumers):
    async with receive:
        async for batch in receive:
            taken.append(batch)  # (in the order of receive(): the stream's order)
            consumers.add(who)
            await anyio.sleep(0.01)  # (a training step: lets the other consumer take the next one)


async def test_two_consumers_of_an_anyio_stream_see_every_batch_once_in_order():
    send, receive = anyio.create_memory_object_stream(2)
    taken, consumers = [], set()
    c = make_collector()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume_stream, receive.clone(), taken, 0, consumers)
            tg.start_soon(consume_stream, receive, taken, 1, consumers)
            await c.start(queue=send)  # the stream ends when the collection does: so do the consumers
        await c.aclose()
    check_every_batch_once_in_order(taken)
    assert consumers == {0, 1}
    with pytest.raises(anyio.ClosedResourceError):
        send.send_nowait(None)  # closed by the collector (close_queue=True)


@pytest.mark.loops("asyncio", "uvloop")
async def test_two_consumers_of_an_asyncio_queue_see_every_batch_once_in_order():
    q: asyncio.Queue = asyncio.Queue(maxsize=2)
    taken = []

    async def consume():
        while True:
            try:
                batch = await q.get()
            except getattr(asyncio, "QueueShutDown", ()):  # Python 3.13+: the collector shut it down
                return
            taken.append(batch)
            await anyio.sleep(0.01)

    c = make_collector()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            tg.start_soon(consume)
            await c.start(queue=q)
            while len(taken) < len(c):  # (before 3.13 the queue stays open: count the batches)
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        await c.aclose()
    check_every_batch_once_in_order(taken)
    assert q.empty()
    if sys.version_info >= (3, 13):
        with pytest.raises(asyncio.QueueShutDown):
            q.put_nowait(None)


@pytest.mark.loops("trio")
async def test_a_trio_memory_channel_takes_every_batch_and_is_closed_at_the_end():
    import trio

    send, receive = trio.open_memory_channel(1)
    taken = []
    c = make_collector()
    with anyio.fail_after(60):
        await c.start(queue=send)
        async with receive:
            async for batch in receive:  # ends when the collector closes the channel
                taken.append(batch)
        await c.aclose()
    check_every_batch_once_in_order(taken)


@pytest.mark.loops("asyncio", "trio")
async def test_a_full_queue_holds_the_collector_and_aclose_cancels_the_pending_put():
    send, receive = anyio.create_memory_object_stream(1)
    c = make_collector(total_frames=-1)
    await c.start(queue=send)
    with anyio.fail_after(30):
        while c.batches < 2:  # one batch in the stream, one waiting to be put
            await anyio.sleep(0.01)
    await anyio.sleep(0.3)  # (time for batches to race ahead, if they could)
    assert c.batches == 2, "the collector handed out more than the queue's size plus one"
    first = await receive.receive()
    with anyio.fail_after(30):
        while c.batches < 3:  # room again: the next one follows
            await anyio.sleep(0.01)
    await anyio.sleep(0.3)
    assert c.batches == 3
    with anyio.fail_after(30):
        await c.aclose()  # a put is pending: cancelled, nothing raised
    assert c.state.value == "closed"
    rest = [batch async for batch in receive]  # the stream was closed: what it held, then its end
    assert len(rest) == 1
    assert torch.equal(first["next", "observation"][:, -1], rest[0]["observation"][:, 0])
    receive.close()


@pytest.mark.loops("asyncio", "uvloop")
async def test_aclose_with_a_full_asyncio_queue_nobody_reads_does_not_hang():
    q: asyncio.Queue = asyncio.Queue(maxsize=1)
    c = make_collector(total_frames=-1)
    await c.start(queue=q)
    with anyio.fail_after(30):
        while c.batches < 2:
            await anyio.sleep(0.01)
        await c.aclose()
    assert q.qsize() == 1


async def test_a_worker_failure_ends_the_consumers_stream_and_aclose_raises_it():
    send, receive = anyio.create_memory_object_stream(4)
    c = Collector(lambda: CountingEnv(episode_length=20, fail_at_step=3 * FRAMES + 2),
                  frames_per_batch=FRAMES, total_frames=-1, num_workers=1, seed=0)
    with anyio.fail_after(60):
        await c.start(queue=send)
        async with receive:
            taken = [batch async for batch in receive]  # ends: the collector closed the stream
        with pytest.raises(WorkerError, match="InjectedFailure") as info:
            await c.aclose()
    assert isinstance(info.value.__cause__, InjectedFailure)
    # at most the batches completed before the failure, from the start, none repeated
    assert len(taken) <= 3
    firsts = [int(b["observation"][0, 0, 0]) for b in taken]
    del taken
    assert firsts == [FRAMES * i for i in range(len(firsts))]


async def test_close_queue_false_leaves_the_stream_open():
    send, receive = anyio.create_memory_object_stream(BATCHES)
    c = make_collector()
    with anyio.fail_after(60):
        await c.start(queue=send, close_queue=False)
        taken = [await receive.receive() for _ in range(BATCHES)]
        while c.state.value == "running":
            await anyio.sleep(0.01)
        await c.aclose()
    send.send_nowait("still open")
    assert receive.receive_nowait() == "still open"
    send.close()
    receive.close()
    check_every_batch_once_in_order(taken)


@pytest.mark.loops("asyncio")
async def test_wrong_queues_and_combinations_are_refused_with_the_fix():
    send, receive = anyio.create_memory_object_stream(1)
    c = make_collector()
    with pytest.raises(ConfigError, match="both replay_buffer=.* and queue="):
        await c.start(replay_buffer=ReplayBuffer(100), queue=send)
    with pytest.raises(ConfigError, match="queue=.*not a queue.*create_memory_object_stream"):
        await c.start(queue=[])
    with pytest.raises(ConfigError, match="close_queue=1"):
        await c.start(queue=send, close_queue=1)
    await c.start(queue=send)
    with pytest.raises(AiocollectError, match="take from the queue"):
        await c.collect()
    await c.aclose()
    receive.close()


@pytest.mark.loops("trio")
async def test_an_asyncio_queue_on_trio_is_refused():
    c = make_collector()
    with pytest.raises(ConfigError, match="asyncio.Queue, which needs an asyncio event loop.*trio"):
        await c.start(queue=asyncio.Queue())
    await c.aclose()


class RecordingQueue(asyncio.Queue):
    """An asyncio.Queue that records its shutdown() (Python 3.13's; called where it exists)."""

    shut_down = False

    def shutdown(self, immediate=False):
        self.shut_down = True
        if sys.version_info >= (3, 13):
            super().shutdown(immediate)


@pytest.mark.loops("asyncio")
async def test_an_asyncio_queue_with_shutdown_is_shut_down_at_the_end_unless_close_queue_is_false():
    for close_queue in (True, False):
        q = RecordingQueue(maxsize=BATCHES)
        c = make_collector()
        with anyio.fail_after(60):
            await c.start(queue=q, close_queue=close_queue)
            while c.state.value == "running":
                await anyio.sleep(0.01)
            await c.aclose()
        assert q.qsize() == BATCHES and q.shut_down == close_queue
        while not q.empty():
            q.get_nowait()
