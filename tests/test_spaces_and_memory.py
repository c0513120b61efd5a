"""One-leaf Dict and Tuple spaces, and batches that cannot fit in memory.

A Dict or Tuple space with a single leaf (``Dict({"pixels": Box})``, what pixel-only wrappers
produce; ``Tuple((Box,))``; nestings) gives the batch the keys the multi-key path would, and the
data of a plain gymnasium loop, as observation and as action, in every path: the local backend,
process workers, vector envs, server inference and the Evaluator.

A run whose batch slots cannot fit in the memory the machine can give is refused with a
ConfigError naming the figures and the largest ``frames_per_batch`` that fits, once the real frame
size is known and before any slot is filled; nothing is left behind (the autouse fixture in
conftest checks processes, threads and shared memory after each test).
"""

from __future__ import annotations

import re

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict.nn import TensorDictModule
from torch import nn

from aiocollect import Collector, ConfigError
from aiocollect._core import shm as _shm
from aiocollect._evaluator.evaluator import Evaluator
from aiocollect._core.layout import action_leaves, observation_leaves
from aiocollect.testing import SpacesEnv

pytestmark = pytest.mark.timeout(90)

FRAME = spaces.Box(0, 255, (6, 6, 3), np.uint8)
MOVE = spaces.Discrete(3)
PUSH = spaces.Box(-1.0, 1.0, (2,), np.float32)
SEED = 7

# one-leaf observation spaces and the key of their leaf in the batch
OBS_CASES = {
    "dict-pixels": (spaces.Dict({"pixels": FRAME}), ("pixels",)),
    "dict-observation": (spaces.Dict({"observation": FRAME}), ("observation",)),
    "tuple": (spaces.Tuple((FRAME,)), ("observation", "0")),
    "nested-dict": (spaces.Dict({"a": spaces.Dict({"b": FRAME})}), ("a", "b")),
    "dict-in-tuple": (spaces.Tuple((spaces.Dict({"x": FRAME}),)), ("observation", "0", "x")),
}
# one-leaf action spaces and the key of their leaf in the batch
ACT_CASES = {
    "dict-discrete": (spaces.Dict({"move": MOVE}), ("action", "move")),
    "tuple-box": (spaces.Tuple((PUSH,)), ("action", "0")),
    "nested-dict": (spaces.Dict({"a": spaces.Dict({"b": MOVE})}), ("action", "a", "b")),
    "dict-in-tuple": (spaces.Tuple((spaces.Dict({"m": PUSH}),)), ("action", "0", "m")),
}


# the keys of every batch besides the observation and the action
COMMON_KEYS = {
    ("done",), ("terminated",), ("truncated",), ("next", "done"), ("next", "terminated"), ("next", "truncated"),
    ("next", "reward"), ("collector", "traj_ids"), ("collector", "policy_version"), ("collector", "env_epoch"),
}


def wrap(space: spaces.Space, value):
    """The value of a one-leaf ``space`` whose leaf holds ``value``."""
    if isinstance(space, spaces.Dict):
        ((name, sub),) = space.spaces.items()
        return {name: wrap(sub, value)}
    if isinstance(space, spaces.Tuple):
        (sub,) = space.spaces
        return (wrap(sub, value),)
    return value


def unwrap(value):
    """The leaf value of a one-leaf structured value."""
    while isinstance(value, (dict, tuple)):
        (value,) = value.values() if isinstance(value, dict) else value
    return value


def leaf_space(space: spaces.Space) -> spaces.Space:
    while isinstance(space, (spaces.Dict, spaces.Tuple)):
        (space,) = space.spaces.values() if isinstance(space, spaces.Dict) else space.spaces
    return space


class OneLeafEnv(gym.Env):
    """An env whose data shows what went in: each observation is a 6x6x3 uint8 frame made from a
    seeded base, the step and the last action; the reward is the action's code (the Discrete
    index, or the sum of a Box action). So a plain loop given the batch's actions sees the batch's
    data exactly, and a wrong action changes the data. Refuses an action outside its space."""

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Space, episode_length: int = 3) -> None:
        self.observation_space = observation_space
        self.action_space = action_space
        self.episode_length = episode_length

    def _obs(self, code: float):
        start = self.base + 7 * self.t + int(round(code * 10))
        frame = ((start + np.arange(FRAME.shape[0] * FRAME.shape[1] * FRAME.shape[2])) % 256).astype(np.uint8)
        return wrap(self.observation_space, frame.reshape(FRAME.shape))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.base, self.t = int(self.np_random.integers(256)), 0
        return self._obs(0.0), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"OneLeafEnv: action {action!r} is not in {self.action_space}")
        code = float(np.sum(unwrap(action)))
        self.t += 1
        return self._obs(code), code, self.t >= self.episode_length, False, {}


