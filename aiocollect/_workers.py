"""The collector's side of its workers: process workers (forked by the launcher, talked to over a
socket, slots in shared memory) and the in-process local backend, behind one small interface.

Readiness is awaited on file descriptors (``anyio.wait_readable``): no thread, no blocking call.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from collections import deque
from typing import Any

import anyio
import torch

from . import _shm, _wire
from ._errors import AiocollectError, BrokenWorkerError, WorkerError
from ._layout import Key, SlotLayout
from ._rollout import Rollout, RolloutConfig

#: pids of every worker process started by this process (tests check they are all gone).
started_pids: list[int] = []


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def worker_error(
    worker: int | None, pid: int | None, exc: BaseException | None, tb: str, who: str | None = None
) -> BaseException:
    """The exception the consumer sees for ``exc`` raised in a worker: our own errors (a
    :class:`SpecError` ...) as themselves with the worker traceback as a note, anything else
    wrapped in :class:`WorkerError` with the original as ``__cause__``."""
    if who is None:
        who = "the local worker" if worker is None else f"worker {worker} (pid {pid})"
    if isinstance(exc, AiocollectError):
        _add_note(exc, f"raised in {who}; worker traceback:\n{tb}")
        return exc
    what = f"{type(exc).__name__}: {exc}" if exc is not None else "an error"
    err = WorkerError(
        f"{who} raised {what}\n\nWorker traceback (most recent call last):\n{tb.rstrip()}",
        worker=worker,
        worker_traceback=tb,
    )
    err.__cause__ = exc
    return err


class _Slots:
    """Slot views as torch tensors over one worker's memory (shared or local)."""

    def __init__(self, layout: SlotLayout, buffer: Any) -> None:
        self.layout = layout
        self.np_views = [layout.views(buffer, s) for s in range(layout.num_slots)]
        self.views: list[dict[Key, torch.Tensor]] = [
            {k: torch.from_numpy(v) for k, v in views.items()} for views in self.np_views
        ]


class WorkerHandle:
    """What the producer sees of a worker."""

    index: int
    pid: int | None = None
    slots: _Slots

    def __init__(self, index: int) -> None:
        self.index = index
        self.ready: deque[tuple[int, int, dict]] = deque()  # (slot, worker batch, info)
        self.traces: list[str] = []  # profiler trace files written, not yet announced
        self.credits_sent = 0
        self.alive = True

    async def grant(self, credits: int) -> None:
        raise NotImplementedError

    def profile_off(self) -> None:
        """Drop a profiler recording in progress (no trace is written)."""

    async def release(self, slot: int) -> None:
        raise NotImplementedError


