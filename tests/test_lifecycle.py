"""Structured lifecycle and cleanup: a collector starts and closes from any task, ends after
``total_frames``, survives cancellation without losing frames, and leaves no process, thread or
shared memory behind (the autouse fixture in conftest checks the leftovers after every test)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch

from aiocollect import (
    AiocollectError,
    Collector,
    CollectorClosedError,
    EndOfCollection,
    State,
)
from aiocollect._backends.launcher import get_launcher
from aiocollect.testing import CountingEnv
from procs import alive as _alive

SCRIPTS = Path(__file__).resolve().parent / "scripts"
OBS = "observation"
NEXT_OBS = ("next", "observation")
TRAJ = ("collector", "traj_ids")


def _aiocollect_mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if "aiocollect" in line]


def counting(**kwargs):
    """Kwargs for a CountingEnv whose episodes outlast every test (obs = seed * 100 + step)."""
    return {"episode_length": 99, **kwargs}


def assert_continues(prev, batch) -> None:
    """``batch`` takes every env up exactly where ``prev`` left it: same trajectory, and the
    first observation is the last next-observation of ``prev``."""
    assert torch.equal(batch[OBS][:, 0], prev[NEXT_OBS][:, -1]), (prev[NEXT_OBS][:, -1, 0], batch[OBS][:, 0, 0])
    assert torch.equal(batch[TRAJ][:, 0], prev[TRAJ][:, -1])


# ---- states and closing -------------------------------------------------------------------------

async def test_async_with_starts_and_closes():
    """`async with` starts the collector on entry (workers running) and closes it on exit."""
    c = Collector("CartPole-v1", frames_per_batch=32, num_workers=1)
    assert c.state is State.CREATED and c.worker_pids == ()
    async with c as entered:
        assert entered is c
        assert c.state is State.RUNNING
        pids = c.worker_pids
        assert len(pids) == 1 and all(_alive(p) for p in pids)
        batch = await c.collect()
        assert batch.batch_size == torch.Size([1, 32])
    assert c.state is State.CLOSED
    assert c.worker_pids == ()
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_state_goes_created_running_stopped_closed(num_workers):
    """state: CREATED -> RUNNING (start) -> STOPPED (total_frames delivered, by itself, without
    another request) -> CLOSED (aclose)."""
    c = Collector(CountingEnv, frames_per_batch=16, total_frames=32, num_workers=num_workers)
    assert c.state is State.CREATED
    await c.start()
    assert c.state is State.RUNNING
    await c.collect()
    assert c.state is State.RUNNING
    await c.collect()  # the last batch
    with anyio.fail_after(10):
        while c.state is not State.STOPPED:
            await anyio.sleep(0.01)
    await c.aclose()
    assert c.state is State.CLOSED


async def test_aclose_twice_is_fine():
    """aclose() is idempotent."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1)
    await c.start()
    await c.collect()
    await c.aclose()
    await c.aclose()
    assert c.state is State.CLOSED


async def test_start_after_close_raises_collector_closed_error():
    """A closed collector cannot be restarted: start() raises CollectorClosedError."""
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=1) as c:
        await c.collect()
    with pytest.raises(CollectorClosedError, match="closed"):
        await c.start()
    with pytest.raises(CollectorClosedError):
        async with c:
            pass  # pragma: no cover


async def test_collect_after_close_raises_collector_closed_error():
    """collect() and `async for` on a closed collector raise CollectorClosedError."""
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=1) as c:
        await c.collect()
    with pytest.raises(CollectorClosedError):
        await c.collect()
    with pytest.raises(CollectorClosedError):
        async for _ in c:
            pass  # pragma: no cover


async def test_never_started_collector_closes_fine_and_cannot_start_after():
    """A collector that was never started closes without error (twice), and is then closed."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1)
    await c.aclose()
    await c.aclose()
    assert c.state is State.CLOSED
    with pytest.raises(CollectorClosedError):
        await c.start()
    with pytest.raises(CollectorClosedError):
        await c.collect()


def test_never_started_collector_closes_fine_with_blocking_close():
    """close() (the blocking wrapper) on a never-started collector is fine, twice."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1)
    c.close()
    c.close()
    assert c.state is State.CLOSED


