"""Test helpers: small deterministic gymnasium envs and a policy, with failure injection.

They are public so that users can test their own collection code with them:

- :class:`CountingEnv`: observations that say which env (seed) and step produced them, a
  configurable step cost, and faults at a chosen step or reset: an exception, a hang, a process
  that dies (SIGKILL, SIGSEGV, ``os._exit``), an observation that is NaN or does not match the
  space.
- :class:`SpacesEnv`: any observation and action space, for batch-layout tests.
- :class:`BadObservationEnv`: returns observations of the wrong shape from a given step of every
  episode on (already at reset, by default).
- :class:`FaultyPolicy`: a ``torch.nn.Module`` policy that raises, or returns a wrong shape or
  NaN, on its N-th call. Loaded on first use: importing this module never imports torch.
- :class:`InjectedFailure`: the exception the envs and the policy raise on purpose.

All of them are module-level classes (picklable by reference, so they can be sent to worker
processes) and the envs' ``close()`` may be called any number of times.

This module is imported inside worker processes: it imports only the standard library, numpy
and gymnasium.
"""

from __future__ import annotations

import copy
import ctypes
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import gymnasium
import numpy as np
from gymnasium import spaces
from ._failures import InjectedFailure

if TYPE_CHECKING:  # pragma: no cover
    from ._torch import FaultyPolicy as FaultyPolicy

__all__ = ["BadObservationEnv", "CountingEnv", "FaultyPolicy", "InjectedFailure", "SpacesEnv"]


def __getattr__(name: str) -> Any:
    if name == "FaultyPolicy":  # imports torch: only when asked for
        from ._torch import FaultyPolicy

        return FaultyPolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _hang() -> None:
    """Block forever, as a deadlocked simulator does; a signal handler that raises (Ctrl-C's
    KeyboardInterrupt) ends it, SIGKILL ends the process."""
    while True:
        time.sleep(60)