class ProcessWorker(WorkerHandle):
    def __init__(self, index: int, sock: socket.socket) -> None:
        super().__init__(index)
        self.sock = sock
        sock.setblocking(False)
        self.reader = _wire.FrameReader()
        self.inbox: deque[Any] = deque()
        self.pidfd: int | None = None
        self.mm: Any = None
        self.eof = False

    # -- messages -------------------------------------------------------------------------------
    async def send(self, msg: Any, fds: tuple[int, ...] = ()) -> None:
        """Send one message; a worker that died (its socket closed under us, perhaps before its
        reader saw the end-of-file) raises :class:`BrokenWorkerError`, never a raw OSError."""
        try:
            await self._send(msg, fds)
        except (BrokenPipeError, ConnectionResetError):
            self.eof = True
            raise self.broken() from None

    async def _send(self, msg: Any, fds: tuple[int, ...] = ()) -> None:
        data = memoryview(_wire.encode(msg))
        if fds:
            while True:
                try:
                    sent = socket.send_fds(self.sock, [data[:65536]], list(fds))
                    break
                except BlockingIOError:
                    await anyio.wait_writable(self.sock)
            data = data[sent:]
        while data:
            try:
                data = data[self.sock.send(data):]
            except BlockingIOError:
                await anyio.wait_writable(self.sock)

    def send_nowait(self, msg: Any) -> bool:
        """Best effort, for shutdown: False when the message could not be sent at once."""
        try:
            data = _wire.encode(msg)
            return self.sock.send(data) == len(data)
        except OSError:
            return False

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
            self.inbox.extend(self.reader.feed(data))
        return self.inbox.popleft()

    def broken(self) -> BrokenWorkerError:
        return BrokenWorkerError(
            f"worker {self.index} (pid {self.pid}) exited unexpectedly: its control socket closed "
            f"without an error report. It was killed from outside (SIGKILL, the OOM killer) or "
            f"crashed in native code; look at the process's stderr and `dmesg` for the cause",
            worker=self.index,
        )

    def error_from(self, msg: Any) -> BaseException:
        import cloudpickle

        try:
            exc = cloudpickle.loads(msg[1])
        except Exception:  # the exception's class could not be loaded here
            exc = None
        return worker_error(self.index, self.pid, exc, msg[2])

    async def expect(self, op: str) -> Any:
        msg = await self.recv()
        if msg[0] == "error":
            raise self.error_from(msg)
        if msg[0] != op:  # pragma: no cover - protocol error
            raise RuntimeError(f"worker {self.index}: expected {op!r}, got {msg[0]!r}")
        return msg

    # -- producer interface ---------------------------------------------------------------------
    async def grant(self, credits: int) -> None:
        self.credits_sent += credits
        await self.send(("credit", credits))

    async def release(self, slot: int) -> None:
        await self.send(("release", slot))

    def profile_off(self) -> None:
        self.send_nowait(("profile_off",))

    async def give_store(self, store: Any) -> None:
        await self.send(("store", store.layout), (store.fd,))

    def nudge(self) -> None:
        """New weights are published: an idle worker applies them now."""
        self.send_nowait(("weights",))

    async def serve(self, on_ready: Any, on_error: Any, on_applied: Any) -> None:
        """Read the worker's messages until it fails (reported with ``on_error``, after every
        batch it completed before) or the task is cancelled."""
        while True:
            try:
                msg = await self.recv()
            except BrokenWorkerError as exc:
                on_error(exc)
                return
            if msg[0] == "ready":
                self.ready.append((msg[1], msg[2], msg[3]))
                on_ready(self)
            elif msg[0] == "trace":
                self.traces.append(msg[1])
                on_ready(None)
            elif msg[0] == "applied":
                await on_applied(self, msg[1])
            elif msg[0] == "error":
                on_error(self.error_from(msg))
                return

    # -- lifecycle -------------------------------------------------------------------------------
    def set_pid(self, pid: int) -> None:
        self.pid = pid
        started_pids.append(pid)
        try:
            self.pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # pragma: no cover - no pidfd (old kernel, not Linux)
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

    def kill(self) -> None:
        if self.pid is None:
            return
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:  # pragma: no cover
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass

    def close_fds(self) -> None:
        self.sock.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        self.slots = None  # type: ignore[assignment]
        self.mm = None  # unmapped once the views are gone

    async def stop(self, timeout: float) -> None:
        """Ask the worker to close its envs and exit; kill it after ``timeout`` seconds."""
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
                    raise RuntimeError(f"worker {self.index} (pid {self.pid}) did not exit after SIGKILL")
        self.close_fds()

    def stop_nowait(self) -> None:
        """Synchronous last resort (the event loop is going away): kill and wait briefly."""
        self.kill()
        deadline = time.monotonic() + 2.0
        while not self.exited() and time.monotonic() < deadline:
            time.sleep(0.001)
        self.close_fds()


async def start_process_workers(
    configs: list[RolloutConfig], needs: tuple[str, ...], launcher: Any
) -> tuple[list[ProcessWorker], list[dict]]:
    """Fork a worker per config, send each its config, return the workers and their specs."""
    import cloudpickle

    workers: list[ProcessWorker] = []
    try:
        for i, cfg in enumerate(configs):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                workers.append(ProcessWorker(i, ours))
                launcher.spawn(theirs.fileno(), needs)
            finally:
                theirs.close()
        specs: list[dict] = [{}] * len(workers)

        async def handshake(w: ProcessWorker, cfg: RolloutConfig) -> None:
            hello = await w.expect("hello")
            w.set_pid(hello[1])
            await w.send(("config", cloudpickle.dumps(cfg)))
            specs[w.index] = (await w.expect("spec"))[1]

        async with anyio.create_task_group() as tg:
            for w, cfg in zip(workers, configs):
                tg.start_soon(handshake, w, cfg)
        return workers, specs
    except BaseException:
        with anyio.CancelScope(shield=True):
            for w in workers:
                await w.stop(0)
        raise


