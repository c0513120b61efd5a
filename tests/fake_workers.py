"""A fake worker pool for testing the collector's producer without processes or envs (httpx's
``MockTransport`` is the precedent): each :class:`FakeWorker` is a worker seat that "collects" by
writing a known value into its rows of the real slots, on a script (how long each batch takes,
at which batch it fails), and records what the producer asked of it (credits, releases).

Use :func:`fake_pool` as a fixture helper: it replaces the run's worker start-up
(``aiocollect._collector.run.launch_workers``) for the collectors built inside it. Everything after the
start-up is the real thing: the run, the producer, delivery, the slots' shared memory, the
supervisor, events, the consumer's API.

The value written into every numeric leaf of batch ``n`` of worker ``w`` is ``w * 1000 + n``
(booleans are False), so a test can tell where each row of a delivered batch came from.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from typing import Any, Callable, Iterator

import anyio
import numpy as np
import pytest

import aiocollect._collector.run
from aiocollect import WorkerError
from aiocollect._core.layout import SlotLayout, frame_leaves
from aiocollect._worker.policy import PolicySpec
from aiocollect._collector.producer import whole_slots
from aiocollect._collector.startup import rollout_configs
from aiocollect._worker.vector import open_rollout
from aiocollect._core.wire import NO_EPISODES, BatchInfo
from aiocollect._backends.workers import WorkerHandle, _Slots, allocate_segment


@dataclasses.dataclass
class Script:
    """How a fake worker behaves: ``delay(n)`` seconds for its batch ``n``; ``fail_at``: the batch
    at which it fails (its serve() returns an error, as a dying process's does)."""

    delay: Callable[[int], float] = lambda n: 0.0
    fail_at: int | None = None


def value(worker: int, n: int) -> int:
    return worker * 1000 + n


class FakeWorker(WorkerHandle):
    def __init__(self, index: int, script: Script) -> None:
        super().__init__(index)
        self.script = script
        self.credits = 0
        self.free: deque[int] = deque()
        self.wakeup = anyio.Event()
        self.granted: list[int] = []  # every grant's size
        self.released: list[int] = []  # every slot released, in order
        self.written: list[int] = []  # slot of each batch written
        self.stopped = False
        self.failed_once = False

    async def grant(self, credits: int) -> None:
        self.credits_sent += credits
        self.credits += credits
        self.granted.append(credits)
        self.wakeup.set()

    async def release(self, slot: int) -> None:
        self.held.discard(slot)
        self.released.append(slot)
        if slot not in self.free:
            self.free.append(slot)
        self.wakeup.set()

    async def give_store(self, store: Any) -> None:
        pass

    async def serve(self, on_ready: Any, on_applied: Any) -> BaseException:
        while True:
            while not (self.credits > 0 and self.free):
                self.wakeup = anyio.Event()
                await self.wakeup.wait()
            n = self.completed
            if self.script.fail_at == n and not self.failed_once:
                self.failed_once = True
                return WorkerError(f"fake worker {self.index} failed at its batch {n}", worker=self.index)
            slot = self.free.popleft()
            self.credits -= 1
            await anyio.sleep(self.script.delay(n))
            for view in self.slots.np_views[slot].values():
                view[...] = False if view.dtype == np.bool_ else value(self.index, n)
            self.written.append(slot)
            rows = self.slots.np_views[slot][("observation",)].shape[0]
            self._completed(slot, BatchInfo(NO_EPISODES, [0] * rows, {"env": 0.0, "policy": 0.0}, 0))
            on_ready(self)

    async def replace(self, cfg: Any) -> None:
        """As a replacement process: no credits (the producer grants them again from what the seat
        completed), the slots neither waiting for delivery nor held."""
        self.restarts += 1
        self.credits_sent = self.completed
        self.credits = 0
        self.free = deque(self.free_slots())

    async def stop(self, timeout: float) -> None:
        self.stop_nowait()

    def stop_nowait(self) -> None:
        self.stopped = True
        self.slots = None  # type: ignore[assignment]


def _launcher_for(scripts: list[Script], pools: list[list[FakeWorker]]) -> Callable[[Any], Any]:
    async def launch_workers(run: Any) -> None:
        c = run.config
        assert len(scripts) == c.workers, f"{len(scripts)} scripts for {c.workers} workers"
        run.configs = rollout_configs(run, [PolicySpec("random", exploration_type=c.exploration_type)] * c.workers)
        real = open_rollout(run.configs[0])  # (its spec only: the batch leaves of the real env)
        try:
            spec = real.spec()
        finally:
            real.close()
        workers = [FakeWorker(i, s) for i, s in enumerate(scripts)]
        run.workers = workers
        pools.append(workers)
        T = c.frames_per_batch // c.envs_per_batch
        leaves = frame_leaves(spec["obs"], spec["act"], spec["extras"])
        run.layout = SlotLayout.build(leaves, run.rows_per_worker, T, c.num_slots, len(workers))
        run.sync.setup([None] * len(workers), workers)
        run.segment = allocate_segment(run.layout, "aiocollect-test-fake")
        for w in workers:
            w.slots = _Slots(run.layout, run.segment[1], w.index)
            w.free.extend(range(run.layout.num_slots))
        run.slot_views = whole_slots(run.layout, run.segment[1])
        run.workers_ready = True

    return launch_workers


@contextlib.contextmanager
def fake_pool(monkeypatch: pytest.MonkeyPatch, *scripts: Script) -> Iterator[list[list[FakeWorker]]]:
    """Collectors started inside get fake workers (one per script); yields the list of the pools
    started (one list of workers per collector start)."""
    pools: list[list[FakeWorker]] = []
    with monkeypatch.context() as m:
        m.setattr(aiocollect._collector.run, "launch_workers", _launcher_for(list(scripts), pools))
        yield pools
