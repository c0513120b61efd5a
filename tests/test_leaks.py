"""Nothing accumulates over many collectors (issues 8 and 14): open / collect / close cycles, as
users write them and cancelled at random points, leave no process, fd, shared memory or thread
behind, and RSS stays flat.

Real workers (2 x 2 CartPole envs, 64-frame batches, a small MLP policy). Each test warms up
first (the first cycles of a test import and allocate what later ones reuse), then compares the
counts of ``benchmarks/_leaks.py`` after its cycles with those after the warm-up: the launcher's
live children (running workers), this process's open fds, memfd fds and mappings, OS and Python
threads and live aiocollect objects, and the launcher's open fds must not have grown at all,
neither at once after each cycle nor at the end; RSS may grow by at most ``RSS_TOLERANCE_MB``
(32 MB: generous on purpose, as RSS is noisy; a leak per cycle of any size that matters shows in
the fd, memfd and object counts first). No warning may be emitted (a ``ResourceWarning`` would
say a collector was left to its finalizer).

This is the short version for CI: on each event loop (asyncio and uvloop: their fd watchers
differ) 30 cycles and 20 cancellations, 60 and 40 in all, about 20 s on an idle 2-core machine.
``benchmarks/leaks.py`` runs 1,000 cycles and 200 cancellations.
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import warnings
from pathlib import Path

import pytest
import sniffio
import torch

from aiocollect import State

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks`
from benchmarks._leaks import (  # noqa: E402
    HOWS,
    TARGETS,
    CYCLES as CYCLE_KINDS,
    ArgmaxMLP,
    Cancel,
    CycleSettings,
    Phases,
    Snapshot,
    alive,
    open_collector,
    run_cycle,
    settled_snapshot,
    snapshot,
)

RSS_TOLERANCE_MB = 32.0
CYCLES = 10  # per kind and event loop
CANCELLATIONS = 10  # per way of cancelling and event loop
SETTINGS = CycleSettings(num_workers=2, envs_per_worker=2, frames_per_batch=64)


def _policy() -> ArgmaxMLP:
    torch.manual_seed(0)
    return ArgmaxMLP()


async def _warm_up(policy: ArgmaxMLP) -> Snapshot:
    """A cycle of each kind and two cancelled ones, then the counts to compare with."""
    for kind in CYCLE_KINDS:
        await run_cycle(kind, policy, SETTINGS, seed=0)
    await run_cycle("with", policy, SETTINGS, seed=1, cancel=Cancel(0.0, Phases.ENTRY, "scope"))
    how = "task" if sniffio.current_async_library() == "asyncio" else "scope"  # (trio: no task.cancel())
    await run_cycle("weights", policy, SETTINGS, seed=2, cancel=Cancel(0.02, Phases.COLLECTING, how))
    return await settled_snapshot()


def _assert_no_growth(baseline: Snapshot, after: Snapshot, caught: list[warnings.WarningMessage]) -> None:
    assert not [str(w.message) for w in caught], "warnings while cycling (a collector left to its finalizer?)"
    problems = after.problems(baseline, RSS_TOLERANCE_MB)
    assert not problems, f"grew over the cycles: {problems}"


@pytest.mark.parametrize("kind", list(CYCLE_KINDS))
async def test_open_collect_close_cycles_leave_nothing_behind(kind):
    """``CYCLES`` cycles of: open a collector, collect one batch, close it; written as ``async
    with ... async for`` (with), the same with ``update_weights`` after the batch (weights), or
    as a notebook's separate ``await c.start()`` / ``collect()`` / ``aclose()`` calls (notebook).
    After each, nothing of it is left, even for a moment; after all, nothing grew."""
    policy = _policy()
    baseline = await _warm_up(policy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(CYCLES):
            assert await run_cycle(kind, policy, SETTINGS, seed=100 + i) == Phases.DONE
            # at once, without settling: when aclose() returned, its workers had exited
            assert not snapshot().problems(baseline, float("inf")), (i, snapshot())
        gc.collect()
    _assert_no_growth(baseline, await settled_snapshot(baseline), caught)


@pytest.mark.parametrize("how", [pytest.param(h, marks=pytest.mark.asyncio_only) if h == "task" else h for h in HOWS])
async def test_cycles_cancelled_at_random_points_leave_nothing_behind(how):
    """``CANCELLATIONS`` cycles (of each kind in turn) cancelled 0-300 ms (seeded) after their
    start or after their entry, or 0-30 ms after they began closing: by a cancel scope around
    them (``move_on_after``), or by ``task.cancel()`` of the task running them.
    Cancellations land while the collector starts (in ``async with``'s entry, in ``await
    c.start()``), while it collects (cycles collect until cancelled) and while it closes; a
    notebook cycle interrupted before its closing cell still runs it. Nothing grows."""
    policy = _policy()
    rng = random.Random(14)
    targets = TARGETS
    baseline = await _warm_up(policy)
    hit: dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(CANCELLATIONS):
            kind = list(CYCLE_KINDS)[i % len(CYCLE_KINDS)]
            after = targets[i % len(targets)]
            # the first ones certainly hit the entry and the collection; the rest anywhere
            longest = 0.03 if after == Phases.CLOSING else 0.3
            cancel = Cancel(0.0 if i < len(targets) else rng.uniform(0.0, longest), after, how)
            phase = await run_cycle(kind, policy, SETTINGS, seed=200 + i, cancel=cancel)
            hit[phase] = hit.get(phase, 0) + 1
            assert not snapshot().problems(baseline, float("inf")), (i, kind, cancel, snapshot())
        gc.collect()
    assert hit.get(Phases.ENTRY) and hit.get(Phases.COLLECTING), hit
    _assert_no_growth(baseline, await settled_snapshot(baseline), caught)


@pytest.mark.asyncio_only
async def test_task_cancelled_while_closing_still_closes_everything_first():
    """``task.cancel()`` (``asyncio.wait_for``'s timeout, a server stopping) reaching a task while
    it leaves ``async with Collector(...)``: the cancellation propagates once the collector is
    closed, its workers gone and its shared memory freed, as with a cancel scope."""
    policy = _policy()
    baseline = await _warm_up(policy)
    c = open_collector(policy, SETTINGS, seed=0)
    pids: list[int] = []

    async def consumer() -> None:
        async with c:
            await c.collect()
            pids.extend(c.worker_pids)
            asyncio.get_running_loop().call_soon(task.cancel)  # arrives while __aexit__ closes

    task = asyncio.ensure_future(consumer())
    try:
        await asyncio.wait({task})
        assert task.cancelled()
        assert c.state is State.CLOSED
        assert not [p for p in pids if alive(p)]
        assert not snapshot().problems(baseline, float("inf")), snapshot()
    finally:
        await c.aclose()
