"""max_decorrelation_steps (rlpyt's): before collecting, each env takes a seeded random number of
random steps, so that envs do not start in lockstep. The steps are not frames and their episodes
are not reported; the same seed gives the same data whatever the number of workers; 0 changes
nothing; a replaced worker's envs are decorrelated again; vector envs too."""

from __future__ import annotations

import functools
import os

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch

from aiocollect import Collector, ConfigError
from aiocollect._worker.decorrelate import decorrelation_draws
from aiocollect._worker.seeding import derived_seed
from aiocollect.events import EpisodeEnded, WorkerRestarted
from aiocollect.testing import CountingEnv

SEED = 11
MAX = 30
LONG = functools.partial(CountingEnv, episode_length=50)  # longer than MAX: no episode ends while decorrelating


def counts(envs: int, restart: int = 0, first: int = 0) -> list[int]:
    """The counts of random steps the collector draws for global envs ``first .. first + envs - 1``."""
    drawn, _ = decorrelation_draws(SEED, np.arange(first, first + envs), restart, MAX, gym.spaces.Discrete(2))
    return drawn.tolist()


def phases(batch, t: int = 0) -> list[int]:
    """Each row's step of its episode at frame ``t`` (CountingEnv: observation % 100)."""
    return [int(v) % 100 for v in batch["observation"][:, t, 0]]


async def first_batch(**options):
    async with Collector(LONG, frames_per_batch=16, total_frames=16, seed=SEED, **options) as c:
        return await c.collect()


async def test_envs_start_collection_at_their_drawn_phases():
    """Each env starts collecting exactly its drawn number of random steps into its episode
    (uniform in [0, max]), so the envs' phases differ; step_count (max_frames_per_traj) counts the
    random steps of the episode in progress."""
    with anyio.fail_after(50):
        batch = await first_batch(num_workers=2, envs_per_worker=2, max_decorrelation_steps=MAX,
                                  max_frames_per_traj=100)
    assert phases(batch) == counts(4)
    assert len(set(phases(batch))) > 1 and all(0 <= k <= MAX for k in phases(batch))
    assert batch["step_count"][:, 0, 0].tolist() == counts(4)


async def test_same_seed_gives_the_same_batch_whatever_the_workers():
    """The counts and random actions come from the seed and each env's global index: 2 workers
    x 2 envs, 1 x 4 and the local backend (num_workers=0) deliver the same first batch."""
    with anyio.fail_after(50):
        batches = [
            await first_batch(num_workers=n, envs_per_worker=4 // max(n, 1), max_decorrelation_steps=MAX)
            for n in (2, 1, 0)
        ]
    for other in batches[1:]:
        for key in ("observation", "action", ("next", "reward"), ("collector", "traj_ids")):
            assert torch.equal(batches[0][key], other[key]), key
    assert phases(batches[0]) == counts(4)


async def test_zero_changes_nothing():
    """max_decorrelation_steps=0 (the default) gives today's data: every env at its episode's start."""
    with anyio.fail_after(50):
        plain = await first_batch(num_workers=1, envs_per_worker=2)
        zero = await first_batch(num_workers=1, envs_per_worker=2, max_decorrelation_steps=0)
    assert phases(plain) == [0, 0]
    for key in plain.keys(include_nested=True, leaves_only=True):
        assert torch.equal(plain[key], zero[key]), key


async def test_random_steps_are_not_frames_and_their_episodes_not_reported():
    """Short episodes (3 steps) end many times while decorrelating: none of them is reported,
    frames are counted exactly, and every episode reported has its full length (the one in
    progress at the start counts its random steps)."""
    ended: list[EpisodeEnded] = []
    c = Collector(functools.partial(CountingEnv, episode_length=3), frames_per_batch=24, total_frames=48,
                  num_workers=2, envs_per_worker=2, seed=SEED, max_decorrelation_steps=MAX)
    c.on(EpisodeEnded, ended.append)  # (before the start: no batch is assembled unseen)
    async with c:
        with anyio.fail_after(50):
            frames = dones = 0
            async for batch in c:
                frames += batch.numel()
                dones += int(batch["next", "done"].sum())
        assert c.frames == frames == 48
    assert len(ended) == dones and all(e.length == 3 for e in ended)


async def test_vector_envs_start_at_their_drawn_phases():
    """A vector env's sub-envs step together: each is reset (a partial reset) its count of steps
    before the end, so each starts exactly its drawn number of steps into its episode."""

    def make():
        return gym.vector.SyncVectorEnv([LONG] * 3)

    with anyio.fail_after(50):
        async with Collector(make, frames_per_batch=24, total_frames=24, num_workers=2, seed=SEED,
                             max_decorrelation_steps=MAX) as c:
            batch = await c.collect()
    assert phases(batch) == counts(6)


def fail_once(flag: str):
    """Worker 1's first env fails at its 40th step (after its random steps); its replacements do not."""

    def make():
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            return CountingEnv(episode_length=50, fail_at_step=40)
        except FileExistsError:
            return CountingEnv(episode_length=50)

    return [LONG, make]


@pytest.mark.timeout(90)
async def test_a_replaced_worker_decorrelates_its_envs_again(tmp_path):
    """A replacement worker's envs start afresh (seeds derived from the restart), and are
    decorrelated again with counts derived from the restart: its first frame is at its drawn phase."""
    restarted: list[WorkerRestarted] = []
    env = 1  # worker 1's only env
    start = derived_seed(SEED, env, 1) % 1000  # CountingEnv: observation // 100 is its reset seed % 1000
    with anyio.fail_after(80):
        c = Collector(fail_once(str(tmp_path / "flag")), frames_per_batch=8, num_workers=2, seed=SEED,
                      max_decorrelation_steps=MAX, on_worker_failure="restart")
        c.on(WorkerRestarted, restarted.append)
        async with c:
            async for batch in c:
                obs = batch["observation"][env, :, 0].tolist()
                mine = [int(v) % 100 for v in obs if int(v) // 100 == start]
                if mine:
                    break
    assert len(restarted) == 1
    assert mine[0] == counts(1, restart=1, first=env)[0]


@pytest.mark.parametrize("value", [-1, 2.5, True, "10"])
def test_a_bad_value_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match="max_decorrelation_steps"):
        Collector(CountingEnv, frames_per_batch=8, num_workers=0, max_decorrelation_steps=value)