@pytest.mark.parametrize("how", ["collect", "async for"])
async def test_collect_and_async_for_start_the_collector_if_needed(how):
    """collect() and `async for` start a CREATED collector themselves."""
    c = Collector(CountingEnv, frames_per_batch=16, total_frames=32, num_workers=1)
    try:
        if how == "collect":
            batches = [await c.collect()]
        else:
            batches = [b async for b in c]
        assert batches[0].batch_size == torch.Size([1, 16])
        assert c.state in (State.RUNNING, State.STOPPED)
    finally:
        await c.aclose()


async def test_start_is_idempotent_and_concurrent_starts_share_the_workers():
    """start() twice, or from two tasks at once, starts the workers once."""
    from aiocollect._backends import workers as _workers

    first = len(_workers.started_pids)
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=2) as c:
        async with anyio.create_task_group() as tg:
            tg.start_soon(c.start)
            tg.start_soon(c.start)
        await c.start()
        assert len(_workers.started_pids) - first == 2
        assert sorted(_workers.started_pids[first:]) == sorted(c.worker_pids)


# ---- total_frames -------------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 1, 2], ids=["local", "1-worker", "2-workers"])
async def test_total_frames_ends_iteration_after_exact_number_of_batches(num_workers):
    """`async for` ends after exactly total_frames / frames_per_batch batches; collect() then
    raises EndOfCollection (every time); the workers are gone (state STOPPED) before aclose()."""
    c = Collector(CountingEnv, frames_per_batch=16, total_frames=80, num_workers=num_workers,
                  envs_per_worker=2, create_env_kwargs=counting())
    async with c:
        pids = c.worker_pids
        assert len(pids) == num_workers
        n = 0
        frames = 0
        with anyio.fail_after(30):
            async for batch in c:
                n += 1
                frames += batch.numel()
        assert n == 5 and frames == 80
        assert c.frames == 80 and c.batches == 5
        assert c.state is State.STOPPED
        assert c.worker_pids == ()
        assert not any(_alive(p) for p in pids)
        with pytest.raises(EndOfCollection, match="80"):
            await c.collect()
        with pytest.raises(EndOfCollection):
            await c.collect()
    assert c.state is State.CLOSED


async def test_workers_exit_after_last_batch_without_aclose_or_further_request():
    """Once the last batch is delivered, the workers exit by themselves (state STOPPED) while
    the consumer keeps the collector open and makes no further request."""
    async with Collector(CountingEnv, frames_per_batch=16, total_frames=32, num_workers=2,
                         envs_per_worker=1) as c:
        pids = c.worker_pids
        await c.collect()
        await c.collect()
        with anyio.fail_after(10):
            while c.state is not State.STOPPED:
                await anyio.sleep(0.01)
        assert not any(_alive(p) for p in pids)


# ---- notebook shape: start, collect and close from different tasks ------------------------------

