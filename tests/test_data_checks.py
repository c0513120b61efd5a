"""No silent data corruption: what an env returns and a policy writes is stored exactly, cast by a
documented rule, or refused with a :class:`SpecError` naming the env, the key, the value and the
space; ``check_finite=True`` refuses NaN/inf; ``action_bounds`` decides what the env gets for a
Box action outside its bounds, while the batch keeps what the policy wrote.

Every test is a short complete program with real worker processes (``num_workers=1``; the local
backend once), with the envs and policies of this module (picklable by reference)."""

from __future__ import annotations

from typing import Any

import anyio
import gymnasium
import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch import nn

from aiocollect import Collector, ConfigError, SpecError
from aiocollect._evaluator.evaluator import Evaluator
from aiocollect._backends.launcher import get_launcher

U8 = spaces.Box(0, 255, (3,), np.uint8)
F32 = spaces.Box(-1000.0, 1000.0, (3,), np.float32)
TORQUE = spaces.Box(-2.0, 2.0, (1,), np.float32)


@pytest.fixture(scope="module", autouse=True)
def launcher_with_this_modules_imports():
    """Workers unpickle this module's envs and policies by importing it: let the launcher import
    its heavy imports once."""
    get_launcher().ensure_started(("torch", "tensordict", "tensordict.nn", "pytest", "anyio"))


# ---- envs and policies ------------------------------------------------------------------------


