"""The event bus: handlers (awaited in registration order, dispatch along the class hierarchy,
errors propagate) and subscriptions (a bounded stream each; a slow subscriber never stalls the
collector or the other subscribers: its overflow policy is explicit and its drops are counted)."""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any, Callable, Generic, Literal, TypeVar, overload

import anyio

from .._core.errors import ConfigError, ConfigTypeError
from .._core.errors import SubscriptionOverflowError as SubscriptionOverflowError  # re-exported: its first home
from ..events import Event
from .._core.public import public

E = TypeVar("E", bound=Event)
Overflow = Literal["drop_oldest", "drop_newest", "error"]


class Handle:
    """Returned by :meth:`EventBus.on`: ``handle.remove()`` (or ``with handle:``) unsubscribes."""

    def __init__(self, bus: "EventBus", entry: tuple) -> None:
        self._bus, self._entry = bus, entry

    def remove(self) -> None:
        try:
            self._bus._handlers.remove(self._entry)
        except ValueError:
            pass

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


@public
class Subscription(Generic[E]):
    """A bounded stream of events of one type (and its subclasses).

    ``async for event in subscription`` ends when the bus closes (the collector closed). Use it
    as a context manager (``with collector.subscribe(...) as sub:``) or call :meth:`close`.

    Attributes:
        dropped: events this subscription lost to overflow.
        peak: most events it held at once.
    """

    def __init__(self, bus: "EventBus", event_type: type[E], max_buffer: int, overflow: Overflow) -> None:
        if isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer < 1:
            raise ConfigError(f"max_buffer={max_buffer!r} must be an int >= 1: the events a subscriber may fall behind by")
        if not isinstance(overflow, str) or overflow not in ("drop_oldest", "drop_newest", "error"):
            raise ConfigError(f"overflow={overflow!r} must be 'drop_oldest', 'drop_newest' or 'error'")
        self._bus = bus
        self.event_type = event_type
        self.max_buffer = max_buffer
        self.overflow = overflow
        self._items: deque[E] = deque()
        self._event: anyio.Event | None = None
        self._closed = False
        self._overflowed = False
        self.dropped = 0
        self.peak = 0

    def _offer(self, event: E) -> None:
        if self._closed:
            return
        if len(self._items) >= self.max_buffer:
            self.dropped += 1
            if self.overflow == "drop_newest":
                return
            if self.overflow == "error":
                self._overflowed = True
            self._items.popleft()
        self._items.append(event)
        self.peak = max(self.peak, len(self._items))
        if self._event is not None:
            self._event.set()

    def _close(self) -> None:
        self._closed = True
        if self._event is not None:
            self._event.set()

    def receive_nowait(self) -> E:
        """The next event; raises ``anyio.WouldBlock`` if none is waiting, ``anyio.EndOfStream``
        once closed and drained."""
        if self._overflowed:
            self._overflowed = False
            raise SubscriptionOverflowError(
                f"subscription to {self.event_type.__name__} fell behind and lost {self.dropped} events "
                f"(max_buffer={self.max_buffer}); receive faster, raise max_buffer, or use overflow='drop_oldest'"
            )
        if self._items:
            return self._items.popleft()
        if self._closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> E:
        while True:
            try:
                return self.receive_nowait()
            except anyio.WouldBlock:
                self._event = anyio.Event()
                await self._event.wait()

    def __aiter__(self) -> "Subscription[E]":
        return self

    async def __anext__(self) -> E:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Unsubscribe; events already received stay readable."""
        self._bus._unsubscribe(self)
        self._close()

    def __enter__(self) -> "Subscription[E]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class EventBus:
    """Dispatches :class:`~aiocollect.events.Event` objects to handlers and subscriptions."""

    def __init__(self) -> None:
        self._handlers: list[tuple[type, Callable[[Any], Any]]] = []
        self._subs: list[Subscription] = []
        self._closed = False

    @overload
    def on(self, event_type: type[E], handler: Callable[[E], Any]) -> Handle: ...

    @overload
    def on(self, event_type: type[E]) -> Callable[[Callable[[E], Any]], Callable[[E], Any]]: ...

    def on(self, event_type: type[E], handler: Callable[[E], Any] | None = None) -> Any:
        """Call ``handler(event)`` (sync or async; awaited) for every event of ``event_type`` or a
        subclass, in registration order. Returns a :class:`Handle`; without ``handler`` it is a
        decorator (the handle is then ``decorated.handle``). An exception in a handler propagates
        to whoever emitted the event (for the collector: to its consumer)."""
        _check_type(event_type)
        if handler is None:

            def decorator(fn: Callable[[E], Any]) -> Callable[[E], Any]:
                fn.handle = self.on(event_type, fn)  # type: ignore[attr-defined]
                return fn

            return decorator
        if not callable(handler):
            raise ConfigTypeError(f"handler={handler!r} is not callable; pass a function or coroutine function taking the event")
        entry = (event_type, handler)
        self._handlers.append(entry)
        return Handle(self, entry)

    def subscribe(self, event_type: type[E], *, max_buffer: int = 1024, overflow: Overflow = "drop_oldest") -> Subscription[E]:
        """A bounded stream of the events of ``event_type`` (and subclasses) from now on."""
        _check_type(event_type)
        sub = Subscription(self, event_type, max_buffer, overflow)
        if self._closed:
            sub._close()
        else:
            self._subs.append(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        try:
            self._subs.remove(sub)
        except ValueError:
            pass

    async def wait_for(self, event_type: type[E], predicate: Callable[[E], bool] | None = None) -> E:
        """The next event of ``event_type`` for which ``predicate`` is true. Raises
        ``anyio.EndOfStream`` if the bus closes first."""
        with self.subscribe(event_type, max_buffer=1 << 16) as sub:
            async for event in sub:
                if predicate is None or predicate(event):
                    return event
        raise anyio.EndOfStream

    def listens_to(self, event_type: type[Event]) -> bool:
        """Whether anything would receive an event of ``event_type`` (to skip building it)."""
        return any(issubclass(event_type, t) for t, _ in self._handlers) or any(
            issubclass(event_type, s.event_type) for s in self._subs
        )

    async def emit(self, event: Event) -> None:
        """Deliver ``event``: subscriptions first (never blocks), then handlers, awaited in order."""
        for sub in list(self._subs):
            if isinstance(event, sub.event_type):
                sub._offer(event)
        for event_type, handler in list(self._handlers):
            if isinstance(event, event_type):
                result = handler(event)
                if inspect.isawaitable(result):
                    await result

    def close(self) -> None:
        """End every subscription's ``async for`` (after it drains)."""
        self._closed = True
        for sub in self._subs:
            sub._close()
        self._subs.clear()


def _check_type(event_type: Any) -> None:
    if not (isinstance(event_type, type) and issubclass(event_type, Event)):
        raise ConfigTypeError(
            f"{event_type!r} is not an aiocollect.events.Event subclass; pass an event class, such as aiocollect.events.Event"
        )
