"""Validators that the collector's and the evaluator's options share: each raises
:class:`~aiocollect.ConfigError` naming the argument, the value and the fix."""

from __future__ import annotations

import difflib
import importlib.util
import math
from typing import Any

from .._core.datachecks import ACTION_BOUNDS
from .._core.errors import ConfigError
from .._core.limits import max_worker_processes
from .._worker.policy import EXPLORATION_TYPES


def format_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def exploration_name(value: Any) -> str:
    name = getattr(value, "value", value)  # tensordict's InteractionType / TorchRL's ExplorationType
    if not isinstance(name, str) or name.lower() not in EXPLORATION_TYPES:
        raise ConfigError(
            f"exploration_type={value!r} is not one of {list(EXPLORATION_TYPES)}; pass a string or "
            f"tensordict.nn.InteractionType (e.g. InteractionType.DETERMINISTIC)"
        )
    return name.lower()


def check_env_id(env_id: str, argument: str = "create_env_fn") -> None:
    """Raise :class:`ConfigError` (with close matches) if ``env_id`` is not a registered id."""
    import gymnasium as gym

    if ":" in env_id:
        check_module_env_id(env_id, argument)
        return
    if env_id in gym.registry:
        return
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else (
        "; register it with gymnasium.register, or use 'module:EnvId' so that the module is imported first"
    )
    raise ConfigError(f"{argument}={env_id!r} is not a registered gymnasium env id{hint}")


def check_data_options(check_finite: Any, action_bounds: Any) -> None:
    """Validate the two data-check options (shared by the collector's and the evaluator's config)."""
    if not isinstance(check_finite, bool):
        raise ConfigError(f"check_finite={check_finite!r} must be True or False")
    if not isinstance(action_bounds, str) or action_bounds not in ACTION_BOUNDS:
        raise ConfigError(
            f"action_bounds={action_bounds!r} must be 'pass' (the env gets the policy's action as it is), "
            f"'clip' (the env gets it clipped to the Box's bounds) or 'error' (SpecError)"
        )


def positive_int(name: str, value: Any, *, allow_zero: bool = False, fix: str = "") -> int:
    """``value``, an int >= 1 (>= 0 with ``allow_zero``; never a bool), or :class:`ConfigError`
    naming ``name`` (and ``fix``, the way out, when given). The collector's and the evaluator's
    config both use it."""
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} must be an int >= {low}" + (f"; {fix}" if fix else ""))
    return value


def positive_seconds(name: str, value: Any, alternative: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name}={value!r} must be a positive, finite number of seconds, {alternative}")
    return value


def check_module_env_id(env_id: str, argument: str) -> None:
    """``"module:EnvId"`` (gymnasium imports the module, whose import registers the id): the module
    must be importable (the id itself is only known once it is imported, in the workers)."""
    module, _, name = env_id.partition(":")
    try:
        found = bool(module) and importlib.util.find_spec(module) is not None
    except Exception:  # noqa: BLE001 - a malformed name, or a parent package that fails to import
        found = False
    if not name or ":" in name or not found:
        why = f"no module {module!r} can be imported" if not found else "the env id after ':' is missing or malformed"
        raise ConfigError(
            f"{argument}={env_id!r} is not 'module:EnvId' ({why}); pass a registered id such as 'CartPole-v1', "
            f"or 'package.module:EnvId' where importing package.module registers EnvId"
        )


def check_worker_count(num_workers: int) -> None:
    limit = max_worker_processes()
    if limit is not None and num_workers > limit[0]:
        raise ConfigError(
            f"num_workers={num_workers} is more worker processes than this machine allows: {limit[0]}, by "
            f"{limit[1]}; use fewer workers (each steps envs_per_worker envs), or raise the limit"
        )


def check_strs(config: Any, choices: dict[str, str]) -> None:
    """Options that are one of a few strings get a str (a numpy array, compared with ``in``,
    would raise numpy's ambiguous-truth ValueError instead of ours)."""
    for name, allowed in choices.items():
        value = getattr(config, name)
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} must be {allowed}")


def check_kwargs(name: str, kwargs: Any) -> None:
    """Keyword arguments: a dict (or None) whose keys are strs."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"{name}={kwargs!r} must be a dict or None")
    bad = [k for k in kwargs or () if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{name}={kwargs!r:.200} has the key {bad[0]!r}; keyword arguments are named by strs")


def check_sendable_to_workers(env_fn: Any, env_kwargs: Any) -> None:
    """The env factory and its keyword arguments must travel to worker processes (cloudpickle):
    found out here, not once the workers are started (costs one pickling of each)."""
    import cloudpickle

    for name, value in (("create_env_fn", env_fn), ("create_env_kwargs", env_kwargs)):
        if value is None or isinstance(value, str):
            continue
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any failure to pickle
            raise ConfigError(
                f"{name}={value!r:.100} cannot be sent to the worker processes ({type(exc).__name__}: {exc}); "
                f"pass objects that cloudpickle can pickle (a function, a class, plain data)"
            ) from exc


def check_platform(what: str) -> None:
    """aiocollect needs Linux: fork, memfd, pidfd and /proc."""
    import sys

    if not sys.platform.startswith("linux"):
        raise ConfigError(
            f"{what} needs Linux (it relies on fork, memfd_create, pidfd and /proc), and this is "
            f"{sys.platform!r}; run it on Linux (WSL2 and Docker on macOS are Linux)"
        )


def check_policy_args(policy: Any, policy_factory: Any) -> None:
    """``policy`` and ``policy_factory``: at most one of them, and a callable policy (the
    collector's and the evaluator's)."""
    if policy is not None and policy_factory is not None:
        raise ConfigError(
            f"policy={policy!r:.80} and policy_factory={policy_factory!r:.80}: pass either policy or "
            f"policy_factory, not both"
        )
    if policy is not None and not callable(policy):
        raise ConfigError(f"policy={policy!r} is not callable; pass an nn.Module, a TensorDictModule or None")
