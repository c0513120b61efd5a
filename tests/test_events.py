"""Collector events with real worker processes: hooks, episode ends computed in the workers,
batch timing, lifecycle and failure events, postproc, stats."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiocollect import Collector, CollectorClosedError, WorkerError
from aiocollect.events import (
    AfterRollout,
    BatchReady,
    BeforeRollout,
    CollectorStarted,
    CollectorStopped,
    EpisodeEnded,
    Event,
    WorkerFailed,
    WorkerStarted,
)
from aiocollect.testing import CountingEnv, InjectedFailure


def counting(**kw):
    return lambda: CountingEnv(**kw)


async def test_episode_ended_events_match_the_episodes_in_the_batches():
    """EpisodeEnded (computed in the workers) has the return, length and trajectory id of each
    episode that ended in a delivered batch."""
    c = Collector(counting(episode_length=5), frames_per_batch=24, total_frames=96, num_workers=2, envs_per_worker=2, seed=0)
    ended: list[EpisodeEnded] = []
    c.on(EpisodeEnded, ended.append)
    async with c:
        batches = [b async for b in c]
    done = torch.cat([b["next", "done"][..., 0] for b in batches], 1)
    ids = torch.cat([b["collector", "traj_ids"] for b in batches], 1)[done]
    assert sorted(e.traj_id for e in ended) == sorted(ids.tolist())
    rewards = torch.cat([b["next", "reward"][..., 0] for b in batches], 1)
    traj = torch.cat([b["collector", "traj_ids"] for b in batches], 1)
    for e in ended:
        assert e.length == 5 and e.terminated and e.policy_version == 0
        assert e.ret == pytest.approx(float(rewards[traj == e.traj_id].sum()))
        assert e.worker == e.env // 2


async def test_hooks_are_awaited_in_order_and_after_rollout_may_change_the_batch():
    c = Collector("CartPole-v1", frames_per_batch=32, total_frames=96, num_workers=1, envs_per_worker=2)
    order = []

    @c.on(BeforeRollout)
    async def before(event):
        await anyio.sleep(0.001)
        order.append(("before", event.index))

    @c.on(AfterRollout)
    def after(event):
        order.append(("after", event.index))
        event.batch["hooked"] = torch.full(event.batch.batch_size, event.index)

    c.on(BatchReady, lambda e: order.append(("ready", e.index)))
    async with c:
        batches = [b async for b in c]
    assert order == [(name, i) for i in range(3) for name in ("before", "after", "ready")]
    assert [int(b["hooked"][0, 0]) for b in batches] == [0, 1, 2]


@pytest.mark.parametrize("failing", [BeforeRollout, AfterRollout, EpisodeEnded, BatchReady])
async def test_a_handler_error_surfaces_to_the_consumer(failing):
    c = Collector(counting(episode_length=2), frames_per_batch=8, num_workers=1)

    @c.on(failing)
    async def boom(event):
        raise LookupError(f"handler of {type(event).__name__} failed")

    with anyio.fail_after(20), pytest.raises(LookupError, match="handler of"):
        async with c:
            async for _ in c:
                pass


async def test_batch_ready_reports_workers_versions_and_timing():
    c = Collector(counting(episode_length=9, step_cost=0.0002), frames_per_batch=32, total_frames=128, num_workers=2, envs_per_worker=2)
    with c.subscribe(BatchReady) as sub:
        async with c:
            async for _ in c:
                pass
        ready = [e async for e in sub]
    assert [e.index for e in ready] == [0, 1, 2, 3]
    for e in ready:
        assert e.workers == (0, 1) and e.policy_versions == (0, 0) and e.frames == 32
        assert set(e.timing) == {"env", "policy", "wait", "delivery"}
        assert e.timing["env"] > 0.002, "4 envs x 8 steps x 0.2 ms of busy work each, summed over workers"


async def test_a_slow_subscriber_never_stalls_collection_and_counts_what_it_dropped():
    c = Collector(counting(episode_length=3), frames_per_batch=16, total_frames=16 * 20, num_workers=1, envs_per_worker=2)
    slow = c.subscribe(EpisodeEnded, max_buffer=4)
    everything = c.subscribe(Event, max_buffer=100_000)
    async with c:
        batches = [b async for b in c]  # the slow subscriber never reads meanwhile
    assert len(batches) == 20
    total_episodes = sum(int(b["next", "done"].sum()) for b in batches)
    assert slow.dropped == total_episodes - 4 and slow.peak == 4
    kinds = [type(e) async for e in everything]
    assert kinds[0] is WorkerStarted and kinds[1] is CollectorStarted and kinds[-1] is CollectorStopped
    assert kinds.count(BatchReady) == 20 and kinds.count(EpisodeEnded) == total_episodes


async def test_wait_for_returns_a_matching_event_and_raises_once_the_collector_stopped():
    async with Collector(counting(episode_length=4), frames_per_batch=8, num_workers=1, envs_per_worker=2, seed=0) as c:
        async with anyio.create_task_group() as tg:

            async def consume():
                for _ in range(4):
                    await c.collect()

            tg.start_soon(consume)
            with anyio.fail_after(20):
                event = await c.wait_for(EpisodeEnded, lambda e: e.env == 1)
        assert event.env == 1 and event.length == 4
    with pytest.raises(CollectorClosedError, match="stopped before"):
        await c.wait_for(EpisodeEnded)


@pytest.mark.parametrize("num_workers", [0, 1])
async def test_worker_failed_and_collector_stopped_events_carry_the_error(num_workers):
    c = Collector(counting(fail_at_step=5), frames_per_batch=4, num_workers=num_workers)
    failed, stopped = [], []
    c.on(WorkerFailed, failed.append)
    c.on(CollectorStopped, stopped.append)
    with anyio.fail_after(20), pytest.raises(WorkerError) as info:
        async with c:
            async for _ in c:
                pass
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert [f.error for f in failed] == [info.value]
    assert failed[0].worker == (0 if num_workers else -1)
    assert [(s.reason, s.error) for s in stopped] == [("error", info.value)]


async def test_collector_stopped_reasons():
    reasons = []
    c = Collector("CartPole-v1", frames_per_batch=8, total_frames=16, num_workers=1)
    c.on(CollectorStopped, lambda e: reasons.append(e.reason))
    async with c:
        [b async for b in c]
    c = Collector("CartPole-v1", frames_per_batch=8, num_workers=1)
    c.on(CollectorStopped, lambda e: reasons.append(e.reason))
    async with c:
        await c.collect()
    assert reasons == ["total_frames", "closed"]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_postproc_transforms_each_batch(kind):
    if kind == "sync":
        def postproc(batch):
            return batch.exclude("observation")
    else:
        async def postproc(batch):
            await anyio.sleep(0)
            return batch.exclude("observation")

    batches = []
    async with Collector("CartPole-v1", frames_per_batch=16, total_frames=32, num_workers=1, postproc=postproc) as c:
        batches = [b async for b in c]
    assert len(batches) == 2 and all("observation" not in b.keys() for b in batches)


async def test_stats_count_frames_episodes_returns_and_stage_times():
    async with Collector(counting(episode_length=4), frames_per_batch=16, total_frames=64, num_workers=2, envs_per_worker=2, seed=0) as c:
        batches = [b async for b in c]
        stats = c.stats()
    assert stats.frames == 64 and stats.batches == 4 and stats.fps > 0
    assert stats.episodes == sum(int(b["next", "done"].sum()) for b in batches) == 16
    # T = 4 = episode_length: each row of each batch is exactly one episode
    assert stats.mean_return == pytest.approx(float(sum(b["next", "reward"].sum() for b in batches)) / 16)
    assert set(stats.timing) == {"env", "policy", "wait", "delivery"} and stats.timing["env"] > 0


async def test_progress_bar_shows_frames_and_mean_return(capsys):
    async with Collector(counting(episode_length=3), frames_per_batch=16, total_frames=64, num_workers=1, progress=True, seed=0) as c:
        [b async for b in c]
    err = capsys.readouterr().err
    assert "100%" in err and "64.0/64.0" in err and "return" in err and "frames/s" in err
