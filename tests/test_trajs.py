"""trajs_per_batch: batches of complete episodes only, joined across batch boundaries."""

from __future__ import annotations

import pytest
import torch

from aiocollect import Collector, ConfigError, ReplayBuffer
from aiocollect.testing import CountingEnv


def varied():
    # episodes of 7 steps, longer than T = 5 frames per env and batch: every one crosses a boundary
    return CountingEnv(episode_length=7)


@pytest.mark.parametrize("num_workers,delivery", [(0, "sync"), (2, "sync"), (2, "async")])
async def test_padded_batches_hold_complete_episodes_joined_across_batches(num_workers, delivery):
    async with Collector(varied, frames_per_batch=20, total_frames=20 * 12, num_workers=num_workers,
                         envs_per_worker=2, delivery=delivery, trajs_per_batch=3, seed=0) as c:
        batches = [b async for b in c]
    assert batches and all(b.batch_size == torch.Size([3, 7]) for b in batches)
    seen = set()
    for b in batches:
        mask = b["collector", "mask"]
        assert mask.all(), "every episode is exactly 7 steps: no padding"
        obs = b["observation"][..., 0]
        assert torch.equal(obs % 100, torch.arange(7).expand(3, 7).float()), "steps 0..6 in order, nothing lost"
        assert b["next", "done"][:, -1].all() and not b["next", "done"][:, :-1].any()
        for row in b["collector", "traj_ids"]:
            assert len(row.unique()) == 1
            assert int(row[0]) not in seen
            seen.add(int(row[0]))
    assert sum(int(b["collector", "mask"].sum()) for b in batches) == c.frames


async def test_cat_format_and_flat_sequences_into_a_replay_buffer():
    async with Collector(varied, frames_per_batch=20, total_frames=200, num_workers=1, envs_per_worker=4,
                         trajs_per_batch=2, traj_format="cat", seed=0) as c:
        batches = [b async for b in c]
    assert all(b.batch_size == torch.Size([14]) for b in batches)
    for b in batches:
        assert b.names == ["time"] or b.batch_dims == 1
        ids = b["collector", "traj_ids"]
        assert len(ids.unique()) == 2 and torch.equal(ids[:7], ids[:1].expand(7))
    rb = ReplayBuffer(1000)
    for b in batches:
        rb.extend(b)  # complete trajectories, stored as flat contiguous sequences
    assert len(rb) == 14 * len(batches)


async def test_variable_lengths_are_padded_with_a_mask():
    """(Also: `async for` over a collector that is never closed leaves nothing open.)"""
    (batch,) = [b async for b in Collector("CartPole-v1", frames_per_batch=64, total_frames=64 * 4, num_workers=1,
                                           envs_per_worker=4, trajs_per_batch=4, seed=0)][:1]
    mask = batch["collector", "mask"]
    lengths = mask.sum(1)
    assert batch.batch_size[0] == 4 and int(lengths.max()) == batch.batch_size[1]
    for row, n in enumerate(lengths.tolist()):
        assert batch["next", "done"][row, n - 1, 0] and not batch["next", "done"][row, : n - 1].any()
        assert not batch["observation"][row, n:].any(), "padding is zeros"


def test_trajs_per_batch_errors():
    with pytest.raises(ConfigError, match="drop split_trajs"):
        Collector("CartPole-v1", frames_per_batch=8, trajs_per_batch=2, split_trajs=True)
    with pytest.raises(ConfigError, match="traj_format='bogus'"):
        Collector("CartPole-v1", frames_per_batch=8, trajs_per_batch=2, traj_format="bogus")
    with pytest.raises(ConfigError, match="trajs_per_batch=0"):
        Collector("CartPole-v1", frames_per_batch=8, trajs_per_batch=0)