async def test_start_collect_close_in_separate_tasks_like_notebook_cells():
    """start() in one task, collect() in another, aclose() in a third (each a finished task
    group, as separate notebook cells are) works: the collector's tasks belong to no cell."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1, seed=0, create_env_kwargs=counting())
    got = []
    async with anyio.create_task_group() as cell:
        cell.start_soon(c.start)
    assert c.state is State.RUNNING

    async def collect_two():
        got.append(await c.collect())
        got.append(await c.collect())

    async with anyio.create_task_group() as cell:
        cell.start_soon(collect_two)
    assert len(got) == 2
    assert_continues(got[0], got[1])
    assert c.state is State.RUNNING
    async with anyio.create_task_group() as cell:
        cell.start_soon(c.aclose)
    assert c.state is State.CLOSED


# ---- cancellation -------------------------------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 1])
async def test_cancelling_a_waiting_consumer_loses_no_frame(prefetch):
    """A collect() cancelled while it waits (move_on_after) loses no frame: the next collect()
    returns a batch that continues exactly where the previous delivered one ended (same
    trajectory ids, observations counting on), and closing leaves no process."""
    # 2 envs of 0.0125 s per step, 8 steps: a batch takes ~0.2 s, the consumer gives up after 0.03 s
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1, envs_per_worker=2, seed=0,
                  prefetch=prefetch, create_env_kwargs=counting(step_sleep=0.0125))
    cancelled = 0
    async with c:
        pids = c.worker_pids
        prev = await c.collect()
        assert prev[OBS][:, 0, 0].tolist() == [0.0, 100.0]  # env k starts at k * 100
        for _ in range(3):
            with anyio.move_on_after(0.03) as scope:
                await c.collect()
                pytest.fail("the batch should take longer than the consumer waited")  # pragma: no cover
            cancelled += scope.cancelled_caught
            with anyio.fail_after(10):
                batch = await c.collect()
            assert_continues(prev, batch)
            prev = batch
        assert c.state is State.RUNNING
    assert cancelled == 3
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_repeated_cancellation_at_random_moments_loses_no_frame(num_workers):
    """Many collect() calls cancelled at assorted moments (some just as a batch arrives): the
    batches that do arrive are, in order, consecutive for every env."""
    import random

    rng = random.Random(0)
    c = Collector(CountingEnv, frames_per_batch=8, num_workers=num_workers, envs_per_worker=2, seed=0,
                  create_env_kwargs=counting(step_sleep=0.002))  # ~16 ms per batch
    delivered = []
    cancelled = 0
    async with c:
        with anyio.fail_after(30):
            while len(delivered) < 25:
                with anyio.move_on_after(rng.uniform(0.0, 0.02)) as scope:
                    delivered.append(await c.collect())
                cancelled += scope.cancelled_caught
    assert cancelled >= 3, cancelled  # the test exercised cancellation
    for prev, batch in zip(delivered, delivered[1:]):
        if not prev[("next", "done")][:, -1].any():  # an episode end restarts the count
            assert_continues(prev, batch)


async def test_cancelling_the_task_that_owns_async_with_shuts_everything_down():
    """Cancelling, from outside, the task that owns `async with` while it iterates (workers in
    the middle of a long batch) closes the collector promptly; no process is left."""
    c = Collector(CountingEnv, frames_per_batch=512, num_workers=2,
                  create_env_kwargs=counting(step_sleep=0.01))  # ~2.5 s per batch
    running = anyio.Event()
    pids: list[int] = []

    async def owner():
        async with c:
            pids.extend(c.worker_pids)
            running.set()
            async for _ in c:
                pass  # pragma: no cover - cancelled before the first batch

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(owner)
            await running.wait()
            await anyio.sleep(0.2)
            t0 = time.monotonic()
            tg.cancel_scope.cancel()
        took = time.monotonic() - t0
    assert took < 5, took  # shutdown_timeout is 5 s; a worker checks for stop every few ms
    assert c.state is State.CLOSED
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


async def test_aclose_finishes_even_when_the_caller_is_cancelled():
    """aclose() called from a scope that is already cancelled still closes everything."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1)
    await c.start()
    pids = c.worker_pids
    with anyio.CancelScope() as scope:
        scope.cancel()
        await c.aclose()
    assert c.state is State.CLOSED
    assert not any(_alive(p) for p in pids)


def _slow_factory(delay: float = 0.5):
    def make():
        time.sleep(delay)  # a slow env start: start() takes a while
        return CountingEnv(episode_length=99)

    return make


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_cancelled_start_leaves_a_collector_that_starts_and_closes(num_workers):
    """A start() cancelled while the workers come up does not break the collector: a later
    start() finishes the same start-up, collecting works, and aclose() cleans up."""
    c = Collector(_slow_factory(), frames_per_batch=16, num_workers=num_workers, seed=0)
    try:
        with anyio.move_on_after(0.1) as scope:
            await c.start()
        if num_workers:  # the local backend builds its env in the loop: nothing to cancel then
            assert scope.cancelled_caught
        with anyio.fail_after(20):
            await c.start()
            assert c.state is State.RUNNING
            batch = await c.collect()
        assert batch[OBS][0, :, 0].tolist() == list(map(float, range(16)))
    finally:
        await c.aclose()
    assert c.state is State.CLOSED