class BadValueEnv(gymnasium.Env):
    """Observations ``np.full(shape, k, dtype)`` of its space (of each part of a Dict space) at
    step ``k`` of an episode (``k = 0`` after reset), reward 1.0; at step ``bad_at`` it returns
    ``bad["obs"]`` and/or ``bad["reward"]`` instead (those of the keys it has), but only if its
    first reset was seeded with ``bad_seed`` (``None``: any env), so that a test chooses which
    env goes wrong. Episodes are truncated after 50 steps."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        observation_space: spaces.Space = F32,
        action_space: spaces.Space = TORQUE,
        bad: dict | None = None,
        bad_at: int = 3,
        bad_seed: int | None = None,
    ) -> None:
        self.observation_space = observation_space
        self.action_space = action_space
        self.bad, self.bad_at, self.bad_seed = bad or {}, bad_at, bad_seed
        self.k = 0
        self.chosen: bool | None = None

    def _obs(self) -> Any:
        if self.chosen and self.k == self.bad_at and "obs" in self.bad:
            return self.bad["obs"]
        return self._good(self.observation_space)

    def _good(self, space: spaces.Space) -> Any:
        if isinstance(space, spaces.Dict):
            return {name: self._good(sub) for name, sub in space.spaces.items()}
        return np.full(space.shape, self.k, space.dtype)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if self.chosen is None:
            self.chosen = self.bad_seed is None or seed == self.bad_seed
        self.k = 0
        return self._obs(), {}

    def step(self, action):
        self.k += 1
        reward = 1.0
        if self.chosen and self.k == self.bad_at and "reward" in self.bad:
            reward = self.bad["reward"]
        return self._obs(), reward, False, self.k >= 50, {}


class EchoActionEnv(gymnasium.Env):
    """Its observation after a step is the action it was given (as float32) and its reward their
    sum, so a batch's ``("next", "observation")`` shows what the env received and ``"action"``
    what the policy wrote. ``action_space`` is a Box, or a Dict holding a Box under ``"move"``
    (echoed) and a Discrete."""

    metadata = {"render_modes": []}

    def __init__(self, action_space: spaces.Space = TORQUE) -> None:
        self.action_space = action_space
        box = action_space["move"] if isinstance(action_space, spaces.Dict) else action_space
        self.observation_space = spaces.Box(-np.inf, np.inf, box.shape, np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        return np.zeros(self.observation_space.shape, np.float32), {}

    def step(self, action):
        move = action["move"] if isinstance(action, dict) else action
        received = np.asarray(move, np.float32).copy()
        return received, float(received.sum()), False, False, {}


class ActionFromStep(nn.Module):
    """A one-dimensional action of ``dtype`` for each env: ``good`` while the env's observation
    (BadValueEnv's counts the steps of the episode) is below ``bad_at``, then ``bad``."""

    def __init__(self, good: float, bad: float, bad_at: int = 3, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.good, self.bad, self.bad_at, self.dtype = good, bad, bad_at, dtype

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        late = obs[:, :1] >= self.bad_at
        good = torch.full((obs.shape[0], 1), self.good, dtype=self.dtype)
        return torch.where(late, torch.full_like(good, self.bad), good)


def integer_actions_later(td):
    """A TensorDict policy: float actions while the step count is below 3, then integer ones (the
    dtype changes after the first, checked step)."""
    obs = td["observation"]
    if bool((obs[:, 0] >= 3).any()):
        td["action"] = torch.ones(obs.shape[0], 1, dtype=torch.int64)
    else:
        td["action"] = torch.full((obs.shape[0], 1), 0.5)
    return td


def move_and_fire(td):
    """A TensorDict policy for ``Dict(move=Box(-1, 1, (2,)), fire=Discrete(2))``: always moves
    (3.0, -0.5) and fires."""
    n = td.batch_size[0]
    td["action", "move"] = torch.tensor([[3.0, -0.5]]).expand(n, 2).clone()
    td["action", "fire"] = torch.ones(n, dtype=torch.int64)
    return td


async def _first_error(collector: Collector) -> BaseException:
    """The error of ``start()`` or, when that succeeds, of a following ``collect()``."""
    try:
        with anyio.fail_after(30):
            await collector.start()
            while True:
                await collector.collect()
    except SpecError as exc:
        return exc
    finally:
        await collector.aclose()


async def _one_batch(collector: Collector):
    async with collector:
        with anyio.fail_after(30):
            return await collector.collect()


def _bad_env(**kwargs) -> Collector:
    """A collector over two BadValueEnvs (seeds 0 and 1: only env 1 goes wrong) in one worker;
    ``bad_obs`` / ``bad_reward`` go into the env's ``bad`` dict, ``policy``, ``check_finite``,
    ``action_bounds`` and ``num_workers`` to the collector, the rest to the env."""
    policy = kwargs.pop("policy", None)
    options = {k: kwargs.pop(k) for k in ("check_finite", "action_bounds", "num_workers") if k in kwargs}
    options.setdefault("num_workers", 1)
    kwargs["bad"] = {name: kwargs.pop(f"bad_{name}") for name in ("obs", "reward") if f"bad_{name}" in kwargs}
    return Collector(
        BadValueEnv, policy, frames_per_batch=16, envs_per_worker=2, seed=0,
        create_env_kwargs={"bad_seed": 1, **kwargs}, **options,
    )


# ---- observations: another kind is an error, another width a documented cast --------------------


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_float_observation_for_uint8_box_raises_spec_error_naming_env_key_value_and_space(num_workers):
    """300.7 (float64) for a Box(0, 255, uint8) is refused, never stored wrapped: the SpecError
    names env 1, the key, the value, its dtype, the space and a fix, with the worker traceback."""
    err = await _first_error(_bad_env(observation_space=U8, bad_obs=np.array([300.7, 1.0, 2.0]), num_workers=num_workers))
    assert type(err) is SpecError
    msg = str(err)
    for part in ("env 1's observation", "'observation'", "300.7", "float64", "Box(0, 255, (3,), uint8)", "DtypeObservation"):
        assert part in msg, (part, msg)
    assert any("traceback" in note for note in getattr(err, "__notes__", [])), err


async def test_integer_observation_for_float_box_raises_spec_error_naming_dtypes():
    """int64 values for a float32 Box are refused (another kind), naming both dtypes and the fix."""
    err = await _first_error(_bad_env(bad_obs=np.array([7, 8, 9])))
    msg = str(err)
    assert type(err) is SpecError
    for part in ("env 1's observation", "int64", "float32", "[7, 8, 9]", "Box(-1000.0, 1000.0, (3,), float32)", "astype(np.float32)"):
        assert part in msg, (part, msg)


async def test_integer_observation_out_of_range_of_uint8_raises_spec_error_never_wraps():
    """int64 300 for a uint8 Box is refused (300 would be stored as 44): the message names the
    value, where it is and the dtype's range."""
    err = await _first_error(_bad_env(observation_space=U8, bad_obs=np.array([1, 300, 2])))
    msg = str(err)
    assert type(err) is SpecError
    for part in ("env 1's observation", "holds 300", "(1,)", "uint8 (0 to 255)", "Box(0, 255, (3,), uint8)"):
        assert part in msg, (part, msg)


async def test_float64_observation_for_float32_box_is_stored_as_its_float32_rounding():
    """A float64 observation of the right shape is rounded to float32 (the documented cast)."""
    value = np.array([0.1, -123.456789012345, 1e-8])
    batch = await _one_batch(_bad_env(bad_obs=value, bad_at=2))
    stored = batch["next", "observation"][1, 1].numpy()  # env 1's step 2
    assert stored.dtype == np.float32
    np.testing.assert_array_equal(stored, value.astype(np.float32))
    np.testing.assert_array_equal(batch["next", "observation"][0, 1].numpy(), np.full(3, 2, np.float32))


async def test_narrower_or_wider_integers_and_floats_in_a_dict_observation_are_stored_exactly():
    """Dict observation: int64 values within 0..255 into a uint8 Box, bools into a MultiBinary
    and float64 into a float32 Box are all stored exactly (their float32 rounding for floats)."""
    space = spaces.Dict({"pixels": U8, "flags": spaces.MultiBinary(2), "state": F32})
    bad = {"pixels": np.array([0, 128, 255]), "flags": np.array([True, False]), "state": np.array([0.1, 2.5, -3.0])}
    batch = await _one_batch(_bad_env(observation_space=space, bad_obs=bad, bad_at=2))
    step = batch["next"][1, 1]
    np.testing.assert_array_equal(step["pixels"].numpy(), np.array([0, 128, 255], np.uint8))
    np.testing.assert_array_equal(step["flags"].numpy(), np.array([1, 0], np.int8))
    np.testing.assert_array_equal(step["state"].numpy(), np.array([0.1, 2.5, -3.0], np.float32))


async def test_python_int_observations_of_a_discrete_space_are_stored_exactly():
    """FrozenLake returns Python ints for its Discrete(16) observations: they are stored as int64,
    equal to a plain gymnasium replay of the same seed and actions."""
    batch = await _one_batch(Collector("FrozenLake-v1", frames_per_batch=40, num_workers=1, seed=3))
    env = gymnasium.make("FrozenLake-v1")
    obs, _ = env.reset(seed=3)
    assert type(obs) is int
    for t in range(40):
        assert batch["observation"][0, t].item() == obs
        obs, _, terminated, truncated, _ = env.step(int(batch["action"][0, t]))
        assert batch["next", "observation"][0, t].item() == obs
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    assert batch["observation"].dtype == torch.int64


# ---- rewards ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reward", "shown"),
    [(np.array([1.5]), "[1.5]"), (None, "None"), ("1.0", "'1.0'")],
    ids=["one-element-array", "None", "str"],
)
async def test_reward_that_is_not_a_real_scalar_raises_spec_error_naming_env_and_value(reward, shown):
    """A reward must be a real scalar: a one-element array, None or a string is a SpecError
    naming the env, the step and the value."""
    err = await _first_error(_bad_env(bad_reward=reward))
    msg = str(err)
    assert type(err) is SpecError
    assert "env 1's reward at step 3" in msg and shown in msg and "real scalar" in msg, msg


async def test_numpy_and_integer_rewards_are_stored_as_float32():
    """np.float32, np.int64 and Python int rewards are fine (stored as float32)."""
    batch = await _one_batch(_bad_env(bad_reward=np.float32(2.5), bad_at=2))
    assert batch["next", "reward"][1, 1, 0].item() == 2.5
    batch = await _one_batch(_bad_env(bad_reward=np.int64(-3), bad_at=2))
    assert batch["next", "reward"][1, 1, 0].item() == -3.0


# ---- check_finite -----------------------------------------------------------------------------


@pytest.mark.parametrize(("bad_at", "when"), [(0, "returned by reset"), (2, "returned by step 2")])
async def test_nan_observation_is_stored_by_default_and_refused_with_check_finite(bad_at, when):
    """Without check_finite a NaN observation is data like any other; with check_finite=True it
    is a SpecError naming env 1, the key, the step (or the reset) and the value."""
    nan = np.array([np.nan, 0.0, 0.0], np.float32)
    batch = await _one_batch(_bad_env(bad_obs=nan, bad_at=bad_at))
    stored = batch["observation"][1, 0] if bad_at == 0 else batch["next", "observation"][1, bad_at - 1]
    assert np.isnan(stored[0].item())
    err = await _first_error(_bad_env(bad_obs=nan, bad_at=bad_at, check_finite=True))
    msg = str(err)
    assert type(err) is SpecError
    for part in ("env 1's observation", "'observation'", when, "nan", "check_finite"):
        assert part in msg, (part, msg)


async def test_check_finite_refuses_an_infinite_reward_naming_env_and_step():
    err = await _first_error(_bad_env(bad_reward=float("-inf"), check_finite=True))
    msg = str(err)
    assert type(err) is SpecError
    assert "env 1's reward returned by step 3" in msg and "-inf" in msg, msg


async def test_check_finite_refuses_a_nan_action_before_the_env_gets_it():
    """A policy writing NaN once it sees observation 3 (for its 4th step): SpecError naming the
    env, the key and the step."""
    err = await _first_error(_bad_env(policy=ActionFromStep(0.5, float("nan")), check_finite=True))
    msg = str(err)
    assert type(err) is SpecError
    assert "action for env 0 at step 4" in msg and "'action'" in msg and "nan" in msg, msg


async def test_random_actions_pass_every_check():
    """policy=None samples the action space: check_finite and action_bounds='error' never object."""
    batch = await _one_batch(_bad_env(check_finite=True, action_bounds="error"))
    actions = batch["action"]
    assert bool(((actions >= -2) & (actions <= 2)).all())


# ---- actions: dtype and bounds ------------------------------------------------------------------


async def test_integer_actions_for_a_float_box_raise_spec_error_naming_dtype_and_space():
    """An nn.Module writing int64 actions for Box(-2, 2, float32) is refused at start."""
    policy = ActionFromStep(1, 1, dtype=torch.int64)
    err = await _first_error(_bad_env(policy=policy))
    msg = str(err)
    assert type(err) is SpecError
    for part in ("'action'", "int64", "Box(-2.0, 2.0, (1,), float32)", "floats (float32)"):
        assert part in msg, (part, msg)


async def test_policy_switching_to_integer_actions_after_the_first_step_is_refused():
    """The dtype check is not only done once: a TensorDict policy that writes floats at first and
    integers from step 3 on gets a SpecError then (not a silent cast)."""
    err = await _first_error(_bad_env(policy=integer_actions_later))
    assert type(err) is SpecError
    assert "int64" in str(err) and "float32" in str(err), str(err)


async def test_action_bounds_error_refuses_an_out_of_bounds_action_naming_env_value_and_bounds():
    err = await _first_error(_bad_env(policy=ActionFromStep(0.5, 7.5), action_bounds="error"))
    msg = str(err)
    assert type(err) is SpecError
    for part in ("action for env 0 at step 4", "'action'", "[7.5]", "low=[-2.0]", "high=[2.0]", "action_bounds='error'"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize(("mode", "received"), [("pass", 7.5), ("clip", 2.0)])
async def test_action_bounds_decides_what_the_env_gets_and_the_batch_keeps_the_policys_action(mode, received):
    """"pass": the env gets 7.5 as written; "clip": it gets 2.0. Either way the batch stores 7.5."""
    c = Collector(
        EchoActionEnv, ActionFromStep(7.5, 7.5), frames_per_batch=8, num_workers=1, action_bounds=mode,
    )
    batch = await _one_batch(c)
    assert bool((batch["action"] == 7.5).all())
    assert bool((batch["next", "observation"] == received).all())


async def test_action_bounds_clip_applies_to_a_box_inside_a_dict_action_space():
    space = spaces.Dict({"move": spaces.Box(-1.0, 1.0, (2,), np.float32), "fire": spaces.Discrete(2)})
    c = Collector(
        EchoActionEnv, move_and_fire, frames_per_batch=4, num_workers=1,
        create_env_kwargs={"action_space": space}, action_bounds="clip",
    )
    batch = await _one_batch(c)
    np.testing.assert_array_equal(batch["action", "move"][0].numpy(), np.tile([3.0, -0.5], (4, 1)))
    np.testing.assert_array_equal(batch["next", "observation"][0].numpy(), np.tile([1.0, -0.5], (4, 1)))
    assert bool((batch["action", "fire"] == 1).all())


def narrow_pendulum() -> gymnasium.Env:
    """Pendulum-v1 declaring Box(-1, 1) torques: the env itself clips only at +-2, so its dynamics
    tell a torque of 1.5 from one clipped to 1.0."""
    env = gymnasium.make("Pendulum-v1")
    env.unwrapped.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
    return env


class PendulumTorque(nn.Module):
    """Torque 1.5 while the angular velocity is >= 0, else -1.5: outside Box(-1, 1)."""

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.where(obs[:, 2:3] >= 0, torch.tensor(1.5), torch.tensor(-1.5))


def _replay(torques: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Observations and next observations of a plain loop over ``narrow_pendulum`` with ``torques``."""
    env = narrow_pendulum()
    obs, _ = env.reset(seed=seed)
    before, after = [], []
    for torque in torques:
        before.append(obs)
        obs, *_ = env.step(np.array([torque], np.float32))
        after.append(obs)
    env.close()
    return np.array(before), np.array(after)


async def test_action_bounds_clip_on_pendulum_stores_the_policys_torque_and_steps_with_the_clipped_one():
    """A real env's dynamics: with action_bounds="clip" the batch holds the policy's torques
    (+-1.5), and its observations are exactly those of a plain loop stepped with the torques
    clipped to +-1, not those of one stepped with +-1.5."""
    c = Collector(narrow_pendulum, PendulumTorque(), frames_per_batch=20, num_workers=1, seed=5, action_bounds="clip")
    batch = await _one_batch(c)
    torques = batch["action"][0, :, 0].numpy()
    assert set(torques.tolist()) <= {1.5, -1.5}
    obs, next_obs = _replay(np.clip(torques, -1.0, 1.0), seed=5)
    np.testing.assert_array_equal(batch["observation"][0].numpy(), obs)
    np.testing.assert_array_equal(batch["next", "observation"][0].numpy(), next_obs)
    assert not np.array_equal(_replay(torques, seed=5)[1], next_obs)


# ---- the evaluator shares the rules ---------------------------------------------------------------


async def test_evaluator_refuses_out_of_range_observations_and_nan_actions_like_the_collector():
    async with Evaluator(
        BadValueEnv, num_trajectories=1, max_steps=5,
        env_kwargs={"observation_space": U8, "bad": {"obs": np.array([1, 2, 999])}},
    ) as ev:
        with anyio.fail_after(30), pytest.raises(SpecError, match=r"eval env 0's observation.*holds 999.*uint8"):
            await ev.evaluate()
    async with Evaluator(BadValueEnv, ActionFromStep(0.5, float("nan")), num_trajectories=1, max_steps=5, check_finite=True) as ev:
        with anyio.fail_after(30), pytest.raises(SpecError, match=r"action for eval env 0 at step 4 of episode 0 is not finite"):
            await ev.evaluate()


@pytest.mark.parametrize(("mode", "received"), [("pass", 7.5), ("clip", 2.0)])
async def test_evaluator_action_bounds_decides_what_the_env_gets(mode, received):
    """The echo env's reward is the action it got: 3 steps of 7.5 or, clipped, of 2.0."""
    policy = ActionFromStep(7.5, 7.5)
    async with Evaluator(EchoActionEnv, policy, num_trajectories=1, max_steps=3, action_bounds=mode) as ev:
        with anyio.fail_after(30):
            metrics = await ev.evaluate()
    assert metrics["return_mean"] == 3 * received


# ---- options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"check_finite": "yes"}, r"check_finite='yes' must be True or False"),
        ({"check_finite": 1}, r"check_finite=1 must be True or False"),
        ({"action_bounds": "clamp"}, r"action_bounds='clamp' must be 'pass'.*'clip'.*'error'"),
        ({"action_bounds": None}, r"action_bounds=None must be"),
    ],
)
def test_bad_check_finite_or_action_bounds_raises_config_error_in_collector_and_evaluator(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Collector(BadValueEnv, frames_per_batch=4, **kwargs)
    with pytest.raises(ConfigError, match=match):
        Evaluator(BadValueEnv, **kwargs)
