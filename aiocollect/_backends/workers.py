"""The collector's side of its rollout workers: process workers (forked by the launcher, talked to
over a socket, slots in shared memory) and the in-process local backend, behind one interface.

A handle stands for one worker *seat* (an index) for the whole run: when a worker is replaced
after a failure, the handle keeps its batches already completed, its slots and its counters, and
only the process behind it changes (:meth:`WorkerHandle.replace`).
"""

from __future__ import annotations

import abc
import functools
import os
import time
import traceback
from collections import deque
from typing import Any, Awaitable, Callable, TypeVar, cast

import anyio

from .._core import heartbeat as _heartbeat
from .._core import shm as _shm
from .child import ChildProcess, started_pids
from .failures import changed_spec, stop_on_failure, unpacked_error, worker_error
from .seat import SlotViews
from .._core.layout import SlotLayout
from .._worker.rollout import Rollout, RolloutConfig
from .._worker.vector import open_rollout
from .._core.wire import (
    Applied, BatchInfo, Config, Credit, EnvCall, EnvCallDone, Error, Profile, ProfileOff, Ready, Release, Slots, Spec, Store, Trace,
    WeightsPublished,
)

_ENTRY = "aiocollect._worker.main:serve"

OnReady = Callable[[Any], None]
OnApplied = Callable[[Any, int], Awaitable[None]]


_Verb = TypeVar("_Verb", bound=Callable[..., Awaitable[Any]])
_VerbNowait = TypeVar("_VerbNowait", bound=Callable[..., None])


def _at_home(method: _Verb) -> _Verb:
    """A verb the caller's loop may call while the seat is served by background collection's
    own loop (``update_weights`` nudging a worker, giving it a weight store): run there, so that
    one loop alone talks to the worker."""

    @functools.wraps(method)
    async def wrapper(self: "WorkerHandle", *args: Any) -> Any:
        home = self.home
        if home is not None and not home.on_thread():
            return await home.to_thread(method, self, *args)
        return await method(self, *args)

    return cast(_Verb, wrapper)


def _at_home_nowait(method: _VerbNowait) -> _VerbNowait:
    """As :func:`_at_home`, for a verb that does not wait (``enable_profile``): posted there."""

    @functools.wraps(method)
    def wrapper(self: "WorkerHandle", *args: Any) -> None:
        home = self.home
        if home is not None and not home.on_thread():
            home.post_thread(functools.partial(method, self, *args))
            return
        method(self, *args)

    return cast(_VerbNowait, wrapper)


