"""What the collector and the evaluator share as objects owning processes and tasks."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any, Callable, TypeVar

import anyio

T = TypeVar("T")


class AsyncResource:
    """``async with obj:`` is ``await obj.start()`` ... ``await obj.aclose()``; when the body
    raises, its exception wins over one from ``aclose()`` (the object is closed either way)."""

    async def start(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def aclose(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def _closing(self, closer: str) -> None:
        """Note what is about to close the object (``"the end of its `async with` block"``), for
        the errors of later calls; the first closer is kept. (A no-op unless a subclass keeps it.)"""

    async def __aenter__(self) -> Any:
        try:
            await self.start()
        except BaseException as exc:
            # cancelled (or failed) on entry: nobody will call __aexit__, so close here; what it
            # started is gone before the entry's own error (or cancellation) is raised
            self._closing(f"its `async with` entry, {_ended_by(exc)}")
            with anyio.CancelScope(shield=True):
                try:
                    await self.aclose()
                except Exception:  # noqa: BLE001 - the entry's own error (or cancellation) wins
                    pass
            raise
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self._closing("the end of its `async with` block")
            await self.aclose()
            return
        self._closing(f"the end of its `async with` block, {_ended_by(exc)}")
        try:
            await self.aclose()
        except Exception:
            pass


def _ended_by(exc: BaseException) -> str:
    """How a block ended early, in a closer's words: "cancelled", or "which raised ValueError"."""
    if isinstance(exc, anyio.get_cancelled_exc_class()) or isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return f"which raised {type(exc).__name__}"


async def wait_shielded(event: Any) -> None:
    """Wait for ``event`` whatever cancels the caller meanwhile; then re-raise the cancellation.

    ``anyio.CancelScope(shield=True)`` stops anyio's cancellations, but on asyncio a native
    ``task.cancel()`` (``asyncio.wait_for``'s timeout, a server shutting down, Ctrl-C under
    ``asyncio.run``) still interrupts the wait: cleanup that must finish would return half done.
    """
    pending: BaseException | None = None
    while True:
        try:
            with anyio.CancelScope(shield=True):
                await event.wait()
            break
        except asyncio.CancelledError as exc:  # a native task.cancel(): the shield let it through
            pending = exc
    if pending is not None:
        raise pending


async def in_own_thread(
    fn: Callable[[], T], name: str, *, give_up_after: float | None = None, discard: Callable[[T], Any] | None = None
) -> T:
    """Run ``fn()`` in a thread of its own that ends with it, while the event loop keeps running;
    its result is returned, its exception raised here. (Not anyio's thread pool: its idle thread
    would outlive the collector by seconds.)

    A thread cannot be interrupted: a cancelled caller waits for ``fn`` to return, or with
    ``give_up_after`` that many seconds more, then raises the cancellation and leaves ``fn`` to
    finish in its (daemon) thread; what ``fn`` returns is nobody's then: ``discard(result)`` is
    called on it (here, or in that thread when it returns)."""
    done = anyio.Event()
    loop = loop_token()
    failure: list[BaseException] = []
    result: list[T] = []
    lock = threading.Lock()
    abandoned = False

    def target() -> None:
        try:
            got: list[T] = [fn()]
        except BaseException as exc:  # noqa: BLE001 - raised in the loop below
            got, error = [], exc
        with lock:
            left = abandoned
            if not left:
                result.extend(got)
                if not got:
                    failure.append(error)
        if left:  # the caller is gone
            if got and discard is not None:
                try:
                    discard(got[0])
                except Exception:  # noqa: BLE001 - nobody to report it to
                    pass
            return
        _wake_soon(loop, done.set)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    if give_up_after is None:
        await wait_shielded(done)  # the thread cannot be interrupted: wait for it (task.cancel() too)
    else:
        try:
            await done.wait()
        except anyio.get_cancelled_exc_class():
            with anyio.move_on_after(give_up_after, shield=True):
                await done.wait()
            with lock:
                abandoned = not (result or failure)
            if not abandoned:  # it returned meanwhile: the thread ends once it has told us
                with anyio.CancelScope(shield=True):
                    await done.wait()
                thread.join()
                if result and discard is not None:
                    discard(result[0])
            raise
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def _wake_soon(loop: Any, wake: Callable[[], Any]) -> None:
    """From another thread, have ``loop`` (an asyncio loop or trio's token) call ``wake()``
    without waiting for it: a loop that is stopped (not closed) calls it when it runs again,
    where ``anyio.from_thread.run_sync`` would block this thread until then, perhaps forever.
    A closed loop or a finished trio run has nobody waiting: nothing to wake."""
    try:
        if isinstance(loop, asyncio.AbstractEventLoop):
            loop.call_soon_threadsafe(wake)
        else:
            loop.run_sync_soon(wake)
    except RuntimeError:  # closed (trio's RunFinishedError is one too)
        pass


def unwrap_group(exc: BaseException) -> BaseException:
    """The first real error inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not isinstance(e, anyio.get_cancelled_exc_class())]
        exc = (inner or list(exc.exceptions))[0]
    return exc


def loop_token() -> Any:
    """The event loop running the current task (an asyncio loop, or trio's token)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
    return None
