"""The producer (credits, waiting, assembly, delivery, failures, zero-copy leases, cancellation)
with fake workers (tests/fake_workers.py, passed in as the collector's backend): no worker
process and no env step, so each case says exactly which worker delivered what and when. Every
other stage is the real one."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiocollect import Collector, CollectorClosedError, EndOfCollection, State, WorkerError
from aiocollect.events import WorkerFailed, WorkerRestarted
from fake_workers import FakeBackend, Script, value

pytestmark = pytest.mark.timeout(60)

E, T = 2, 4  # envs per worker, frames per env in a batch


def _collector(fake: FakeBackend, **kw) -> Collector:
    kw.setdefault("num_workers", 2)
    kw.setdefault("frames_per_batch", kw["num_workers"] * E * T if kw.get("delivery", "sync") == "sync" else E * T)
    return Collector("CartPole-v1", None, envs_per_worker=E, backend=fake, **kw)


def _source(batch) -> list[int]:
    """Per env row of a batch: the value its fake worker wrote (``worker * 1000 + n``)."""
    obs = batch["observation"]
    assert (obs == obs[:, :1, :1]).all(), "each row holds one worker's batch"
    return obs[:, 0, 0].to(torch.int64).tolist()


async def test_sync_batches_hold_every_workers_rows_and_never_run_ahead():
    """A complete program: the batch of round n has worker 0's rows then worker 1's, both from
    their batch n, even when one worker is slower; with prefetch=0 no worker is granted a batch
    before the consumer asks for it; the run ends at total_frames and the workers are stopped."""
    fake = FakeBackend(Script(), Script(delay=lambda n: 0.01))
    pools = fake.pools
    received = 0
    async with _collector(fake, total_frames=16 * 5, prefetch=0) as c:
        async for batch in c:
            assert batch.batch_size == torch.Size([4, T])
            assert _source(batch) == [value(0, received)] * E + [value(1, received)] * E
            assert all(w.credits_sent <= received + 1 for w in pools[0]), "prefetch=0: granted ahead"
            received += 1
        assert c.state is State.STOPPED
    workers = pools[0]
    assert received == 5
    assert [sum(w.granted) for w in workers] == [5, 5]
    assert all(w.stopped for w in workers)


async def test_prefetch_grants_that_many_batches_ahead():
    fake = FakeBackend(Script(), Script())
    pools = fake.pools
    async with _collector(fake, total_frames=16 * 6, prefetch=2) as c:
        await c.collect()
        with anyio.fail_after(10):
            while not all(w.completed == 3 for w in pools[0]):  # the one asked for and 2 ahead
                await anyio.sleep(0.01)
        await anyio.sleep(0.05)
        assert [w.credits_sent for w in pools[0]] == [3, 3]


async def test_async_delivery_takes_whichever_worker_is_ready():
    """delivery='async': each batch is one worker's rows, each worker's batches in its order, and
    a slow worker does not hold the fast one back."""
    fake = FakeBackend(Script(), Script(delay=lambda n: 0.3))
    pools = fake.pools
    sources = []
    async with _collector(fake, total_frames=E * T * 8, delivery="async") as c:
        async for batch in c:
            assert batch.batch_size == torch.Size([E, T])
            rows = _source(batch)
            assert len(set(rows)) == 1
            sources.append(rows[0])
    assert len(sources) == 8
    for w in (0, 1):
        mine = [v - value(w, 0) for v in sources if v // 1000 == w]
        assert mine == list(range(len(mine))), f"worker {w}'s batches out of order: {mine}"
    counts = [sum(1 for v in sources if v // 1000 == w) for w in (0, 1)]
    assert counts[0] > counts[1], f"the fast worker delivered {counts[0]}, the slow one {counts[1]}"
    assert pools[0][0].completed >= counts[0]


async def test_a_failed_worker_raises_after_the_batches_completed_before():
    failed: list[WorkerFailed] = []
    fake = FakeBackend(Script(), Script(fail_at=2))
    c = _collector(fake, total_frames=16 * 5)
    c.on(WorkerFailed, failed.append)
    got = []
    async with c:
        with pytest.raises(WorkerError, match="fake worker 1 failed at its batch 2"):
            async for batch in c:
                got.append(_source(batch))
        assert c.state is State.STOPPED
        with pytest.raises(WorkerError):  # the error stays: the collector is not reusable
            await c.collect()
    with pytest.raises(CollectorClosedError):
        await c.collect()
    assert got == [[value(0, n)] * E + [value(1, n)] * E for n in range(2)]
    assert [e.worker for e in failed] == [1]


async def test_a_restarted_worker_goes_on_where_its_seat_left_off():
    restarted: list[WorkerRestarted] = []
    fake = FakeBackend(Script(), Script(fail_at=2))
    pools = fake.pools
    c = _collector(fake, total_frames=16 * 5, on_worker_failure="restart", max_restarts=1)
    c.on(WorkerRestarted, restarted.append)
    async with c:
        got = [_source(b) async for b in c]
        assert c.stats().restarts == 1
    assert got == [[value(0, n)] * E + [value(1, n)] * E for n in range(5)]
    assert [e.worker for e in restarted] == [1] and pools[0][1].restarts == 1


async def test_zero_copy_holds_the_slots_until_the_next_batch():
    """zero_copy=True: the consumer's batch is a view on the slots, which no worker gets back
    until the consumer asks for the next batch; then the view's data is still that batch's."""
    fake = FakeBackend(Script(), Script())
    pools = fake.pools
    async with _collector(fake, total_frames=16 * 4, zero_copy=True, prefetch=1) as c:
        n = 0
        async for batch in c:
            await anyio.sleep(0.02)  # (the workers fill the other slots meanwhile)
            for w in pools[0]:
                assert w.written[n] not in w.released[n:], "a held slot was released"
                assert len(w.released) == n
            assert _source(batch) == [value(0, n)] * E + [value(1, n)] * E, "overwritten while held"
            n += 1
    assert n == 4
    assert all(len(w.released) >= 3 for w in pools[0])


async def test_a_cancelled_collect_loses_no_batch():
    fake = FakeBackend(Script(delay=lambda n: 0.2), Script(delay=lambda n: 0.2))
    async with _collector(fake, total_frames=16 * 2, prefetch=0) as c:
        with anyio.move_on_after(0.05) as scope:
            await c.collect()
        assert scope.cancelled_caught and c.batches == 0
        assert _source(await c.collect()) == [value(0, 0)] * E + [value(1, 0)] * E
        assert _source(await c.collect()) == [value(0, 1)] * E + [value(1, 1)] * E
        with pytest.raises(EndOfCollection):
            await c.collect()
        assert c.batches == 2


async def test_a_sync_batch_made_before_its_last_part_holds_that_rounds_data():
    """Sync delivery makes a round's batch on its slot once the first worker's part is in, while
    the slower one still collects: every batch delivered holds both workers' rows of its round,
    and its ``("next", "done")`` is ``terminated | truncated`` of those rows, also once the
    consumer keeps a batch (then copied) and when a worker is replaced in the middle of a
    round."""
    fake = FakeBackend(Script(ends=True), Script(delay=lambda n: 0.02, fail_at=5, ends=True))
    rounds, kept = 12, []
    async with _collector(fake, total_frames=16 * rounds, prefetch=0, on_worker_failure="restart", max_restarts=1) as c:
        producer = c._run.shared.producer
        n = 0
        async for batch in c:
            assert _source(batch) == [value(0, n)] * E + [value(1, n)] * E
            nxt = batch["next"]
            assert nxt["done"].any() and not nxt["done"].all(), "the fake's flags are a fifth True"
            assert torch.equal(nxt["done"], nxt["terminated"] | nxt["truncated"])
            if n == 3:
                kept.append(batch)  # (with the loop's variable, all the slots it may be lent: copies)
            if n == 7:
                kept.clear()  # (lent again)
            n += 1
        assert n == rounds and c.stats().restarts == 1
        made_ahead, copied = producer.made_ahead, c.stats().batches_copied
    assert copied >= 1 and made_ahead >= rounds // 2, (made_ahead, copied)
