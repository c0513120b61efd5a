"""The parent's side of one child process forked by the launcher (a rollout worker or the
evaluator's worker): its socket, its pid and pidfd, and how to stop it.

Messages are small (:mod:`aiocollect._core.wire`); readiness is awaited on the socket and the pidfd
(``anyio.wait_readable``): no thread, no blocking call. Sends go through one outgoing buffer, so
that a message sent without waiting (:meth:`ChildProcess.send_nowait`, from synchronous code)
never lands inside another whose sending is in progress.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import deque
from typing import Any

import anyio

from .._core import heartbeat as _heartbeat
from .._core import wire as _wire
from .._core.errors import BrokenWorkerError, WorkerTimeoutError
from .failures import exited_unexpectedly, hung_error, unpacked_error, worker_error

#: pids of the child processes this process started (the last 10,000 at least; tests check that
#: they are all gone).
started_pids: list[int] = []

#: seconds that stopping a child whose hello was not read yet waits for it (forking takes
#: milliseconds, seconds on a loaded machine), whatever the stop's own timeout.
HELLO_WAIT = 2.0


class ChildProcess:
    """One child process: send and receive messages, learn its pid, stop or kill it, take its
    stack when it is hung (:meth:`hung_error`).

    ``index`` is the worker index reported in errors (``None`` for the evaluator's worker);
    ``who`` names it in messages (``"worker 0"``), ``after_death`` says what happens next when
    it dies (appended to :class:`BrokenWorkerError`'s message).
    """

    def __init__(self, sock: socket.socket, *, index: int | None, who: str, after_death: str = "") -> None:
        self.sock = sock
        sock.setblocking(False)
        self.index = index
        self.who = who
        self.after_death = after_death
        self.reader = _wire.FrameReader()
        self.inbox: deque[Any] = deque()
        self.pid: int | None = None
        self.pidfd: int | None = None
        self.eof = False
        self.received = 0  # bytes read from the socket (progress the watchdog can see)
        self._out = bytearray()  # encoded messages not yet written to the socket
        self._sending = False
        self._lock = anyio.Lock(fast_acquire=True)

    @classmethod
    def spawn(cls, launcher: Any, needs: tuple[str, ...], entry: str, **kwargs: Any) -> "ChildProcess":
        """Ask the launcher for a child running ``entry`` and return our side of its socket (the
        child says hello with its pid: :meth:`handshake`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            child = cls(ours, **kwargs)
            launcher.spawn(theirs.fileno(), needs, entry=entry)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return child

    async def handshake(self) -> None:
        """Wait for the child's hello and take its pid."""
        hello = await self.expect(_wire.Hello)
        self.set_pid(hello.pid)

    @property
    def name(self) -> str:
        return f"{self.who} (pid {self.pid})"

    # -- messages ---------------------------------------------------------------------------------
    async def send(self, msg: Any, fds: tuple[int, ...] = ()) -> None:
        """Send one message (and ``fds`` with it); a child that died (its socket closed under us,
        perhaps before its reader saw the end-of-file) raises :class:`BrokenWorkerError`, never a
        raw OSError."""
        async with self._lock:  # another task writing: our message follows its own, whole
            await self._send(msg, fds)

    async def _send(self, msg: Any, fds: tuple[int, ...]) -> None:
        self._sending = True
        try:
            if fds:
                await self._flush()  # the fds ride with the first byte of their own message
                data = _wire.encode(msg)
                while True:
                    try:
                        sent = socket.send_fds(self.sock, [data[:65536]], list(fds))
                        break
                    except BlockingIOError:
                        await anyio.wait_writable(self.sock)
                # (the rest first: what send_nowait or send_later queued meanwhile follows it)
                self._out[:0] = data[sent:]
            else:
                self._out += _wire.encode(msg)
            await self._flush()
        except (BrokenPipeError, ConnectionResetError):
            self.eof = True
            raise self.broken() from None
        finally:
            self._sending = False

    async def _flush(self) -> None:
        while self._out:
            try:
                del self._out[: self.sock.send(self._out)]
            except BlockingIOError:
                await anyio.wait_writable(self.sock)

    def send_later(self, msg: Any) -> None:
        """Queue one message to go with the next one sent (:meth:`send`, :meth:`send_nowait`):
        for what the child has no use for before then (one write and one wake-up of the child
        fewer)."""
        self._out += _wire.encode(msg)

    def send_nowait(self, msg: Any) -> bool:
        """Queue one message and write what the socket takes now (best effort: the rest goes
        with the next :meth:`send`). False if the child is gone."""
        if self.sock.fileno() < 0:
            return False
        self._out += _wire.encode(msg)
        if self._sending:
            return True  # the task writing now flushes it after its own message
        try:
            del self._out[: self.sock.send(self._out)]
        except BlockingIOError:
            pass
        except OSError:
            return False
        return True

    async def recv(self) -> Any:
        while not self.inbox:
            await anyio.wait_readable(self.sock)
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self.eof = True
                raise self.broken()
            self.received += len(data)
            self.inbox.extend(self.reader.feed(data))
        return self.inbox.popleft()

    def broken(self) -> BrokenWorkerError:
        return exited_unexpectedly(self.name, self.index, self.after_death)

    def error_from(self, msg: Any) -> BaseException:
        """The exception for an :class:`~aiocollect._core.wire.Error` message (or any message with a
        packed ``exception`` and its ``traceback``, as the evaluator's ``Failed``)."""
        return unpacked_error(self.index, self.pid, msg.exception, msg.traceback, self.name)

    async def expect(self, kind: type) -> Any:
        """The next message, which must be a ``kind``; an :class:`~aiocollect._core.wire.Error` raises
        the child's exception."""
        msg = await self.recv()
        if isinstance(msg, _wire.Error):
            raise self.error_from(msg)
        if not isinstance(msg, kind):  # pragma: no cover - protocol error
            raise RuntimeError(f"{self.name}: expected {kind.__name__}, got {msg!r}")
        return msg

    # -- the process ------------------------------------------------------------------------------
    def set_pid(self, pid: int) -> None:
        self.pid = pid
        started_pids.append(pid)
        if len(started_pids) > 20_000:  # a long-lived process: keep the recent ones only
            del started_pids[:10_000]
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # pragma: no cover - no pidfd (old kernel)
            self.pidfd = None

    def exited(self) -> bool:
        if self.pid is None:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # pragma: no cover
            return False
        # a zombie of the launcher's is gone for our purpose; it is reaped at once
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    async def wait_exit(self, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            if self.pidfd is not None:
                await anyio.wait_readable(self.pidfd)
                return True
            while not self.exited():  # pragma: no cover - no pidfd
                await anyio.sleep(0.01)
            return True
        return self.exited()

    def signal(self, sig: int) -> None:
        if self.pid is None:
            return
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:  # pragma: no cover
                os.kill(self.pid, sig)
        except (ProcessLookupError, OSError):
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    async def hung_error(
        self, monitor: _heartbeat.HeartbeatMonitor, what: int, env: int, seconds: float, timeout: float
    ) -> WorkerTimeoutError:
        """The error for this child, found hung (``what``, ``env``, ``seconds``: as
        :meth:`HeartbeatMonitor.stuck <aiocollect._core.heartbeat.HeartbeatMonitor.stuck>` or
        :meth:`ProgressWatch.check <aiocollect._core.heartbeat.ProgressWatch.check>` say), with its
        Python stack: :mod:`faulthandler` in the child writes it into ``monitor``'s dump area on
        ``SIGUSR1``, read here until it stops growing (1 s at most). A stopped process cannot
        write it: the error says it is stopped instead. The caller kills the child."""
        state = _heartbeat.process_state(self.pid)
        letter = None if state is None else state[0]
        stack = ""
        if letter not in _heartbeat.STOPPED:
            self.signal(signal.SIGUSR1)
            with anyio.move_on_after(1.0):
                while True:  # until the dump stops growing
                    await anyio.sleep(0.05)
                    now = monitor.stack_dump()
                    if now and now == stack:
                        break
                    stack = now
        return hung_error(self.name, self.index, (what, env, seconds), timeout, stack, letter)

    def close_fds(self) -> None:
        self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    async def learn_pid(self, timeout: float) -> None:
        """A child whose hello was not read yet (its start-up was cancelled or failed first):
        read it, for up to ``timeout`` seconds, so that the child can be waited for and killed
        rather than left to exit by itself. Until it gets its config the child only waits, so it
        is alive when its pidfd is opened. Nothing is learned if the launcher reported that the
        fork failed, or the socket reached end-of-file (no child, or it is gone already)."""
        if self.pid is not None or self.eof or self.sock.fileno() < 0:
            return
        with anyio.move_on_after(timeout):
            try:
                await self.handshake()
            except Exception:  # noqa: BLE001 - the launcher's error, or end-of-file: no child left
                pass

    async def stop(self, timeout: float) -> None:
        """Ask the child to finish (end-of-file on its socket) and wait up to ``timeout`` seconds
        for it to exit; then kill it. Closes our fds. Call it shielded from cancellation.

        A child whose hello was not read yet is waited for (:meth:`learn_pid`, at least
        ``HELLO_WAIT`` seconds): once it is forked it says hello at once. One the launcher has
        not forked within that time finds its socket closed and exits on its own."""
        try:
            deadline = anyio.current_time() + timeout
            await self.learn_pid(max(timeout, HELLO_WAIT))
            timeout = max(deadline - anyio.current_time(), 0.0)
            if self.pid is not None:
                # end-of-file is the stop request: unlike a message, it cannot land inside a message
                # whose sending was interrupted (cancelled) half-way
                try:
                    self.sock.shutdown(socket.SHUT_WR)
                    asked = True
                except OSError:
                    asked = False
                if self.eof or not asked or not await self.wait_exit(timeout):
                    self.kill()
                    if not await self.wait_exit(5.0):  # pragma: no cover - unkillable (D state)
                        raise RuntimeError(f"{self.name} did not exit after SIGKILL")
        except BaseException:
            # interrupted (a native task.cancel() passes the caller's shield: the event loop is
            # going away): nothing more can be awaited, so kill it now, and close our fds
            # whoever holds this object (it may be detached from its worker seat already)
            self.stop_nowait()
            raise
        finally:
            self.close_fds()

    def stop_nowait(self) -> None:
        """Synchronous last resort (the event loop is going away): kill and wait briefly."""
        self.kill()
        deadline = time.monotonic() + 2.0
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.001)
        self.close_fds()


__all__ = ["ChildProcess", "started_pids", "worker_error"]
