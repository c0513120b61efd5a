"""A rollout's policy, set up for its rows (:func:`build_policy`): the policy's runner (its torch
seeded after every env's seed), the runner of random actions, the policy's extra outputs and the
reader of its weights; and the checks of its actions (:func:`action_guard`).

Imported by worker processes: numpy and gymnasium only (torch through the policy runner).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .._core.datachecks import ActionBounds, ActionGuard
from .._core.layout import Leaf
from .policy import EnvActions, PolicySpec, RandomRunner, build_runner
from .seeding import seed_torch


def build_policy(
    spec: PolicySpec, local_policy: Any, seeding: tuple[int | None, int, int, int], act_space: Any,
    act_leaves: list[Leaf], obs_leaves: list[Leaf], action_spaces: list[Any], cur_obs: list[np.ndarray],
) -> tuple[RandomRunner, Any, list[Leaf], Any]:
    """``(random runner, runner, extra leaves, weight reader)`` for ``len(action_spaces)`` rows
    (``action_spaces``: each row's seeded copy; ``cur_obs``: their observations, which the policy
    is probed with). ``seeding``: ``(seed, worker, restart, total_envs)``, for the torch generator
    of a policy this process builds (not a random, a server's or a local one). The weight reader
    is ``None`` for a policy without a model."""
    if spec.kind not in ("random", "server") and local_policy is None:
        seed_torch(*seeding)
    random_runner = RandomRunner(action_spaces, act_leaves)
    runner = build_runner(spec, act_space, act_leaves, obs_leaves, len(action_spaces), action_spaces, local_policy)
    extra_leaves = runner.probe(cur_obs)
    model = getattr(runner, "model", None)
    if model is None:
        return random_runner, runner, extra_leaves, None
    from .weights import WeightReader

    return random_runner, runner, extra_leaves, WeightReader(model)


def action_guard(
    act_space: Any, act_leaves: list[Leaf], names: list[str], check_finite: bool, action_bounds: ActionBounds,
    per_env: Callable[[list[np.ndarray]], Sequence[Any]] | None = None,
) -> ActionGuard | None:
    """The checks of the policy's actions (not random ones) for the rows named ``names``
    (``per_env``: the envs' actions from the action arrays; default: the runner's per-env
    conversion); ``None``: nothing to check."""
    if per_env is None:
        env_actions, E = EnvActions(act_space, act_leaves), len(names)
        per_env = lambda arrays: env_actions.per_env(arrays, E)  # noqa: E731
    guard = ActionGuard(act_space, act_leaves, names, per_env, check_finite=check_finite, action_bounds=action_bounds)
    return guard if guard.active else None


__all__ = ["action_guard", "build_policy"]
