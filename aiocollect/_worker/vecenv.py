"""One vector env as a rollout sees it, whatever its kind: a gymnasium ``VectorEnv`` (any
autoreset mode) or an EnvPool env: its sub-envs, how it is seeded, how some of its sub-envs are
reset on their own, and its answers in the order of its rows (EnvPool names rows by
``info["env_id"]``). Imported by worker processes."""

from __future__ import annotations

from typing import Any, Callable

import gymnasium as gym
import numpy as np

from .._core.errors import SpecError

def is_envpool(env: Any) -> bool:
    """An EnvPool env (``envpool.make_gymnasium``): batched, though a ``gymnasium.Env`` by class
    too (and a ``VectorEnv`` in EnvPool >= 1.2)."""
    return hasattr(env, "all_env_ids") and any(k.__module__.startswith("envpool") for k in type(env).__mro__)


def is_vector(env: Any) -> bool:
    return isinstance(env, gym.vector.VectorEnv) or is_envpool(env)


_NEXT, _SAME, _DISABLED = "NextStep", "SameStep", "Disabled"


def _mode_name(env: Any) -> Any:
    mode = env.metadata.get("autoreset_mode") if isinstance(getattr(env, "metadata", None), dict) else None
    return getattr(mode, "value", mode)


def _cartpole_partial_reset(env: Any, rows: np.ndarray, out: np.ndarray | None = None) -> Any:
    """gymnasium's ``CartPoleVectorEnv`` resets the sub-envs that ended at the start of its next
    step; this does the same now for ``rows`` (sorted indices), with the same draws from its
    generator. Returns the batched observation; with ``out`` (``[num_envs, 4]`` float32) only
    ``rows`` are written, into ``out``, which is returned."""
    env.state[:, rows] = env.np_random.uniform(low=env.low, high=env.high, size=(4, len(rows)))
    env.steps[rows] = 0
    env.prev_done[rows] = False
    if out is None:
        return env.state.T.astype(np.float32)
    out[rows] = env.state[:, rows].T
    return out


