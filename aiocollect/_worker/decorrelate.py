"""``max_decorrelation_steps``: before a worker collects its first frame, its envs take random
actions for a random number of steps each, so that they do not move in lockstep (rlpyt's
decorrelation: with every env at the same phase of its episode, the first batches of on-policy
training see only episode starts, then only middles, ...).

Every row (a single env, or a sub-env of a vector env) draws its count ``k`` uniformly in
``[0, max_decorrelation_steps]``. A single env takes its ``k`` steps on its own. A vector env's
sub-envs can only step together: the vector env steps ``K`` times (the largest ``k`` of its
sub-envs), and sub-env ``r`` is reset (a partial reset) ``k_r`` steps before the end. Either way
each row starts collection ``k_r`` random steps into an episode, or fewer where an episode ended
on the way (it is reset then, as when collecting). A vector env that cannot reset sub-envs on its
own (same-step autoreset without a partial reset) steps all its sub-envs ``K`` times: its rows'
phases then differ only where their episodes end at different steps.

The counts and the random actions are seeded from ``seed`` (the env's global index and the
worker's restart count), so the same seed gives the same data. These steps are not frames: they
are not written, counted or reported, and the episodes they end are not reported. The episode in
progress when collection starts keeps its length and return so far (as rlpyt's trajectory infos
do): its :class:`~aiocollect.events.EpisodeEnded` counts the random steps too, and so do
``step_count`` and ``max_frames_per_traj``.

Imported by worker processes: numpy and gymnasium only.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .._core.datachecks import check_reward
from .policy import RandomRunner

_STREAM = 0xDEC0  # keeps the counts' generator apart from the env's own seed derived from the same numbers


def decorrelation_draws(
    seed: int | None, env_ids: np.ndarray, restart: int, max_steps: int, act_space: Any
) -> tuple[np.ndarray, list[Any]]:
    """Each row's count of random steps, uniform in ``[0, max_steps]``, and its own seeded copy of
    ``act_space`` to draw them from (the rollout's action spaces are left as they are): from
    ``seed``, the row's global env id and the worker's restart count, so the same whatever the
    number of workers; unseeded without ``seed``."""
    counts, spaces = np.zeros(len(env_ids), np.int64), []
    for i, g in enumerate(env_ids):
        rng = np.random.default_rng(None if seed is None else [seed & (2**63 - 1), int(g), restart, _STREAM])
        counts[i] = rng.integers(0, max_steps + 1)
        space = copy.deepcopy(act_space)
        space.seed(int(rng.integers(2**31)))
        spaces.append(space)
    return counts, spaces


def decorrelate(rollout: Any, counts: np.ndarray, spaces: list[Any]) -> None:
    """Step ``rollout``'s envs with random actions from ``spaces`` (see the module docstring):
    afterwards its carried observations are the envs' current ones, and each row's episode start
    and return say how far into its episode it is (``rollout.steps`` stays 0: nothing was
    collected)."""
    if not counts.any():
        return
    if rollout.serial:
        phase, ret = _step_each(rollout, counts, spaces)
    else:
        phase, ret = _step_together(rollout, counts, RandomRunner(spaces, rollout.act_leaves))
    rollout.trajs.ep_start[:] = -phase  # (the episodes began before step 0 of collection)
    rollout.trajs.ep_ret[:] = ret


def _step_each(rollout: Any, counts: np.ndarray, spaces: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Single envs: each takes its own count of steps. Returns each row's steps and return in
    the episode it is in."""
    max_len = rollout.cfg.max_frames_per_traj
    phase, ret = np.zeros(len(counts), np.int64), np.zeros(len(counts), np.float64)
    for i, (env, k, space) in enumerate(zip(rollout.envs, counts.tolist(), spaces)):
        obs = None
        for _ in range(k):
            obs, reward, terminated, truncated, _ = env.step(space.sample())
            if not isinstance(reward, (float, int)):
                reward = check_reward(reward, f"env {int(rollout.env_ids[i])}'s reward (max_decorrelation_steps)")
            phase[i] += 1
            ret[i] += reward
            if terminated or truncated or (max_len is not None and phase[i] >= max_len):
                obs, _ = env.reset()
                phase[i], ret[i] = 0, 0.0
        if obs is not None:
            rollout._set_obs(i, obs, checked=True)
    return phase, ret


def _step_together(rollout: Any, counts: np.ndarray, runner: Any) -> tuple[np.ndarray, np.ndarray]:
    """Vector envs: every row steps ``K`` times, through the stepping loop's own step and resets;
    row ``r`` is reset ``k_r`` steps before the end. Returns as :func:`_step_each`."""
    E = rollout.rows
    K = int(counts.max())
    starts = K - counts if rollout.partial else np.zeros(E, np.int64)
    max_len = rollout.cfg.max_frames_per_traj
    nxt = [np.zeros_like(buf) for buf in rollout.cur_obs]
    rew, term, trunc = np.zeros(E, np.float64), np.zeros(E, bool), np.zeros(E, bool)
    phase, ret = np.zeros(E, np.int64), np.zeros(E, np.float64)
    no_end = np.zeros(E, bool)
    for s in range(K):
        begin = starts == s
        if s and begin.any():  # rows whose count starts now: a fresh episode
            _reset(rollout, begin.nonzero()[0], no_end, begin, [], nxt, phase, ret)
        _, arrays, _ = runner.act(rollout.cur_obs)
        finals = rollout._step_envs(arrays, rollout.cur_obs, nxt, rew, term, trunc)
        phase += 1
        ret += rew
        ended = term | trunc
        cut = None if max_len is None else (phase >= max_len) & ~ended
        for dst, src in zip(rollout.cur_obs, nxt):
            dst[...] = src
        over = ended if cut is None else ended | cut
        if over.any():
            _reset(rollout, over.nonzero()[0], ended, cut, finals, nxt, phase, ret)
    return phase, ret


def _reset(
    rollout: Any, rows: np.ndarray, ended: np.ndarray, cut: np.ndarray | None, finals: list, nxt: list[np.ndarray],
    phase: np.ndarray, ret: np.ndarray,
) -> None:
    """The rows ``rows`` start a new episode: reset as the stepping loop resets them after an end
    (``ended``: by the env; ``cut``: by this side), into the carried observations."""
    rollout._after_ends(rows, ended, cut, finals, nxt, rollout.cur_obs)
    phase[rows] = 0
    ret[rows] = 0.0


__all__ = ["decorrelate", "decorrelation_draws"]
