"""The parent's side of the evaluator's worker process: start it (:meth:`EvalProcess.open`), send
it an evaluation and read the answer (:meth:`EvalProcess.evaluate`), notice its death at once (one
task reads its socket: :meth:`EvalProcess.read`), declare it hung (:meth:`EvalProcess.check_hung`)
and stop it. The messages are those of :mod:`aiocollect._core.eval_wire`; the worker's side is
:mod:`aiocollect._worker.eval_main`.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from typing import Any, Callable

import anyio

from .._core import heartbeat as _heartbeat
from .._core import shm as _shm
from .child import HELLO_WAIT, ChildProcess
from .._core.errors import BrokenWorkerError, WorkerError
from .._core.eval_wire import Abort, Aborted, Answer, Configure, Error, Evaluate, Failed, Ready, Result, is_fatal
from .._core.wire import EnvCall, EnvCallDone
from .failures import stop_on_failure, unpacked_error
from .launcher import get_launcher

ENTRY = "aiocollect._worker.eval_main:serve"


class EvalProcess(ChildProcess):
    """The evaluator's worker process, whose messages are read by one task (:meth:`read`) so
    that its death is noticed at once, even between evaluations; with a ``step_timeout``, its
    heartbeat (:meth:`watch`)."""

    def __init__(self, sock: socket.socket, *, after_death: str, **_: Any) -> None:
        super().__init__(sock, index=None, who="the evaluator's worker", after_death=after_death)
        self.replies: deque[Any] = deque()
        self.wakeup: anyio.Event | None = None
        self.dead: WorkerError | None = None  # its socket reached end-of-file (the hang, if it was hung)
        self.failed = False  # it reported a fatal error (and exits)
        self.hung: WorkerError | None = None  # set by the watchdog before it kills the process
        self.scope: anyio.CancelScope | None = None
        self.reader_done: anyio.Event | None = None
        self.heartbeat_fd: int | None = None
        self.monitor: _heartbeat.HeartbeatMonitor | None = None
        self.progress = _heartbeat.ProgressWatch()  # hangs the heartbeat cannot show (a stopped process)
        self.waiting: int | None = None  # the evaluation sent and not answered yet

    @classmethod
    async def open(
        cls,
        tg: Any,
        *,
        needs: tuple[str, ...],
        worker_config: bytes,
        watch: bool,
        after_death: str,
        on_death: Callable[["EvalProcess", WorkerError], None],
    ) -> "EvalProcess":
        """A new worker, configured and ready, whose reader runs in ``tg`` (``on_death`` is called
        when it dies without reporting an error). ``watch``: keep a heartbeat (a ``step_timeout``).
        Raises what the worker raised while starting; it is gone then."""
        proc = cls.spawn(get_launcher(), needs, ENTRY, after_death=after_death)
        assert isinstance(proc, EvalProcess)
        async with stop_on_failure([proc]):
            fds = (proc.watch(),) if watch else ()
            await proc.handshake()
            await proc.send(Configure(worker_config), fds)
            await proc.expect(Ready)  # (an Error raises the worker's exception)
            await tg.start(proc.read, on_death)
        return proc

    def watch(self) -> int:
        """Allocate the heartbeat (a small memfd of its own); return the fd to send."""
        fd, mm = _shm.allocate(_heartbeat.NBYTES, f"aiocollect-{os.getpid()}-eval")
        self.heartbeat_fd, self.monitor = fd, _heartbeat.HeartbeatMonitor(mm, 0)
        return fd

    def close_fds(self) -> None:
        super().close_fds()
        if self.heartbeat_fd is not None:
            os.close(self.heartbeat_fd)
            self.heartbeat_fd = None
        # the mapping goes with the monitor (a watchdog reading a stack dump may still hold it)
        self.monitor = None

    async def send(self, msg: Any, fds: tuple[int, ...] = ()) -> None:
        try:
            await super().send(msg, fds)
        except OSError:  # broken pipe: the worker is gone
            raise (self.dead or self.broken()) from None

    # -- answers --------------------------------------------------------------------------------
    async def read(self, on_death: Callable[["EvalProcess", WorkerError], None], *, task_status: Any) -> None:
        self.reader_done = anyio.Event()
        try:
            with anyio.CancelScope() as scope:
                self.scope = scope
                task_status.started()
                while True:
                    try:
                        msg = await self.recv()
                    except BrokenWorkerError as exc:
                        self.dead = self.hung or exc
                        self._wake()
                        if not self.failed:
                            on_death(self, self.dead)
                        return
                    if is_fatal(msg):
                        self.failed = True
                    self.replies.append(msg)
                    self._wake()
        finally:
            self.reader_done.set()

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()

    async def reply(self) -> Any:
        while not self.replies:
            if self.dead is not None:
                raise self.dead
            self.wakeup = anyio.Event()
            await self.wakeup.wait()
        return self.replies.popleft()

    async def evaluate(self, req: Any, weights: Any, episodes: int) -> Answer:
        """Send evaluation ``req`` (its ``id``; ``req.sent`` is set once the whole request is in
        the socket, and an ``req.abandoned`` one is aborted at once); return its answer
        (:class:`Result`, :class:`Failed`, :class:`Aborted` or the fatal :class:`Error`). Raises the
        worker's death (or hang) if it comes first."""
        req.sent = False
        self.waiting = req.id
        try:
            await self.send(Evaluate(req.id, weights, episodes, req.step))
            req.sent = True
            if req.abandoned:
                await self.send(Abort(req.id))
            while True:
                msg = await self.reply()
                if is_fatal(msg) or (isinstance(msg, (Result, Failed, Aborted)) and msg.id == req.id):
                    return msg
                # else the answer to an abort that arrived after its evaluation finished
        finally:
            self.waiting = None

    async def env_call(self, call: EnvCall) -> list:
        """Send the env call ``call`` (between evaluations: the evaluator sends none during one);
        its results, one per env row, once the worker applied it. Raises what the env raised as
        the worker's error (the worker goes on), and the worker's death (or fatal error) if it
        comes first."""
        await self.send(call)
        while True:
            msg = await self.reply()
            if is_fatal(msg):
                raise self.error_from(msg)
            if isinstance(msg, EnvCallDone) and msg.id == call.id:
                break
        if msg.error is not None:
            raise unpacked_error(None, self.pid, msg.result, msg.error, self.name)
        import cloudpickle

        return cloudpickle.loads(msg.result)

    def abort_nowait(self, rid: int) -> None:
        """Ask the worker to stop evaluation ``rid`` (from synchronous code: a cancelled caller)."""
        self.send_nowait(Abort(rid))

    def failure(self, msg: Failed | Error) -> BaseException:
        """The exception for a :class:`Failed` evaluation or the fatal :class:`Error` (both carry
        the packed exception and its traceback)."""
        return self.error_from(msg)

    # -- hangs and stopping ---------------------------------------------------------------------
    async def check_hung(self, timeout: float) -> None:
        """If the worker has spent longer than ``timeout`` in one call, or, from what the
        evaluator sees alone, is stopped or has not started the evaluation it was sent
        (:class:`~aiocollect._core.heartbeat.ProgressWatch`), take its stack, record the
        :class:`WorkerTimeoutError` in :attr:`hung` and kill it."""
        monitor = self.monitor
        if monitor is None:
            return
        stuck = monitor.stuck(timeout) or self.progress.check(self.pid, timeout, self.waiting, self.received, monitor)
        if stuck is None:
            return
        error = await self.hung_error(monitor, *stuck, timeout)  # type: ignore[arg-type]
        if self.dead is None:  # (else it died meanwhile, of something else)
            self.hung = error
            self.kill()

    async def stop(self, timeout: float) -> None:
        """Close our end for writing (the worker exits at end-of-file, even mid-message); kill it
        after ``timeout`` seconds."""
        if self.scope is not None:
            self.scope.cancel()
            assert self.reader_done is not None
            await self.reader_done.wait()  # no task may wait on the socket when it is closed
        await self.learn_pid(max(timeout, HELLO_WAIT))  # (its start-up was cancelled or failed)
        if self.pid is not None:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            if self.dead is None and not await self.wait_exit(timeout):
                self.kill()
            if not await self.wait_exit(5.0):  # pragma: no cover - unkillable (D state)
                self.kill()
                raise RuntimeError(f"the evaluator's worker (pid {self.pid}) did not exit after SIGKILL")
        self.close_fds()


__all__ = ["ENTRY", "EvalProcess"]
