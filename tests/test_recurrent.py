"""Recurrent policies: the collector carries a TensorDict policy's state from step to step
(``recurrent_state=`` or TorchRL's primer), zeroes it where an episode starts (``is_init``),
and stores ``is_init``, the state read and the state written in the batch, in every inference
mode: local, process workers, vector envs, server inference (with worker groups), after a
weight update, after a worker's restart, Ray, and the evaluator's episodes.

The policy acts by memory alone: its action is the observation it saw ``DELAY`` steps earlier in
the episode (0 before that), held in its state as a shift register; the env rewards exactly
that. Every frame of a batch is checked against the trajectory's own history (by trajectory
id, so across batches too)."""

from __future__ import annotations

import os
import signal

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from aiocollect import Collector, ConfigError, Evaluator, SpecError

from procs import local_ray

DELAY = 3
STATE = {"recurrent_state": (DELAY,)}


class RecallEnv(gym.Env):
    """Observations: a random symbol in 0..3 (float32 ``[1]``); the reward is 1 when the action is
    the symbol seen ``DELAY`` steps earlier in the episode (0 before that); episodes of 4 to 11
    steps (terminated)."""

    observation_space = spaces.Box(0, 3, (1,), np.float32)
    action_space = spaces.Discrete(4)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.seen = [self._symbol()]
        self.length = int(self.np_random.integers(4, 12))
        return np.array([self.seen[-1]], np.float32), {}

    def _symbol(self) -> float:
        return float(self.np_random.integers(0, 4))

    def step(self, action):
        want = self.seen[-1 - DELAY] if len(self.seen) > DELAY else 0.0
        self.seen.append(self._symbol())
        return (np.array([self.seen[-1]], np.float32), float(int(action) == int(want)),
                len(self.seen) > self.length, False, {})


class Delay(torch.nn.Module):
    """The action is the oldest entry of the state; the next state shifts the observation in.
    ``scale`` (1) is a weight to update."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, observation, state, is_init):
        assert bool((state[is_init[:, 0]] == 0).all()), "a state at an episode's start is not zero"
        action = (state[:, 0] * self.scale).round().long()
        return action, torch.cat([state[:, 1:], observation], -1)


def delay_policy(cls=TensorDictModule) -> TensorDictModule:
    return cls(Delay(), in_keys=["observation", "recurrent_state", "is_init"],
               out_keys=["action", ("next", "recurrent_state")])


class PrimedModule(TensorDictModule):
    """Declares its state TorchRL's way: ``make_tensordict_primer()`` (duck-typed: a ``primers``
    mapping of key -> a per-env spec with a shape and a dtype)."""

    def make_tensordict_primer(self):
        class Primer:
            primers = TensorDict({"recurrent_state": torch.zeros(DELAY)}, [])

        return Primer()


class History:
    """Checks batches frame by frame against each trajectory's history of observations."""

    def __init__(self) -> None:
        self.seen: dict[int, list[float]] = {}
        self.last_next: dict[int, torch.Tensor] = {}  # per trajectory: ("next", state) of its last frame
        self.frames = 0

    def check(self, batch) -> None:
        ids = batch["collector", "traj_ids"]
        obs, act, init = batch["observation"][..., 0], batch["action"], batch["is_init"][..., 0]
        state, nxt = batch["recurrent_state"], batch["next", "recurrent_state"]
        assert batch["is_init"].dtype == torch.bool and batch["is_init"].shape == (*ids.shape, 1)
        for e in range(ids.shape[0]):
            for t in range(ids.shape[1]):
                traj = int(ids[e, t])
                hist = self.seen.setdefault(traj, [])
                assert bool(init[e, t]) == (not hist), f"is_init {bool(init[e, t])} at step {len(hist)} of trajectory {traj}"
                if not hist:
                    assert not state[e, t].any(), f"trajectory {traj} starts from a state that is not zero"
                else:  # the state read is the state written at the trajectory's step before
                    assert torch.equal(state[e, t], self.last_next[traj]), f"trajectory {traj}: state not carried"
                want = hist[-DELAY] if len(hist) >= DELAY else 0.0
                assert int(act[e, t]) == int(want), f"trajectory {traj} step {len(hist)}: action {int(act[e, t])}, not {want}"
                hist.append(float(obs[e, t]))
                self.last_next[traj] = nxt[e, t].clone()
                self.frames += 1


async def collect_checked(batches: int = 4, after=None, **kwargs) -> History:
    history = History()
    options = dict(frames_per_batch=48, seed=5, recurrent_state=STATE) | kwargs
    with anyio.fail_after(100):
        async with Collector(RecallEnv, delay_policy(), **options) as c:
            for n in range(batches):
                history.check(await c.collect())
                if after is not None:
                    await after(c, n)
    assert history.frames == batches * options["frames_per_batch"]
    return history


MODES = {
    "local": dict(num_workers=0, envs_per_worker=3),
    "process": dict(num_workers=2, envs_per_worker=2),
    "async": dict(num_workers=2, envs_per_worker=2, delivery="async"),
    "vector": dict(num_workers=1, create_env_kwargs=None, envs_per_worker=1),
    "server": dict(num_workers=2, envs_per_worker=2, inference="server"),
    "server-groups": dict(num_workers=2, envs_per_worker=4, inference="server", worker_groups=2, frames_per_batch=64),
    "cuts": dict(num_workers=1, envs_per_worker=2, max_frames_per_traj=5),
}