class CallWaiter:
    """An :class:`EnvCall` sent to a worker process, waiting for its answer (re-sent to a
    replacement if the worker fails first)."""

    __slots__ = ("call", "done", "answer", "error")

    def __init__(self, call: EnvCall) -> None:
        self.call = call
        self.done = anyio.Event()
        self.answer: EnvCallDone | None = None
        self.error: BaseException | None = None

    def finish(self, answer: EnvCallDone | None = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.answer, self.error = answer, error
            self.done.set()

    def results(self, remote_error: Callable[[bytes, str], BaseException]) -> list:
        """Once :attr:`done`: the call's results, one per row; or raise the worker's failure, or
        what the env raised (``remote_error(exception, traceback)`` makes it)."""
        if self.error is not None:
            raise self.error
        answer = self.answer
        assert answer is not None
        if answer.error is not None:
            raise remote_error(answer.result, answer.error)
        import cloudpickle

        return cloudpickle.loads(answer.result)


class WorkerHandle(abc.ABC):
    """What the producer sees of a rollout worker seat: the bookkeeping every kind shares (its
    batches completed, the slots it holds, its counters); each kind of worker implements the
    verbs of :class:`~aiocollect._backends.seat.RolloutSeat` on it.

    ``ready`` holds ``(slot, BatchInfo)`` for batches completed and not yet taken; ``held`` the slots
    taken by the producer and not yet released; ``completed`` counts the batches the seat's
    processes reported (credits of a replacement start from it).
    """

    index: int
    slots: SlotViews
    hung: BaseException | None = None  # set by the watchdog before it kills the worker
    # background collection: the collector's own loop serves this seat (see offloop.py), and the
    # kinds of seat whose verbs the caller's loop reaches through it (_at_home)
    home: Any = None
    can_serve_off_loop = False
    parked = False  # serve() waits for the worker's next report, with nothing half-done (safe to cancel)
    reaches_envs = False  # env_call() works (Collector.call, get_attr, set_attr ...)
    server_link: Any = None  # inference="server": its link to the server (the process backend's seats use it)

    def __init__(self, index: int) -> None:
        self.index = index
        self.ready: deque[tuple[int, BatchInfo]] = deque()
        self.held: set[int] = set()
        self.traces: list[str] = []  # profiler trace files written, not yet announced
        self.credits_sent = 0
        self.completed = 0
        self.counters: list[int] | None = None  # trajectory numbers at the end of the last batch
        self.restarts = 0
        self.calls: dict[int, CallWaiter] = {}  # env calls sent, by id, not answered yet (the seats that reach envs)
        self.slots = SlotViews.unset()  # (shared with it once its spec is known)

    @property
    def pid(self) -> int | None:
        return None

    @property
    def calls_pending(self) -> bool:
        """Env calls were sent to it and not answered yet."""
        return bool(self.calls)

    def take(self) -> tuple[int, BatchInfo]:
        """The oldest completed batch: ``(slot, info)``; the slot is held until released."""
        slot, info = self.ready.popleft()
        self.held.add(slot)
        return slot, info

    def free_slots(self) -> list[int]:
        """Slots a replacement may fill: neither waiting for delivery nor held."""
        busy = self.held | {slot for slot, _ in self.ready}
        return [s for s in range(self.slots.layout.num_slots) if s not in busy]

    def _completed(self, slot: int, info: BatchInfo) -> None:
        self.ready.append((slot, info))
        self.completed += 1
        self.counters = info.traj_counters

    @abc.abstractmethod
    async def grant(self, credits: int) -> None:
        """Let the worker fill ``credits`` more batches."""

    @abc.abstractmethod
    async def release(self, slot: int) -> None:
        """The consumer is done with ``slot``: the worker may fill it again."""

    async def nudge(self) -> None:
        """New weights are published: an idle worker applies them now."""

    async def give_store(self, store: Any) -> None:
        """Read weights from ``store`` (a seat whose policy has no weights has nothing to read)."""

    def profile(self, settings: dict, path: str) -> None:
        """Profile this worker's next rollouts."""

    async def env_call(self, call: EnvCall) -> list:
        """Apply ``call`` to the worker's envs between two env steps; its results (one per row)."""
        raise NotImplementedError(f"{type(self).__name__} cannot reach into its envs")

    def fail_calls(self, error: BaseException) -> None:
        """The worker failed for good (or is stopped): the env calls waiting on it raise ``error``."""

    def profile_off(self) -> None:
        """Drop a profiler recording in progress (no trace is written)."""

    @abc.abstractmethod
    async def serve(self, on_ready: OnReady, on_applied: OnApplied) -> BaseException:
        """Handle the worker's reports until it fails; return its error."""

    @abc.abstractmethod
    async def replace(self, cfg: RolloutConfig) -> None:
        """Replace the failed worker by a new one built from ``cfg`` (same spaces, same slots)."""

    def stuck(self, timeout: float) -> tuple[int, int, float] | None:
        """``(what, env, seconds)`` if the worker is busy with one call for over ``timeout``;
        ``None`` here: a seat with no watchdog is never hung. A seat that can report a hang also
        has ``declare_hung`` (:class:`~aiocollect._backends.seat.WatchedSeat`), which the watchdog
        calls only after this reported one."""
        return None

    @abc.abstractmethod
    async def stop(self, timeout: float) -> None:
        """Ask the worker to close its envs and exit; kill it after ``timeout`` seconds."""

    @abc.abstractmethod
    def stop_nowait(self) -> None:
        """Kill the worker now (the event loop is going away: nothing may be awaited)."""


class ProcessWorker(WorkerHandle):
    """A worker process (replaced by a new one after a failure, under the same handle)."""

    can_serve_off_loop = True
    reaches_envs = True

    def __init__(self, index: int, launcher: Any, needs: tuple[str, ...]) -> None:
        super().__init__(index)
        self.launcher = launcher
        self.needs = needs
        self.proc: ChildProcess | None = None
        self.spec: dict | None = None
        self.fd: int | None = None  # the slots' memfd, kept for replacements
        self.mm: Any = None
        self.monitor: _heartbeat.HeartbeatMonitor | None = None
        self.weight_layout: Any = None
        self.store_fds: tuple[int, ...] = ()  # the weight stores' memfds (kept by WeightSync)
        self.watch = False
        self.server_link: tuple[Any, tuple[int, ...]] | None = None  # inference="server": layout, fds
        self.progress = _heartbeat.ProgressWatch()  # hangs the heartbeat cannot show (a stopped process)
        self.own_store: Any = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    # -- start-up -------------------------------------------------------------------------------
    def spawn(self) -> ChildProcess:
        return ChildProcess.spawn(self.launcher, self.needs, _ENTRY, index=self.index, who=f"worker {self.index}")

    async def configure(self, proc: ChildProcess, cfg: RolloutConfig) -> dict:
        """Send the config to a new process; return the spec it reports."""
        from .._core import pickling as _pickling

        await proc.handshake()
        await proc.send(Config(_pickling.dumps(cfg)))
        return (await proc.expect(Spec)).spec

    def attach(self, layout: SlotLayout, fd: int, mm: Any) -> None:
        """Take this seat's rows of the slots' segment (``fd``: a descriptor of its own)."""
        self.fd, self.mm = fd, mm
        self.slots = SlotViews(layout, mm, self.index)
        self.monitor = _heartbeat.HeartbeatMonitor(mm, _heartbeat.heartbeat_offset(layout, self.index))

    async def give_slots(self, free: list[int]) -> None:
        assert self.proc is not None and self.fd is not None
        server, server_fds = self.server_link if self.server_link is not None else (None, ())
        await self.proc.send(
            Slots(self.slots.layout, self.weight_layout, free, self.watch, server), (self.fd, *self.store_fds, *server_fds)
        )

    # -- producer interface ---------------------------------------------------------------------
    async def grant(self, credits: int) -> None:
        if self.proc is None:
            return  # being replaced: the replacement gets its credits when it is up
        self.credits_sent += credits
        await self.proc.send(Credit(credits))

    async def release(self, slot: int) -> None:
        self.held.discard(slot)
        if self.proc is None:  # (a replacement gets it with its free slots)
            return
        if self.credits_sent <= self.completed:
            # owed no batch (``delivery="sync"`` between batches): a free slot is of no use to it
            # before its next credit, so it goes with that (one write and one wake-up fewer)
            self.proc.send_later(Release(slot))
        else:
            await self.proc.send(Release(slot))

    @_at_home
    async def nudge(self) -> None:
        if self.proc is not None:
            await self.proc.send(WeightsPublished())

    @_at_home
    async def give_store(self, store: Any) -> None:
        """A weight store of this worker's own (kept for a replacement)."""
        self.own_store = store
        if self.proc is not None:
            await self.proc.send(Store(store.layout), (store.fd,))

    @_at_home_nowait
    def profile(self, settings: dict, path: str) -> None:
        if self.proc is not None:
            self.proc.send_nowait(Profile(settings, path))

    @_at_home_nowait
    def profile_off(self) -> None:
        if self.proc is not None:
            self.proc.send_nowait(ProfileOff())

    @_at_home
    async def env_call(self, call: EnvCall) -> list:
        """Send ``call``; its results once the worker applied it between two env steps. A worker
        that fails first is replaced (``on_worker_failure="restart"``) and its replacement gets
        the call; else it raises the worker's error."""
        waiter = self.calls[call.id] = CallWaiter(call)
        try:
            if self.proc is not None:  # (else being replaced: the replacement gets it when it is up)
                try:
                    await self.proc.send(call)
                except Exception:  # noqa: BLE001 - its failure is serve()'s to report
                    pass
            await waiter.done.wait()
        finally:
            self.calls.pop(call.id, None)
        return waiter.results(
            lambda exc, tb: unpacked_error(self.index, self.pid, exc, tb, f"worker {self.index} (pid {self.pid})"))

    def fail_calls(self, error: BaseException) -> None:
        for waiter in list(self.calls.values()):
            waiter.finish(error=error)

    async def serve(self, on_ready: OnReady, on_applied: OnApplied) -> BaseException:
        proc = self.proc
        assert proc is not None
        while True:
            self.parked = True
            try:
                msg = await proc.recv()  # (cancelled, it loses nothing: what it read waits in its inbox)
            except Exception as exc:  # noqa: BLE001 - its end-of-file (BrokenWorkerError)
                return self.hung or exc
            finally:
                self.parked = False
            match msg:
                case Ready(slot, _, info):
                    self._completed(slot, info)
                    on_ready(self)
                case Applied(version, _):
                    await on_applied(self, version)
                case Trace(path):
                    self.traces.append(path)
                    on_ready(None)
                case EnvCallDone(call_id):
                    waiter = self.calls.get(call_id)
                    if waiter is not None:
                        waiter.finish(msg)
                case Error():
                    return self.hung or proc.error_from(msg)
                case _:  # pragma: no cover - protocol error
                    raise RuntimeError(f"{proc.name}: unexpected message {msg!r}")

    # -- hangs ----------------------------------------------------------------------------------
    def stuck(self, timeout: float) -> tuple[int, int, float] | None:
        """Busy with one call for too long (its heartbeat), or, from what the collector sees
        alone, stopped, or idle with work granted (credits and a free slot) and no progress."""
        proc, monitor = self.proc, self.monitor
        if proc is None or monitor is None or self.hung is not None:
            return None
        found = monitor.stuck(timeout)
        if found is None:
            owed = self.credits_sent > self.completed and bool(self.free_slots())
            found = self.progress.check(proc.pid, timeout, True if owed else None, proc.received, monitor)
        return found

    async def declare_hung(self, what: int, env: int, seconds: float, timeout: float) -> None:
        """The worker has been in one call for ``seconds``: take its stack, kill it; its
        :meth:`serve` then returns a :class:`WorkerTimeoutError`."""
        proc, monitor = self.proc, self.monitor
        assert proc is not None and monitor is not None
        self.hung = await proc.hung_error(monitor, what, env, seconds, timeout)
        proc.kill()  # (no await since the line above: serve() sees the end-of-file after self.hung is set)

    # -- replacement and shutdown ---------------------------------------------------------------
    async def replace(self, cfg: RolloutConfig) -> None:
        old, self.proc = self.proc, None
        if old is not None:
            with anyio.CancelScope(shield=True):
                await old.stop(0)  # killed now: it must never write into the slots again
        self.hung = None
        self.restarts += 1
        proc = self.spawn()
        async with stop_on_failure([proc], forget=self._forget_process):
            # not installed until configured: a credit or release must not reach it before its config
            spec = await self.configure(proc, cfg)
            if spec != self.spec:
                raise changed_spec(self.index, spec, self.spec)
            assert self.monitor is not None
            self.monitor.reset()
            self.progress.reset()
            self.proc = proc
            self.credits_sent = self.completed
            await self.give_slots(self.free_slots())  # (slots released meanwhile are free now)
            if self.own_store is not None:
                await self.give_store(self.own_store)
            for waiter in list(self.calls.values()):  # calls the failed worker did not answer
                if not waiter.done.is_set():
                    await proc.send(waiter.call)

    def _forget_process(self) -> None:
        self.proc = None

    async def stop(self, timeout: float) -> None:
        """Ask the worker to close its envs and exit; kill it after ``timeout`` seconds."""
        proc, self.proc = self.proc, None
        try:
            if proc is not None:
                await proc.stop(timeout)
        finally:
            self._free()

    def stop_nowait(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.stop_nowait()
        self._free()

    def _free(self) -> None:
        from .._core.errors import CollectorClosedError

        self.fail_calls(CollectorClosedError(f"worker {self.index} was stopped before it applied the env call"))
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.monitor is not None:
            self.monitor.release()
            self.monitor = None
        self.slots = SlotViews.unset()
        self.mm = None  # unmapped once the views are gone


async def start_process_workers(
    configs: list[RolloutConfig], needs: tuple[str, ...], launcher: Any, shutdown_timeout: float = 0.0
) -> tuple[list[ProcessWorker], list[dict]]:
    """Fork a worker per config, send each its config, return the workers and their specs.

    Cancelled, or when a worker fails to start, every worker forked is gone before this raises:
    one that built its envs gets ``shutdown_timeout`` seconds to close them, one still building
    them (an env factory that may never return) ``STARTING_GRACE`` at most, then is killed (those
    whose hello was not read yet are waited for too)."""
    workers: list[ProcessWorker] = []
    async with stop_on_failure(workers, shutdown_timeout, started=lambda w: w.spec is not None):
        for i in range(len(configs)):
            w = ProcessWorker(i, launcher, needs)
            workers.append(w)
            w.proc = w.spawn()

        async def handshake(w: ProcessWorker, cfg: RolloutConfig) -> None:
            w.spec = await w.configure(w.proc, cfg)  # type: ignore[arg-type]

        async with anyio.create_task_group() as tg:
            for w, cfg in zip(workers, configs):
                tg.start_soon(handshake, w, cfg)
        return workers, [w.spec for w in workers]  # type: ignore[misc]


async def setup_process_slots(
    workers: list[ProcessWorker], layout: SlotLayout, store_fds: dict[int, tuple[int, ...]], weight_layout: Any,
    watch: bool,
) -> tuple[int, Any]:
    """Give each worker its slots (and the shared weight store, if the policy has weights).

    Returns the segment (descriptor, mapping) that holds every worker's slots; the caller owns the
    descriptor (each worker has a duplicate of its own)."""
    fd, mm = allocate_segment(layout, f"aiocollect-{os.getpid()}-slots")
    try:
        for w in workers:
            w.attach(layout, os.dup(fd), mm)
            w.weight_layout = weight_layout
            w.store_fds = store_fds.get(w.index, ())
            w.watch = watch
            await w.give_slots(list(range(layout.num_slots)))
    except BaseException:
        os.close(fd)  # (each worker closes its own duplicate when it stops)
        raise
    return fd, mm


def allocate_segment(layout: SlotLayout, name: str) -> tuple[int, Any]:
    """The shared-memory segment of a run's slots, with a heartbeat area per worker after them."""
    return _shm.allocate(layout.nbytes + layout.workers * _heartbeat.NBYTES, name)


class LoopSeat(WorkerHandle):
    """A seat whose credits and free slots are kept in the collector's process, by a coroutine on
    its loop (the local backend's rollout, a Ray actor's caller), rather than by a worker process."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.credits = 0
        self.free: deque[int] = deque()
        self.wakeup = anyio.Event()

    def _wake(self) -> None:
        self.wakeup.set()

    async def grant(self, credits: int) -> None:
        self.credits_sent += credits
        self.credits += credits
        self._wake()

    async def release(self, slot: int) -> None:
        self.held.discard(slot)
        if slot not in self.free:
            self.free.append(slot)
        self._wake()


class LocalWorker(LoopSeat):
    """The local backend: the rollout runs in the collector's process and event loop, yielding to
    the loop every few milliseconds."""

    can_serve_off_loop = True
    reaches_envs = True

    def __init__(self, cfg: RolloutConfig, policy: Any) -> None:
        super().__init__(0)
        self.cfg = cfg
        self.policy = policy
        self.recorder: Any = None
        self.stores: list[Any] = []
        self.rollout = self._build(cfg)

    def _build(self, cfg: RolloutConfig) -> Rollout:
        try:
            rollout = open_rollout(cfg, local_policy=self.policy)
            assert isinstance(rollout, Rollout)  # (no worker_groups without worker processes)
            return rollout
        except BaseException as exc:
            err = _local_error(exc)
            raise err

    def setup(self, layout: SlotLayout) -> tuple[int, Any]:
        """Allocate the slots (a memfd like the process backend's, so that zero-copy batches behave
        alike); returns the segment, owned by the caller."""
        fd, self.buffer = allocate_segment(layout, f"aiocollect-{os.getpid()}-local")
        self.slots = SlotViews(layout, self.buffer, 0)
        self.free.extend(range(layout.num_slots))
        return fd, self.buffer

    @_at_home_nowait
    def profile(self, settings: dict, path: str) -> None:
        from .._core.profiling import Recorder

        if self.recorder is not None:
            self.recorder.abort()
        self.recorder = Recorder(settings, path)
        self.profiled_from = self.rollout.batches

    @_at_home_nowait
    def profile_off(self) -> None:
        if self.recorder is not None:
            self.recorder.abort()
            self.recorder = None

    @_at_home
    async def nudge(self) -> None:
        self._wake()

    @_at_home
    async def give_store(self, store: Any) -> None:
        self.stores.append(store)
        self.rollout.add_store(store)

    @_at_home
    async def env_call(self, call: EnvCall) -> list:
        """Applied at once: the rollout runs on this loop, and yields to it only between env steps."""
        from .._worker.env_calls import apply

        try:
            return apply(self.rollout, call)
        except Exception as exc:
            raise _local_error(exc)

    async def _apply_weights(self, on_applied: OnApplied) -> None:
        version = self.rollout.apply_weights()
        if version is not None:
            await on_applied(self, version)

    async def serve(self, on_ready: OnReady, on_applied: OnApplied) -> BaseException:
        if self.cfg.profile is not None and self.rollout.batches == 0:
            self.profile(*self.cfg.profile)
        while True:
            await self._apply_weights(on_applied)  # a batch boundary: the only place weights change
            while not (self.credits > 0 and self.free):
                self.wakeup = anyio.Event()
                await self._apply_weights(on_applied)
                self.parked = True
                try:
                    await self.wakeup.wait()
                finally:
                    self.parked = False
            slot = self.free.popleft()
            self.credits -= 1
            rollout = self.rollout
            recorder = self.recorder
            n = rollout.batches - self.profiled_from
            if recorder is not None:
                recorder.before(n)
            deadline = time.perf_counter() + 0.004
            try:
                for _ in rollout.fill(self.slots.np_views[slot], rollout.version):
                    if time.perf_counter() > deadline:
                        await anyio.sleep(0)
                        deadline = time.perf_counter() + 0.004
            except Exception as exc:
                self.free.appendleft(slot)
                return _local_error(exc)
            self._completed(slot, rollout.batch_info())
            on_ready(self)
            if recorder is not None and (path := recorder.after(n)) is not None:
                self.recorder = None
                self.traces.append(path)

    async def replace(self, cfg: RolloutConfig) -> None:
        self.rollout.close()
        self.restarts += 1
        self.cfg = cfg
        self.rollout = self._build(cfg)
        for store in self.stores:
            self.rollout.add_store(store)
        self.credits = 0
        self.credits_sent = self.completed
        self.free = deque(self.free_slots())

    async def stop(self, timeout: float) -> None:
        self.stop_nowait()

    def stop_nowait(self) -> None:
        if self.recorder is not None:
            self.recorder.abort()
            self.recorder = None
        self.rollout.close()
        self.slots = SlotViews.unset()
        self.buffer = None  # unmapped once the views are gone

    profiled_from = 0


def _local_error(exc: BaseException) -> BaseException:
    if not isinstance(exc, Exception):
        return exc
    text = "".join(traceback.format_exception(exc))
    # the rollout's frames hold views on the slots: the error (kept for the consumer) must not
    # keep the shared memory mapped
    traceback.clear_frames(exc.__traceback__)
    return worker_error(None, None, exc, text)


__all__ = [
    "LocalWorker",
    "ProcessWorker",
    "WorkerHandle",
    "setup_process_slots",
    "start_process_workers",
    "started_pids",
    "worker_error",
]