async def test_aclose_while_another_task_is_starting_closes_everything():
    """aclose() while start() is still bringing the workers up (in another task) waits for it
    and closes; no process is left; the starting task does not hang."""
    c = Collector(_slow_factory(), frames_per_batch=16, num_workers=1)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(c.start)
            await anyio.sleep(0.1)
            assert c.state is State.STARTING
            await c.aclose()
    assert c.state is State.CLOSED
    assert c.worker_pids == ()


def _env_that_hangs_in_close():
    class HangsInClose(CountingEnv):
        def close(self):
            if not self.closed:
                time.sleep(60)  # a simulator that never shuts down
            super().close()

    return HangsInClose


class HangsInStep(CountingEnv):
    """Its first step tells it began (a file appears), then never returns."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def step(self, action):
        with open(self.marker, "w"):
            pass
        time.sleep(60)  # a simulator stuck in a step
        return super().step(action)


@pytest.mark.parametrize("where", ["step", "close"])
async def test_worker_stuck_in_env_is_killed_after_shutdown_timeout(where, tmp_path):
    """A worker stuck in an env's step() or close() does not hold up aclose(): it is killed
    after shutdown_timeout seconds."""
    marker = tmp_path / "stepping"
    if where == "step":
        env_fn, kwargs = HangsInStep, {"marker": str(marker)}
    else:
        env_fn, kwargs = _env_that_hangs_in_close(), None
    # (prefetch=1: the worker steps, and gets stuck, without a request)
    c = Collector(env_fn, frames_per_batch=16, num_workers=1, shutdown_timeout=0.5, create_env_kwargs=kwargs,
                  prefetch=1)
    await c.start()
    pids = c.worker_pids
    if where == "close":
        await c.collect()
    else:
        with anyio.fail_after(30):
            while not marker.exists():  # (the worker is in its step now)
                await anyio.sleep(0.01)
    t0 = time.monotonic()
    with anyio.fail_after(10):
        await c.aclose()
    assert 0.4 < time.monotonic() - t0 < 5
    assert c.state is State.CLOSED
    assert not any(_alive(p) for p in pids)


async def test_consumer_waiting_while_another_task_closes_gets_collector_closed_error():
    """A collect() waiting when another task calls aclose() raises CollectorClosedError (the
    collection did not end: it was closed)."""
    c = Collector(CountingEnv, frames_per_batch=256, num_workers=1,
                  create_env_kwargs=counting(step_sleep=0.01))  # a batch takes ~2.5 s
    await c.start()
    errors: list[BaseException] = []

    async def consumer():
        try:
            await c.collect()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            await anyio.sleep(0.1)
            await c.aclose()
    assert len(errors) == 1
    assert isinstance(errors[0], CollectorClosedError), repr(errors[0])


class _Buffer:
    """A replay buffer that keeps every batch it is given."""

    def __init__(self) -> None:
        self.batches: list = []

    def extend(self, batch) -> None:
        self.batches.append(batch.clone())


@pytest.mark.loops("asyncio", "uvloop", "trio")
@pytest.mark.parametrize("prefetch", [0, 2])
async def test_start_with_a_replay_buffer_inside_async_with_gets_every_batch(prefetch):
    """`async with Collector(...) as c: await c.start(replay_buffer=rb)` (the collector started
    by the entry, no batch taken yet) collects into the buffer in the background: every batch of
    total_frames, those collected ahead before the call (prefetch) included, in order, with the
    same frames as a collector of the same seed that is consumed with `async for`."""
    settings = dict(frames_per_batch=64, total_frames=64 * 4, num_workers=1, envs_per_worker=2, seed=3,
                    prefetch=prefetch)
    rb = _Buffer()
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", **settings) as c:
            await anyio.sleep(0.2)  # (with prefetch, batches are collected ahead meanwhile)
            await c.start(replay_buffer=rb)
            while len(rb.batches) < 4:
                await anyio.sleep(0.01)
            with pytest.raises(AiocollectError, match="writes its batches into a replay buffer"):
                await c.collect()
        async with Collector("CartPole-v1", **settings) as reference:
            expected = [batch.clone() async for batch in reference]
    assert len(rb.batches) == len(expected) == 4
    for got, want in zip(rb.batches, expected):
        assert torch.equal(got[OBS], want[OBS]) and torch.equal(got[TRAJ], want[TRAJ])


@pytest.mark.loops("asyncio", "uvloop", "trio")
async def test_a_late_replay_buffer_is_refused_once_a_batch_was_taken_saying_what_to_write():
    """start(replay_buffer=...) after a batch was taken (that batch could not go into the
    buffer), or a second buffer: AiocollectError naming the cause and what to write instead."""
    async with Collector("CartPole-v1", frames_per_batch=32, num_workers=1) as c:
        await c.collect()
        with pytest.raises(AiocollectError, match=r"consumers already asked it for batches\): attach the buffer or "
                           r"queue before taking a batch .*await c\.start\(replay_buffer=rb\)"):
            await c.start(replay_buffer=_Buffer())
    async with Collector("CartPole-v1", frames_per_batch=32, num_workers=1) as c:
        await c.start(replay_buffer=_Buffer())
        with pytest.raises(AiocollectError, match="already writes its batches into a replay buffer or a queue"):
            await c.start(replay_buffer=_Buffer())


async def test_frames_and_batches_count_only_batches_the_consumer_received():
    """`frames` and `batches` ("delivered so far") do not count a batch that waits, prefetched,
    in the stream: after one collect(), they are 16 and 1 however long the consumer waits."""
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=1, prefetch=1) as c:
        await c.collect()
        with anyio.move_on_after(3):  # the prefetched batch takes milliseconds
            while c.batches == 1:
                await anyio.sleep(0.01)
        assert (c.frames, c.batches) == (16, 1)
        assert c.state_dict()["frames"] == 16


# ---- several consumers ----------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [0, 2], ids=["local", "process"])
async def test_several_consumers_get_distinct_batches_and_together_every_batch_once(num_workers):
    """Three tasks calling collect() concurrently on one collector each get distinct batches;
    together they receive every batch exactly once (first observations 0, 8, ..., 88)."""
    c = Collector(CountingEnv, frames_per_batch=16, total_frames=16 * 12, num_workers=num_workers,
                  envs_per_worker=2 if num_workers == 0 else 1, seed=0, create_env_kwargs=counting())
    got: dict[int, list] = {0: [], 1: [], 2: []}

    async def consumer(k):
        while True:
            try:
                got[k].append(await c.collect())
            except EndOfCollection:
                return

    with anyio.fail_after(30):
        async with c, anyio.create_task_group() as tg:
            for k in got:
                tg.start_soon(consumer, k)
    batches = [b for k in got for b in got[k]]
    assert len(batches) == 12
    starts = sorted(int(b[OBS][0, 0, 0]) for b in batches)
    assert starts == list(range(0, 96, 8))
    for b in batches:  # each batch is a contiguous run of steps of each env
        T = b.batch_size[1]
        start = int(b[OBS][0, 0, 0])
        expected = torch.arange(start, start + T, dtype=torch.float32)
        assert torch.equal(b[OBS][0, :, 0], expected)
        assert torch.equal(b[OBS][1, :, 0], expected + 100)
    assert sum(1 for k in got if got[k]) >= 2  # the consumers really shared the stream


# ---- the blocking wrapper -------------------------------------------------------------------------

def test_blocking_with_and_for_returns_every_batch_and_leaves_no_thread():
    """Plain `with Collector(...) as c: for batch in c:` returns total_frames / frames_per_batch
    batches; close() is idempotent; no thread is left (the portal's loop thread ends)."""
    before = set(threading.enumerate())
    with Collector("CartPole-v1", frames_per_batch=32, total_frames=128, num_workers=1) as c:
        assert c.state is State.RUNNING
        batches = [batch for batch in c]
        pids = c.worker_pids
    assert len(batches) == 4
    assert all(b.batch_size == torch.Size([1, 32]) for b in batches)
    assert c.state is State.CLOSED
    c.close()
    c.close()
    assert c.state is State.CLOSED
    assert not any(_alive(p) for p in pids)
    deadline = time.monotonic() + 2
    while [t for t in threading.enumerate() if t not in before] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t not in before]


