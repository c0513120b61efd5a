"""The evaluator's episodes through the rollout's stepping loop: a set number of whole episodes,
each seeded, on a worker's envs, with :meth:`~aiocollect._worker.rollout.Rollout.fill` recording
the frames, ending the episodes (the env's ends, and ``max_steps``'s cuts) and tallying returns and
lengths, as it does for the collector.

Episode ``j`` starts with ``reset(seed=seed + j)`` on whichever env is free: the envs that end an
episode in the same step take the next ones in the order they started their episodes, so the
results do not depend on the number of envs. A row with no episode left stops stepping (the policy
still sees its last observation), and a batch stops after the step where no row steps any more.

Imported by the evaluator's worker process when it starts: numpy and gymnasium only (torch through
the policy runner).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import numpy as np

from .._core.datachecks import ActionGuard, check_reward, check_value, short
from .._core.errors import SpecError
from .._core.heartbeat import RESET, STEP
from .._core.layout import Key
from .._core.video import VideoRecorder
from .policy_setup import action_guard
from .rollout import Rollout, RolloutConfig

_BATCH_STEPS = 16  # steps of one batch of the loop (its scratch frames; an evaluation is any number of them)


class EpisodeRollout(Rollout):
    """Runs the evaluator's whole episodes (:meth:`run_episodes`) on ``cfg.num_envs`` envs made
    already: :class:`Rollout`'s loop over one vector of their rows, which names them "eval env
    ``i``" in its messages and counts steps within each episode. ``cfg`` is the evaluator's
    worker's config (:class:`~aiocollect._core.eval_wire.EvalWorkerConfig`); :meth:`begin` gives
    it its policy's runner."""

    def __init__(self, cfg: Any, envs: list[Any], obs_space: Any, act_space: Any) -> None:
        E = cfg.num_envs
        self.eval_cfg = cfg
        # the loop's settings; its own finiteness checks are off: the evaluator's are made as each
        # env steps (see _step_envs), with the evaluator's texts
        self.cfg = RolloutConfig(
            cfg.env_fn, cfg.env_kwargs, None, 0, E, E,  # type: ignore[arg-type]  # (no policy: set up apart)
            seed=cfg.seed, max_frames_per_traj=cfg.max_steps,
        )
        self.envs, self.obs_space, self.act_space = envs, obs_space, act_space
        self._layout(cfg.check_finite, cfg.one_hot_actions)
        self._start_rows(np.arange(E, dtype=np.int64), E, [0] * E)
        self.action_spaces = [copy.deepcopy(env.action_space) for env in envs]
        self.random_calls = self.batches = 0
        self.heartbeat: Any = None  # a _heartbeat.Heartbeat with a step_timeout
        self.episode = [-1] * E  # per row: its episode in the evaluation in progress
        self.next_episode = 0  # the next episode to start
        self.episodes_left = 0  # episodes of the evaluation in progress not started yet
        self.ended: list[int] = []  # the episodes ended in the batch, in the order of the loop's tally
        # record_video: the frames of each evaluation's first episode
        self.video = VideoRecorder(cfg.video_max_frames) if cfg.record_video else None

    def begin(self, runner: Any, uses_torch: bool) -> None:
        """The policy's runner; each env starts an episode (``seed + i``), whose observations the
        policy is probed with (a policy that does not fit fails here, at start; RNG untouched)."""
        cfg = self.eval_cfg
        self.runner = self.random_runner = runner
        self.uses_torch = uses_torch
        names = [f"eval env {i}" for i in range(self.rows)]
        # (random actions need no checks)
        self.guard: ActionGuard | None = (
            action_guard(self.act_space, self.act_leaves, names, cfg.check_finite, cfg.action_bounds) if uses_torch else None
        )
        for i in range(self.rows):
            self._start_episode(i, i, self.cur_obs)
        self.extra_leaves = runner.probe(self.cur_obs)
        self.views = self._scratch(_BATCH_STEPS)

    def _scratch(self, T: int) -> dict[Key, np.ndarray]:
        """The frames of one batch (``[E, T, ...]``): the loop writes them; no one reads them."""
        E = self.rows
        views = {("next",) + leaf.key: np.zeros((E, T) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves}
        for leaf in self.obs_leaves + self.act_leaves + self.extra_leaves:
            views[leaf.key] = np.zeros((E, T) + leaf.shape, leaf.np_dtype)
        views[("next", "reward")] = np.zeros((E, T, 1), np.float64)
        views[("next", "terminated")] = np.zeros((E, T, 1), bool)
        views[("next", "truncated")] = np.zeros((E, T, 1), bool)
        views[("collector", "traj_ids")] = np.zeros((E, T), np.int64)
        views[("collector", "policy_version")] = np.zeros((E, T), np.int64)
        return views

    def run_episodes(self, n: int, tick: Callable[[], None]) -> tuple[list[float], list[int]]:
        """Run ``n`` episodes; returns their returns and lengths, by episode. ``tick()`` runs
        before each step (it may raise to give up)."""
        cfg = self.eval_cfg
        if self.uses_torch and cfg.seed is not None:
            import torch

            torch.manual_seed(cfg.seed)
        returns, lengths = [0.0] * n, [0] * n
        E = self.rows
        self.trajs.new_trajs(np.arange(E), self.steps)
        self.stepping, self.idle = [], np.ones(E, bool)
        self.next_episode, self.episodes_left = 0, n
        for i in range(min(E, n)):
            self._start_episode(i, self.next_episode, self.cur_obs)
        if self.stepping:
            tick()
        while self.stepping:
            self.ended = []
            for _ in self.fill(self.views):
                tick()  # (after a step that has a next one: the loop stops after the last)
            if self.ended:
                done = self.episodes  # (in the order of self.ended)
                for episode, ret, length in zip(self.ended, np.asarray(done.ret).tolist(), np.asarray(done.length).tolist()):
                    returns[episode], lengths[episode] = ret, length
        return returns, lengths

    def _start_episode(self, i: int, episode: int, into: list[np.ndarray]) -> None:
        """Row ``i`` starts episode ``episode``: a seeded reset (and its action space, for random
        actions), whose observation goes into ``into``; it steps after the rows stepping now."""
        seed = self.eval_cfg.seed
        if self.heartbeat is not None:
            self.heartbeat.begin(RESET, i)
        obs, _ = self.envs[i].reset(seed=None if seed is None else seed + episode)
        if seed is not None and not self.uses_torch:
            self.action_spaces[i].seed(seed + episode)
        self._write_obs(i, obs, into, "returned by reset")
        self.mark_init(i)
        self.episode[i] = episode
        if self.stepping is not None and episode == 0 and self.video is not None:
            self.video.start(self.envs[i], f"eval env {i}")
        if self.stepping is not None:  # (an evaluation in progress)
            self.stepping.append(i)
            self.idle[i] = False  # type: ignore[index]
            self.next_episode += 1
            self.episodes_left -= 1

    def _when(self, row: int) -> str:
        """When row ``i`` takes its next action, or got its reward (for messages)."""
        return f"at step {self.steps - int(self.trajs.ep_start[row]) + 1} of episode {self.episode[row]}"

    _action_step = _when

    def _write_obs(self, i: int, obs: Any, bufs: list[np.ndarray], when: str) -> None:
        what = f"eval env {i}'s observation"
        if self.single_obs:  # (a one-leaf Dict/Tuple obs is a dict/tuple: flattened)
            bufs[0][i] = check_value(obs, self.obs_leaves[0], what, self.obs_spaces[0])
        else:
            for leaf, space, buf, value in zip(self.obs_leaves, self.obs_spaces, bufs, self.flatten_obs(obs)):
                buf[i] = check_value(value, leaf, what, space)
        for k in self.finite_obs:
            if not np.isfinite(bufs[k][i]).all():
                raise SpecError(
                    f"{what} for key {'.'.join(self.obs_leaves[k].key)!r} {when} is "
                    f"{short(bufs[k][i])}: not finite (check_finite=True)"
                )

    def _step_envs(
        self, actions: Any, obs_t: list[np.ndarray], nxt: list[np.ndarray], rew_t: np.ndarray, term_t: np.ndarray,
        trunc_t: np.ndarray,
    ) -> list[tuple[int, dict]]:
        """One step of each row that steps, in order, each checked as it steps. A row that ends its
        episode, or does not step, keeps its observation (an episode's final one is not looked
        at)."""
        cfg, hb, max_steps = self.eval_cfg, self.heartbeat, self.eval_cfg.max_steps
        rew_t[:] = 0.0
        term_t[:] = trunc_t[:] = False
        unchanged = np.ones(self.rows, bool)
        for i in self.stepping:  # type: ignore[union-attr]
            if hb is not None:
                hb.begin(STEP, i)
            obs, reward, terminated, truncated, _ = self.envs[i].step(actions[i])
            if self.video is not None and self.video.env is self.envs[i]:
                self.video.add()
            if not isinstance(reward, (float, int)):
                reward = check_reward(reward, f"eval env {i}'s reward {self._when(i)}")
            if cfg.check_finite and not math.isfinite(reward):
                raise SpecError(f"eval env {i}'s reward {self._when(i)} is {reward!r}: not finite (check_finite=True)")
            rew_t[i], term_t[i], trunc_t[i] = float(reward), terminated, truncated
            length = self.steps + 1 - int(self.trajs.ep_start[i])
            if not (terminated or truncated or (max_steps is not None and length >= max_steps)):
                self._write_obs(i, obs, nxt, f"returned by step {length} of episode {self.episode[i]}")
                unchanged[i] = False
        for dst, src in zip(nxt, obs_t):
            dst[unchanged] = src[unchanged]
        return []

    def _after_ends(
        self, rows: np.ndarray, env_ended: np.ndarray, cut: np.ndarray | None, finals: list[tuple[int, dict]],
        next_obs: list[np.ndarray], cur: list[np.ndarray],
    ) -> None:
        """The rows ``rows`` ended their episode: in the order they stepped, each takes the next
        episode (its reset observation into ``cur``), or, with none left, stops stepping."""
        self.ended.extend(self.episode[i] for i in rows.tolist())
        if self.video is not None and any(self.episode[i] == 0 for i in rows.tolist()):
            self.video.stop()  # (the first episode's last frame is in: its env starts another)
        ended = set(rows.tolist())
        order = [i for i in self.stepping if i in ended]  # type: ignore[union-attr]
        for i in order:
            self.stepping.remove(i)  # type: ignore[union-attr]
            if self.episodes_left:
                self._start_episode(i, self.next_episode, cur)
            else:
                self.idle[i] = True  # type: ignore[index]
