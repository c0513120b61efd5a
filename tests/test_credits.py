"""Credits never deadlock: whatever layout a delivery needs, the workers are granted rounds until it
can be made, with episodes many times longer than a round, for every delivery and backend.

A round is one slot of ``frames_per_batch / workers`` frames per worker; with ``trajs_per_batch``
one delivery may need many rounds (an episode longer than a round) or a round may make several.
"""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium import spaces

from aiocollect import Collector
from aiocollect.testing import CountingEnv

pytestmark = pytest.mark.timeout(120)

LENGTH = 60  # frames per episode; rounds hold 3 frames per env below: 20 rounds per episode


def long_episodes():
    return CountingEnv(episode_length=LENGTH)


def check_whole_episodes(batches, traj_format: str) -> int:
    """Every delivered trajectory is one whole episode, in order, under one id; returns how many."""
    seen: set[int] = set()
    for b in batches:
        if traj_format == "cat":
            ids = b["collector", "traj_ids"]
            rows = [b[ids == i] for i in ids.unique().tolist()]
        else:
            assert b["collector", "mask"].all(), "every episode is exactly LENGTH frames: no padding"
            rows = list(b.unbind(0))
        for row in rows:
            obs = row["observation"][..., 0]
            assert torch.equal(obs % 100, torch.arange(LENGTH, dtype=obs.dtype)), "steps 0..LENGTH-1 in order"
            assert row["next", "done"][-1].all() and not row["next", "done"][:-1].any()
            ids = row["collector", "traj_ids"]
            assert len(ids.unique()) == 1 and int(ids[0]) not in seen
            seen.add(int(ids[0]))
    return len(seen)


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("traj_format", ["pad", "cat"])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("delivery", ["sync", "async"])
@pytest.mark.parametrize("num_workers", [0, 1, 2])
async def test_trajs_per_batch_delivers_episodes_many_rounds_long(num_workers, delivery, prefetch, traj_format):
    """Each delivery needs 20+ rounds: it still comes, and it holds whole episodes only."""
    workers = max(num_workers, 1)
    envs = 2
    frames = 3 * envs * workers  # 3 frames per env and round
    rounds = 3 * LENGTH // 3 + 2  # every env ends 3 episodes (and a bit) in sync delivery
    async with Collector(long_episodes, frames_per_batch=frames, total_frames=frames * rounds,
                         num_workers=num_workers, envs_per_worker=envs, delivery=delivery, prefetch=prefetch,
                         trajs_per_batch=2, traj_format=traj_format, seed=0) as c:
        batches = [b async for b in c]
    count = check_whole_episodes(batches, traj_format)
    if delivery == "sync":  # every env ended 3 episodes: 3 * envs * workers trajectories, 2 per batch
        assert len(batches) == 3 * envs * workers // 2 and count == 3 * envs * workers
    else:  # the rounds are shared out among the workers as they come: at least one batch
        assert batches and count == 2 * len(batches)


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_trajs_per_batch_with_vector_envs_and_server_inference(delivery):
    """The same with a vector env per worker (each sub-env a row) and the policy on a server."""
    import functools

    vector = functools.partial(gymnasium.vector.SyncVectorEnv, [long_episodes] * 2)

    class First(torch.nn.Module):
        def forward(self, observation):
            return torch.zeros(observation.shape[:-1], dtype=torch.int64)

    async with Collector(vector, First(), frames_per_batch=12, total_frames=12 * 42, num_workers=2,
                         inference="server", delivery=delivery, trajs_per_batch=2, seed=0) as c:
        batches = [b async for b in c]
    count = check_whole_episodes(batches, "pad")
    assert batches and count == 2 * len(batches)
    if delivery == "sync":
        assert count == 2 * 2 * 2  # 2 workers x 2 sub-envs, 2 whole episodes each


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("num_workers", [0, 2])
async def test_split_trajs_and_plain_batches_with_episodes_longer_than_a_batch(num_workers):
    """Layouts that deliver every round keep delivering too (the long episode spans batches)."""
    workers = max(num_workers, 1)
    for split in (False, True):
        async with Collector(long_episodes, frames_per_batch=4 * workers, total_frames=4 * workers * 40,
                             num_workers=num_workers, envs_per_worker=1, prefetch=0, split_trajs=split,
                             seed=0) as c:
            batches = [b async for b in c]
        assert len(batches) == 40
        assert sum(int(b.get(("collector", "mask"), torch.ones(b.shape, dtype=torch.bool)).sum())
                   for b in batches) == c.frames


class StopWhenTold(gymnasium.Env):
    """Observation: the step of the episode. The episode ends when the action is 1 (so the policy
    decides how long episodes are), or is truncated at 10,000 steps."""

    observation_space = spaces.Box(0, np.inf, (1,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.k = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.k += 1
        return np.full(1, self.k, np.float32), 0.0, int(action) == 1, self.k >= 10_000, {}


class Threshold(torch.nn.Module):
    """Acts 1 (ends the episode) once the step reaches ``threshold``: as it "learns" (the
    threshold grows), episodes grow, the way a pole-balancing policy's do."""

    def __init__(self) -> None:
        super().__init__()
        self.threshold = torch.nn.Parameter(torch.tensor(4.0), requires_grad=False)

    def forward(self, observation):
        return (observation[..., 0] >= self.threshold).long()


@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_a_training_program_whose_episodes_grow_runs_to_its_end(delivery):
    """The user program that used to hang once training worked: whole episodes per batch, the
    policy updated after each one so that episodes grow from 5 frames to many times a round."""
    policy = Threshold()
    lengths = []
    async with Collector(StopWhenTold, policy, frames_per_batch=16, total_frames=16 * 150, num_workers=2,
                         envs_per_worker=2, delivery=delivery, trajs_per_batch=2, seed=0) as c:
        async for batch in c:
            mask = batch["collector", "mask"]
            for row, n in enumerate(mask.sum(1).tolist()):
                obs = batch["observation"][row, :n, 0]
                assert torch.equal(obs, torch.arange(n, dtype=obs.dtype)), "whole episodes from their start"
                actions = batch["action"][row, :n]
                assert actions[-1] == 1 and not actions[:-1].any(), "it ends where the policy said so"
                lengths.append(n)
            with torch.no_grad():
                policy.threshold += 4  # "training": the next episodes are longer
            await c.update_weights(policy)
    assert lengths and max(lengths) > 4 * 4, "episodes grew to several rounds (4 frames per env each)"
