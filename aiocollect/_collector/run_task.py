"""A run's own task: :class:`RunTask`.

Started once, when the collector first starts (a system task: the collector's user never awaits
it), it launches the workers, announces the start, starts the data plane
(:class:`~aiocollect._collector.plane.DataPlane`) in its task group and waits until the run is
asked to stop; then it stops the workers, announces the stop, and closes what the run had open
before entering its stopped phase. It is part of the run's lifecycle.
"""

from __future__ import annotations

import sys
import time

import anyio

from .. import events as ev
from .._backends.failures import STARTING_GRACE
from .._service.resource import unwrap_group
from .consumer import BatchStream
from .plane import DataPlane
from .pool import import_in_thread
from .queue_sink import QueueSink
from .run_state import Phase, RunState


class RunTask:
    """The run's own task (see the module docstring): :meth:`run` is its body."""

    def __init__(self, state: RunState, plane: DataPlane, stream: BatchStream) -> None:
        self.state = state
        self.plane = plane
        self.stream = stream
        self.started = anyio.Event()  # the run is running (or failed, or ended): start() returns
        self.done = anyio.Event()  # the workers are gone
        self.launching: anyio.CancelScope | None = None  # while the workers start
        # causes that outlive the phases they ended
        self.loop_gone = False  # the event loop that ran it ended under it
        self.abandoned = False  # its Collector was garbage-collected

    async def run(self) -> None:
        s = self.state
        cancelled = anyio.get_cancelled_exc_class()
        launch_failed = False
        try:
            try:
                async with anyio.create_task_group() as tg:
                    t_launch = time.perf_counter()
                    await self._launch()
                    if not s.phase.closing:  # (else closed while starting: nothing more to start)
                        await self._announce_start(time.perf_counter() - t_launch)
                        if not s.phase.closing:  # (else closed by a handler of CollectorStarted)
                            s.move_to(Phase.RUNNING)
                            self.plane.start(tg, self.started.set)
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
                await self._stop_workers()
            await self._announce_stop()
        finally:
            if isinstance(s.delivery.sink, QueueSink):  # (also a delivery that never began: a start failed or cancelled)
                try:
                    await s.delivery.sink.end()
                except Exception as exc:  # noqa: BLE001 - the user's queue did not close: aclose() raises it
                    s.errors.error = s.errors.error or exc
            self._end(launch_failed)

    async def _launch(self) -> None:
        s = self.state
        with anyio.CancelScope() as self.launching:  # (aclose() cancels a start-up in progress)
            if s.phase.closing:  # closed before this task ran: nothing to start
                self.launching.cancel()
            async with anyio.create_task_group() as starting:
                if "tensordict" not in sys.modules:
                    # (given up with the start-up: left to finish in its thread, which harms nothing)
                    starting.start_soon(import_in_thread, "tensordict", min(s.config.shutdown_timeout, STARTING_GRACE))
                await s.pool.launch(s.resume_point())
                s.profiling.start()
                if s.config.progress:
                    from .._service.progress import make_bar

                    s.delivery.bar = make_bar(s.config.total_frames, s.delivery.counts.frames)
        self.launching = None

    async def _stop_workers(self) -> None:
        """Stop the pool's workers and release its memory (the slots of batches the consumer
        still holds stay mapped), and the producer's."""
        s = self.state
        producer = s.producer
        lent = {slot for loan in producer.loans.out for _, slot in loan.parts} if producer is not None else set()
        try:
            await s.pool.stop(lent, s.stats.server_stopped)
        finally:
            if producer is not None:
                producer.chunks.clear()
                producer.loans.clear()  # (a lent batch the consumer keeps keeps its mapping itself)

    async def _announce_start(self, startup_seconds: float) -> None:
        s = self.state
        s.stats.start()
        for w in s.pool.workers:
            await s.emit(ev.WorkerStarted, worker=w.index, pid=w.pid)
        await s.emit(
            ev.CollectorStarted,
            num_workers=s.config.num_workers,
            envs_per_worker=s.config.envs_per_worker,
            pids=tuple(w.pid for w in s.pool.workers if w.pid is not None),
            startup_seconds=startup_seconds,
        )

    async def _announce_stop(self) -> None:
        s = self.state
        reason = "error" if s.errors.error is not None else ("closed" if s.phase.closing else "total_frames")
        if reason == "total_frames" and isinstance(s.delivery.sink, QueueSink) and s.delivery.sink.consumer_gone:
            reason = "queue_closed"
        with anyio.CancelScope(shield=True):
            try:
                await s.emit(ev.CollectorStopped, reason=reason, frames=s.delivery.counts.frames,
                             batches=s.delivery.counts.batches, error=s.errors.error)
            except Exception as exc:  # noqa: BLE001 - a handler's error still surfaces
                if s.errors.error is None:
                    s.errors.error = exc

    def _end(self, launch_failed: bool) -> None:
        """The workers are gone: close what the run had open and enter the stopped phase."""
        s = self.state
        s.profiling.abort_collector()
        s.bus.close()
        if s.delivery.bar is not None:
            s.delivery.bar.close()
            s.delivery.bar = None
        if s.delivery.send is not None:
            s.delivery.send.close()
        if self.abandoned:  # no consumer is left to receive anything
            self.stream.close()
        if s.phase is not Phase.CLOSED:
            s.move_to(_STOPPED_FROM.get(s.phase, Phase.STOPPED) if not launch_failed else Phase.LAUNCH_FAILED)
        s.sync.notify()
        self.started.set()
        self.plane.ended()
        self.done.set()


# the phase a run whose workers are gone enters, by the phase it was in (else STOPPED)
_STOPPED_FROM = {
    Phase.FINISHED: Phase.COMPLETED,
    Phase.CLOSING: Phase.STOPPED_CLOSING,
    Phase.CANCELLING_START: Phase.STOPPED_CLOSING,
}


__all__ = ["RunTask"]