def _segfault() -> None:
    """Die of a real SIGSEGV (reading address 0), without leaving a core file."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):  # pragma: no cover - best effort
        pass
    ctypes.string_at(0)


class _ClosableEnv(gymnasium.Env):
    """Shared behaviour: idempotent ``close()``; ``reset``/``step`` after it raise."""

    metadata = {"render_modes": []}
    render_mode = None
    closed = False

    def close(self) -> None:
        """Close the env. Calling it again does nothing."""
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{type(self).__name__} is closed")


class CountingEnv(_ClosableEnv):
    """A deterministic env whose observations identify the env and the step.

    ``reset(seed=s)`` sets the env's *start* to ``s % 1000``; a reset without a seed keeps the
    start of the previous one (``0`` if the env was never seeded). At step ``k`` of an episode
    (``k = 0`` after reset) the observation is ``np.full(obs_shape, start * 100 + k, dtype)``, so a
    frame tells which env (seed) and which step of its episode produced it, as long as
    ``episode_length < 100``. Actions are ``Discrete(2)`` and the reward is
    ``float(action) + 1.0``. The episode ends when
    ``k == episode_length``: terminated, or truncated when ``truncate=True``. ``info`` is
    ``{"count": k}``.

    Args:
        episode_length: steps per episode.
        obs_shape: shape of the observations.
        dtype: dtype of the observations (a float or integer dtype; values must fit it).
        truncate: end episodes by truncation instead of termination.
        step_cost: seconds of busy CPU work per step (holds the GIL and a core, like a costly
            simulator).
        step_sleep: seconds of ``time.sleep`` per step (like an env waiting on I/O).
        fail_at_step: raise :class:`InjectedFailure` on the N-th call to ``step`` over the env's
            whole life (1-based, counted across episodes); the env's state is left as it was, so
            later steps carry on.
        fail_on_reset: raise :class:`InjectedFailure` on the N-th call to ``reset`` (1-based).
        crash_at_step: on the N-th call to ``step`` (1-based), kill the env's own process with
            ``SIGKILL``, as a crash in native code would. **Only use it in envs that run inside
            worker processes**: in the process that runs your tests, it kills the test run.
        segfault_at_step: on the N-th call to ``step``, crash the env's own process with a real
            segmentation fault (``SIGSEGV``, no core file). **Worker processes only.**
        exit_at_step: on the N-th call to ``step``, end the env's own process with
            ``os._exit(exit_code)`` (no clean-up, no flushing, as a library calling ``exit()`` in
            native code does). **Worker processes only.**
        exit_code: the exit status of ``exit_at_step``.
        hang_at_step: block forever in the N-th call to ``step``, like a deadlocked simulator
            (an interruptible sleep: a signal handler that raises, such as Ctrl-C's, ends it).
        hang_on_reset: block forever in the N-th call to ``reset``.
        nan_at_step: the observation of the N-th call to ``step`` is all NaN (float dtypes only:
            ``ValueError`` at construction otherwise).
        wrong_shape_at_step: the observation of the N-th call to ``step`` has one more element on
            its last axis (shape ``(1,)`` for a scalar space), so it does not match the space.
            :class:`BadObservationEnv` gives wrong shapes from a step of every episode on.
        wrong_dtype_at_step: the observation of the N-th call to ``step`` has another kind of
            dtype than the space: ``int64`` for a float space, ``float64`` for an integer one.

    After a fault of the observation, the episode carries on: later observations are right.

    Attributes:
        num_steps: calls to ``step`` so far (including one that raised).
        num_resets: calls to ``reset`` so far (including one that raised).
        closed: whether ``close()`` was called.
    """

    def __init__(
        self,
        *,
        episode_length: int = 10,
        obs_shape: tuple[int, ...] = (3,),
        dtype: Any = np.float32,
        truncate: bool = False,
        step_cost: float = 0.0,
        step_sleep: float = 0.0,
        fail_at_step: int | None = None,
        fail_on_reset: int | None = None,
        crash_at_step: int | None = None,
        segfault_at_step: int | None = None,
        exit_at_step: int | None = None,
        exit_code: int = 1,
        hang_at_step: int | None = None,
        hang_on_reset: int | None = None,
        nan_at_step: int | None = None,
        wrong_shape_at_step: int | None = None,
        wrong_dtype_at_step: int | None = None,
    ) -> None:
        if episode_length < 1:
            raise ValueError(f"episode_length must be at least 1, got {episode_length}")
        self.episode_length = episode_length
        self.obs_shape = tuple(obs_shape)
        self.dtype = np.dtype(dtype)
        if nan_at_step is not None and self.dtype.kind != "f":
            raise ValueError(
                f"nan_at_step needs a float dtype, got dtype={self.dtype}: NaN is not an integer"
            )
        self.truncate = truncate
        self.step_cost = step_cost
        self.step_sleep = step_sleep
        self.fail_at_step = fail_at_step
        self.fail_on_reset = fail_on_reset
        self.crash_at_step = crash_at_step
        self.segfault_at_step = segfault_at_step
        self.exit_at_step = exit_at_step
        self.exit_code = exit_code
        self.hang_at_step = hang_at_step
        self.hang_on_reset = hang_on_reset
        self.nan_at_step = nan_at_step
        self.wrong_shape_at_step = wrong_shape_at_step
        self.wrong_dtype_at_step = wrong_dtype_at_step
        low: float
        high: float
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            low, high = info.min, info.max
        else:
            low, high = -np.inf, np.inf
        self.observation_space = spaces.Box(low, high, self.obs_shape, self.dtype)
        self.action_space = spaces.Discrete(2)
        self.num_steps = 0
        self.num_resets = 0
        self._start = 0
        self._count: int | None = None  # None until the first reset

    def _obs(self) -> np.ndarray:
        assert self._count is not None, "reset() first"
        return np.full(self.obs_shape, self._start * 100 + self._count, dtype=self.dtype)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode; see the class docstring for the observations."""
        self._check_open()
        self.num_resets += 1
        if self.hang_on_reset == self.num_resets:
            _hang()
        if self.fail_on_reset is not None and self.num_resets == self.fail_on_reset:
            raise InjectedFailure(f"CountingEnv: injected failure at reset {self.num_resets}")
        super().reset(seed=seed)
        if seed is not None:
            self._start = seed % 1000
        self._count = 0
        return self._obs(), {"count": 0}

    def step(self, action):
        """Advance one step; ``reward = float(action) + 1.0``.

        Raises ``ValueError`` for an action not in ``Discrete(2)`` (an array of shape ``(1,)``
        is refused too: the action must be a scalar).
        """
        self._check_open()
        if self._count is None:
            raise gymnasium.error.ResetNeeded("CountingEnv: call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(
                f"CountingEnv: action {action!r} (type {type(action).__name__}) is not in the "
                f"action space {self.action_space}"
            )
        n = self.num_steps = self.num_steps + 1
        if self.crash_at_step == n:
            os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
        if self.segfault_at_step == n:
            _segfault()
        if self.exit_at_step == n:
            os._exit(self.exit_code)
        if self.hang_at_step == n:
            _hang()
        if self.fail_at_step is not None and self.num_steps == self.fail_at_step:
            raise InjectedFailure(f"CountingEnv: injected failure at step {self.num_steps}")
        if self.step_cost > 0:
            deadline = time.perf_counter() + self.step_cost
            while time.perf_counter() < deadline:
                pass
        if self.step_sleep > 0:
            time.sleep(self.step_sleep)
        self._count += 1
        done = self._count >= self.episode_length
        terminated = done and not self.truncate
        truncated = done and self.truncate
        return self._faulty_obs(n), float(action) + 1.0, terminated, truncated, {"count": self._count}

    def _faulty_obs(self, n: int) -> np.ndarray:
        """The observation of the ``n``-th step, with the fault injected at that step, if any."""
        obs = self._obs()
        if self.nan_at_step == n:
            obs = np.full(self.obs_shape, np.nan, self.dtype)
        if self.wrong_shape_at_step == n:
            shape = self.obs_shape[:-1] + (self.obs_shape[-1] + 1,) if self.obs_shape else (1,)
            obs = np.full(shape, obs.flat[0], self.dtype)
        if self.wrong_dtype_at_step == n:
            obs = obs.astype(np.int64 if self.dtype.kind == "f" else np.float64)
        return obs


class SpacesEnv(_ClosableEnv):
    """An env with any observation and action spaces, for batch-layout tests.

    Observations are samples of ``observation_space``, drawn from a private copy of the space
    seeded from the env's generator at each seeded reset: the same seed gives the same
    observations, and unseeded resets carry on deterministically. Every space gymnasium can
    sample works (Box, Discrete, MultiDiscrete, MultiBinary, Dict, Tuple and nestings).

    ``step`` checks each action with ``action_space.contains`` and raises ``ValueError`` naming
    it if it does not fit (note that gymnasium's ``Box.contains`` refuses a dtype that does not
    safely cast to the space's, such as float64 for a float32 box). The reward is ``1.0``; the
    episode ends after ``episode_length`` steps, terminated, or truncated when
    ``terminate=False``.
    """

    def __init__(
        self,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        episode_length: int = 5,
        terminate: bool = True,
    ) -> None:
        if episode_length < 1:
            raise ValueError(f"episode_length must be at least 1, got {episode_length}")
        self.observation_space = observation_space
        self.action_space = action_space
        self.episode_length = episode_length
        self.terminate = terminate
        self.num_steps = 0
        self.num_resets = 0
        # Own copy: seeding it must not touch a space the caller may share with other envs.
        self._sampler = copy.deepcopy(observation_space)
        self._sampler_seeded = False
        self._count: int | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode; the observation is a sample of the observation space."""
        self._check_open()
        self.num_resets += 1
        super().reset(seed=seed)
        if seed is not None or not self._sampler_seeded:
            self._sampler.seed(int(self.np_random.integers(2**31 - 1)))
            self._sampler_seeded = True
        self._count = 0
        return self._sampler.sample(), {}

    def step(self, action):
        """Check the action, then return a new sample; raises ``ValueError`` for a bad action."""
        self._check_open()
        if self._count is None:
            raise gymnasium.error.ResetNeeded("SpacesEnv: call reset() before step()")
        if not self.action_space.contains(action):
            raise ValueError(
                f"SpacesEnv: action {action!r} (type {type(action).__name__}) is not in the action "
                f"space {self.action_space}"
            )
        self.num_steps += 1
        self._count += 1
        done = self._count >= self.episode_length
        return self._sampler.sample(), 1.0, done and self.terminate, done and not self.terminate, {}


class BadObservationEnv(_ClosableEnv):
    """Declares ``Box(-1, 1, (3,), float32)`` observations but returns the wrong shape.

    From step ``bad_at_step`` of each episode on (``0``: already the observation of ``reset``)
    the observations have shape ``bad_shape``; before it they are zeros of shape ``(3,)``. For
    tests that a mismatch between an env and its space gets a clear error. Actions are
    ``Discrete(2)``, the reward is ``1.0``, episodes terminate after ``episode_length`` steps.
    (For one bad observation in an otherwise good env, see :class:`CountingEnv`'s
    ``wrong_shape_at_step``, ``wrong_dtype_at_step`` and ``nan_at_step``.)
    """

    def __init__(
        self,
        *,
        bad_shape: tuple[int, ...] = (2,),
        bad_at_step: int = 0,
        episode_length: int = 10,
    ) -> None:
        self.bad_shape = tuple(bad_shape)
        self.bad_at_step = bad_at_step
        self.episode_length = episode_length
        self.observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.num_steps = 0
        self.num_resets = 0
        self._count: int | None = None

    def _obs(self) -> np.ndarray:
        assert self._count is not None, "reset() first"
        shape = self.bad_shape if self._count >= self.bad_at_step else self.observation_space.shape or ()
        return np.zeros(shape, dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode."""
        self._check_open()
        self.num_resets += 1
        super().reset(seed=seed)
        self._count = 0
        return self._obs(), {}

    def step(self, action):
        """Advance one step."""
        self._check_open()
        if self._count is None:
            raise gymnasium.error.ResetNeeded("BadObservationEnv: call reset() before step()")
        self.num_steps += 1
        self._count += 1
        return self._obs(), 1.0, self._count >= self.episode_length, False, {}
