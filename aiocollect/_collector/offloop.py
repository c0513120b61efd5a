"""Background collection off the caller's event loop: the collector's own loop, in a thread.

``start(replay_buffer=...)`` and ``start(queue=...)`` promise that collection goes on while the
caller's thread trains without awaiting (a synchronous gradient step holds its thread for
milliseconds, and a loop of them holds it for seconds). The run's data plane (the tasks reading
the workers' reports, the producer, the drain into the sink, the watchdog) therefore runs in an
event loop of its own, in a thread the run starts once its workers are up and joins before it
stops them: :class:`CollectorLoop`. The caller's loop keeps the run's lifecycle and everything the
user sees: the events (handlers and subscriptions run there), the weight versions that
``update_weights`` waits for, and the queue of an ``asyncio.Queue`` sink.

What crosses between the two loops goes through this module's two directions, never through a
shared primitive: :meth:`CollectorLoop.to_user` / :meth:`post_user` (the data plane asks the
caller's loop to run something: emit an event, record an acknowledged version, stop the run),
:meth:`CollectorLoop.to_thread` / :meth:`post_thread` (the caller's loop asks the data plane: a
message to a worker, the pause gate). Each object that waits stays on one loop. The thread's loop
runs on the caller's library (asyncio, with uvloop where the caller runs uvloop; trio), so that
the primitives the start-up made on the caller's loop behave the same in it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections import deque
from typing import Any, Awaitable, Callable, TypeVar

import anyio

from .._core.errors import LoopGone
from .._service.resource import loop_token

T = TypeVar("T")


def _post(loop: Any, fn: Callable[[], Any]) -> None:
    """Have ``loop`` (an asyncio loop or trio's token) call ``fn()`` soon, from any thread.
    Raises :class:`LoopGone` when that loop is closed or its run finished."""
    try:
        if isinstance(loop, asyncio.AbstractEventLoop):
            loop.call_soon_threadsafe(fn)
        else:
            loop.run_sync_soon(fn)
    except RuntimeError as exc:  # closed (trio's RunFinishedError is one too)
        raise LoopGone("the event loop of this collector's background collection has ended") from exc


class _Inbox:
    """What one loop is asked to run by the other thread: each call is started as a task of a
    task group of this loop, in the order posted (by :meth:`serve`, a task of that group: anyio
    starts tasks from a task only, never from a loop's bare callback). Once :meth:`serve` ends
    (its loop is ending), every call still waiting, and every call posted later, is dropped:
    its ``dropped()`` callback tells whoever waits for it."""

    def __init__(self, loop: Any = None) -> None:
        self.calls: deque[tuple[Callable[..., Awaitable[Any]], tuple, Callable[[], None] | None]] = deque()
        self.wakeup: Any = None
        self.loop = loop
        self.closed = False
        self._guard = threading.Lock()  # (posts come from the other thread)

    async def serve(self, tg: Any) -> None:
        try:
            while True:
                self.wakeup = anyio.Event()
                while self.calls:
                    fn, args, _ = self.calls.popleft()
                    tg.start_soon(fn, *args)
                await self.wakeup.wait()
        finally:
            self.close()

    def close(self) -> None:
        """No more calls: drop those still waiting (from either thread; idempotent)."""
        with self._guard:
            self.closed = True
            left = list(self.calls)
            self.calls.clear()
        for _, _, dropped in left:
            if dropped is not None:
                dropped()

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()

    def post(self, fn: Callable[..., Awaitable[Any]], *args: Any, dropped: Callable[[], None] | None = None) -> None:
        """From the other thread: start ``fn(*args)`` there soon; :class:`LoopGone` if that loop
        takes no more calls (``dropped`` is not called then)."""
        with self._guard:
            if self.closed:
                raise LoopGone("the event loop of this collector's background collection has ended")
            self.calls.append((fn, args, dropped))
        _post(self.loop, self._wake)


class CollectorLoop:
    """An event loop in a thread of its own that hosts background collection's data plane.

    Built on the caller's loop (``user_loop``, with ``user_tg`` a task group there that hosts
    what the thread asks of it); :meth:`run` runs the data plane in the thread and returns (or
    raises) what it did, having joined the thread."""

    def __init__(self, user_loop: Any, user_tg: Any) -> None:
        self.user_loop = user_loop
        self.loop: Any = None  # the thread's loop (token), once it runs
        self._user_tg = user_tg
        self._to_user = _Inbox(user_loop)
        self._to_thread = _Inbox()
        self._scope: anyio.CancelScope | None = None
        self._ready = threading.Event()  # the thread's loop takes calls (or has ended)
        self._thread: threading.Thread | None = None

    def on_thread(self) -> bool:
        """The current task runs in the collector's thread."""
        return self.loop is not None and loop_token() is self.loop

    # -- the thread ----------------------------------------------------------------------------
    async def run(
        self, main: Callable[[], Awaitable[None]], give_up_after: float, on_ready: Callable[[], Any] = lambda: None
    ) -> None:
        """Run ``main()`` in the thread's loop until it returns, raises or this call is
        cancelled (then ``main`` is cancelled and waited for, ``give_up_after`` seconds at most:
        a write into a sink that never returns is left to its daemon thread). Its error is
        raised here. ``on_ready()`` is called on the caller's loop once the thread's loop runs
        ``main`` (a caller that then holds its thread without awaiting still gets batches)."""
        outcome: list[BaseException | None] = []
        finished = anyio.Event()
        user_loop = self.user_loop

        def report(result: BaseException | None) -> None:
            if not outcome:
                outcome.append(result)
            self._to_thread.close()  # (what the caller's loop asks from now on is refused, or dropped)
            self._ready.set()
            try:
                _post(user_loop, finished.set)
            except LoopGone:
                pass  # nobody waits on the caller's side any more

        async def body() -> None:
            try:
                with anyio.CancelScope() as self._scope:
                    async with anyio.create_task_group() as tg:
                        self._to_thread.loop = self.loop = loop_token()
                        tg.start_soon(self._to_thread.serve, tg)
                        self._ready.set()
                        _post(user_loop, on_ready)
                        await main()
                        tg.cancel_scope.cancel()  # (what the caller asked meanwhile ends too)
                report(None)
            except BaseException as exc:  # noqa: BLE001 - raised on the caller's loop
                report(exc)

        def thread_main() -> None:
            backend, options = _library_of(user_loop)
            try:
                anyio.run(body, backend=backend, backend_options=options)
            except BaseException as exc:  # noqa: BLE001 - the loop itself failed to run
                report(exc)

        async with anyio.create_task_group() as inbox:
            inbox.start_soon(self._to_user.serve, self._user_tg)
            self._thread = threading.Thread(target=thread_main, name="aiocollect background collection", daemon=True)
            self._thread.start()
            try:
                await finished.wait()
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    self.cancel()
                    with anyio.move_on_after(give_up_after):
                        await finished.wait()
                raise
            finally:
                inbox.cancel_scope.cancel()
                self._to_user.close()
                if finished.is_set():
                    self._thread.join()
        error = outcome[0] if outcome else None
        if error is not None and not isinstance(error, anyio.get_cancelled_exc_class()):
            raise error

    def cancel(self) -> None:
        """End the data plane (from the caller's loop or any thread)."""
        self._ready.wait()
        scope, loop = self._scope, self.loop
        if scope is not None and loop is not None:
            try:
                _post(loop, scope.cancel)
            except LoopGone:
                pass

    # -- the thread asks the caller's loop ------------------------------------------------------
    def post_user(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start ``fn(*args)`` as a task on the caller's loop, without waiting for it (its error
        fails the run there). Tasks posted in order start in order."""
        self._to_user.post(fn, *args)

    def call_user(self, fn: Callable[[], Any]) -> None:
        """Call ``fn()`` on the caller's loop soon, without waiting for it."""
        _post(self.user_loop, fn)

    async def to_user(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the caller's loop and return its result here (in the thread);
        cancelled here, it goes on there until the run ends."""
        return await _across(self._to_user, self.loop, fn, args)

    # -- the caller's loop asks the thread ------------------------------------------------------
    def post_thread(self, fn: Callable[[], Any]) -> None:
        """Call ``fn()`` in the thread's loop soon, without waiting for it."""
        self._ready.wait()
        if self._to_thread.loop is None:
            raise LoopGone("this collector's background collection has ended")
        _post(self._to_thread.loop, fn)

    async def to_thread(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` in the thread's loop and return its result on the caller's loop
        (shielded: what it sends to a worker goes whole, or not at all)."""
        self._ready.wait()
        if self._to_thread.loop is None:
            raise LoopGone("this collector's background collection has ended")
        with anyio.CancelScope(shield=True):
            result = await _across(self._to_thread, self.user_loop, fn, args)
        return result


async def _across(inbox: _Inbox, here: Any, fn: Callable[..., Awaitable[T]], args: tuple) -> T:
    """Run ``fn(*args)`` on the other loop (through its ``inbox``), wait for it on this one
    (``here``), return or raise what it did."""
    done = anyio.Event()
    box: list[Any] = []

    def answer() -> None:
        try:
            _post(here, done.set)
        except LoopGone:
            pass

    async def task() -> None:
        try:
            box.append((True, await fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - raised where it was asked for
            box.append((False, exc))
        finally:
            answer()

    def dropped() -> None:  # the other loop ended before it started the task
        box.append((False, LoopGone("the other loop of this collector's background collection has ended")))
        answer()

    inbox.post(task, dropped=dropped)
    await done.wait()
    ok, value = box[0]
    if not ok:
        if isinstance(value, anyio.get_cancelled_exc_class()):
            raise LoopGone("the other loop of this collector's background collection is ending") from None
        raise value
    return value


def _library_of(loop: Any) -> tuple[str, dict[str, Any]]:
    """The anyio backend (and its options) of the caller's loop, for the thread's loop."""
    if isinstance(loop, asyncio.AbstractEventLoop):
        return "asyncio", ({"use_uvloop": True} if type(loop).__module__.startswith("uvloop") else {})
    if "trio" in sys.modules:
        return "trio", {}
    return "asyncio", {}  # pragma: no cover


__all__ = ["CollectorLoop", "LoopGone"]
