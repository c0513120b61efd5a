"""A running collector's data plane: :class:`DataPlane`.

The data plane is the set of tasks that take the workers' batches to the consumers or to the
sink of background collection: a supervisor per worker seat, the producer, the drain into the
sink, the watchdog and the inference server's watch. It runs on the caller's loop, or in the
collector's own loop (a thread, :mod:`~aiocollect._collector.offloop`) for background
collection, so that batches reach the sink while the caller's thread trains without awaiting;
a sink attached to a running collector moves it there, at a moment when cancelling it loses
nothing. The plane is built with the parts it drives (the config, the worker pool, the
delivery, the producer) and hooks to the run (the next batch, a stop, where it runs).
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio

from .._service.supervisor import supervise, watchdog
from .offloop import CollectorLoop
from .queue_sink import QueueSink, writes_on_user_loop

if TYPE_CHECKING:  # pragma: no cover
    from anyio.abc import TaskGroup
    from tensordict import TensorDict

    from .config import CollectorConfig
    from .delivery import Delivery
    from .pool import WorkerPool
    from .producer import Producer


@dataclasses.dataclass(frozen=True)
class PlaneHooks:
    """What the data plane asks of the run."""

    take: Callable[[], Awaitable["TensorDict"]]  # the next batch for the sink (raises at the end)
    request_stop: Callable[[], None]  # nobody takes from the sink any more: stop the workers
    at_home: Callable[["CollectorLoop | None"], None]  # the collector's loop runs the plane now (or no more)


class DataPlane:
    """The tasks that take the workers' batches to the consumers or the sink (see the module
    docstring), started by :meth:`start` in the run's task group."""

    def __init__(self, config: "CollectorConfig", pool: "WorkerPool", delivery: "Delivery", producer: "Producer",
                 user_loop: Any, hooks: PlaneHooks) -> None:
        self.config = config
        self.pool = pool
        self.delivery = delivery
        self.producer = producer
        self.user_loop = user_loop  # the caller's loop (loop_token()), which the collector's loop reports to
        self.hooks = hooks
        self.tasks: TaskGroup | None = None  # the run's task group, once it runs (a sink attached late joins it)
        self.scope: anyio.CancelScope | None = None  # the plane on the caller's loop, which a late sink moves
        self.moved: anyio.Event | None = None  # set once it runs in the collector's loop (or the run ended)
        self.home: CollectorLoop | None = None  # the collector's own loop, while it runs the plane

    def start(self, tg: "TaskGroup", started: Callable[[], Any]) -> None:
        """Start the plane in the run's task group ``tg``: in the collector's loop when a sink is
        attached already, else on the caller's loop. ``started()`` once it runs."""
        self.tasks = tg
        movable = all(w.can_serve_off_loop for w in self.pool.workers)
        if self.delivery.sink is not None and movable:
            # start() returns once the collector's thread runs: a caller that trains right after
            # it without awaiting gets batches (the run's task ends setting started, whatever happens)
            tg.start_soon(self._collect_off_loop, tg, started)
            return
        started()
        if movable:  # on the caller's loop until a sink attached late moves it (start(replay_buffer=...))
            self.scope = anyio.CancelScope()
            tg.start_soon(self._plane_on_loop, tg, self.scope)
        else:
            self._start_tasks(tg)

    def sink_attached(self) -> None:
        """A sink was attached to the running collector: every batch goes there from now on."""
        assert self.tasks is not None, "the run's task group exists once it runs"
        if self.scope is not None:  # the data plane moves to the collector's loop, the drain with it
            self.moved = anyio.Event()
            self.tasks.start_soon(self._move_off_loop)
        else:  # (a backend whose seats only the caller's loop serves: the drain runs there too)
            self.tasks.start_soon(self._drain_into_sink)

    def ended(self) -> None:
        """The run ended: nobody waits for a move any more."""
        if self.moved is not None:
            self.moved.set()

    def _off_loop(self) -> CollectorLoop | None:
        """The collector's own loop when the current task runs in it, else ``None``."""
        home = self.home
        return home if home is not None and home.on_thread() else None

    def _start_tasks(self, tg: "TaskGroup") -> None:
        """The tasks that take the workers' batches to the consumers or the sink."""
        pool = self.pool
        for w in pool.workers:
            tg.start_soon(supervise, pool, w)
        tg.start_soon(self.producer.produce)
        if self.delivery.sink is not None:
            tg.start_soon(self._drain_into_sink)
        if self.config.step_timeout is not None:
            tg.start_soon(watchdog, pool, self.config.step_timeout)
        if pool.server is not None:
            tg.start_soon(pool.server.watch)

    async def _plane_on_loop(self, tg: "TaskGroup", scope: anyio.CancelScope) -> None:
        """The data plane on the caller's loop, in ``scope``: a sink attached to the running
        collector (:meth:`_move_off_loop`) cancels the scope once every task of the plane is parked
        (waiting, with nothing half-done), then runs the plane in the collector's own loop."""
        try:
            with scope:
                async with anyio.create_task_group() as plane:
                    self._start_tasks(plane)
        finally:
            self.scope = None
        if scope.cancelled_caught:  # moved: on to the collector's loop
            moved = self.moved
            assert moved is not None
            await self._collect_off_loop(tg, moved.set)

    async def _move_off_loop(self) -> None:
        """Move the data plane to the collector's loop, at a moment when cancelling it loses
        nothing: the producer, every worker's reader and every env call parked (they park within
        a round: the producer once its ``prefetch`` batches are collected)."""
        scope, workers = self.scope, self.pool.workers
        while scope is not None and self.scope is scope and not scope.cancel_called:
            if self.producer.parked and all(w.parked for w in workers) and not any(w.calls_pending for w in workers):
                scope.cancel()  # (no await since the check: every task is still where it was seen)
                return
            await anyio.sleep(0.001)

    async def _collect_off_loop(self, tg: "TaskGroup", on_ready: Callable[[], Any]) -> None:
        """Background collection: the data plane runs in the collector's own loop, so that
        batches reach the sink while the caller's thread trains without awaiting. Ends (the
        thread joined) when the run's task group is cancelled; the data plane's error is raised
        here. ``on_ready()`` once the thread runs it."""
        home = CollectorLoop(self.user_loop, tg)

        async def data_plane() -> None:
            async with anyio.create_task_group() as plane:
                self._start_tasks(plane)

        self._at_home(home)
        try:
            await home.run(data_plane, self.config.shutdown_timeout, on_ready)
        finally:
            self._at_home(None)

    def _at_home(self, home: CollectorLoop | None) -> None:
        self.home = home
        self.hooks.at_home(home)
        for w in self.pool.workers:
            w.home = home

    async def _drain_into_sink(self) -> None:
        """Background collection: every batch goes into the replay buffer or the user's queue
        (whose side is closed when the delivery ends, however it ends: here, or for a queue of
        the caller's loop by the run's task there once the data plane is gone)."""
        sink = self.delivery.sink
        try:
            await self._drain()
        finally:
            if isinstance(sink, QueueSink) and not (self._off_loop() and writes_on_user_loop(sink)):
                await sink.end()

    async def _drain(self) -> None:
        """Take each batch and write it into the sink, in order, one at a time. In the
        collector's own loop (background collection off the caller's loop) a sink whose writes
        belong to the caller's loop (an ``async def extend``, an ``asyncio.Queue``, an anyio or
        trio stream) is written there, this loop waiting for it; any other is written here."""
        sink, gate = self.delivery.sink, self.delivery.gate
        home = self._off_loop()
        there = home if home is not None and writes_on_user_loop(sink) else None
        while True:
            try:
                batch = await self.hooks.take()
            except Exception:  # noqa: BLE001 - the end, or the run's stored error (aclose raises it)
                self.producer.drained.set()
                return
            await gate.wait_open()
            gate.writing = anyio.Event()
            try:
                if there is not None:
                    await there.to_user(_write, sink, batch)
                else:
                    await _write(sink, batch)
                if isinstance(sink, QueueSink) and sink.consumer_gone:  # nobody takes from it now
                    self.hooks.request_stop()
                    return
            except BaseException as exc:
                # (its frames hold the batch: a lent one would stay mapped while the error is kept)
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                gate.writing.set()
                gate.writing = None
                del batch


async def _write(sink: Any, batch: "TensorDict") -> None:
    result = sink.extend(batch)
    if inspect.isawaitable(result):
        await result


__all__ = ["DataPlane", "PlaneHooks"]
