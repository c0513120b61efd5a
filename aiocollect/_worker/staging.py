"""Where one batch of a rollout is written as its envs step (:class:`Staging`): time-major
buffers, or the slot itself, and each step's views of them, made once.

Imported by worker processes: numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._core.layout import Key, Leaf


def _copy_transposed(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[e, t] = src[t, e]`` (``dst``: ``[E, T, ...]``, ``src``: ``[T, E, ...]``). A frame's
    leaf of a few elements is moved as one item (a void of its size) where both arrays hold it
    contiguous: numpy copies that several times faster than element by element."""
    size = src.itemsize * int(np.prod(src.shape[2:], dtype=np.int64))
    if src.ndim > 2 and 0 < size <= 256 and _leaf_contiguous(dst) and _leaf_contiguous(src):
        void = np.dtype((np.void, size))
        d = dst.reshape(dst.shape[:2] + (-1,)).view(void)[..., 0]  # (views: the leaves are contiguous)
        s = src.reshape(src.shape[:2] + (-1,)).view(void)[..., 0]
        np.copyto(d, s.swapaxes(0, 1))
    else:
        np.copyto(dst, src.swapaxes(0, 1))


def _leaf_contiguous(a: np.ndarray) -> bool:
    """Whether each ``a[i, j]`` is C-contiguous."""
    stride = a.itemsize
    for dim, step in zip(reversed(a.shape[2:]), reversed(a.strides[2:])):
        if dim != 1 and step != stride:
            return False
        stride *= dim
    return True


_SLOTS_KEPT = 4  # slots whose step views a rollout keeps (a worker has two or three)


class Staging:
    """Where one batch of ``T`` steps of ``E`` rows is written as the envs step. Rewards and
    flags: time-major buffers (``[T, E]``), written into the slot at the batch's end. Frames
    (observations, actions, extras): time-major buffers too (each step writes contiguous rows,
    and the batch goes into the slot in one copy per key at its end), or, ``in_slot``, the slot
    itself (single envs write a row at a time: no copy at the end). Each step's views are made
    once (once per slot where they are the slot's)."""

    def __init__(
        self, T: int, E: int, obs: list[Leaf], act: list[Leaf], extras: list[Leaf], carried: list[np.ndarray],
        in_slot: bool = False, reward_dtype: Any = np.float32,
    ) -> None:
        def bufs(leaves: list[Leaf]) -> list[np.ndarray]:
            return [np.zeros((T, E) + leaf.shape, leaf.np_dtype) for leaf in leaves]

        self.T, self.in_slot, self.carried = T, in_slot, carried
        self.slots: dict[int, tuple[dict, list[tuple]]] = {}  # in_slot: id(views) -> (views, its steps)
        self.rew = np.zeros((T, E), reward_dtype)
        self.term = np.zeros((T, E), bool)
        self.trunc = np.zeros((T, E), bool)
        self.done = np.zeros((T, E), bool)  # terminated | truncated (with max_frames_per_traj's cuts)
        self.sums = np.zeros((T, E), np.float64)  # running sums of the rewards (episode returns)
        if not in_slot:
            self.obs, self.next, self.act, self.extras = bufs(obs), bufs(obs), bufs(act), bufs(extras)
            self.steps = self._steps(self.obs, self.act, self.extras, self.next, time_major=True)

    def _steps(
        self, obs: list[np.ndarray], act: list[np.ndarray], extras: list[np.ndarray], nxt: list[np.ndarray],
        time_major: bool,
    ) -> list[tuple]:
        """Per step: obs, actions, extras, next obs, the obs of the step after (after the last
        step: the rollout's carried obs), reward, terminated, truncated, done."""
        T = self.T

        def at(bufs: list[np.ndarray], t: int) -> list[np.ndarray]:
            return [b[t] for b in bufs] if time_major else [b[:, t] for b in bufs]

        return [
            (
                at(obs, t), at(act, t), at(extras, t), at(nxt, t), at(obs, t + 1) if t + 1 < T else self.carried,
                self.rew[t], self.term[t], self.trunc[t], self.done[t],
            )
            for t in range(T)
        ]

    def stop_after(self, t: int, cur: list[np.ndarray], carried: list[np.ndarray]) -> None:
        """The batch stops after step ``t`` (no row has anything left to do): the steps after it
        hold no reward and no episode end, and ``cur`` (the observation after step ``t``) is
        carried."""
        for buf in (self.rew, self.term, self.trunc, self.done):
            buf[t + 1:] = 0
        if cur is not carried:
            for dst, src in zip(carried, cur):
                dst[...] = src

    def slot_steps(self, views: dict[Key, np.ndarray], obs: list[Leaf], act: list[Leaf], extras: list[Leaf]) -> list[tuple]:
        """``in_slot``: each step's views of the slot ``views``, made once per slot (a worker
        fills the same few slots, each a dict of the same arrays, over and over; the last
        :data:`_SLOTS_KEPT` are kept)."""
        kept = self.slots.get(id(views))
        if kept is not None and kept[0] is views:
            return kept[1]
        steps = self._steps(
            [views[leaf.key] for leaf in obs], [views[leaf.key] for leaf in act], [views[leaf.key] for leaf in extras],
            [views[("next",) + leaf.key] for leaf in obs], time_major=False,
        )
        if len(self.slots) >= _SLOTS_KEPT:
            del self.slots[next(iter(self.slots))]
        self.slots[id(views)] = (views, steps)
        return steps

    def into_slot(self, views: dict[Key, np.ndarray], obs: list[Leaf], others: list[Leaf]) -> None:
        """At the batch's end, into the slot: one copy per key (``[T, E, ...]`` -> ``[E, T, ...]``)."""
        if not self.in_slot:
            for leaf, st in zip(obs, self.obs):
                _copy_transposed(views[leaf.key], st)
            for leaf, st in zip(obs, self.next):
                _copy_transposed(views[("next",) + leaf.key], st)
            for leaf, st in zip(others, self.act + self.extras):
                _copy_transposed(views[leaf.key], st)
        views[("next", "reward")][..., 0] = self.rew.T
        views[("next", "terminated")][..., 0] = self.term.T
        views[("next", "truncated")][..., 0] = self.trunc.T



__all__ = ["Staging"]
