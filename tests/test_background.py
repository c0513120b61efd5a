"""Background collection into a replay buffer, and pause()."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiocollect import AiocollectError, Collector, ConfigError, ReplayBuffer
from aiocollect.testing import CountingEnv


def slow_env():
    return CountingEnv(episode_length=10, step_sleep=0.001)


async def test_background_collection_writes_every_batch_into_the_buffer():
    rb = ReplayBuffer(10_000)
    c = Collector("CartPole-v1", frames_per_batch=64, total_frames=64 * 10, num_workers=2, envs_per_worker=2)
    await c.start(replay_buffer=rb)
    with anyio.fail_after(30):
        while c.state.value == "running" or c.frames < 640:
            await anyio.sleep(0.01)
    await c.aclose()
    assert rb.write_count == 640 and len(rb) == 640
    sample = rb.sample(32)
    assert sample["observation"].shape == (32, 4)


async def test_pause_really_stops_writes_and_loses_nothing():
    writes = []

    class Sink:
        def extend(self, batch):
            writes.append((anyio.current_time(), batch))

    c = Collector(slow_env, frames_per_batch=16, num_workers=2, envs_per_worker=2, seed=0)
    await c.start(replay_buffer=Sink())
    with anyio.fail_after(30):
        while len(writes) < 3:
            await anyio.sleep(0.005)
        async with c.pause():
            assert c.paused
            during = len(writes)
            await anyio.sleep(0.5)  # several batches' worth of time
            assert len(writes) == during, "a batch was written during the pause"
        while len(writes) < during + 3:
            await anyio.sleep(0.005)
    await c.aclose()
    # nothing was lost: each env's observations continue from batch to batch
    obs = torch.cat([b["observation"][..., 0] for _, b in writes], dim=1)
    nxt = torch.cat([b["next", "observation"][..., 0] for _, b in writes], dim=1)
    done = torch.cat([b["next", "done"][..., 0] for _, b in writes], dim=1)
    assert torch.equal(obs[:, 1:][~done[:, :-1]], nxt[:, :-1][~done[:, :-1]])


async def test_pause_holds_delivery_to_consumers_too():
    async with Collector(slow_env, frames_per_batch=16, num_workers=1, envs_per_worker=2) as c:
        await c.collect()
        async with c.pause():
            with anyio.move_on_after(0.3) as scope:
                await c.collect()
            assert scope.cancelled_caught
        with anyio.fail_after(10):
            await c.collect()  # the batch held during the pause comes now


async def test_sink_errors_surface_at_aclose_and_collect_is_refused():
    class Broken:
        def extend(self, batch):
            raise OSError("disk full")

    c = Collector("CartPole-v1", frames_per_batch=16, num_workers=1)
    await c.start(replay_buffer=Broken())
    with pytest.raises(AiocollectError, match="replay buffer"):
        await c.collect()
    with anyio.fail_after(10):
        while c.state.value == "running":
            await anyio.sleep(0.01)
    with pytest.raises(OSError, match="disk full"):
        await c.aclose()
    with pytest.raises(ConfigError, match="no extend"):
        await Collector("CartPole-v1", frames_per_batch=16, num_workers=0).start(replay_buffer=object())
