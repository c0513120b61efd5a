"""What the public fronts of a service, :class:`~aiocollect.Collector` and
:class:`~aiocollect.Evaluator`, share: the lifecycle of an async resource
(:class:`~aiocollect._service.resource.AsyncResource`), typed events (:meth:`Service.on`,
:meth:`Service.subscribe`, :meth:`Service.wait_for`) and the warning for one left unclosed.

Each front holds its run (``_run``: the state and the tasks, which never refer back to the
front) whose ``bus`` is the :class:`~aiocollect._service.bus.EventBus` the events go through.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, ClassVar, TypeVar

import anyio

from .bus import Overflow, Subscription
from .._core.errors import AiocollectError
from .resource import AsyncResource
from ..events import Event

E = TypeVar("E", bound=Event)


class Service(AsyncResource):
    """Base of :class:`~aiocollect.Collector` and :class:`~aiocollect.Evaluator`: events and
    lifecycle. A subclass sets ``_run`` (with a ``bus``) and says how it ends in
    ``_closed_error`` (the error :meth:`wait_for` raises) and ``_ended`` (its words for it)."""

    _run: Any
    _closed_error: ClassVar[type[AiocollectError]]
    _ended: ClassVar[str]  # "the collector stopped", "the evaluator closed"

    def on(self, event_type: type[E], handler: Callable[[E], Any] | None = None) -> Any:
        """Call ``handler(event)`` (sync or async, awaited in registration order) for each event
        of ``event_type`` or a subclass (see :mod:`aiocollect.events`). Returns a handle whose
        ``remove()`` unsubscribes; without ``handler`` it is a decorator.

        Handlers run in the collector's (or evaluator's) own task. A collector's run before the
        batch they concern is delivered: a slow handler slows collection (that is what hooks are
        for; use :meth:`subscribe` to watch without ever slowing anything). An exception in a
        handler stops the collector and is raised to the consumer.

        An evaluator's (:class:`~aiocollect.events.EvaluationCompleted` /
        :class:`~aiocollect.events.EvaluationFailed`, and :class:`~aiocollect.events.WorkerFailed`
        / :class:`~aiocollect.events.WorkerRestarted` about its worker, or any superclass
        registered) run before the next evaluation starts (so a handler may call
        :meth:`Evaluator.trigger <aiocollect.Evaluator.trigger>`, but must not await
        :meth:`~aiocollect.Evaluator.evaluate` or :meth:`~aiocollect.Evaluator.wait`: they would
        wait for the handler itself). An exception in one surfaces like a background
        evaluation's error (from :meth:`~aiocollect.Evaluator.evaluate` for its own evaluation).

        Examples:
            >>> @collector.on(EpisodeEnded)                     # doctest: +SKIP
            ... def log(event): print(event.ret)
        """
        return self._run.bus.on(event_type, handler)

    def subscribe(
        self, event_type: type[E], *, max_buffer: int = 1024, overflow: Overflow = "drop_oldest"
    ) -> Subscription[E]:
        """A bounded stream of events of ``event_type``: ``async for event in subscription``
        (ends when the collector stops, or the evaluator closes). A subscriber that falls behind
        loses events by its ``overflow`` policy (``"drop_oldest"``, ``"drop_newest"`` or
        ``"error"``, counted in ``subscription.dropped``); it never slows the collector (or the
        evaluator) or the other subscribers."""
        return self._run.bus.subscribe(event_type, max_buffer=max_buffer, overflow=overflow)

    async def wait_for(self, event_type: type[E], predicate: Callable[[E], bool] | None = None) -> E:
        """The next event of ``event_type`` that ``predicate`` accepts. Raises
        :class:`~aiocollect.CollectorClosedError` if the collector stops first
        (:class:`~aiocollect.EvaluatorClosedError` if the evaluator closes first)."""
        try:
            return await self._run.bus.wait_for(event_type, predicate)
        except anyio.EndOfStream:
            raise self._closed_error(f"{self._ended} before a matching {event_type.__name__} event") from None


def warn_unclosed(description: str, kind: str) -> None:
    """The ``ResourceWarning`` for a collector or evaluator (``kind``: its class name) that was
    garbage-collected while running: named by ``description`` (its repr)."""
    warnings.warn(
        f"{description} was not closed: use `async with {kind}(...)` or `await {kind.lower()}.aclose()`",
        ResourceWarning,
        stacklevel=3,
    )


__all__ = ["Service", "warn_unclosed"]