class VecEnv:
    """One vector env as the rollout sees it: ``n`` sub-envs, their single spaces, how it is
    seeded and how ended sub-envs get their reset observation."""

    def __init__(self, env: Any, who: str) -> None:
        self.env = env
        self.who = who
        self.envpool = is_envpool(env)
        if self.envpool:
            self._init_envpool(env)
            return
        self.n = int(env.num_envs)
        self.step = env.step  # type: ignore[method-assign]  # (one call less per step than the method)
        self.obs_space = env.single_observation_space
        self.act_space = env.single_action_space
        mode = _mode_name(env)
        base = env.unwrapped
        from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv

        self.list_seeds = isinstance(base, (gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv))
        if self.list_seeds:
            self._partial: Callable[..., Any] | None = self._reset_mask
        elif type(env) is CartPoleVectorEnv:  # (a wrapper around it might keep state of its own)
            self._partial = lambda rows, out=None: _cartpole_partial_reset(env, rows, out)
            self.writes_rows = True
        else:
            self._partial = None
        if mode not in (_NEXT, _SAME, _DISABLED):
            raise SpecError(
                f"{who} is {type(env).__name__}, whose metadata['autoreset_mode'] is {mode!r}: aiocollect needs "
                f"to know how it resets its sub-envs. Set env.metadata['autoreset_mode'] to a "
                f"gymnasium.vector.AutoresetMode (SAME_STEP is the simplest to support), or build it with "
                f"gymnasium.vector.SyncVectorEnv / AsyncVectorEnv"
            )
        if mode != _SAME and self._partial is None:
            raise SpecError(
                f"{who} is {type(env).__name__} with autoreset mode {mode}, and it cannot reset some sub-envs "
                f"on their own: a sub-env that ended would spend its next step resetting while the others take "
                f"real steps, so a batch could not hold the same number of real frames for each. Use a vector "
                f"env in AutoresetMode.SAME_STEP, or gymnasium.vector.SyncVectorEnv / AsyncVectorEnv "
                f"(gym.make_vec(..., vectorization_mode='sync'), which resets with options={{'reset_mask': ...}})"
            )
        self.mode = mode

    def _init_envpool(self, env: Any) -> None:
        self.n = int(env.config["num_envs"])
        self.obs_space = env.observation_space  # (EnvPool's spaces are those of one sub-env)
        self.act_space = env.action_space
        self.list_seeds = False
        # EnvPool resets an ended env in its next step, whose action it ignores (as gymnasium's
        # next-step mode does); reset(env_id) resets some envs at once, and answers for them only
        self.mode = _NEXT
        batch = int(env.config.get("batch_size", self.n) or self.n)
        if batch != self.n:
            raise SpecError(
                f"{self.who} is an EnvPool env in asynchronous mode (batch_size={batch} of num_envs={self.n}); "
                f"aiocollect steps every sub-env at each step: make it with batch_size=num_envs (the default)"
            )
        self.rows = np.arange(self.n)
        self._partial = self._envpool_reset

    # -- resets ---------------------------------------------------------------------------------
    @property
    def partial(self) -> bool:
        return self._partial is not None

    def reset(self, seeds: list[int | None]) -> Any:
        """Reset every sub-env (``seeds``: one per sub-env; an env with a single generator gets
        the first). Returns the batched observation."""
        env = self.env
        if self.envpool:  # seeded when made (envpool.make_gymnasium(seed=...)): reset(seed) is ignored
            obs, info = env.reset()
            return self._in_order(obs, info)
        if self.list_seeds:
            seed: Any = None if all(s is None for s in seeds) else list(seeds)
        else:
            seed = seeds[0]
        obs, _ = env.reset(seed=seed)
        return obs

    writes_rows = False  # whether reset_rows(rows, out) writes the reset rows into out

    def reset_rows(self, rows: np.ndarray, out: np.ndarray | None = None) -> Any:
        """Reset the sub-envs ``rows`` (sorted indices; without seeds: each goes on with its
        generator); returns the batched observation (the other rows are not read). Where
        :attr:`writes_rows`, ``out`` (``[num_envs, ...]``, of the single observation leaf's dtype)
        gets the reset rows, and is returned."""
        if self.writes_rows:
            return self._partial(rows, out)  # type: ignore[misc]  # (not None: partial resets exist)
        return self._partial(rows)  # type: ignore[misc]

    def _reset_mask(self, rows: np.ndarray) -> Any:
        mask = np.zeros(self.n, bool)
        mask[rows] = True
        obs, _ = self.env.reset(options={"reset_mask": mask})
        return obs

    def _envpool_reset(self, rows: np.ndarray) -> Any:
        obs, info = self.env.reset(rows.astype(np.int32))
        return _scatter(obs, self.n, np.asarray(info["env_id"]))

    def _in_order(self, obs: Any, info: dict) -> Any:
        """EnvPool names the rows of its answers by ``info["env_id"]``: in the order of the ids."""
        ids = np.asarray(info["env_id"])
        if np.array_equal(ids, self.rows):
            return obs
        return _scatter(obs, self.n, ids)

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict]:
        if not self.envpool:
            return self.env.step(actions)
        obs, rew, term, trunc, info = self.env.step(actions)
        ids = np.asarray(info["env_id"])
        if not np.array_equal(ids, self.rows):
            obs, rew, term, trunc = (_scatter(x, self.n, ids) for x in (obs, rew, term, trunc))
        return obs, rew, term, trunc, info


def _scatter(obs: Any, n: int, rows: np.ndarray) -> Any:
    """Rows ``rows`` of a batched observation of ``n`` rows, from one with ``len(rows)`` rows."""
    if isinstance(obs, dict):
        return {k: _scatter(v, n, rows) for k, v in obs.items()}
    if isinstance(obs, tuple):
        return tuple(_scatter(v, n, rows) for v in obs)
    obs = np.asarray(obs)
    full = np.zeros((n,) + obs.shape[1:], obs.dtype)
    full[rows] = obs
    return full


__all__ = ["VecEnv", "is_envpool", "is_vector"]
