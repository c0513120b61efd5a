"""A fake worker pool for testing the collector's producer without processes or envs (httpx's
``MockTransport`` is the precedent): each :class:`FakeWorker` is a worker seat that "collects" by
writing a known value into its rows of the real slots, on a script (how long each batch takes,
at which batch it fails), and records what the producer asked of it (credits, releases).

Pass a :class:`FakeBackend` to the collector (``Collector(..., backend=FakeBackend(Script(),
Script()))``): it implements the backend seam (:class:`aiocollect._backends.seat.Backend`) with one
fake worker per script. Everything else is the real thing: the start-up, the run, the producer,
delivery, the slots' shared memory, the supervisor, events, the consumer's API.

The value written into every numeric leaf of batch ``n`` of worker ``w`` is ``w * 1000 + n``
(booleans are False), so a test can tell where each row of a delivered batch came from.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Callable

import anyio
import numpy as np

from aiocollect import WorkerError
from aiocollect._backends.seat import Launch, Sharing, SlotViews
from aiocollect._backends.workers import WorkerHandle, allocate_segment
from aiocollect._core.wire import NO_EPISODES, BatchInfo
from aiocollect._worker.vector import open_rollout


@dataclasses.dataclass
class Script:
    """How a fake worker behaves: ``delay(n)`` seconds for its batch ``n``; ``fail_at``: the batch
    at which it fails (its serve() returns an error, as a dying process's does); ``ends``: episode
    ends in its ``("next", "terminated")`` and ``("next", "truncated")`` flags (a fifth of them,
    drawn from a generator seeded with the batch's value), else every boolean is False."""

    delay: Callable[[int], float] = lambda n: 0.0
    fail_at: int | None = None
    ends: bool = False


_ENDS = (("next", "terminated"), ("next", "truncated"))


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
            rng = np.random.default_rng(value(self.index, n))
            for key, view in self.slots.np_views[slot].items():
                if view.dtype != np.bool_:
                    view[...] = value(self.index, n)
                else:
                    view[...] = self.script.ends and key in _ENDS and rng.random(view.shape) < 0.2
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
        self.slots = SlotViews.unset()


class FakeBackend:
    """A backend of fake workers, one per script; ``pools`` holds the workers of each start."""

    name = "fake"
    weights_in_parent = False
    profiles = False  # (a fake worker records nothing)
    serves_inference = False
    opens_evaluator = False
    options_name = None  # (no options of its own)

    def __init__(self, *scripts: Script) -> None:
        self.scripts = list(scripts)
        self.pools: list[list[FakeWorker]] = []
        self.warmed: list[tuple[str, ...]] = []  # the needs of every warm_up

    def check_options(self, options: Any, workers: int) -> None:
        """No options of its own (aiocollect's backends' are refused by the config's table)."""

    def warm_up(self, needs: tuple[str, ...]) -> None:
        self.warmed.append(needs)

    async def start(self, launch: Launch) -> tuple[list[FakeWorker], list[dict]]:
        configs = launch.configs
        assert len(self.scripts) == len(configs), f"{len(self.scripts)} scripts for {len(configs)} workers"
        real = open_rollout(configs[0])  # (its spec only: the batch leaves of the real env)
        try:
            spec = real.spec()
        finally:
            real.close()
        workers = [FakeWorker(i, s) for i, s in enumerate(self.scripts)]
        self.pools.append(workers)
        return workers, [spec] * len(workers)

    async def share_slots(self, seats: list[FakeWorker], sharing: Sharing) -> tuple[int, Any]:
        segment = allocate_segment(sharing.layout, "aiocollect-test-fake")
        for w in seats:
            w.slots = SlotViews(sharing.layout, segment[1], w.index)
            w.free.extend(range(sharing.layout.num_slots))
        return segment