def test_blocking_for_without_with_then_close():
    """`for batch in collector` without `with` starts the collector; close() ends it."""
    c = Collector(CountingEnv, frames_per_batch=16, total_frames=48, num_workers=1)
    try:
        n = sum(1 for _ in c)
    finally:
        c.close()
    assert n == 3
    assert c.state is State.CLOSED


def test_blocking_break_out_of_endless_loop_then_close():
    """Breaking out of an endless blocking loop and closing leaves nothing behind."""
    with Collector(CountingEnv, frames_per_batch=16, num_workers=1) as c:
        for i, _ in enumerate(c):
            if i == 2:
                break
        assert c.state is State.RUNNING
    assert c.state is State.CLOSED


# ---- processes and shared memory ----------------------------------------------------------------

def test_workers_and_launcher_exit_when_parent_is_killed():
    """A process that runs a collector is SIGKILLed: its workers and its launcher (the template
    process workers are forked from) exit by themselves within 10 s."""
    script = SCRIPTS / "parent_dies.py"
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    pids = info["workers"] + [info["launcher"]]
    assert len(info["workers"]) == 2 and info["launcher"] not in info["workers"]
    assert os.getpid() not in pids
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], "processes outlived their parent"


async def test_shared_memory_is_mapped_during_collection_and_unmapped_after_close():
    """While collecting, the batch slots are mapped (memfd "aiocollect-..."), so the leftover
    check is not vacuous; after aclose() no such mapping or file descriptor remains."""
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=2) as c:
        batch = await c.collect()
        during = _aiocollect_mappings()
        assert len(during) >= 1, during  # one segment for every worker's slots
        assert all("memfd:aiocollect" in line for line in during), during
    del batch
    assert _aiocollect_mappings() == []
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert not [t for t in fds if "aiocollect" in t]


