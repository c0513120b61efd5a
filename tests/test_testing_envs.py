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
from procs import child_env

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
        env=child_env(REPO),
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout == "two steps\n"


def _run_child(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports this checkout's aiocollect."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, env=child_env(REPO),
    )


@pytest.mark.parametrize(
    ("kwargs", "returncode"),
    [({"segfault_at_step": 3}, -signal.SIGSEGV), ({"exit_at_step": 3, "exit_code": 7}, 7)],
    ids=["segfault", "exit"],
)
def test_counting_env_process_faults_end_its_process_at_the_nth_step_only(kwargs, returncode):
    """segfault_at_step dies of a real SIGSEGV, exit_at_step exits with exit_code: in a child
    interpreter, at the N-th step only, without running the code after it."""
    proc = _run_child(
        f"""
        from aiocollect.testing import CountingEnv
        env = CountingEnv(**{kwargs!r})
        env.reset(seed=0)
        env.step(0)
        env.step(0)
        print("two steps", flush=True)
        try:
            env.step(0)
        finally:
            print("survived", flush=True)
        """
    )
    assert proc.returncode == returncode, proc.stderr
    assert proc.stdout == "two steps\n"


@pytest.mark.parametrize("where", ["step", "reset"])
def test_counting_env_hang_blocks_in_the_nth_call_until_interrupted(where):
    """hang_at_step / hang_on_reset block in the N-th call (earlier calls return) and never
    return by themselves; Ctrl-C (SIGINT, sent by a timer in the child) ends the hang with
    KeyboardInterrupt. Run in a child interpreter."""
    proc = _run_child(
        f"""
        import os, signal, threading
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (a background job inherits SIGINT ignored)
        from aiocollect.testing import CountingEnv
        env = CountingEnv(hang_at_step=2, hang_on_reset=3)  # reset(seed=0) is the first reset
        call = env.step if {where!r} == "step" else (lambda action: env.reset())
        env.reset(seed=0)
        call(0)
        print("first call returned", flush=True)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            call(0)
            print("second call returned", flush=True)
        except KeyboardInterrupt:
            print(f"interrupted: {{env.num_steps}} steps, {{env.num_resets}} resets", flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    expected = "2 steps, 1 resets" if where == "step" else "0 steps, 3 resets"
    assert proc.stdout == f"first call returned\ninterrupted: {expected}\n"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_counting_env_nan_at_step_makes_only_that_observation_nan(dtype):
    env = CountingEnv(episode_length=2, nan_at_step=3, dtype=dtype)
    obs, ends = rollout(env, 0, 4)  # steps 1, 2 (episode end: not reset here), 3, 4
    assert [np.isnan(o).all() for o in obs] == [False, False, False, True, False]
    assert obs[3].dtype == dtype and obs[3].shape == (3,)
    assert np.all(obs[4] == 4)


def test_counting_env_nan_at_step_refuses_an_integer_dtype():
    with pytest.raises(ValueError, match="nan_at_step needs a float dtype.*int64"):
        CountingEnv(dtype=np.int64, nan_at_step=1)


@pytest.mark.parametrize(
    ("obs_shape", "dtype", "bad_shape", "bad_dtype"),
    [((3,), np.float32, (4,), np.int64), ((2, 3), np.float64, (2, 4), np.int64), ((), np.int64, (1,), np.float64)],
)
def test_counting_env_wrong_shape_and_dtype_at_step_only_that_observation(obs_shape, dtype, bad_shape, bad_dtype):
    """The observation of the N-th step does not match the space (one more element on the last
    axis, or another kind of dtype); those before and after it do."""
    for kwargs, bad in (
        ({"wrong_shape_at_step": 2}, lambda o: o.shape == bad_shape and o.dtype == dtype),
        # another kind (gymnasium's Box.contains accepts an int64 observation in a float64 box)
        ({"wrong_dtype_at_step": 2}, lambda o: o.shape == obs_shape and o.dtype == bad_dtype),
    ):
        env = CountingEnv(obs_shape=obs_shape, dtype=dtype, **kwargs)
        obs, _ = rollout(env, 0, 3)
        good = [o.shape == obs_shape and o.dtype == dtype and o in env.observation_space for o in obs]
        assert good == [True, True, False, True], kwargs
        assert bad(obs[2]), (kwargs, obs[2])
        assert np.all(obs[2] == 2) and np.all(obs[3] == 3)


# ---- FaultyPolicy -----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["raise", "wrong_shape", "nan"])
def test_faulty_policy_injects_its_fault_on_the_nth_call_only(fault):
    """Calls before and after the N-th return actions [E, *action_shape] equal to `action`; the
    N-th raises InjectedFailure, or returns an extra last dimension, or NaN."""
    import torch

    from aiocollect.testing import FaultyPolicy

    dtype = torch.float32 if fault == "nan" else torch.int64
    policy = FaultyPolicy(fault, at_call=2, action=1, action_shape=(2,), dtype=dtype)
    obs = torch.zeros(5, 3)
    good = policy(obs)
    assert good.shape == (5, 2) and good.dtype == dtype and (good == 1).all()
    if fault == "raise":
        with pytest.raises(InjectedFailure, match="call 2"):
            policy(obs)
    else:
        bad = policy(obs)
        if fault == "wrong_shape":
            assert bad.shape == (5, 2, 3)
        else:
            assert bad.shape == (5, 2) and bad.isnan().all()
    assert torch.equal(policy(obs), good)
    assert policy.calls == 3


def test_faulty_policy_refuses_bad_arguments():
    import torch

    from aiocollect.testing import FaultyPolicy

    with pytest.raises(ValueError, match="fault='segfault'"):
        FaultyPolicy("segfault")
    with pytest.raises(ValueError, match="at_call=0"):
        FaultyPolicy("raise", at_call=0)
    with pytest.raises(ValueError, match="float dtype.*torch.int64"):
        FaultyPolicy("nan", dtype=torch.int64)


def test_faulty_policy_pickles_by_reference_with_its_call_count():
    import torch

    from aiocollect.testing import FaultyPolicy

    policy = FaultyPolicy("raise", at_call=2)
    policy(torch.zeros(1, 3))
    data = pickle.dumps(policy)
    assert b"aiocollect.testing._torch" in data and b"FaultyPolicy" in data
    clone = pickle.loads(data)
    assert type(clone) is FaultyPolicy and clone.calls == 1
    with pytest.raises(InjectedFailure):
        clone(torch.zeros(1, 3))


def test_testing_module_loads_torch_only_for_faulty_policy():
    """``import aiocollect.testing`` (as a worker does) imports no torch; asking for
    FaultyPolicy does, and it is listed in __all__."""
    proc = _run_child(
        """
        import sys
        import aiocollect.testing as testing
        print("torch" in sys.modules, flush=True)
        testing.FaultyPolicy
        print("torch" in sys.modules, "FaultyPolicy" in testing.__all__, flush=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "False\nTrue True\n"


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
    """Worker processes import this module; it must not pull torch or tensordict in, nor any of
    the package but itself."""
    code = textwrap.dedent(
        """
        import sys
        import aiocollect.testing
        heavy = {"torch", "tensordict"}
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in heavy)
        assert not loaded, loaded
        ours = sorted(m for m in sys.modules if m.split(".")[0] == "aiocollect")
        assert ours == ["aiocollect", "aiocollect.testing", "aiocollect.testing._failures"], ours
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=child_env(REPO))
