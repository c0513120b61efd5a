"""A collector's run: its lifecycle (start, its tasks, stop, close).

:class:`Run` starts the workers and the tasks that drive them: one per worker seat (reading its
reports, replacing it after a failure), the producer (:mod:`aiocollect._collector.producer`), the
watchdog for hung workers and the drain into a replay buffer; then stops and closes it all. What
those parts share (the worker pool, credits, the batch stream, the pending error, weights,
profiling, counters, the phase) is a :class:`~aiocollect._collector.run_state.RunState`, which
they receive instead of the ``Run``. Those tasks reference the run, never the user's
:class:`~aiocollect.Collector`: a collector that its user forgets can be garbage-collected, and
its finalizer then stops the run.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, AsyncContextManager, Callable, Mapping

import anyio
import anyio.lowlevel

from .. import events as ev
from .._backends.failures import STARTING_GRACE
from .._backends.seat import Backend
from .._backends.table import backend_named
from .._core.errors import (
    AiocollectError,
    BrokenWorkerError,
    CollectorClosedError,
    ConfigError,
    EndOfCollection,
)
from .._core.profiling import ProfileConfig
from .._core.wire import BatchInfo
from .._service.bus import EventBus
from .._service.resource import loop_token, unwrap_group, wait_shielded
from .._service.supervisor import supervise, watchdog
from .._service.systask import spawn_system_task
from .config import CollectorConfig
from .offloop import CollectorLoop
from .producer import Lease, Producer
from .queue_sink import QueueSink, writes_on_user_loop
from .run_state import CollectorState, Phase, RunState, State
from .startup import import_in_thread, launch_workers, stop_workers


if TYPE_CHECKING:  # tensordict is imported while the first collector starts (see Run._run)
    from tensordict import TensorDict


class Run:
    """The lifecycle of one collector's run (see the module docstring); what its parts share is
    :attr:`shared` (a :class:`~aiocollect._collector.run_state.RunState`)."""

    def __init__(self, config: CollectorConfig, backend: Backend | None = None) -> None:
        # where the workers run: the backend named by the config, or the object passed in
        self.shared = RunState(config, backend if backend is not None else backend_named(config.backend_name))
        self.task: Any = None
        self.loop: Any = None
        self.launching: anyio.CancelScope | None = None  # while the workers start
        self.recv: Any = None  # the consumer's side of the batch stream
        self.lease: Lease | None = None  # zero_copy: the slots of the batch the consumer has
        self.consumers_waiting = 0  # the user's collect() calls waiting for a batch
        self.tasks: Any = None  # the task group of the running run's tasks (a sink attached late joins it)
        # the data plane on the caller's loop, which a sink attached late moves to the collector's loop
        self.plane_scope: anyio.CancelScope | None = None
        self.moved: anyio.Event | None = None  # set once it runs there (or the run ended)
        # causes that outlive the phases they ended
        self.loop_gone = False  # the event loop that ran it ended under it
        self.abandoned = False  # its Collector was garbage-collected
        self.closed_by: str | None = None  # what closed it, in the user's words ("aclose()", ...)

    @property
    def config(self) -> CollectorConfig:
        return self.shared.config

    @property
    def bus(self) -> EventBus:
        return self.shared.bus

    @property
    def state(self) -> CollectorState:
        """What ``collector.state`` reports."""
        return self.shared.phase.public

    # -- lifecycle ------------------------------------------------------------------------------
    def note_closer(self, closer: str) -> None:
        """Record what is closing the collector (``"the end of its `async with` block"``), unless
        something closed it already: the first closer is the one a later error names."""
        if self.closed_by is None and self.shared.phase is not Phase.CLOSED:
            self.closed_by = closer

    def why_closed(self) -> str:
        """What closed or stopped this collector, as a sentence about it: by whom it was closed
        (``aclose()``, the end of its ``async with`` block, its failed start ...), or why it
        stopped (a worker's failure, ``total_frames`` reached)."""
        s = self.shared
        if s.phase.closing:
            if self.loop_gone:
                return "this collector was closed when the event loop that started it ended"
            return f"this collector was closed by {self.closed_by or 'aclose()'}"
        error = s.errors.error
        if error is not None:
            first = str(error).partition("\n")[0][:200]
            return f"this collector stopped on an error ({type(error).__name__}" + (f": {first})" if first else ")")
        if s.phase in (Phase.COMPLETED, Phase.ENDED, Phase.FINISHED):
            return f"this collector delivered its total_frames={self.config.total_frames} and stopped"
        return f"this collector is {self.state.value}"

    def closed_error(self, what: str) -> CollectorClosedError:
        """The :class:`CollectorClosedError` for ``what`` (``"update_weights()"``, ``"collect()"``)
        called on a collector that is closed or stopped: it names what closed it (and chains a
        worker's error where one stopped it, when raised ``from`` it)."""
        return CollectorClosedError(f"{what}: {self.why_closed()}; create a new Collector")

    def check_loop(self) -> None:
        """A collector belongs to the event loop that started it (and to its own loop, which
        runs background collection's data plane)."""
        if self.loop is None or self.loop is loop_token() or self.shared.off_loop() is not None:
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
        s = self.shared
        if s.phase is Phase.CLOSED:
            raise CollectorClosedError(f"start(): {self.why_closed()}, and a closed collector cannot be reopened; "
                                       f"create a new Collector")
        self.check_loop()
        if sink is not None:
            self._attach(sink)
        if s.phase is Phase.CREATED:
            self._begin()
        await self.started.wait()
        if sink is not None and self.moved is not None:
            await self.moved.wait()  # (a caller that trains right after without awaiting gets batches)
        if s.phase is Phase.LAUNCH_FAILED:
            # nothing was started that could be used: the collector is closed, its error raised once
            if self.closed_by is None:
                error = s.errors.error
                self.closed_by = f"its failed start ({type(error).__name__})" if error is not None else "its failed start"
            try:
                await wait_shielded(self.done)
            finally:
                self.close_stream()
                s.move_to(Phase.CLOSED)
            if not s.errors.seen and s.errors.error is not None:
                s.errors.seen = True
                raise s.errors.error

    def _attach(self, sink: Any) -> None:
        """Background collection: every batch goes to ``sink`` from now on. Before the start, or
        on a started collector (``async with`` entered) whose consumers took no batch yet: the
        batches collected ahead meanwhile (``prefetch``) go to the sink too, none is lost."""
        s = self.shared
        if not callable(getattr(sink, "extend", None)):
            raise ConfigError(f"replay_buffer={sink!r} has no extend(batch) method; pass a ReplayBuffer or a TorchRL buffer")
        if s.sink is not None:
            raise AiocollectError(
                "this collector already writes its batches into a replay buffer or a queue (an earlier "
                "start(replay_buffer=...) or start(queue=...)): one per collector; extend several buffers from one "
                "object's extend(), or create a Collector per buffer"
            )
        if s.phase is not Phase.CREATED and (
            s.phase not in (Phase.STARTING, Phase.RUNNING) or s.counts.requested or self.consumers_waiting
        ):
            if s.counts.requested or self.consumers_waiting:
                taken = "its consumers already asked it for batches"
            elif s.phase.public is CollectorState.RUNNING:
                taken = "every batch of total_frames is collected already"
            else:
                taken = f"it is {self.state.value}"
            raise AiocollectError(
                f"start(replay_buffer=...) or start(queue=...) on a collector whose batches cannot all go there any "
                f"more ({taken}): attach the buffer or queue before taking a batch (collect(), `async for`), e.g. "
                f"`async with Collector(...) as c: await c.start(replay_buffer=rb)`, or create a new Collector"
            )
        s.sink = sink
        if s.phase is not Phase.RUNNING:  # (else _start_tasks starts the drain)
            return
        if self.plane_scope is not None:  # the data plane moves to the collector's loop, the drain with it
            self.moved = anyio.Event()
            self.tasks.start_soon(self._move_off_loop)
        else:  # (a backend whose seats only the caller's loop serves: the drain runs there too)
            self.tasks.start_soon(self._drain_into_sink)

    def _begin(self) -> None:
        """The first start: the stream, the producer and the run's own task."""
        s = self.shared
        s.move_to(Phase.STARTING)
        self.loop = loop_token()
        if s.config.zero_copy == "debug":
            import faulthandler

            if not faulthandler.is_enabled():  # a read of a handed-back batch prints its traceback
                faulthandler.enable()
        size = max(s.config.prefetch, 1)
        s.send, self.recv = anyio.create_memory_object_stream[tuple["TensorDict", list, int, "Lease | None"]](size)
        self.started = anyio.Event()
        self.done = anyio.Event()
        s.stop = anyio.Event()
        s.producer = Producer(s)
        self.task = spawn_system_task(self._run)

    def close_unstarted(self) -> bool:
        """Close a collector that never started (nothing to stop); False if it did start."""
        if self.shared.phase is Phase.CREATED:
            self.note_closer("aclose()")
            self.shared.move_to(Phase.CLOSED)
        return self.shared.phase is Phase.CLOSED

    def request_close(self) -> None:
        """Ask the run to stop because its user closes it (or forgot it): enter the closing phase."""
        s = self.shared
        if s.phase is Phase.STARTING:
            s.move_to(Phase.CANCELLING_START)
        elif s.phase in (Phase.RUNNING, Phase.FINISHED):
            s.move_to(Phase.CLOSING)
        elif s.phase in (Phase.COMPLETED, Phase.STOPPED, Phase.ENDED):
            s.move_to(Phase.STOPPED_CLOSING)

    async def aclose(self) -> None:
        s = self.shared
        self.note_closer("aclose()")  # (unless a caller said more: the end of an `async with` ...)
        if self.close_unstarted():
            return
        if self.loop_gone and self.done.is_set():  # its loop ended (and stopped the workers)
            self.close_stream()
            s.move_to(Phase.CLOSED)
            return
        self.check_loop()
        self.request_close()
        s.stop.set()
        if self.launching is not None:
            # a start-up in progress may never end (an env factory waiting for a licence server,
            # Ray actors for resources the cluster lacks): end it. Workers still in their env
            # factories get STARTING_GRACE, those with envs shutdown_timeout, then are killed
            # (every process forked, its hello read or not); the local backend's factories are
            # left to finish in their thread
            self.launching.cancel()
        try:
            await wait_shielded(self.done)  # even under task.cancel(): the workers are gone first
        finally:
            if self.lease is not None:
                self.lease.protect()  # (the workers are gone: nothing to hand back)
                self.lease = None
            self.close_stream()
            if s.phase is not Phase.CLOSED:
                s.move_to(Phase.CLOSED)
        if s.errors.error is not None and not s.errors.seen:
            s.errors.seen = True
            raise s.errors.error

    def abandon(self) -> None:
        """The collector was garbage-collected while running: stop the run from wherever we are
        (a finalizer, in any thread). Its own task stops the workers; if its loop is gone, they
        are killed now."""
        self.abandoned = True
        if self.task is None or self.done.is_set():
            if self.task is not None:
                self.close_stream()
            return
        loop, stop = self.loop, self.shared.stop
        try:
            self.request_close()
            if isinstance(loop, asyncio.AbstractEventLoop):
                if loop.is_closed() or not loop.is_running():
                    raise RuntimeError("the loop is gone")
                if loop_token() is loop:
                    stop.set()
                else:
                    loop.call_soon_threadsafe(stop.set)
            else:  # trio
                loop.run_sync_soon(stop.set)
        except Exception:  # noqa: BLE001 - no loop to stop it in: kill the workers now
            self.kill_now()

    def kill_now(self) -> None:
        for w in self.shared.workers:
            try:
                w.stop_nowait()
            except Exception:  # noqa: BLE001 - best effort: the process is going away
                pass

    # -- consuming ------------------------------------------------------------------------------
    async def consume(self) -> "TensorDict":
        """The user's :meth:`collect`: with ``zero_copy``, one consumer task at a time (taking a
        batch hands the previous one back to the workers, whoever holds it)."""
        if self.consumers_waiting and self.config.zero_copy:
            raise AiocollectError(
                f"zero_copy={self.config.zero_copy!r}: another task is already waiting for a batch of this collector "
                f"(collect() or `async for`); with zero_copy=True each batch goes back to the workers as soon as the "
                f"next one is asked for, so two consumer tasks would read each other's batches overwritten. Take "
                f"batches in one task (and pass copies on), or leave zero_copy=False (the default), whose batches "
                f"several tasks may share"
            )
        self.consumers_waiting += 1
        try:
            return await self.collect()
        finally:
            self.consumers_waiting -= 1

    async def collect(self, *, drain: bool = False) -> "TensorDict":
        s = self.shared
        if s.phase is Phase.CLOSED:
            raise self.closed_error("collect()")
        self.check_loop()
        if s.phase is Phase.ENDED:
            self.raise_end()
        if self.lease is not None:  # zero_copy: the consumer is done with the batch it has
            await self.release_lease()
        s.counts.requested += 1
        s.wake()
        try:
            batch, parts, frames, self.lease = await self.recv.receive()
        except anyio.EndOfStream:
            if not drain:  # (the drain into a replay buffer is what the runner itself waits for)
                await self.done.wait()  # the workers are gone before the end is reported
            if s.phase.closing:
                if s.errors.error is None:
                    raise self.closed_error("collect() waiting for a batch") from None
            elif not drain:
                # the end was seen: nothing is left to release (a consumer that never calls
                # aclose(), as in `async for b in Collector(...)`, leaves nothing open)
                if s.phase in (Phase.COMPLETED, Phase.STOPPED):
                    s.move_to(Phase.ENDED)
                self.recv.close()
            self.raise_end()
        except anyio.ClosedResourceError:
            raise self.closed_error("collect() waiting for a batch") from None
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
        errors = self.shared.errors
        if errors.error is not None:
            errors.seen = True
            raise errors.error from errors.error.__cause__
        if self.loop_gone:
            self.check_loop()
        raise EndOfCollection(f"all {self.config.total_frames} frames (total_frames) have been collected")

    def delivered(self, parts: "list[tuple[int, BatchInfo]]", frames: int) -> None:
        """Account for a batch the consumer received (counters, state_dict, progress)."""
        s = self.shared
        counts = s.counts
        if counts.traj_counters is None:
            counts.traj_counters = list(counts.start_counters or [0] * s.total_rows)
        rows = s.rows_per_worker
        for index, info in parts:
            counts.traj_counters[index * rows : (index + 1) * rows] = info.traj_counters
        counts.frames += frames
        counts.batches += 1
        if s.bar is not None:
            s.bar.update_to(counts.frames, s.stats.mean_return)

    def pause(self) -> AsyncContextManager[None]:
        return self.shared.gate.hold()

    async def _drain_into_sink(self) -> None:
        """Background collection: every batch goes into the replay buffer or the user's queue
        (whose side is closed when the delivery ends, however it ends: here, or for a queue of
        the caller's loop by the run's task there once the data plane is gone)."""
        sink = self.shared.sink
        try:
            await self._drain()
        finally:
            if isinstance(sink, QueueSink) and not (self.shared.off_loop() and writes_on_user_loop(sink)):
                await sink.end()

    async def _drain(self) -> None:
        """Take each batch and write it into the sink, in order, one at a time. In the
        collector's own loop (background collection off the caller's loop) a sink whose writes
        belong to the caller's loop (an ``async def extend``, an ``asyncio.Queue``, an anyio or
        trio stream) is written there, this loop waiting for it; any other is written here."""
        s = self.shared
        sink, gate = s.sink, s.gate
        home = s.off_loop()
        there = home if home is not None and writes_on_user_loop(sink) else None
        while True:
            try:
                batch = await self.collect(drain=True)
            except Exception:  # noqa: BLE001 - the end, or the run's stored error (aclose raises it)
                s.producer.drained.set()  # type: ignore[union-attr]
                return
            await gate.wait_open()
            gate.writing = anyio.Event()
            try:
                if there is not None:
                    await there.to_user(_write, sink, batch)
                else:
                    await _write(sink, batch)
                if isinstance(sink, QueueSink) and sink.consumer_gone:  # nobody takes from it now
                    s.request_stop()
                    return
            except BaseException as exc:
                # (its frames hold the batch: a lent one would stay mapped while the error is kept)
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                gate.writing.set()
                gate.writing = None
                del batch

    # -- weights --------------------------------------------------------------------------------
    async def update_weights(self, updates: Mapping[str, Any], targets: list[int], wait: bool) -> int:
        """The lifecycle's part of ``update_weights`` (the weight sync checked the arguments and
        does the rest): start a collector not started yet, refuse a closed one, count on after
        the last batch; then publish, and wait for the targets' acknowledgements if asked."""
        s = self.shared
        sync = s.sync
        if self.state in (State.CREATED, State.STARTING):
            await self.start()  # (a start cancelled earlier may still be under way: wait for it)
        self.check_loop()
        if s.phase.closing:
            raise CollectorClosedError(f"update_weights() on a collector that is {self.state.value}; create a new Collector")
        if self.state is State.STOPPED:
            if s.errors.error is not None:
                raise CollectorClosedError(
                    f"update_weights(): the collector stopped because a worker failed ({type(s.errors.error).__name__}); "
                    f"no worker is left to update"
                ) from s.errors.error
            return sync.bump()  # total_frames reached: nothing will collect again, so nothing is waited for
        version = await sync.publish(updates, targets)
        if not wait:
            await anyio.lowlevel.checkpoint()  # (a coroutine yields once: background work runs)
        elif not await sync.wait_applied(version, targets, self.collecting):
            if s.errors.error is not None:
                raise s.errors.error
            if s.phase in (Phase.RUNNING, Phase.FINISHED, Phase.COMPLETED, Phase.ENDED):
                return version  # total_frames reached meanwhile: the rest will not collect again
            raise CollectorClosedError(f"the collector was closed before the workers applied version {version}")
        return version

    def collecting(self) -> bool:
        """The workers may still collect frames (so an update is worth waiting for)."""
        return self.shared.collecting

    # -- profiling ------------------------------------------------------------------------------
    def enable_profile(self, config: ProfileConfig) -> None:
        s = self.shared
        if self.state in (State.STOPPED, State.CLOSED):
            s.profiling.check(config)
            raise self.closed_error("enable_profile()")
        s.profiling.enable(config, s.workers_ready)

    def disable_profile(self) -> None:
        self.shared.profiling.disable()

    # -- the run's own task ---------------------------------------------------------------------
    async def _run(self) -> None:
        s = self.shared
        cancelled = anyio.get_cancelled_exc_class()
        launch_failed = False
        try:
            try:
                async with anyio.create_task_group() as tg:
                    t_launch = time.perf_counter()
                    await self._launch()
                    if not s.phase.closing:  # (else closed while starting: nothing more to start)
                        await self._announce_start(time.perf_counter() - t_launch)
                        self._start_tasks(tg)
                        await s.stop.wait()
                    tg.cancel_scope.cancel()
            except cancelled:
                if not s.phase.closing:  # the loop is shutting down under us (asyncio.run's end)
                    self.loop_gone = True
                raise
            except Exception as exc:  # noqa: BLE001 - reported to the consumer
                s.errors.error = unwrap_group(exc)
                launch_failed = not self.started.is_set()
            finally:
                await stop_workers(s)
            await self._announce_stop()
        finally:
            if isinstance(s.sink, QueueSink):  # (also a delivery that never began: a start failed or cancelled)
                try:
                    await s.sink.end()
                except Exception as exc:  # noqa: BLE001 - the user's queue did not close: aclose() raises it
                    s.errors.error = s.errors.error or exc
            self._end(launch_failed)

    async def _launch(self) -> None:
        s = self.shared
        with anyio.CancelScope() as self.launching:  # (aclose() cancels a start-up in progress)
            if s.phase.closing:  # closed before this task ran: nothing to start
                self.launching.cancel()
            async with anyio.create_task_group() as starting:
                if "tensordict" not in sys.modules:
                    # (given up with the start-up: left to finish in its thread, which harms nothing)
                    starting.start_soon(import_in_thread, "tensordict", min(s.config.shutdown_timeout, STARTING_GRACE))
                await launch_workers(s)
        self.launching = None

    async def _announce_start(self, startup_seconds: float) -> None:
        s = self.shared
        s.stats.start()
        for w in s.workers:
            await s.emit(ev.WorkerStarted, worker=w.index, pid=w.pid)
        await s.emit(
            ev.CollectorStarted,
            num_workers=s.config.num_workers,
            envs_per_worker=s.config.envs_per_worker,
            pids=tuple(w.pid for w in s.workers if w.pid is not None),
            startup_seconds=startup_seconds,
        )

    def _start_tasks(self, tg: Any) -> None:
        """Running: a supervisor per worker seat, the producer, and what the config asks for."""
        s = self.shared
        if s.phase.closing:  # (closed by a handler of CollectorStarted)
            return
        s.move_to(Phase.RUNNING)
        self.tasks = tg
        movable = all(w.can_serve_off_loop for w in s.workers)
        if s.sink is not None and movable:
            # start() returns once the collector's thread runs: a caller that trains right after
            # it without awaiting gets batches (the run's task ends setting started, whatever happens)
            tg.start_soon(self._collect_off_loop, tg, self.started.set)
            return
        self.started.set()
        if movable:  # on the caller's loop until a sink attached late moves it (start(replay_buffer=...))
            self.plane_scope = anyio.CancelScope()
            tg.start_soon(self._plane_on_loop, tg, self.plane_scope)
        else:
            self._start_data_plane(tg)

    def _start_data_plane(self, tg: Any) -> None:
        """The tasks that take the workers' batches to the consumers or the sink."""
        s = self.shared
        for w in s.workers:
            tg.start_soon(supervise, s, w)
        tg.start_soon(s.producer.produce)  # type: ignore[union-attr]
        if s.sink is not None:
            tg.start_soon(self._drain_into_sink)
        if s.config.step_timeout is not None:
            tg.start_soon(watchdog, s, s.config.step_timeout)
        if s.server is not None:
            tg.start_soon(s.server.watch)

    async def _plane_on_loop(self, tg: Any, scope: anyio.CancelScope) -> None:
        """The data plane on the caller's loop, in ``scope``: a sink attached to the running
        collector (:meth:`_move_off_loop`) cancels the scope once every task of the plane is parked
        (waiting, with nothing half-done), then runs the plane in the collector's own loop."""
        try:
            with scope:
                async with anyio.create_task_group() as plane:
                    self._start_data_plane(plane)
        finally:
            self.plane_scope = None
        if scope.cancelled_caught:  # moved: on to the collector's loop
            moved = self.moved
            assert moved is not None
            await self._collect_off_loop(tg, moved.set)

    async def _move_off_loop(self) -> None:
        """Move the data plane to the collector's loop, at a moment when cancelling it loses
        nothing: the producer, every worker's reader and every env call parked (they park within
        a round: the producer once its ``prefetch`` batches are collected)."""
        s = self.shared
        scope = self.plane_scope
        while scope is not None and self.plane_scope is scope and not scope.cancel_called:
            producer = s.producer
            if (producer is not None and producer.parked and all(w.parked for w in s.workers)
                    and not any(getattr(w, "calls", None) for w in s.workers)):
                scope.cancel()  # (no await since the check: every task is still where it was seen)
                return
            await anyio.sleep(0.001)

    async def _collect_off_loop(self, tg: Any, on_ready: Callable[[], Any]) -> None:
        """Background collection: the data plane runs in the collector's own loop (a thread,
        :mod:`~aiocollect._collector.offloop`), so that batches reach the sink while the caller's
        thread trains without awaiting. Ends (the thread joined) when the run's task group is
        cancelled; the data plane's error is raised here. ``on_ready()`` once the thread runs it."""
        s = self.shared
        home = CollectorLoop(self.loop, tg)

        async def data_plane() -> None:
            async with anyio.create_task_group() as plane:
                self._start_data_plane(plane)

        s.home = home
        for w in s.workers:
            w.home = home
        try:
            await home.run(data_plane, s.config.shutdown_timeout, on_ready)
        finally:
            s.home = None
            for w in s.workers:
                w.home = None

    async def _announce_stop(self) -> None:
        s = self.shared
        reason = "error" if s.errors.error is not None else ("closed" if s.phase.closing else "total_frames")
        if reason == "total_frames" and isinstance(s.sink, QueueSink) and s.sink.consumer_gone:
            reason = "queue_closed"
        with anyio.CancelScope(shield=True):
            try:
                await s.emit(ev.CollectorStopped, reason=reason, frames=s.counts.frames,
                             batches=s.counts.batches, error=s.errors.error)
            except Exception as exc:  # noqa: BLE001 - a handler's error still surfaces
                if s.errors.error is None:
                    s.errors.error = exc

    def _end(self, launch_failed: bool) -> None:
        """The workers are gone: close what the run had open and enter the stopped phase."""
        s = self.shared
        s.profiling.abort_collector()
        s.bus.close()
        if s.bar is not None:
            s.bar.close()
            s.bar = None
        s.send.close()
        if self.abandoned:  # no consumer is left to receive anything
            self.close_stream()
        if s.phase is not Phase.CLOSED:
            s.move_to(_STOPPED_FROM.get(s.phase, Phase.STOPPED) if not launch_failed else Phase.LAUNCH_FAILED)
        s.sync.notify()
        self.started.set()
        if self.moved is not None:
            self.moved.set()
        self.done.set()


async def _write(sink: Any, batch: "TensorDict") -> None:
    result = sink.extend(batch)
    if inspect.isawaitable(result):
        await result


# the phase a run whose workers are gone enters, by the phase it was in (else STOPPED)
_STOPPED_FROM = {
    Phase.FINISHED: Phase.COMPLETED,
    Phase.CLOSING: Phase.STOPPED_CLOSING,
    Phase.CANCELLING_START: Phase.STOPPED_CLOSING,
}


__all__ = ["CollectorState", "Run", "State"]