async def test_batches_stay_valid_after_close():
    """A delivered batch is a copy: it keeps its values after the collector is closed."""
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=1, seed=0,
                         create_env_kwargs=counting()) as c:
        batch = await c.collect()
        before = batch.clone()
    assert (batch == before).all()
    assert batch[OBS][0, :, 0].tolist() == list(map(float, range(16)))


# ---- progress bar, several collectors -----------------------------------------------------------

async def test_progress_bar_writes_to_stderr_and_leaves_no_thread(capsys):
    """progress=True shows a bar on stderr and leaves no monitor thread."""
    before = set(threading.enumerate())
    async with Collector(CountingEnv, frames_per_batch=16, total_frames=64, num_workers=1, progress=True) as c:
        n = 0
        async for _ in c:
            n += 1
    assert n == 4
    err = capsys.readouterr().err
    assert "64" in err and "frames" in err, err
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]


async def test_second_collector_in_same_process_uses_the_same_launcher():
    """A second collector, opened while the first runs and after it closed, starts and collects;
    all use the same launcher process."""
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=1) as first:
        await first.collect()
        launcher = get_launcher().pid
        assert launcher is not None and _alive(launcher)
        async with Collector("CartPole-v1", frames_per_batch=16, num_workers=1) as second:
            batch = await second.collect()
            assert batch.batch_size == torch.Size([1, 16])
            assert get_launcher().pid == launcher
            assert set(first.worker_pids).isdisjoint(second.worker_pids)
        await first.collect()
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=1) as third:
        await third.collect()
        assert get_launcher().pid == launcher
