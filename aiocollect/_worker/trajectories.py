"""Each row's trajectory and episode bookkeeping in a rollout (:class:`Trajectories`): the
trajectory it is in, the return and start of its episode, and, at the end of each batch, the
trajectory ids and step counts of the batch's frames and the episodes that ended in it.

Imported by worker processes: numpy only.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .._core.layout import Key
from .._core.wire import NO_EPISODES, Episodes
from .staging import Staging


def write_traj_ids(traj_buf: np.ndarray, ends: np.ndarray, first_traj: np.ndarray, total_envs: int) -> None:
    """Fill ``traj_buf`` (``[E, T]``) from each row's first id and its episode ends (``[E, T]``):
    a new trajectory starts after each end, and ids advance by ``total_envs`` each time."""
    traj_buf[:, 0] = first_traj
    np.cumsum(ends[:, :-1], axis=1, out=traj_buf[:, 1:])
    traj_buf[:, 1:] *= total_envs
    traj_buf[:, 1:] += first_traj[:, None]


def write_step_counts(views: dict[Key, np.ndarray], ends: np.ndarray, start_len: np.ndarray) -> None:
    """``max_frames_per_traj``: fill ``step_count`` and ``("next", "step_count")`` (``[E, T, 1]``,
    as TorchRL's ``StepCounter``: the frames of the trajectory before the step, and after it) from
    each row's trajectory length at the batch's start (``start_len``) and its episode ends
    (``[E, T]``). Nothing to do where the layout has no step counts."""
    step_buf = views.get(("step_count",))
    if step_buf is None:
        return
    E, T = ends.shape
    steps = np.arange(T, dtype=np.int64)
    # per frame: the batch step at which its trajectory started (-start_len: before the batch)
    start = np.empty((E, T), np.int64)
    start[:, 0] = -np.asarray(start_len, dtype=np.int64)
    start[:, 1:] = np.where(ends[:, :-1], steps[1:], start[:, :1])
    np.maximum.accumulate(start, axis=1, out=start)
    step_buf[..., 0] = steps - start
    views[("next", "step_count")][..., 0] = step_buf[..., 0] + 1


class Trajectories:
    """The rows' trajectories and episodes. Row ``i`` is global env ``env_ids[i]`` and starts in
    its ``traj_k[i]``-th trajectory; trajectory ids are ``k * total_rows + env_id`` (a new one
    adds ``total_rows``). Per row: :attr:`cur_traj`, the id of its trajectory now;
    :attr:`ep_ret`, the reward of its episode before this batch; :attr:`ep_start`, the step its
    episode began at (episode returns and lengths are worked out once per batch, from the batch's
    rewards and ends, by :meth:`end_batch`). The arrays are changed in place, never replaced
    (except :attr:`ep_ret`, replaced at each batch's end)."""

    def __init__(self, env_ids: np.ndarray, total_rows: int, traj_k: Sequence[int]) -> None:
        E = len(env_ids)
        self.env_ids, self.total_rows = env_ids, total_rows
        self.cur_traj = np.asarray(traj_k, dtype=np.int64) * total_rows + env_ids
        self.ep_ret = np.zeros(E, np.float64)
        self.ep_start = np.zeros(E, np.int64)
        self._ends: tuple[np.ndarray, ...] | None = None  # the last batch's episodes: rows, ids, returns, ...
        self._first: tuple[np.ndarray, int, np.ndarray] = (self.cur_traj, 0, self.ep_start)

    def new_trajs(self, rows: np.ndarray, step: int) -> None:
        """The rows ``rows`` start a new trajectory and episode at step ``step`` (between batches)."""
        self.cur_traj[rows] += self.total_rows
        self.ep_ret[rows] = 0.0
        self.ep_start[rows] = step

    def begin_batch(self, step: int) -> None:
        """A batch begins at step ``step``: what its end works from (each row's trajectory and
        episode start now)."""
        self._first = (self.cur_traj.copy(), step, self.ep_start.copy())

    def end_batch(self, views: dict[Key, np.ndarray], stage: Staging, ends: list[tuple[int, np.ndarray]]) -> None:
        """At the batch's end: its frames' trajectory ids (and step counts, where the layout has
        them) into ``views``, each row's trajectory moved on past the episodes that ended in it
        (``ends``: the rows that ended at each step, in order), and those episodes tallied
        (:attr:`episodes`)."""
        first_traj, first_step, first_start = self._first
        traj_buf = views[("collector", "traj_ids")]
        write_traj_ids(traj_buf, stage.done.T, first_traj, self.total_rows)
        write_step_counts(views, stage.done.T, first_step - first_start)
        self.cur_traj += self.total_rows * np.count_nonzero(stage.done, axis=0)
        self._ends = self._tally(ends, stage, traj_buf, first_step, first_start)

    @property
    def episodes(self) -> Episodes:
        """The episodes that ended in the last batch, in the order they ended, made from the
        arrays kept per step (a 256-sub-env CartPole ends about a thousand episodes per batch: no
        object per episode)."""
        if self._ends is None:
            return NO_EPISODES
        rows, ids, rets, lens, terms = self._ends
        return Episodes(self.env_ids[rows], ids, rets, lens, terms)

    @property
    def counters(self) -> list[int]:
        """Per row: the number of the trajectory it is in now."""
        return ((self.cur_traj - self.env_ids) // self.total_rows).tolist()

    def _tally(
        self, ends: list[tuple[int, np.ndarray]], stage: Staging, traj_buf: np.ndarray, first_step: int,
        first_start: np.ndarray,
    ) -> tuple[np.ndarray, ...] | None:
        """At the end of a batch: the episodes that ended in it (``ends``: the rows that ended at
        each step, in order) as columns -- rows, trajectory ids, returns, lengths, terminated, in the
        order they ended -- and each row's reward carried into the next batch (:attr:`ep_ret`).
        Worked out from the batch's rewards with a few whole-batch operations rather than per step:
        a row's return is its running sum of rewards (``float64``, from what it carried in, and
        from zero after each end: added in the order the rewards came, as a plain loop adds them);
        its length is the difference of the steps of its end and of its previous end in this batch,
        or, for its first end, from its episode's start (``first_start``: each row's episode start
        at the batch's first step, ``first_step``)."""
        sums = stage.sums  # [T, E]: each row's return up to each step (a step at a time: faster than np.cumsum here)
        np.copyto(sums, stage.rew)
        sums[0] += self.ep_ret
        ended_at = dict(ends)
        add, rew = np.add, stage.rew
        prev = sums[0]
        for t, row in enumerate(sums[1:], 1):  # (each step's row a view made once)
            add(prev, row, out=row)
            restart = ended_at.get(t - 1)
            if restart is not None:  # (after an end the sum starts again from the next reward)
                row[restart] = rew[t, restart]
            prev = row
        self.ep_ret = np.where(stage.done[-1], 0.0, sums[-1])
        if not ends:
            return None
        ts = np.repeat(np.array([t for t, _ in ends]), [len(r) for _, r in ends])
        rows = np.concatenate([r for _, r in ends])
        order = np.lexsort((ts, rows))  # by row, then by step
        er, et = rows[order], ts[order]
        first = np.empty(len(er), bool)  # the row's first end in this batch
        first[0] = True
        np.not_equal(er[1:], er[:-1], out=first[1:])
        prev = np.empty_like(et)  # the step of the row's previous end (first ends: none)
        prev[0] = 0
        prev[1:] = et[:-1]
        lens = et - prev
        lens[first] = first_step + et[first] + 1 - first_start[er[first]]
        back = np.empty_like(order)  # back into the order the episodes ended in
        back[order] = np.arange(len(order))
        return rows, traj_buf[rows, ts], sums[ts, rows], lens[back], stage.term[ts, rows]


__all__ = ["Trajectories", "write_step_counts", "write_traj_ids"]
