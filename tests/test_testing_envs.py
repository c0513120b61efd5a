"""The public test envs of ``aiocollect.testing`` behave as documented."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import gymnasium
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import check_env

from aiocollect.testing import BadObservationEnv, CountingEnv, InjectedFailure, SpacesEnv

REPO = Path(__file__).resolve().parent.parent


def rollout(env, seed, steps, action=0):
    """Observations, rewards and end flags of ``steps`` steps after ``reset(seed=seed)``."""
    obs, _ = env.reset(seed=seed)
    out = [obs]
    ends = []
    for _ in range(steps):
        obs, reward, terminated, truncated, _ = env.step(action)
        out.append(obs)
        ends.append((reward, terminated, truncated))
    return out, ends


# ---- CountingEnv ------------------------------------------------------------------------------


def test_counting_env_observations_encode_seed_and_step():
    env = CountingEnv(episode_length=5, obs_shape=(2, 3))
    obs, info = env.reset(seed=1007)
    assert obs.shape == (2, 3) and obs.dtype == np.float32
    assert np.all(obs == 700) and info == {"count": 0}
    for k in range(1, 6):
        obs, reward, terminated, truncated, info = env.step(1)
        assert np.all(obs == 700 + k)
        assert reward == 2.0
        assert info == {"count": k}
        assert terminated is (k == 5) and truncated is False
    assert obs in env.observation_space


def test_counting_env_same_seed_same_data():
    a, b = CountingEnv(), CountingEnv()
    obs_a, ends_a = rollout(a, 3, 12)
    obs_b, ends_b = rollout(b, 3, 12)
    assert all(np.array_equal(x, y) for x, y in zip(obs_a, obs_b))
    assert ends_a == ends_b
    obs_c, _ = rollout(CountingEnv(), 4, 12)
    assert not np.array_equal(obs_a[0], obs_c[0])


def test_counting_env_unseeded_reset_keeps_the_start():
    env = CountingEnv(episode_length=2)
    obs, _ = env.reset()
    assert np.all(obs == 0)
    env.reset(seed=42)
    env.step(0)
    env.step(0)
    obs, _ = env.reset()
    assert np.all(obs == 4200)
    assert env.num_resets == 3 and env.num_steps == 2


@pytest.mark.parametrize("truncate", [False, True])
def test_counting_env_episode_end_terminated_or_truncated(truncate):
    env = CountingEnv(episode_length=3, truncate=truncate)
    _, ends = rollout(env, 0, 3)
    assert [e[1] for e in ends] == [False, False, not truncate]
    assert [e[2] for e in ends] == [False, False, truncate]


def test_counting_env_integer_dtype():
    env = CountingEnv(dtype=np.int64, obs_shape=())
    obs, _ = env.reset(seed=5)
    assert obs.dtype == np.int64 and obs.shape == () and obs == 500
    assert obs in env.observation_space


def test_counting_env_fail_at_step_counts_over_the_env_life():
    env = CountingEnv(episode_length=2, fail_at_step=5)
    env.reset(seed=0)
    for _ in range(4):  # crosses an episode boundary
        _, _, terminated, _, _ = env.step(0)
        if terminated:
            env.reset()
    with pytest.raises(InjectedFailure, match="step 5"):
        env.step(0)
    assert env.num_steps == 5
    # Only the 5th step fails; the state did not advance, so the env carries on.
    obs, *_ = env.step(0)
    assert np.all(obs == 1)


def test_counting_env_fail_on_reset():
    env = CountingEnv(fail_on_reset=2)
    env.reset(seed=0)
    with pytest.raises(InjectedFailure, match="reset 2"):
        env.reset(seed=0)
    env.reset(seed=0)
    assert isinstance(InjectedFailure("x"), RuntimeError)


def test_counting_env_refuses_an_action_outside_its_space():
    env = CountingEnv()
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action"):
        env.step(2)
    with pytest.raises(ValueError, match="action"):
        env.step(np.array([1]))
    env.step(np.int64(1))


def test_counting_env_step_before_reset_raises():
    with pytest.raises(gymnasium.error.ResetNeeded):
        CountingEnv().step(0)


def test_counting_env_step_cost_and_sleep_take_time():
    for kwargs in ({"step_cost": 0.02}, {"step_sleep": 0.02}):
        env = CountingEnv(**kwargs)
        env.reset(seed=0)
        begin = time.perf_counter()
        env.step(0)
        assert time.perf_counter() - begin >= 0.02


def test_counting_env_crash_at_step_kills_its_process():
    """Run in a child interpreter: the crash must kill that process, at the N-th step only."""
    code = textwrap.dedent(
        """
        from aiocollect.testing import CountingEnv
        env = CountingEnv(crash_at_step=3)
        env.reset(seed=0)
        env.step(0)
        env.step(0)
        print("two steps", flush=True)
        env.step(0)
        print("survived", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout == "two steps\n"


def test_counting_env_passes_gymnasium_check_env():
    with warnings.catch_warnings():
        # Unbounded Box observations are deliberate (values grow with the seed); check_env
        # warns that infinite bounds are "probably too low/high". Render checks are skipped as
        # in the SpacesEnv test below.
        warnings.filterwarnings(
            "ignore", message=r".*A Box observation space (minimum|maximum) value is"
        )
        check_env(CountingEnv(), skip_render_check=True)
        check_env(CountingEnv(truncate=True, dtype=np.int32), skip_render_check=True)


# ---- SpacesEnv --------------------------------------------------------------------------------

SPACES = {
    "box": spaces.Box(-1.0, 1.0, (2, 3), np.float32),
    "discrete": spaces.Discrete(4),
    "multidiscrete": spaces.MultiDiscrete([2, 3, 4]),
    "multibinary": spaces.MultiBinary(5),
    "dict": spaces.Dict(
        {
            "pos": spaces.Box(-1.0, 1.0, (2,), np.float64),
            "inner": spaces.Dict({"flag": spaces.MultiBinary(1), "k": spaces.Discrete(3)}),
        }
    ),
    "tuple": spaces.Tuple((spaces.Discrete(2), spaces.Box(0.0, 1.0, (3,), np.float32))),
}


@pytest.mark.parametrize("name", sorted(SPACES))
def test_spaces_env_passes_gymnasium_check_env(name):
    space = SPACES[name]
    # Render checks are skipped: the envs declare no render mode, and without a registered
    # spec check_env only warns that it cannot test them (an error under -W error).
    check_env(SpacesEnv(space, space), skip_render_check=True)


@pytest.mark.parametrize("name", sorted(SPACES))
def test_spaces_env_is_deterministic_given_the_seed(name):
    space = SPACES[name]
    a, b = SpacesEnv(space, spaces.Discrete(2)), SpacesEnv(space, spaces.Discrete(2))
    obs_a, ends_a = rollout(a, 7, 7)
    obs_b, ends_b = rollout(b, 7, 7)
    for x, y in zip(obs_a, obs_b):
        assert gymnasium.utils.env_checker.data_equivalence(x, y, exact=True)
        assert x in space
    assert ends_a == ends_b
    assert [e[1] for e in ends_a] == [False] * 4 + [True, True, True]


def test_spaces_env_does_not_seed_the_callers_space():
    space = spaces.Discrete(1000)
    space.seed(0)
    expected = [space.sample() for _ in range(3)]
    space.seed(0)
    SpacesEnv(space, spaces.Discrete(2)).reset(seed=1)
    assert [space.sample() for _ in range(3)] == expected


def test_spaces_env_truncates_when_terminate_is_false():
    env = SpacesEnv(spaces.Discrete(3), spaces.Discrete(2), episode_length=2, terminate=False)
    _, ends = rollout(env, 0, 2)
    assert ends == [(1.0, False, False), (1.0, False, True)]


@pytest.mark.parametrize(
    ("space", "bad"),
    [
        (spaces.Discrete(2), 2),
        (spaces.Box(-1.0, 1.0, (2,), np.float32), np.zeros(3, np.float32)),
        (spaces.MultiDiscrete([2, 2]), np.array([0, 5])),
        (spaces.Dict({"a": spaces.Discrete(2)}), {"b": 0}),
    ],
)
def test_spaces_env_refuses_an_action_outside_its_space(space, bad):
    env = SpacesEnv(spaces.Discrete(2), space)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="not in the action space") as info:
        env.step(bad)
    assert repr(bad) in str(info.value)


