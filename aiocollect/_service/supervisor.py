"""Worker failures: reported, or survived.

:func:`supervise` runs one task per worker seat: it hands the worker's reports to the run and,
when the worker fails, emits :class:`~aiocollect.events.WorkerFailed`, then either replaces it
(``on_worker_failure="restart"``, within the :class:`RestartBudget`) and emits
:class:`~aiocollect.events.WorkerRestarted`, or hands the error to the producer, which raises it
after the batches the worker completed before. :func:`watchdog` declares hung the workers that
spend longer than ``step_timeout`` in one call, are stopped (``SIGSTOP``, a debugger) or make no
progress the collector can see while it waits on them.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, Sequence

import anyio

from .. import events as ev
from .._core.errors import add_note

if TYPE_CHECKING:  # pragma: no cover
    from .._core.geometry import Geometry
    from .._worker.rollout import RolloutConfig


class RestartBudget:
    """At most ``max_restarts`` replacements within any ``window`` seconds (``None``: ever)."""

    def __init__(self, max_restarts: int, window: float | None) -> None:
        self.max_restarts = max_restarts
        self.window = window
        self.times: deque[float] = deque()

    def allow(self, error: BaseException) -> bool:
        """Count a replacement for ``error`` if the budget allows it; else note on ``error`` why
        it is raised and return False."""
        now = time.monotonic()
        if self.window is not None:
            while self.times and now - self.times[0] > self.window:
                self.times.popleft()
        if len(self.times) >= self.max_restarts:
            within = "" if self.window is None else f" within restart_window={self.window:g} s"
            add_note(
                error,
                f"aiocollect gave up replacing failed workers: max_restarts={self.max_restarts} restarts"
                f"{within} were used. Fix the cause, or raise max_restarts",
            )
            return False
        self.times.append(now)
        return True


class SupervisedWorker(Protocol):
    """A worker seat, as its supervisor and the watchdog drive it (the collector's seats:
    :class:`~aiocollect._backends.seat.RolloutSeat`)."""

    @property
    def index(self) -> int: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def completed(self) -> int:
        """Batches its processes reported (a replacement's credits start from it)."""
        ...

    @property
    def counters(self) -> list[int] | None:
        """Its envs' trajectory numbers at the end of its last batch."""
        ...

    @property
    def restarts(self) -> int: ...

    async def serve(self, on_ready: Callable[[Any], None], on_applied: Callable[[Any, int], Awaitable[None]]) -> BaseException:
        """Handle the worker's reports until it fails; return its error."""
        ...

    async def replace(self, cfg: RolloutConfig) -> None:
        """Replace the failed worker by a new one built from ``cfg``."""

    def fail_calls(self, error: BaseException) -> None:
        """The worker failed for good: the env calls waiting on it raise ``error``."""

    def stuck(self, timeout: float) -> tuple[int, int, float] | None:
        """``(what, env, seconds)`` if it is busy with one call for over ``timeout``, else ``None``."""
        ...


class _SupervisedConfig(Protocol):
    @property
    def on_worker_failure(self) -> str: ...

    @property
    def geometry(self) -> Geometry: ...


class _KeptCalls(Protocol):
    def kept_for(self, worker: int) -> tuple[Any, ...]:
        """The env calls worker ``worker``'s replacement applies again before its first batch."""
        ...


class SupervisedRun(Protocol):
    """A collector's worker pool, as the supervisor and the watchdog read and tell it (the
    collector's: :class:`~aiocollect._collector.pool.WorkerPool`)."""

    @property
    def config(self) -> _SupervisedConfig: ...

    @property
    def workers(self) -> Sequence[SupervisedWorker]: ...

    @property
    def configs(self) -> Sequence[RolloutConfig]:
        """Each worker's rollout config, by index."""
        ...

    @property
    def rows_per_worker(self) -> int: ...

    @property
    def total_rows(self) -> int: ...

    @property
    def collecting(self) -> bool:
        """A failed worker is worth replacing: the run still collects."""
        ...

    @property
    def budget(self) -> RestartBudget: ...

    @property
    def env_calls(self) -> _KeptCalls: ...

    def wake(self, worker: Any = None) -> None:
        """A worker has news (a batch ready, a failure): the producer looks again."""

    async def applied(self, worker: Any, version: int) -> None:
        """A worker applied weights ``version``."""

    async def emit(self, event_type: type[ev.Event], **fields: Any) -> None:
        """Emit an event of ``event_type`` built from ``fields`` (if someone listens)."""

    def worker_failed(self, error: BaseException) -> None:
        """A worker failed for good: ``error`` ends the run after the batches it completed."""

    def restarted(self) -> None:
        """A worker was replaced (counted in the stats)."""


async def supervise(run: SupervisedRun, w: SupervisedWorker) -> None:
    """Handle worker ``w``'s reports; when it fails, replace it or report the failure."""
    restart = run.config.on_worker_failure == "restart"
    while True:
        error = await w.serve(run.wake, run.applied)
        while True:
            old_pid = w.pid
            index = getattr(error, "worker", w.index)
            await run.emit(ev.WorkerFailed, worker=-1 if index is None else index, pid=old_pid, error=error)
            if not restart or not run.collecting or not run.budget.allow(error):
                w.fail_calls(error)  # (env calls waiting on it raise the worker's error)
                run.worker_failed(error)
                return
            try:
                await w.replace(replacement_config(run, w))
            except Exception as exc:  # noqa: BLE001 - the replacement failed too: counted the same
                error = exc
                continue
            break
        run.restarted()
        await run.emit(ev.WorkerRestarted, worker=w.index, pid=w.pid, old_pid=old_pid)
        run.wake()


def replacement_config(run: SupervisedRun, w: SupervisedWorker) -> RolloutConfig:
    """The config of ``w``'s replacement: fresh trajectory ids for its envs (the trajectories its
    failure cut end there), the random steps it still owes, seeds derived from the restart, and
    the env calls its envs keep (``set_attr``, persisted calls: replayed before its first batch)."""
    c = run.config
    cfg = run.configs[w.index]
    counters = list(cfg.traj_counters or [0] * run.total_rows)
    rows = run.rows_per_worker  # (a vector env's sub-envs are rows, each with its counter)
    base = w.index * rows
    last = w.counters if w.counters is not None else counters[base : base + rows]
    counters[base : base + rows] = [k + 1 for k in last]
    return dataclasses.replace(
        cfg,
        traj_counters=tuple(counters),
        random_frames=max(cfg.random_frames - w.completed * c.geometry.frames_per_copy, 0),
        restart=w.restarts + 1,
        env_calls=run.env_calls.kept_for(w.index),
    )


async def watchdog(run: SupervisedRun, timeout: float) -> None:
    """Declare hung the workers that spend longer than ``timeout`` seconds in one call, that are
    stopped for that long, or that were granted work and show no progress for that long (checked
    four times per timeout, at most every second): see :meth:`RolloutSeat.stuck
    <aiocollect._backends.seat.RolloutSeat.stuck>`. A worker idle because it was granted no work
    (backpressure, a paused collector) is never hung."""
    period = min(max(timeout / 4, 0.01), 1.0)
    while True:
        await anyio.sleep(period)
        for w in run.workers:
            stuck = w.stuck(timeout)
            if stuck is not None:  # (only a seat that reports hangs has declare_hung: a WatchedSeat)
                watched: Any = w
                await watched.declare_hung(*stuck, timeout)


__all__ = ["RestartBudget", "SupervisedRun", "SupervisedWorker", "replacement_config", "supervise", "watchdog"]
