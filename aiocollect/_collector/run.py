"""A collector's run: everything that lives while its workers do.

:class:`Run` owns the run state (the worker pool, credits, the batch stream, the pending error,
weights, profiling, counters) and the tasks that drive it: one per worker seat (reading its
reports, replacing it after a failure), the producer (:mod:`aiocollect._collector.producer`), the
watchdog for hung workers and the drain into a replay buffer. Those tasks reference the run,
never the user's :class:`~aiocollect.Collector`: a collector that its user forgets can be
garbage-collected, and its finalizer then stops the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping

import anyio
import anyio.from_thread
import anyio.lowlevel

from .. import events as ev
from .._service.bus import EventBus
from .config import CollectorConfig
from .._core.errors import (
    AiocollectError,
    BrokenWorkerError,
    CollectorClosedError,
    ConfigError,
    EndOfCollection,
)
from .._core.layout import SlotLayout
from .producer import Lease, Producer
from .._core.profiling import ProfileConfig, RunProfiling
from .._service.resource import loop_token, unwrap_group, wait_shielded
from .._worker.rollout import RolloutConfig
from .stats import Stats
from .startup import import_in_thread, launch_workers, stop_workers
from .._service.supervisor import RestartBudget, supervise, watchdog
from .._service.systask import spawn_system_task
from .weightsync import WeightSync, check_worker_ids
from .._backends.seat import Backend
from .._backends.table import backend_named
from .._backends.workers import WorkerHandle
from .._core.wire import BatchInfo
from .._core.public import public


if TYPE_CHECKING:  # tensordict is imported while the first collector starts (see Run._run)
    from tensordict import TensorDict


@public
class CollectorState(enum.Enum):
    """Lifecycle of a :class:`~aiocollect.Collector`."""

    CREATED = "created"
    """Constructed; no worker yet."""
    STARTING = "starting"
    """Workers are being started."""
    RUNNING = "running"
    """Collecting."""
    STOPPED = "stopped"
    """Workers are gone (``total_frames`` reached, or a failure); batches already collected can
    still be received."""
    CLOSED = "closed"
    """Closed: every process and shared-memory segment is released. Cannot be reopened."""


State = CollectorState  # the name it had first, still exported


class Run:
    """The state and tasks of one collector (see the module docstring)."""

    def __init__(self, config: CollectorConfig, backend: Backend | None = None) -> None:
        c = self.config = config
        # where the workers run: the backend named by the config, or the object passed in
        self.backend: Backend = backend if backend is not None else backend_named(c.backend_name)
        self.bus = EventBus()
        self.stats = Stats()
        self.state = State.CREATED
        # counters of what the consumers received (state_dict, progress)
        self.frames = 0
        self.batches = 0
        self.counters: list[int] | None = None
        self.start_counters: list[int] | None = None
        self.collected = 0  # frames collected by the workers (total_frames counts these)
        self.seed: int | None = c.seed
        self.static_seed = False
        self.profiling = RunProfiling(self, c.profile)
        # (stores in process memory for the local backend, and for Ray, which ships each version)
        self.sync = WeightSync(c.policy, self.backend.weights_in_parent, self.emit)
        # the run
        self.closing = False
        self.ended = False  # the consumer saw the end of the stream
        self.finished = False  # every batch was collected (the workers will collect no more)
        self.loop_gone = False  # the event loop that ran it ended under it
        self.abandoned = False  # its Collector was garbage-collected
        self.launch_failed = False
        self.error: BaseException | None = None
        self.error_seen = False
        self.pending_error: BaseException | None = None  # a worker failed: raised after its batches
        self.server: Any = None  # inference="server": the run's InferenceServer
        self.requested = 0
        self.workers: list[WorkerHandle] = []
        self.workers_ready = False
        self.configs: list[RolloutConfig] = []
        self.layout: SlotLayout | None = None
        self.segment: tuple[int, Any] | None = None  # the slots' memfd and the collector's mapping of it
        self.slot_views: list[dict] = []  # per slot: every worker's rows, as numpy views
        self.lease: Lease | None = None  # zero_copy: the slots of the batch the consumer has
        self.sub_envs = 1  # of each env: a vector env's num_envs (learned from the workers' specs)
        self.bar: Any = None
        self.sink: Any = None
        self.paused = 0
        self.resume = anyio.Event()
        self.resume.set()
        self.writing: anyio.Event | None = None  # set when a write into the sink ends
        self.budget = RestartBudget(c.max_restarts, c.restart_window)
        self.task: Any = None
        self.loop: Any = None
        self.producer: Producer | None = None
        self.launching: anyio.CancelScope | None = None  # while the workers start

    @property
    def rows_per_worker(self) -> int:
        """Env rows of each worker's batch (its sub-envs, for vector envs)."""
        return self.config.envs_per_worker * self.sub_envs

    @property
    def total_rows(self) -> int:
        """Env rows of all workers (the number of envs, counting each sub-env of a vector env)."""
        return self.config.total_envs * self.sub_envs

    # -- events ---------------------------------------------------------------------------------
    async def emit(self, event_type: type[ev.Event], **fields: Any) -> None:
        """Build and emit an event, only if someone listens (events cost nothing otherwise)."""
        if self.bus.listens_to(event_type):
            await self.bus.emit(event_type(**fields))

    def wake(self, worker: WorkerHandle | None = None) -> None:
        if self.producer is not None:
            self.producer.wake(worker)

    # -- lifecycle ------------------------------------------------------------------------------
    def check_loop(self) -> None:
        """A collector belongs to the event loop that started it."""
        if self.loop is None or self.loop is loop_token():
            return
        if self.loop_gone:
            raise CollectorClosedError(
                "this collector was started in another event loop, which has ended (each asyncio.run() "
                "makes a new loop and cancels what ran in the old one): its workers are gone. A collector "
                "belongs to the loop that started it; create a new Collector in this loop"
            )
        raise AiocollectError(
            "this collector was started in another event loop: a collector belongs to the loop that "
            "started it (its workers report to that loop's tasks). Use it from that loop, or create one "
            "Collector per loop"
        )

    async def start(self, sink: Any = None) -> None:
        if self.state is State.CLOSED:
            raise CollectorClosedError("this collector is closed and cannot be reopened; create a new Collector")
        self.check_loop()
        if sink is not None:
            if self.state is not State.CREATED:
                raise AiocollectError("start(replay_buffer=...) must be the first start of the collector")
            if not callable(getattr(sink, "extend", None)):
                raise ConfigError(f"replay_buffer={sink!r} has no extend(batch) method; pass a ReplayBuffer or a TorchRL buffer")
            self.sink = sink
        if self.state is State.CREATED:
            self.state = State.STARTING
            self.loop = loop_token()
            if self.config.zero_copy == "debug":
                import faulthandler

                if not faulthandler.is_enabled():  # a read of a handed-back batch prints its traceback
                    faulthandler.enable()
            size = max(self.config.prefetch, 1)
            self.send, self.recv = anyio.create_memory_object_stream[tuple["TensorDict", list, int, "Lease | None"]](size)
            self.started = anyio.Event()
            self.done = anyio.Event()
            self.stop = anyio.Event()
            self.producer = Producer(self)
            self.task = spawn_system_task(self._run)
        await self.started.wait()
        if self.state is State.STOPPED and self.launch_failed:
            # nothing was started that could be used: the collector is closed, its error raised once
            try:
                await wait_shielded(self.done)
            finally:
                self.close_stream()
                self.state = State.CLOSED
            if not self.error_seen and self.error is not None:
                self.error_seen = True
                raise self.error

    async def aclose(self) -> None:
        if self.state is State.CLOSED:
            return
        if self.state is State.CREATED:
            self.state = State.CLOSED
            return
        if self.loop_gone and self.done.is_set():  # its loop ended (and stopped the workers)
            self.close_stream()
            self.state = State.CLOSED
            return
        self.check_loop()
        self.closing = True
        self.stop.set()
        if self.launching is not None:
            # a start-up in progress may never end (an env factory waiting for a licence server,
            # Ray actors for resources the cluster lacks): end it. Workers still starting get
            # shutdown_timeout seconds, then are killed (every process forked, its hello read or
            # not); the local backend's factories are left to finish in their thread
            self.launching.cancel()
        try:
            await wait_shielded(self.done)  # even under task.cancel(): the workers are gone first
        finally:
            if self.lease is not None:
                self.lease.protect()  # (the workers are gone: nothing to hand back)
                self.lease = None
            self.close_stream()
            self.state = State.CLOSED
        if self.error is not None and not self.error_seen:
            self.error_seen = True
            raise self.error

    def abandon(self) -> None:
        """The collector was garbage-collected while running: stop the run from wherever we are
        (a finalizer, in any thread). Its own task stops the workers; if its loop is gone, they
        are killed now."""
        self.abandoned = True
        if self.task is None or self.done.is_set():
            if self.task is not None:
                self.close_stream()
            return
        self.closing = True
        loop = self.loop
        try:
            if isinstance(loop, asyncio.AbstractEventLoop):
                if loop.is_closed() or not loop.is_running():
                    raise RuntimeError("the loop is gone")
                if loop_token() is loop:
                    self.stop.set()
                else:
                    loop.call_soon_threadsafe(self.stop.set)
            else:  # trio
                loop.run_sync_soon(self.stop.set)
        except Exception:  # noqa: BLE001 - no loop to stop it in: kill the workers now
            self.kill_now()

    def kill_now(self) -> None:
        for w in self.workers:
            try:
                w.stop_nowait()
            except Exception:  # noqa: BLE001 - best effort: the process is going away
                pass

    # -- consuming ------------------------------------------------------------------------------
    async def collect(self, *, drain: bool = False) -> "TensorDict":
        if self.state is State.CLOSED:
            raise CollectorClosedError("this collector is closed; create a new Collector")
        self.check_loop()
        if self.ended:
            self.raise_end()
        if self.lease is not None:  # zero_copy: the consumer is done with the batch it has
            await self.release_lease()
        self.requested += 1
        self.wake()
        try:
            batch, parts, frames, self.lease = await self.recv.receive()
        except anyio.EndOfStream:
            if not drain:  # (the drain into a replay buffer is what the runner itself waits for)
                await self.done.wait()  # the workers are gone before the end is reported
            if self.closing or self.state is State.CLOSED:
                if self.error is None:
                    raise CollectorClosedError("this collector was closed while waiting for a batch") from None
            elif not drain:
                # the end was seen: nothing is left to release (a consumer that never calls
                # aclose(), as in `async for b in Collector(...)`, leaves nothing open)
                self.ended = True
                self.recv.close()
            self.raise_end()
        except anyio.ClosedResourceError:
            raise CollectorClosedError("this collector was closed while waiting for a batch") from None
        self.delivered(parts, frames)
        return batch

    async def release_lease(self) -> None:
        """zero_copy: hand the slots of the consumer's batch back to the workers."""
        lease, self.lease = self.lease, None
        assert lease is not None
        lease.protect()
        for w, slot in lease.parts:
            try:
                await w.release(slot)
            except (BrokenWorkerError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # it died under us: its own task reports it

    def close_stream(self) -> None:
        """Close the consumer's side of the stream, dropping the batches still in it: nobody will
        receive them, and a lent batch would keep its slots' mapping alive."""
        while True:
            try:
                self.recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        self.recv.close()

    def raise_end(self) -> None:
        if self.error is not None:
            self.error_seen = True
            raise self.error from self.error.__cause__
        if self.loop_gone:
            self.check_loop()
        raise EndOfCollection(f"all {self.config.total_frames} frames (total_frames) have been collected")

    def delivered(self, parts: "list[tuple[int, BatchInfo]]", frames: int) -> None:
        """Account for a batch the consumer received (counters, state_dict, progress)."""
        if self.counters is None:
            self.counters = list(self.start_counters or [0] * self.total_rows)
        rows = self.rows_per_worker
        for index, info in parts:
            self.counters[index * rows : (index + 1) * rows] = info.traj_counters
        self.frames += frames
        self.batches += 1
        if self.bar is not None:
            self.bar.update_to(self.frames, self.stats.mean_return)

    @contextlib.asynccontextmanager
    async def pause(self) -> AsyncIterator[None]:
        self.paused += 1
        if self.paused == 1:
            self.resume = anyio.Event()
        try:
            if self.writing is not None:
                await self.writing.wait()  # a write in progress finishes first
            yield
        finally:
            self.paused -= 1
            if self.paused == 0:
                self.resume.set()
                self.wake()

    async def _drain_into_sink(self) -> None:
        """Background collection: every batch goes into the replay buffer."""
        sink = self.sink
        while True:
            try:
                batch = await self.collect(drain=True)
            except Exception:  # noqa: BLE001 - the end, or the run's stored error (aclose raises it)
                self.producer.drained.set()  # type: ignore[union-attr]
                return
            while self.paused:
                await self.resume.wait()
            self.writing = anyio.Event()
            try:
                result = sink.extend(batch)
                if inspect.isawaitable(result):
                    await result
            except BaseException as exc:
                # (its frames hold the batch: a lent one would stay mapped while the error is kept)
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                self.writing.set()
                self.writing = None
                del batch

    # -- weights --------------------------------------------------------------------------------
    async def update_weights(self, updates: Mapping[str, Any], worker_ids: Any, wait: bool) -> int:
        sync = self.sync
        sync.check_model_ids(updates)
        if self.state in (State.CREATED, State.STARTING):
            await self.start()  # (a start cancelled earlier may still be under way: wait for it)
        self.check_loop()
        if self.state is State.CLOSED or self.closing:
            raise CollectorClosedError(f"update_weights() on a collector that is {self.state.value}; create a new Collector")
        if self.state is State.STOPPED:
            if self.error is not None:
                raise CollectorClosedError(
                    f"update_weights(): the collector stopped because a worker failed ({type(self.error).__name__}); "
                    f"no worker is left to update"
                ) from self.error
            # total_frames reached: nothing will collect again, so nothing is waited for
            self._targets(worker_ids)
            return sync.bump()
        targets = self._targets(worker_ids)
        if self.server is not None:
            return await self._update_server(updates, targets)
        version = await sync.publish(updates, targets)
        if wait and not await sync.wait_applied(version, targets, self.collecting):
            if self.error is not None:
                raise self.error
            if self.state is State.RUNNING or self.finished:
                return version  # total_frames reached meanwhile: the rest will not collect again
            raise CollectorClosedError(f"the collector was closed before the workers applied version {version}")
        return version

    def _targets(self, worker_ids: Any) -> list[int]:
        if self.config.inference == "server":
            targets = check_worker_ids(worker_ids, self.config.workers)
            if len(targets) != self.config.workers:
                raise ConfigError(
                    "inference='server' runs one policy for every worker: update_weights() cannot target some "
                    "workers (worker_ids); leave worker_ids=None"
                )
            return targets
        return self.sync.targets(worker_ids, self.config.workers)

    async def _update_server(self, updates: Mapping[str, Any], targets: list[int]) -> int:
        """Server inference: the new weights are the server's at once (one policy for all)."""
        sync = self.sync
        t0 = time.perf_counter()
        version = self.server.update(updates)
        sync.version = version
        ids = tuple(updates)
        await self.emit(ev.WeightsUpdated, version=version, model_id=ids[0], model_ids=ids, workers=tuple(targets))
        for w in targets:
            sync.acked[w] = version
            await self.emit(ev.WeightsApplied, version=version, worker=w, latency=time.perf_counter() - t0)
        sync.notify()
        return version

    def collecting(self) -> bool:
        """The workers may still collect frames (so an update is worth waiting for)."""
        return self.state is State.RUNNING and not self.finished and not self.closing

    # -- profiling ------------------------------------------------------------------------------
    def enable_profile(self, config: ProfileConfig) -> None:
        if self.state in (State.STOPPED, State.CLOSED):
            self.profiling.check(config)
            raise CollectorClosedError(f"enable_profile() on a collector that is {self.state.value}")
        self.profiling.enable(config, self.workers_ready)

    def disable_profile(self) -> None:
        self.profiling.disable()

    # -- the run's own task ---------------------------------------------------------------------
    async def _run(self) -> None:
        cancelled = anyio.get_cancelled_exc_class()
        try:
            try:
                async with anyio.create_task_group() as tg:
                    t_launch = time.perf_counter()
                    with anyio.CancelScope() as self.launching:  # (aclose() cancels a start-up in progress)
                        if self.closing:  # closed before this task ran: nothing to start
                            self.launching.cancel()
                        async with anyio.create_task_group() as starting:
                            if "tensordict" not in sys.modules:
                                starting.start_soon(import_in_thread, "tensordict", self.config.shutdown_timeout)
                            await launch_workers(self)
                    self.launching = None
                    if not self.closing:  # (else closed while starting: nothing more to start)
                        self.stats.start()
                        for w in self.workers:
                            await self.emit(ev.WorkerStarted, worker=w.index, pid=w.pid)
                        await self.emit(
                            ev.CollectorStarted,
                            num_workers=self.config.num_workers,
                            envs_per_worker=self.config.envs_per_worker,
                            pids=tuple(w.pid for w in self.workers if w.pid is not None),
                            startup_seconds=time.perf_counter() - t_launch,
                        )
                        self.state = State.RUNNING
                        self.started.set()
                        for w in self.workers:
                            tg.start_soon(supervise, self, w)
                        tg.start_soon(self.producer.produce)  # type: ignore[union-attr]
                        if self.sink is not None:
                            tg.start_soon(self._drain_into_sink)
                        if self.config.step_timeout is not None:
                            tg.start_soon(watchdog, self, self.config.step_timeout)
                        if self.server is not None:
                            tg.start_soon(self.server.watch)
                        await self.stop.wait()
                    tg.cancel_scope.cancel()
            except cancelled:
                if not self.closing:  # the loop is shutting down under us (asyncio.run's end)
                    self.loop_gone = True
                raise
            except Exception as exc:  # noqa: BLE001 - reported to the consumer
                self.error = unwrap_group(exc)
                self.launch_failed = not self.started.is_set()
            finally:
                await stop_workers(self)
            reason = "error" if self.error is not None else ("closed" if self.closing else "total_frames")
            with anyio.CancelScope(shield=True):
                try:
                    await self.emit(ev.CollectorStopped, reason=reason, frames=self.frames,
                                    batches=self.batches, error=self.error)
                except Exception as exc:  # noqa: BLE001 - a handler's error still surfaces
                    if self.error is None:
                        self.error = exc
        finally:
            self.profiling.abort_collector()
            self.bus.close()
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            self.send.close()
            if self.abandoned:  # no consumer is left to receive anything
                self.close_stream()
            if self.state is not State.CLOSED:
                self.state = State.STOPPED
            self.sync.notify()
            self.started.set()
            self.done.set()

    def worker_failed(self, error: BaseException) -> None:
        """A worker raised or died for good: batches it completed before are still delivered
        (the producer drains them), then the error ends the run."""
        if self.pending_error is None:
            self.pending_error = error
        self.wake()


__all__ = ["CollectorState", "Run", "State"]