# ---- BadObservationEnv ------------------------------------------------------------------------


def test_bad_observation_env_returns_the_bad_shape_from_reset():
    env = BadObservationEnv()
    obs, _ = env.reset(seed=0)
    assert env.observation_space.shape == (3,)
    assert obs.shape == (2,) and obs not in env.observation_space


def test_bad_observation_env_returns_the_bad_shape_from_the_given_step():
    env = BadObservationEnv(bad_shape=(4, 1), bad_at_step=2)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (3,) and obs in env.observation_space
    obs, *_ = env.step(0)
    assert obs.shape == (3,)
    obs, *_ = env.step(0)
    assert obs.shape == (4, 1)


# ---- all envs ---------------------------------------------------------------------------------

ALL_ENVS = [
    lambda: CountingEnv(episode_length=3, fail_at_step=100),
    lambda: SpacesEnv(SPACES["dict"], SPACES["tuple"]),
    lambda: BadObservationEnv(bad_at_step=1),
]


@pytest.mark.parametrize("make", ALL_ENVS, ids=["counting", "spaces", "bad_observation"])
def test_envs_pickle_and_close_idempotently(make):
    env = make()
    env.reset(seed=3)
    clone = pickle.loads(pickle.dumps(env))
    assert type(clone) is type(env)
    # The clone carries on exactly as the original.
    action = 0 if isinstance(env.action_space, spaces.Discrete) else env.action_space.sample()
    assert gymnasium.utils.env_checker.data_equivalence(env.step(action), clone.step(action))
    env.close()
    env.close()
    assert env.closed
    with pytest.raises(RuntimeError, match="closed"):
        env.reset()


def test_testing_module_imports_no_torch():
    """Worker processes import this module; it must not pull torch or tensordict in."""
    path = str(REPO / "aiocollect" / "testing.py")
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("t", {path!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        heavy = {{"torch", "tensordict", "aiocollect"}}
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