class LeafPolicy(nn.Module):
    """Acts from the frame: a Discrete(3) index (the frame's first value mod 3) or two floats in
    [-1, 1] for a Box(2) action."""

    def __init__(self, discrete: bool) -> None:
        super().__init__()
        self.discrete = discrete

    def forward(self, frame: torch.Tensor) -> torch.Tensor:
        first = frame.reshape(frame.shape[0], -1)[:, 0].to(torch.int64)
        if self.discrete:
            return first % 3
        x = first.to(torch.float32) / 255 * 2 - 1
        return torch.stack([x, -x], -1)


def policy_for(obs_key, act_space, act_key) -> TensorDictModule:
    return TensorDictModule(
        LeafPolicy(isinstance(leaf_space(act_space), spaces.Discrete)), in_keys=[obs_key], out_keys=[act_key]
    )


def check_batch(data, obs_space, act_space, obs_key, act_key, seed: int = SEED) -> None:
    """Keys, shapes, dtypes, and the values of a plain gymnasium loop: row ``k`` is an env seeded
    ``seed + k`` and stepped with the batch's actions."""
    E, T = data.batch_size
    keys = {k if isinstance(k, tuple) else (k,) for k in data.keys(True, True)}
    assert keys == COMMON_KEYS | {obs_key, ("next", *obs_key), act_key}
    assert data[obs_key].dtype == torch.uint8 and data[obs_key].shape == (E, T, *FRAME.shape)
    act_leaf = leaf_space(act_space)
    if isinstance(act_leaf, spaces.Discrete):
        assert data[act_key].dtype == torch.int64 and data[act_key].shape == (E, T)
    else:
        assert data[act_key].dtype == torch.float32 and data[act_key].shape == (E, T, *act_leaf.shape)
    for k in range(E):
        env = OneLeafEnv(obs_space, act_space)
        obs, _ = env.reset(seed=seed + k)
        for t in range(T):
            np.testing.assert_array_equal(data[obs_key][k, t].numpy(), unwrap(obs))
            obs, reward, term, trunc, _ = env.step(wrap(act_space, data[act_key][k, t].numpy()))
            np.testing.assert_array_equal(data["next", *obs_key][k, t].numpy(), unwrap(obs))
            assert data["next", "reward"][k, t, 0].item() == np.float32(reward)
            assert data["next", "terminated"][k, t, 0].item() == term
            assert data["next", "truncated"][k, t, 0].item() == trunc
            if term or trunc:
                obs, _ = env.reset()
    assert data["next", "done"].any(), "the run should cross episode ends"


async def collect_cat(make_env, **kwargs):
    with anyio.fail_after(60):
        async with Collector(make_env, **kwargs) as c:
            batches = [b.clone() async for b in c]
    return torch.cat(batches, dim=1)


def with_sibling(space: spaces.Space) -> spaces.Space:
    """``space`` with a second leaf next to its only one (the multi-key path)."""
    if isinstance(space, spaces.Dict):
        ((name, sub),) = space.spaces.items()
        if isinstance(sub, (spaces.Dict, spaces.Tuple)):
            return spaces.Dict({name: with_sibling(sub)})
        return spaces.Dict({name: sub, "zz_sibling": spaces.Discrete(2)})
    (sub,) = space.spaces
    if isinstance(sub, (spaces.Dict, spaces.Tuple)):
        return spaces.Tuple((with_sibling(sub),))
    return spaces.Tuple((sub, spaces.Discrete(2)))


# ---- keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(OBS_CASES) + [f"act-{name}" for name in ACT_CASES])
def test_a_one_leaf_space_has_the_key_the_multi_key_path_gives_its_leaf(case):
    """The leaf of a one-leaf Dict/Tuple space keeps the key it has next to a sibling."""
    if case.startswith("act-"):
        space, key = ACT_CASES[case[4:]]
        leaves = action_leaves
    else:
        space, key = OBS_CASES[case]
        leaves = observation_leaves
    one = [leaf.key for leaf in leaves(space)]
    multi = [leaf.key for leaf in leaves(with_sibling(space))]
    assert one == [key] and len(multi) == 2 and key in multi


