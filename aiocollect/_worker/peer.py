"""The child's side of a child process's socket (a rollout worker's or the evaluator's worker's):
blocking sends and receives, the between-steps check for messages, how an exception is packed
for the parent, and the serve shell every child runs (:func:`serve_peer`).

The parent's side is :class:`aiocollect._backends.child.ChildProcess`. Imported by worker processes:
standard library only (cloudpickle when an exception is packed).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, NoReturn, TypeVar

from .._core import wire as _wire

_TICK = 0.02  # seconds between checks for messages (stop, abort, new weights) between steps


class _Stop(Exception):
    """The parent's side is gone or closed this child's socket: exit."""


class Peer:
    """A child process's end of its socket to the collector (or evaluator): blocking sends and
    receives, and a cheap between-steps check for messages that arrived meanwhile."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._next_tick = 0.0

    def send(self, msg: Any, fds: tuple[int, ...] = ()) -> None:
        try:
            _wire.send_blocking(self.sock, msg, fds)
        except OSError:  # the other side is gone
            raise _Stop from None

    def recv(self) -> tuple[Any, list[int]]:
        try:
            got = _wire.recv_blocking(self.sock)
        except OSError:
            got = None
        if got is None:  # end of file: the other side's process is gone or closed us
            raise _Stop
        return got

    def tick(self) -> None:
        """Between steps, at most every ``_TICK`` seconds: hand each waiting message to
        :meth:`handle`; a closed socket raises ``_Stop``."""
        now = time.monotonic()
        if now < self._next_tick:
            return
        self._next_tick = now + _TICK
        self.drain()

    def drain(self) -> None:
        """Hand each message waiting now to :meth:`handle`; a closed socket raises ``_Stop``."""
        while True:
            try:
                if not _wire.message_waiting(self.sock):
                    return
            except EOFError:
                raise _Stop from None
            self.handle(*self.recv())

    def look(self, seconds: float) -> None:
        """For up to ``seconds``, look for a message without sleeping: returns once one waits (or
        the socket closed: the :meth:`recv` that follows raises ``_Stop``), else when the time is
        up. For a process with a CPU of its own, about to wait: a message read as it comes costs
        no wake-up, on either side."""
        clock, sock, waiting = time.perf_counter, self.sock, _wire.message_waiting
        end = clock() + seconds
        try:
            while not waiting(sock) and clock() < end:
                pass
        except EOFError:
            pass

    def handle(self, msg: Any, fds: list[int]) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def pack_exception(exc: BaseException) -> bytes:
    """``exc`` pickled for the parent (cloudpickle); one that does not survive the round trip
    travels as a ``RuntimeError`` carrying its type and text. Its ``__cause__`` travels with it
    where that pickles too (an exception's pickle leaves it out): our errors raised ``from`` the
    user's keep the original, as they do in the collector's process."""
    import cloudpickle

    cause = exc.__cause__
    if cause is not None:
        try:
            cloudpickle.loads(cloudpickle.dumps(cause))
            vars(exc)["__cause__"] = cause  # (restored by the exception's __setstate__)
        except Exception:  # noqa: BLE001 - the cause stays behind
            pass
    try:
        data = cloudpickle.dumps(exc)
        cloudpickle.loads(data)
        return data
    except Exception:
        return cloudpickle.dumps(RuntimeError(f"{type(exc).__qualname__}: {exc}"))
    finally:
        vars(exc).pop("__cause__", None)


P = TypeVar("P", bound=Peer)


def serve_peer(fd: int, make: Callable[[socket.socket], P], close: Callable[[P], None]) -> NoReturn:
    """Run a child on the socket ``fd``: ``make(sock).run()`` until the parent's side closes
    (``_Stop``), then ``close(peer)``; never returns.

    Any other exception (at set-up or later) is reported to the parent as an
    :class:`~aiocollect._core.wire.Error` (written to stderr if the parent is gone too) and the
    process exits with status 1. :meth:`ChildProcess.expect <aiocollect._backends.child.ChildProcess.expect>` and
    :meth:`ChildProcess.error_from <aiocollect._backends.child.ChildProcess.error_from>` read it."""
    code = 0
    peer = None
    try:
        sock = socket.socket(fileno=fd)
        sock.setblocking(True)
        peer = make(sock)
        try:
            peer.run()  # type: ignore[attr-defined]
        except _Stop:
            pass
        except BaseException as exc:  # noqa: BLE001 - everything is reported to the parent
            code = 1
            tb = traceback.format_exc()
            try:
                peer.send(_wire.Error(pack_exception(exc), tb))
            except BaseException:  # noqa: BLE001
                sys.stderr.write(tb)
    finally:
        try:
            if peer is not None:
                close(peer)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


__all__ = ["Peer", "pack_exception", "serve_peer"]
