"""Delivery into a queue the user owns: ``start(queue=...)``.

A :class:`QueueSink` puts each batch into an ``asyncio.Queue`` (``await put``), an anyio object
send stream or a trio send channel (``await send``), from the run's drain task, so a full queue
holds the collector as a slow replay buffer does. A queue nobody can take from any more (its
receivers all closed, or the queue closed or shut down by its user) ends the delivery: the
collector stops, as at ``total_frames``, and ``aclose()`` has nothing to raise. When the
delivery ends (``total_frames`` reached, a failure, a start that failed or was cancelled,
``aclose()``) :meth:`QueueSink.end` closes the user's side: the stream or
channel is closed (its receivers' ``async for`` ends once they took what is buffered), an
``asyncio.Queue`` is shut down where Python has ``Queue.shutdown`` (3.13+).

A ``queue.Queue`` (a thread queue) is written from the collector's own loop, in its thread
(background collection, :mod:`~aiocollect._collector.offloop`): for a consumer that is a thread,
or a synchronous training loop that takes batches with ``get_nowait()`` between gradient steps
without awaiting. A full one holds the collector (it is polled every few milliseconds, never
waited on with a blocking ``put``). The other kinds belong to the caller's loop, and are written
there (:func:`writes_on_user_loop`): while that loop is held by synchronous code, nothing is put.
"""

from __future__ import annotations

import asyncio
import inspect
import queue as thread_queue
import sys
from typing import Any, Awaitable, Callable, Protocol

import anyio

from .._core.errors import ConfigError
from .._service.resource import loop_token

# the kinds of queue: put() into an asyncio.Queue, send() into an anyio stream or a trio channel
_ASYNCIO, _STREAM, _THREAD = "asyncio.Queue", "send stream", "queue.Queue"
_FULL_POLL = 0.002  # seconds between tries to put into a full thread queue


class Sink(Protocol):
    """What background collection writes its batches into: a replay buffer (aiocollect's, or
    TorchRL's, any object with ``extend(batch)``, possibly ``async``), or a :class:`QueueSink`."""

    def extend(self, batch: Any) -> Any:
        """Take ``batch`` (may return an awaitable)."""


class QueueSink:
    """The sink the drain task writes into (``extend``), for a user's queue."""

    def __init__(self, queue: Any, kind: str, close_queue: bool) -> None:
        self.queue = queue
        self.kind = kind
        self.close_queue = close_queue
        self._put: Callable[[Any], Awaitable[Any]] = (
            queue.put if kind == _ASYNCIO else self._put_thread if kind == _THREAD else queue.send
        )
        # set once the user's side ended the delivery: every receiver closed, the queue closed or
        # shut down; the collector then stops as at total_frames (the consumer's choice, no error)
        self.consumer_gone = False
        self._ended = False

    async def extend(self, batch: Any) -> None:
        try:
            await self._put(batch)  # (a full queue waits here: backpressure; aclose() cancels it)
        except _consumer_gone_errors():
            self.consumer_gone = True

    async def _put_thread(self, batch: Any) -> None:
        while True:
            try:
                self.queue.put_nowait(batch)
                return
            except thread_queue.Full:
                await anyio.sleep(_FULL_POLL)  # (a blocking put would hold the loop: aclose() must end it)

    async def end(self) -> None:
        """The delivery ended: close the user's side (where asked and possible), once. Runs
        shielded: it also ends a delivery that ``aclose()`` cancelled, or that never began."""
        if not self.close_queue or self._ended:
            return
        self._ended = True
        if self.kind in (_ASYNCIO, _THREAD):
            if hasattr(self.queue, "shutdown"):  # Python 3.13+
                self.queue.shutdown()
        elif callable(getattr(self.queue, "close", None)):  # anyio's and trio's memory streams
            self.queue.close()
        else:
            with anyio.CancelScope(shield=True):
                await self.queue.aclose()


def writes_on_user_loop(sink: Any) -> bool:
    """Whether writes into ``sink`` belong to the caller's event loop: a queue of that loop (an
    ``asyncio.Queue``, an anyio or trio stream) or an ``async def extend``. Background collection
    makes them there; a synchronous ``extend`` and a thread queue are written in the collector's
    own thread."""
    if isinstance(sink, QueueSink):
        return sink.kind != _THREAD
    return inspect.iscoroutinefunction(getattr(sink, "extend", None))


def sink_for(replay_buffer: Any, queue: Any, close_queue: bool) -> Sink | None:
    """What ``start(replay_buffer=..., queue=..., close_queue=...)`` writes into (``None``: no
    background delivery). Raises :class:`ConfigError` for both, a queue of an unknown kind, or
    a queue that cannot run on the current event loop."""
    if not isinstance(close_queue, bool):
        raise ConfigError(f"close_queue={close_queue!r} must be True or False")
    if queue is None:
        return replay_buffer
    if replay_buffer is not None:
        raise ConfigError(
            f"start() got both replay_buffer={replay_buffer!r:.60} and queue={queue!r:.60}: batches go to one of "
            f"them; pass one (a consumer of the queue can extend a buffer itself)"
        )
    kind = _kind_of(queue)
    library = "asyncio" if isinstance(loop_token(), asyncio.AbstractEventLoop) else "trio"
    if kind == _ASYNCIO and library != "asyncio":
        raise ConfigError(
            f"queue={queue!r:.60} is an asyncio.Queue, which needs an asyncio event loop, but this runs on {library}: "
            f"pass an anyio memory object stream (anyio.create_memory_object_stream) or a trio memory channel"
        )
    if kind == _STREAM and type(queue).__module__.startswith("trio") and library != "trio":
        raise ConfigError(
            f"queue={queue!r:.60} is a trio channel, which needs trio, but this runs on {library}: pass an "
            f"anyio memory object stream (anyio.create_memory_object_stream), which works on every loop"
        )
    return QueueSink(queue, kind, close_queue)


def _kind_of(queue: Any) -> str:
    if isinstance(queue, asyncio.Queue):
        return _ASYNCIO
    if isinstance(queue, thread_queue.Queue):
        return _THREAD
    if _is_send_stream(queue):
        return _STREAM
    raise ConfigError(
        f"queue={queue!r:.60} is not a queue the collector can put batches into: pass an asyncio.Queue "
        f"(await put), the send side of anyio.create_memory_object_stream() or of trio.open_memory_channel() "
        f"(await send)"
    )


def _consumer_gone_errors() -> tuple[type[BaseException], ...]:
    """What a put or send raises once nobody can take from the queue: its receivers were all
    closed (``BrokenResourceError``), it was closed or shut down by its user."""
    errors: list[type[BaseException]] = [anyio.BrokenResourceError, anyio.ClosedResourceError]
    if hasattr(asyncio, "QueueShutDown"):  # Python 3.13+
        errors.append(asyncio.QueueShutDown)
    if hasattr(thread_queue, "ShutDown"):  # Python 3.13+
        errors.append(thread_queue.ShutDown)
    trio = sys.modules.get("trio")
    if trio is not None:
        errors += [trio.BrokenResourceError, trio.ClosedResourceError]
    return tuple(errors)


def _is_send_stream(queue: Any) -> bool:
    from anyio.abc import ObjectSendStream

    if isinstance(queue, ObjectSendStream):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(queue, trio.abc.SendChannel)


__all__ = ["QueueSink", "Sink", "sink_for"]