# ---- observations ---------------------------------------------------------------------------------


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("case", list(OBS_CASES))
async def test_one_leaf_observation_space_gives_a_plain_loops_data(case, num_workers):
    obs_space, obs_key = OBS_CASES[case]
    data = await collect_cat(
        OneLeafEnv, create_env_kwargs={"observation_space": obs_space, "action_space": MOVE},
        policy=policy_for(obs_key, MOVE, ("action",)), frames_per_batch=12, total_frames=24,
        num_workers=num_workers, envs_per_worker=2, init_random_frames=8, seed=SEED,
    )
    check_batch(data, obs_space, MOVE, obs_key, ("action",))
    assert len(data["action"].unique()) > 1


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("case", list(ACT_CASES))
async def test_one_leaf_action_space_reaches_the_env_as_its_structure(case, num_workers):
    """Random actions (init_random_frames) and the policy's both reach the env as the space's
    dict/tuple (the env refuses anything else), and the batch stores the leaf."""
    act_space, act_key = ACT_CASES[case]
    policy = policy_for(("observation",), act_space, act_key)
    data = await collect_cat(
        OneLeafEnv, create_env_kwargs={"observation_space": FRAME, "action_space": act_space},
        policy=policy, frames_per_batch=12, total_frames=24, num_workers=num_workers, envs_per_worker=2,
        init_random_frames=8, seed=SEED,
    )
    check_batch(data, FRAME, act_space, ("observation",), act_key)
    late = data[:, 4:]  # the policy's frames: its action of each observation
    expected = LeafPolicy(isinstance(leaf_space(act_space), spaces.Discrete))(late["observation"].flatten(0, 1))
    assert torch.equal(late[act_key].flatten(0, 1), expected)


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("case", ["dict-pixels", "nested-dict", "dict-in-tuple"])
async def test_one_leaf_spaces_in_a_vector_env_give_a_plain_loops_data(case, num_workers):
    """gymnasium's SyncVectorEnv of one-leaf envs: a dict/tuple of batched leaves each step,
    each sub-env a row of the batch; one-leaf Dict actions go to it batched."""
    obs_space, obs_key = OBS_CASES[case]
    act_space, act_key = ACT_CASES["dict-discrete" if case != "dict-in-tuple" else "dict-in-tuple"]

    def make():
        return gym.vector.SyncVectorEnv([lambda: OneLeafEnv(obs_space, act_space)] * 2)

    data = await collect_cat(
        make, policy=policy_for(obs_key, act_space, act_key), frames_per_batch=12, total_frames=24,
        num_workers=num_workers, envs_per_worker=1, init_random_frames=4, seed=SEED,
    )
    check_batch(data, obs_space, act_space, obs_key, act_key)


@pytest.mark.loops("asyncio")
async def test_one_leaf_spaces_with_server_inference():
    obs_space, obs_key = OBS_CASES["dict-pixels"]
    act_space, act_key = ACT_CASES["dict-discrete"]
    data = await collect_cat(
        OneLeafEnv, create_env_kwargs={"observation_space": obs_space, "action_space": act_space},
        policy=policy_for(obs_key, act_space, act_key), frames_per_batch=12, total_frames=24, num_workers=1,
        envs_per_worker=2, inference="server", seed=SEED,
    )
    check_batch(data, obs_space, act_space, obs_key, act_key)
    assert torch.equal(data[act_key], LeafPolicy(True)(data[obs_key].flatten(0, 1)).reshape(data.batch_size))


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("obs_case, act_case", [("dict-pixels", "dict-discrete"), ("dict-in-tuple", "tuple-box")])
async def test_evaluator_with_one_leaf_spaces_gives_a_plain_loops_metrics(obs_case, act_case):
    obs_space, obs_key = OBS_CASES[obs_case]
    act_space, act_key = ACT_CASES[act_case]
    module = LeafPolicy(isinstance(leaf_space(act_space), spaces.Discrete))
    returns = []
    env = OneLeafEnv(obs_space, act_space)
    for j in range(3):  # episode j starts from reset(seed=seed + j)
        obs, _ = env.reset(seed=SEED + j)
        ret, done = 0.0, False
        while not done:
            action = module(torch.as_tensor(unwrap(obs))[None])[0].numpy()
            obs, reward, term, trunc, _ = env.step(wrap(act_space, action))
            ret += reward
            done = term or trunc
        returns.append(ret)

    def episodes(rets, lengths):
        return {"returns": rets.tolist(), "lengths": lengths.tolist()}

    with anyio.fail_after(60):
        async with Evaluator(
            lambda: OneLeafEnv(obs_space, act_space), policy_for(obs_key, act_space, act_key), num_trajectories=3,
            seed=SEED, metrics_fn=episodes,
        ) as ev:
            result = await ev.evaluate()
    np.testing.assert_allclose(result["returns"], returns, rtol=1e-6)
    assert result["lengths"] == [3, 3, 3]


