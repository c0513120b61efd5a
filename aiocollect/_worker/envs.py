"""Opening and closing a child process's envs (a rollout worker's or the evaluator's worker's):
make them from an id or a factory, check that they share their spaces, close them at shutdown.

Imported by worker processes: gymnasium only.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from .._core.errors import ConfigTypeError, SpecError
from .._core.registry import install as install_registry


def factory_of(env_fn: Any, env_kwargs: Any, copy: int) -> tuple[Any, dict]:
    """The factory and keyword arguments of a worker's env ``copy``: ``env_fn`` and
    ``env_kwargs`` are each one for every env of the worker, or a tuple of one per env (a
    collector given one ``create_env_fn`` per env; a gymnasium id is a str, never a tuple)."""
    if isinstance(env_fn, tuple):
        env_fn = env_fn[copy]
    if isinstance(env_kwargs, tuple):
        env_kwargs = env_kwargs[copy]
    return env_fn, env_kwargs


def create_env(env_fn: Any, env_kwargs: Any, copy: int = 0) -> Any:
    """What ``create_env_fn`` returns (or ``gymnasium.make`` for an id), not checked yet
    (``copy``: which env of the worker, where each has a factory of its own)."""
    env_fn, env_kwargs = factory_of(env_fn, env_kwargs, copy)
    if isinstance(env_fn, str):
        return gym.make(env_fn, **env_kwargs)
    return env_fn(**env_kwargs)


def make_env(env_fn: Any, env_kwargs: Any, env: Any = None, copy: int = 0) -> gym.Env:
    """A new env (or ``env``, made already), which must be a ``gymnasium.Env``."""
    if env is None:
        env = create_env(env_fn, env_kwargs, copy)
    if not isinstance(env, gym.Env):
        if any(cls.__module__.partition(".")[0] == "torchrl" for cls in type(env).__mro__):
            raise ConfigTypeError(torchrl_env_message(env))
        raise ConfigTypeError(
            f"create_env_fn returned {type(env).__name__}, not a gymnasium.Env; return the env itself "
            f"(a Collector also takes a gymnasium.vector.VectorEnv, if create_env_fn returns one every time)"
        )
    return env


def torchrl_env_message(env: Any) -> str:
    """Why a TorchRL env (``GymEnv``, ``TransformedEnv``, ...) is refused, and what to pass instead."""
    name = getattr(env, "env_name", None) or getattr(getattr(env, "base_env", None), "env_name", None)
    by_id = f"create_env_fn={name!r}, or " if isinstance(name, str) else ""
    return (
        f"create_env_fn returned TorchRL's {type(env).__name__}: aiocollect steps gymnasium envs, not TorchRL "
        f"EnvBases; pass {by_id}a factory returning the gymnasium env (gymnasium.make(...)). Instead of "
        f"TorchRL's transforms use gymnasium wrappers, or the collector's options (StepCounter(max_steps): "
        f"max_frames_per_traj=max_steps); batches keep TorchRL's keys"
    )


def add_envs(
    envs: list[gym.Env], count: int, env_fn: Any, env_kwargs: Any, who: str, registry: tuple = (),
    fn_index: tuple[int, ...] | None = None,
) -> tuple[Any, Any]:
    """Append ``count`` new envs to ``envs`` (so the caller can close those made before a
    failure) and check that they share their spaces; returns (observation, action) space.

    ``registry`` (a :func:`aiocollect._core.registry.snapshot` of the user's process) is installed
    first, so that ids registered there can be made here, by id or by a factory. ``fn_index``:
    per env, the index of its factory in the collector's list of ``create_env_fn`` (named in
    errors)."""
    install_registry(registry)
    for _ in range(count):
        envs.append(make_env(env_fn, env_kwargs, copy=len(envs)))
    obs_space, act_space = envs[0].observation_space, envs[0].action_space
    for i, env in enumerate(envs[1:], 1):
        if env.observation_space != obs_space or env.action_space != act_space:
            raise SpecError(
                f"env {i} of {who}{made_by(fn_index, i)} has spaces {env.observation_space}, {env.action_space}, "
                f"but env 0{made_by(fn_index, 0)} has {obs_space}, {act_space}: all envs must share their spaces"
            )
    return obs_space, act_space


def made_by(fn_index: tuple[int, ...] | None, copy: int) -> str:
    """`` (made by create_env_fn[k])`` for a worker's env ``copy``, where envs have factories of
    their own; empty otherwise."""
    return "" if fn_index is None else f" (made by create_env_fn[{fn_index[copy]}])"


def close_envs(envs: list[gym.Env]) -> None:
    """Close every env (best effort, at shutdown) and empty the list."""
    for env in envs:
        try:
            env.close()
        except Exception:  # pragma: no cover - best effort at shutdown
            pass
    envs.clear()


__all__ = ["add_envs", "close_envs", "create_env", "factory_of", "made_by", "make_env"]