def vector_of_recall():
    return gym.vector.SyncVectorEnv([RecallEnv] * 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
async def test_a_memory_policy_acts_on_its_carried_state(mode):
    """In every inference mode each action is the observation seen DELAY steps before in its
    trajectory, is_init is True exactly at trajectory starts, the state read there is zero, and
    elsewhere it is the state written at the step before (across batches too)."""
    kwargs = dict(MODES[mode])
    if mode == "vector":
        kwargs.pop("create_env_kwargs")
        async with Collector(vector_of_recall, delay_policy(), frames_per_batch=48, seed=5, recurrent_state=STATE,
                             **kwargs) as c:
            history = History()
            for _ in range(4):
                history.check(await c.collect())
        return
    await collect_checked(**kwargs)


async def test_the_state_is_kept_across_a_weight_update():
    """update_weights between batches (as TorchRL and rlpyt do) keeps every env's state: the
    trajectories that cross the update go on acting on their memory."""
    policy = delay_policy()

    async def update(c, n):
        if n == 1:
            await c.update_weights(policy)

    await collect_checked(batches=4, after=update, num_workers=1, envs_per_worker=2, prefetch=0)


@pytest.mark.timeout(120)
async def test_a_restarted_worker_starts_its_envs_from_zero_state():
    """A worker killed mid-run (on_worker_failure="restart"): the replacement's envs start new
    trajectories with is_init True and zero states, and act on their memory from there."""

    async def kill(c, n):
        if n == 0:
            os.kill(c.worker_pids[1], signal.SIGKILL)

    await collect_checked(batches=5, after=kill, num_workers=2, envs_per_worker=2, on_worker_failure="restart",
                          delivery="async")


@pytest.mark.timeout(180)
@pytest.mark.loops("asyncio")
async def test_ray_actors_carry_the_state():
    """backend="ray" runs the same worker code: the same checks hold."""
    pytest.importorskip("ray")
    with local_ray():
        await collect_checked(batches=3, num_workers=2, envs_per_worker=2, backend="ray")


async def test_a_primer_declares_the_state_without_recurrent_state():
    """A module with TorchRL's make_tensordict_primer() needs no recurrent_state."""
    history = History()
    async with Collector(RecallEnv, delay_policy(PrimedModule), frames_per_batch=48, num_workers=1,
                         envs_per_worker=2, seed=5) as c:
        for _ in range(3):
            history.check(await c.collect())


async def test_the_evaluator_carries_the_state_of_each_episode():
    """The evaluator's episodes carry the state from zero: every step of every episode is
    rewarded (a policy without memory is right about one time in four after DELAY steps)."""
    def episodes(returns, lengths) -> dict:
        return {"returns": returns.tolist(), "lengths": lengths.tolist()}

    async with Evaluator(RecallEnv, delay_policy(PrimedModule), num_trajectories=6, num_envs=2, seed=1,
                         metrics_fn=episodes) as ev:
        result = await ev.evaluate()
    assert result["returns"] == [float(n) for n in result["lengths"]] and len(result["lengths"]) == 6


async def test_the_evaluator_takes_recurrent_state_too():
    def episodes(returns, lengths) -> dict:
        return {"returns": returns.tolist(), "lengths": lengths.tolist()}

    async with Evaluator(RecallEnv, delay_policy(), num_trajectories=4, num_envs=3, seed=2, metrics_fn=episodes,
                         recurrent_state=STATE) as ev:
        result = await ev.evaluate()
    assert result["returns"] == [float(n) for n in result["lengths"]]


def test_recurrent_state_with_a_plain_module_names_the_wrapping():
    with pytest.raises(ConfigError, match=r"recurrent_state=.*TensorDictModule with in_keys=\['observation', 'recurrent_state', 'is_init'\]"):
        Collector(RecallEnv, Delay(), frames_per_batch=48, recurrent_state=STATE)


@pytest.mark.parametrize("bad", [{"h": 64}, {"h": (0, 4)}, {"h": ((2,), "text")}, {}])
def test_a_bad_recurrent_state_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"recurrent_state"):
        Collector(RecallEnv, delay_policy(), frames_per_batch=48, recurrent_state=bad)


async def test_a_state_key_the_policy_never_writes_is_named():
    with pytest.raises(SpecError, match=r"wrote no \('next', 'memory'\).*drop 'memory' from recurrent_state"):
        async with Collector(RecallEnv, delay_policy(), frames_per_batch=48, recurrent_state=STATE | {"memory": (2,)}) as c:
            await c.collect()


class Truncating(torch.nn.Module):
    """Writes a next state one element shorter than the one it read."""

    def forward(self, observation, state):
        return torch.zeros(len(observation), dtype=torch.long), state[:, 1:]


async def test_a_state_of_another_shape_is_named():
    policy = TensorDictModule(Truncating(), in_keys=["observation", "recurrent_state"],
                              out_keys=["action", ("next", "recurrent_state")])
    with pytest.raises(SpecError, match=r"wrote \('next', 'recurrent_state'\) with shape \(1, 2\).*\(3,\) per env"):
        async with Collector(RecallEnv, policy, frames_per_batch=48, envs_per_worker=1, recurrent_state=STATE) as c:
            await c.collect()