# ---- a batch that cannot fit ------------------------------------------------------------------------


class _Allocations:
    """Wraps ``_shm.allocate`` to record the size of every segment allocated."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.real = _shm.allocate

    def __call__(self, nbytes: int, name: str):
        self.sizes.append(nbytes)
        return self.real(nbytes, name)


def _largest(message: str) -> int:
    found = re.search(r"the largest frames_per_batch that fits with .* is (\d+)", message)
    assert found, message
    return int(found.group(1))


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("num_workers", [0, 1])
async def test_batch_bigger_than_the_memory_available_is_refused_before_any_slot_is_allocated(num_workers, monkeypatch):
    """1 MiB frames and a frames_per_batch whose slots exceed the memory available as read now: a
    ConfigError with the figures and the largest frames_per_batch that fits; no slot segment is
    allocated (not even lazily), and the collector closes cleanly."""
    allocations = _Allocations()
    monkeypatch.setattr(_shm, "allocate", allocations)
    have, _ = _shm.available()
    frame = 2 * 2**20  # the observation and the next one
    fpb = (have // frame + 2) // 2 * 2  # one slot alone is more than what is available
    c = Collector(
        SpacesEnv, create_env_kwargs={"observation_space": spaces.Box(0, 255, (1024, 1024), np.uint8),
                                      "action_space": spaces.Discrete(2)},
        frames_per_batch=fpb, num_workers=num_workers, envs_per_worker=2, prefetch=0,
    )
    with anyio.fail_after(60):
        with pytest.raises(ConfigError) as raised:
            async with c:
                await c.collect()
    text = str(raised.value)
    assert text.startswith(f"frames_per_batch={fpb} with prefetch=0 (4 batch slots of {fpb:,} frames of ")
    assert "needs " in text and "more than this machine can give now" in text and "kept for the rest" in text
    assert "fewer envs (num_workers, envs_per_worker)" in text and "zero_copy=True" in text
    largest = _largest(text)
    assert 0 < largest < fpb // 4 and largest % 2 == 0
    assert all(size < fpb * frame for size in allocations.sizes), "a segment for the slots was allocated"


@pytest.mark.loops("asyncio")
async def test_largest_frames_per_batch_named_fits_and_the_next_does_not(monkeypatch):
    """With the memory probe saying 300 MiB: the frames_per_batch the message names runs, one more
    row of frames is refused, and so is any async run of 2 workers of that size (twice the slots)."""
    monkeypatch.setattr(_shm, "available", lambda: (300 * 2**20, "a figure for the test"))
    kwargs = dict(
        create_env_kwargs={"observation_space": spaces.Box(0, 255, (256, 256), np.uint8), "action_space": spaces.Discrete(2)},
        num_workers=1, envs_per_worker=2, seed=0,
    )
    with anyio.fail_after(60):
        with pytest.raises(ConfigError, match=r"a figure for the test\), less 256\.0 MiB kept") as raised:
            async with Collector(SpacesEnv, frames_per_batch=1000, **kwargs) as c:
                await c.collect()
        largest = _largest(str(raised.value))
        assert 2 <= largest < 1000 and largest % 2 == 0
        async with Collector(SpacesEnv, frames_per_batch=largest, total_frames=largest, **kwargs) as c:
            sizes = [b.batch_size async for b in c]  # (a lent batch kept would keep the slots mapped)
        assert sizes == [(2, largest // 2)]
        with pytest.raises(ConfigError, match=f"the largest frames_per_batch that fits .* is {largest}"):
            async with Collector(SpacesEnv, frames_per_batch=largest + 2, **kwargs) as c:
                await c.collect()


def test_available_shared_memory_is_known_and_at_most_ram_and_swap():
    have, source = _shm.available()
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
    assert 0 < have <= info["MemTotal"] + info.get("SwapTotal", 0)
    assert source
    assert _shm.headroom(have) >= _shm.HEADROOM_MIN
