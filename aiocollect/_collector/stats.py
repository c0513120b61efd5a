"""``collector.stats()``: running totals, cheap to keep per batch."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any, Mapping

from .._core.wire import BatchInfo
from .._core.public import public


@public
@dataclasses.dataclass(frozen=True)
class CollectorStats:
    """A snapshot of :meth:`Collector.stats`."""

    frames: int
    """Frames delivered to consumers."""
    batches: int
    """Batches delivered."""
    seconds: float
    """Seconds since the workers were ready."""
    fps: float
    """Frames collected per second since the workers were ready."""
    episodes: int
    """Episodes that ended in collected batches."""
    mean_return: float | None
    """Mean return of the last (up to) 100 episodes; ``None`` before the first one ends."""
    timing: Mapping[str, float]
    """Seconds per stage since start: ``"env"`` and ``"policy"`` (summed over workers: CPU time
    in the workers), ``"wait"`` (the collector waiting for workers) and ``"delivery"`` (copying
    out of shared memory, assembling and post-processing)."""
    restarts: int = 0
    """Workers replaced after a failure (``on_worker_failure="restart"``)."""
    batches_copied: int = 0
    """Batches copied out of shared memory. The others were lent (views on the workers' slots,
    which go back to the workers once nothing refers to the batch) or, with ``zero_copy``,
    views held until the next batch is asked for. Batches are copied when every slot that may be
    lent is held by batches the consumer keeps, and for ``trajs_per_batch``."""
    server: Mapping[str, float] | None = None
    """``inference="server"``: the inference server's totals since start: ``"passes"`` (forward
    passes), ``"rows"`` (env rows served), ``"seconds"`` (in forward passes, copies in and out
    included); rows per pass and time per pass follow. ``None`` with worker inference."""


class Stats:
    """Running totals for :meth:`Collector.stats` and the progress bar."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.episodes = 0
        self.restarts = 0
        self.copied = 0
        self.returns: deque[float] = deque(maxlen=100)
        self.timing = {"env": 0.0, "policy": 0.0, "wait": 0.0, "delivery": 0.0}
        self.server: dict[str, float] | None = None  # the inference server's totals when it stopped

    def restarted(self) -> None:
        """A worker was replaced after a failure."""
        self.restarts += 1

    def server_stopped(self, server: Any) -> None:
        """The inference server stops: keep its totals (:meth:`snapshot` reports them after)."""
        self.server = self.server_totals(server)

    @staticmethod
    def server_totals(server: Any) -> dict[str, float]:
        return {"passes": float(server.forward_passes), "rows": float(server.rows_served), "seconds": server.busy}

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def batch(self, infos: "list[tuple[int, BatchInfo]]", *, wait: float, delivery: float) -> dict[str, float]:
        timing = {"env": 0.0, "policy": 0.0, "wait": wait, "delivery": delivery}
        for _, info in infos:
            for key, value in info.timing.items():
                timing[key] += value
            self.episodes += len(info.episodes)
            self.returns.extend(info.episodes.last_returns(self.returns.maxlen or 0))
        for key, value in timing.items():
            self.timing[key] += value
        return timing

    @property
    def mean_return(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None

    def snapshot(self, frames: int, batches: int, server: Any = None) -> CollectorStats:
        seconds = 0.0 if self.t0 is None else time.perf_counter() - self.t0
        return CollectorStats(
            frames=frames,
            batches=batches,
            seconds=seconds,
            fps=frames / seconds if seconds > 0 else 0.0,
            episodes=self.episodes,
            mean_return=self.mean_return,
            timing=dict(self.timing),
            restarts=self.restarts,
            batches_copied=self.copied,
            server=self.server if server is None else self.server_totals(server),
        )
