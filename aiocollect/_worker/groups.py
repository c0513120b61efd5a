"""``worker_groups``: a worker's envs in groups that alternate under server inference, so that the
server computes one group's actions while the worker steps the other (rlpyt's
``AlternatingSampler``, within each worker).

Each group is a :class:`~aiocollect._worker.rollout.Rollout` of its own over its share of the worker's
envs, with a seat of its own at the server (its own request and answer) and env ids, seeds and
trajectory ids exactly as the worker's envs would have without groups: group ``g`` of worker
``w`` is rollout "worker" ``w * G + g`` of ``envs_per_worker / G`` envs. Each group asks for its
next step's actions as soon as its observations are final (``RolloutConfig.ahead``); the worker
then steps the other group, whose actions the server computed meanwhile. So with two groups a step
of the worker costs the longer of stepping a group and a forward pass, rather than their sum.

Of rlpyt's two synchronisation variants this is ``NoOverlapAlternatingSampler``'s: a group steps
once its actions are ready *and* the other group finished its step (in one process the two never
step at the same time; rlpyt's ``AlternatingSampler`` lets them overlap, in separate processes).
Unlike rlpyt's action server, ours does not wait for every worker's group before a forward pass:
it serves the groups that asked (``env_batch_size`` makes it wait for more).

Imported by worker processes: numpy and gymnasium only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from .._core.layout import Key
from .rollout import Rollout, RolloutConfig
from .._core.wire import BatchInfo, Episodes


def _group_factories(cfg: RolloutConfig, envs: slice) -> dict[str, Any]:
    """A group's share of the worker's env factories, where each env has its own (a tuple)."""
    return {
        name: value[envs] for name in ("env_fn", "env_kwargs", "env_fn_index")
        if isinstance(value := getattr(cfg, name), tuple)
    }


class GroupedRollout:
    """A worker's envs as ``cfg.worker_groups`` alternating groups; the interface of a
    :class:`Rollout` to the worker."""

    def __init__(self, cfg: RolloutConfig, env: Any = None) -> None:
        self.cfg = cfg
        G = cfg.worker_groups
        self.groups: list[Rollout] = []
        try:
            for g in range(G):
                per = cfg.envs_per_worker // G
                sub = dataclasses.replace(cfg, worker=cfg.worker * G + g, envs_per_worker=per, worker_groups=1,
                                          ahead=True, **_group_factories(cfg, slice(g * per, (g + 1) * per)))
                self.groups.append(Rollout(sub, None, env if g == 0 else None))
                env = None
        except BaseException:
            self.close()
            raise
        self.episodes: Episodes = Episodes([], [], [], [], [])
        self.timing: dict[str, float] = {"env": 0.0, "policy": 0.0}

    # -- what the worker asks of a rollout ------------------------------------------------------
    def spec(self) -> dict[str, Any]:
        return self.groups[0].spec()  # (every group has the same spaces; the batch counts the worker's envs)

    @property
    def heartbeat(self) -> Any:
        return self.groups[0].heartbeat

    @heartbeat.setter
    def heartbeat(self, value: Any) -> None:
        for g in self.groups:
            g.heartbeat = value

    @property
    def version(self) -> int:
        return max(g.version for g in self.groups)

    def apply_weights(self) -> None:
        return None  # (server inference: no weights in the worker)

    def connect_server(self, layout: Any, mapping: Any, fds: Sequence[int], sock: Any, drain: Callable[[], None]) -> None:
        for g, group in enumerate(self.groups):
            group.connect_server(layout, mapping, fds[2 * g : 2 * g + 2], sock, drain)

    def run_batch(self, views: dict[Key, np.ndarray], version: int = 0, tick: Callable[[], None] | None = None) -> Episodes:
        """One batch: each group fills its rows of the slot, a step of each in turn."""
        n = self.groups[0].cfg.envs_per_worker
        fills = [g.fill({k: v[i * n : (i + 1) * n] for k, v in views.items()}, version)
                 for i, g in enumerate(self.groups)]
        going = list(fills)
        while going:
            for fill in list(going):
                try:
                    next(fill)
                except StopIteration:
                    going.remove(fill)
            if tick is not None:
                tick()
        for g in self.groups:
            g.runner.idle()
        parts = [g.episodes for g in self.groups]
        self.episodes = Episodes(*(np.concatenate([getattr(p, f) for p in parts if len(p)] or [np.zeros(0)])
                                   for f in ("env", "traj_id", "ret", "length", "terminated")))
        self.timing = {k: sum(g.timing[k] for g in self.groups) for k in ("env", "policy")}
        return self.episodes

    @property
    def traj_counters(self) -> list[int]:
        return [c for g in self.groups for c in g.traj_counters]

    def batch_info(self) -> BatchInfo:
        return BatchInfo(self.episodes, self.traj_counters, self.timing, self.version)

    def close(self) -> None:
        for g in self.groups:
            g.close()


__all__ = ["GroupedRollout"]