async def setup_process_slots(workers: list[ProcessWorker], layout: SlotLayout, store: Any = None) -> None:
    """Give each worker its slots (and the shared weight store, if the policy has weights)."""
    for w in workers:
        fd, mm = _shm.allocate(layout.nbytes, f"aiocollect-{os.getpid()}-w{w.index}")
        fds = (fd,) if store is None else (fd, store.fd)
        try:
            await w.send(("layout", layout, None if store is None else store.layout), fds)
        finally:
            os.close(fd)
        w.mm = mm
        w.slots = _Slots(layout, mm)


class LocalWorker(WorkerHandle):
    """The local backend: the rollout runs in the collector's process and event loop, yielding to
    the loop every few milliseconds."""

    def __init__(self, cfg: RolloutConfig, policy: Any) -> None:
        super().__init__(0)
        self.cfg = cfg
        self.credits = 0
        self.free: deque[int] = deque()
        self.wakeup = anyio.Event()
        self.recorder: Any = None
        try:
            self.rollout = Rollout(cfg, local_policy=policy)
        except BaseException as exc:
            err = _local_error(exc)
            raise err

    def setup(self, layout: SlotLayout) -> None:
        self.buffer = bytearray(layout.nbytes)
        self.slots = _Slots(layout, self.buffer)
        self.free.extend(range(layout.num_slots))

    def _wake(self) -> None:
        self.wakeup.set()

    def profile_off(self) -> None:
        if self.recorder is not None:
            self.recorder.abort()
            self.recorder.done = True

    async def grant(self, credits: int) -> None:
        self.credits_sent += credits
        self.credits += credits
        self._wake()

    async def release(self, slot: int) -> None:
        self.free.append(slot)
        self._wake()

    def nudge(self) -> None:
        self._wake()

    async def give_store(self, store: Any) -> None:
        self.rollout.add_store(store)

    async def _apply_weights(self, on_applied: Any) -> None:
        version = self.rollout.apply_weights()
        if version is not None:
            await on_applied(self, version)

    async def serve(self, on_ready: Any, on_error: Any, on_applied: Any) -> None:
        batch = self.cfg.start_batch
        if self.cfg.profile is not None:
            from ._profiling import Recorder

            self.recorder = Recorder(*self.cfg.profile)
        n = 0
        while True:
            while not (self.credits > 0 and self.free):
                self.wakeup = anyio.Event()
                await self._apply_weights(on_applied)
                await self.wakeup.wait()
            await self._apply_weights(on_applied)  # a batch boundary: the only place weights change
            slot = self.free.popleft()
            self.credits -= 1
            rollout = self.rollout
            recorder = self.recorder
            if recorder is not None:
                recorder.before(n)
            deadline = time.perf_counter() + 0.004
            try:
                for _ in rollout.fill(self.slots.np_views[slot], rollout.version):
                    if time.perf_counter() > deadline:
                        await anyio.sleep(0)
                        deadline = time.perf_counter() + 0.004
            except Exception as exc:
                on_error(_local_error(exc))
                return
            self.ready.append((slot, batch, rollout.batch_info()))
            batch += 1
            on_ready(self)
            if recorder is not None and (path := recorder.after(n)) is not None:
                self.traces.append(path)
            n += 1

    async def stop(self, timeout: float) -> None:
        self.stop_nowait()

    def stop_nowait(self) -> None:
        if self.recorder is not None:
            self.recorder.abort()
        self.rollout.close()


def _local_error(exc: BaseException) -> BaseException:
    if not isinstance(exc, Exception):
        return exc
    return worker_error(None, None, exc, "".join(traceback.format_exception(exc)))


__all__ = [
    "LocalWorker",
    "ProcessWorker",
    "WorkerHandle",
    "setup_process_slots",
    "start_process_workers",
    "started_pids",
    "worker_error",
]
