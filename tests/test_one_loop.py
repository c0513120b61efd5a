"""One stepping loop for single envs and vector envs: the same seeded env stepped as a single env
and as a vector env of one sub-env gives the same batches (observations, actions, rewards, flags,
trajectory ids, step counts) and the same episode events."""

from __future__ import annotations

import anyio
import gymnasium as gym
import pytest
import torch
from gymnasium.vector import AutoresetMode

from aiocollect import Collector, Evaluator
from aiocollect.events import EpisodeEnded

pytestmark = pytest.mark.timeout(90)

KEYS = [
    "observation", "action", "done", "terminated", "truncated", "step_count",
    ("next", "observation"), ("next", "reward"), ("next", "done"), ("next", "terminated"), ("next", "truncated"),
    ("next", "step_count"), ("collector", "traj_ids"), ("collector", "policy_version"), ("collector", "env_epoch"),
]


def single_pendulum():
    return gym.make("Pendulum-v1", max_episode_steps=23)  # float64 rewards; episodes end by truncation


def single_cartpole():
    return gym.make("CartPole-v1")  # episodes end by termination, at random lengths


def vector_of_one(make, mode):
    return lambda: gym.vector.SyncVectorEnv([make], autoreset_mode=mode)


async def collect(make_env, **kwargs):
    events: list = []
    c = Collector(make_env, None, **kwargs)
    c.on(EpisodeEnded, events.append)
    with anyio.fail_after(60):
        async with c:
            batches = [b async for b in c]
    return batches, [(e.env, e.traj_id, e.length, e.terminated, e.ret) for e in events]


@pytest.mark.parametrize("make", [single_pendulum, single_cartpole], ids=["pendulum", "cartpole"])
@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP], ids=["next", "same"])
async def test_single_env_and_vector_of_one_give_the_same_batches(make, mode):
    kwargs = dict(frames_per_batch=60, total_frames=240, num_workers=0, envs_per_worker=2, seed=7,
                  backend="local", max_frames_per_traj=17)
    single, single_events = await collect(make, **kwargs)
    vector, vector_events = await collect(vector_of_one(make, mode), **kwargs)
    assert len(single) == len(vector) == 4
    for b, (s, v) in enumerate(zip(single, vector)):
        assert s.batch_size == v.batch_size
        for key in KEYS:
            assert s[key].dtype == v[key].dtype, (b, key)
            assert torch.equal(s[key], v[key]), f"batch {b}, key {key}"
    assert bool(single[0]["next", "done"].any()) and bool(single[0]["next", "truncated"].any())
    assert [e[:4] for e in single_events] == [e[:4] for e in vector_events] and single_events
    for (*_, r1), (*_, r2) in zip(single_events, vector_events):
        assert r1 == pytest.approx(r2, rel=1e-6)


@pytest.mark.parametrize(
    "env, kwargs", [("Pendulum-v1", {"max_episode_steps": 23}), ("CartPole-v1", {})], ids=["pendulum", "cartpole"]
)
async def test_evaluator_episodes_and_collector_batches_agree(env, kwargs):
    """The evaluator's episode j (reset(seed=seed + j), random actions from its action space seeded
    with seed + j) is env j's first episode in a collector with the same seed: the one stepping loop
    gives both the same length and the same return, to the bit (Pendulum's float64 rewards added in
    the order they came, across the collector's batches of 10 steps)."""
    E = 3
    _, events = await collect(
        env, frames_per_batch=E * 10, total_frames=E * 400, num_workers=0, envs_per_worker=E, seed=7,
        backend="local", create_env_kwargs=kwargs,
    )
    first: dict[int, tuple[float, int]] = {}
    for env_row, _, length, _, ret in events:
        first.setdefault(env_row, (ret, length))
    assert sorted(first) == list(range(E))
    with anyio.fail_after(60):
        async with Evaluator(env, env_kwargs=kwargs, num_trajectories=E, seed=7, num_envs=2, metrics_fn=episodes) as ev:
            metrics = await ev.evaluate()
    assert metrics["lengths"] == [first[j][1] for j in range(E)]
    assert metrics["returns"] == [first[j][0] for j in range(E)]
    assert max(metrics["lengths"]) > 10  # (an episode crossed a batch of the collector)


def episodes(returns, lengths) -> dict:
    """metrics_fn that exposes every episode."""
    return {"returns": returns.tolist(), "lengths": lengths.tolist()}
