"""The event bus on its own: dispatch along the class hierarchy, handler order and errors,
bounded subscriptions with explicit overflow, wait_for."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from aiocollect._service.bus import EventBus, SubscriptionOverflowError
from aiocollect.events import Event, WorkerEvent, WorkerFailed, WorkerStarted


def started(i: int = 0) -> WorkerStarted:
    return WorkerStarted(worker=i, pid=100 + i)


async def test_dispatch_follows_the_class_hierarchy_and_registration_order():
    bus = EventBus()
    seen = []
    bus.on(Event, lambda e: seen.append(("event", type(e).__name__)))
    bus.on(WorkerEvent, lambda e: seen.append(("worker", e.worker)))

    async def async_handler(e):
        await anyio.sleep(0)
        seen.append(("started", e.pid))

    bus.on(WorkerStarted, async_handler)
    await bus.emit(started(1))
    await bus.emit(WorkerFailed(worker=2, pid=None, error=RuntimeError("x")))
    assert seen == [("event", "WorkerStarted"), ("worker", 1), ("started", 101), ("event", "WorkerFailed"), ("worker", 2)]


async def test_handle_unsubscribes_and_decorator_form_returns_the_function():
    bus = EventBus()
    seen = []

    @bus.on(WorkerStarted)
    def handler(e):
        seen.append(e.worker)

    await bus.emit(started(1))
    handler.handle.remove()
    handler.handle.remove()  # idempotent
    await bus.emit(started(2))
    assert seen == [1]
    with bus.on(WorkerStarted, lambda e: seen.append(-e.worker)):
        await bus.emit(started(3))
    await bus.emit(started(4))
    assert seen == [1, -3]


async def test_handler_errors_propagate_to_the_emitter():
    bus = EventBus()

    def boom(e):
        raise KeyError("handler failed")

    bus.on(WorkerStarted, boom)
    with pytest.raises(KeyError, match="handler failed"):
        await bus.emit(started())


async def test_slow_subscriber_drops_with_its_policy_and_counts_never_blocking_others():
    bus = EventBus()
    oldest = bus.subscribe(WorkerStarted, max_buffer=2)
    newest = bus.subscribe(WorkerStarted, max_buffer=2, overflow="drop_newest")
    strict = bus.subscribe(WorkerStarted, max_buffer=2, overflow="error")
    roomy = bus.subscribe(Event)
    for i in range(5):
        await bus.emit(started(i))  # never blocks, whatever the subscribers do
    assert [oldest.receive_nowait().worker for _ in range(2)] == [3, 4] and oldest.dropped == 3
    assert [newest.receive_nowait().worker for _ in range(2)] == [0, 1] and newest.dropped == 3
    with pytest.raises(SubscriptionOverflowError, match="lost 3 events"):
        strict.receive_nowait()
    assert [roomy.receive_nowait().worker for _ in range(5)] == list(range(5)) and roomy.peak == 5


async def test_subscription_iteration_ends_when_the_bus_closes_and_wait_for_filters():
    bus = EventBus()
    sub = bus.subscribe(WorkerStarted)
    got = []

    async def reader():
        async for e in sub:
            got.append(e.worker)

    async def waiter():
        event = await bus.wait_for(WorkerStarted, lambda e: e.worker == 2)
        got.append(("waited", event.worker))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(waiter)
            await anyio.sleep(0.01)
            for i in range(4):
                await bus.emit(started(i))
                await anyio.sleep(0)
            bus.close()
    # the reader saw every event in order; the waiter woke once, for worker 2 (when, against the
    # reader's appends, is the scheduler's choice)
    assert [g for g in got if not isinstance(g, tuple)] == [0, 1, 2, 3]
    assert [g for g in got if isinstance(g, tuple)] == [("waited", 2)]


async def test_events_are_frozen_and_keyword_only():
    e = started()
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.worker = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        WorkerStarted(0, 1)  # type: ignore[misc]
    with pytest.raises(TypeError, match="not an aiocollect.events.Event"):
        EventBus().on(int, print)
