"""``trajs_per_batch``: batches made of complete episodes only.

Each env's frames arrive batch after batch; a trajectory cut by a batch boundary keeps its id, so
its pieces are joined here until its episode ends. Complete trajectories queue up and leave
``num_trajs`` at a time: padded ``[num_trajs, max_len]`` with ``("collector", "mask")``
(``traj_format="pad"``) or concatenated ``[sum of lengths]`` (``traj_format="cat"``).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import torch
from tensordict import TensorDictBase

from .split import split_trajectories


class TrajectoryAccumulator:
    def __init__(self, num_trajs: int, traj_format: str) -> None:
        self.num_trajs = num_trajs
        self.traj_format = traj_format
        self.pending: dict[int, tuple[int, list[TensorDictBase]]] = {}  # env -> (traj id, pieces)
        self.complete: deque[TensorDictBase] = deque()
        self.dropped = 0  # unfinished trajectories cut off by a reset (reset_at_each_iter)

    def add(self, batch: TensorDictBase, envs: Sequence[int]) -> list[TensorDictBase]:
        """Take an ``[E, T]`` batch whose row ``i`` holds env ``envs[i]``; return the batches of
        complete trajectories now ready (possibly none)."""
        ids = batch["collector", "traj_ids"]
        done = batch["next", "done"][..., 0]
        E, T = ids.shape
        starts = torch.ones(E, T, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        for row in range(E):
            env = envs[row]
            bounds = starts[row].nonzero().flatten().tolist() + [T]
            for a, b in zip(bounds[:-1], bounds[1:]):
                traj_id = int(ids[row, a])
                pieces: list[Any] = [batch[row, a:b]]
                if a == 0 and env in self.pending:
                    pending_id, pending = self.pending.pop(env)
                    if pending_id == traj_id:
                        pieces = pending + pieces
                    else:
                        self.dropped += 1
                if bool(done[row, b - 1]):
                    # (torch.cat joins TensorDicts through tensordict's __torch_function__)
                    joined: Any = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0].clone()
                    self.complete.append(joined)
                else:
                    # a copy: the batch may be lent (its slot goes back to the worker once it is
                    # dropped) or a zero_copy view, while an episode may outlast many rounds
                    pieces[-1] = pieces[-1].clone()
                    self.pending[env] = (traj_id, pieces)
        out: list[TensorDictBase] = []
        while len(self.complete) >= self.num_trajs:
            trajs: list[Any] = [self.complete.popleft() for _ in range(self.num_trajs)]
            flat: Any = torch.cat(trajs, 0)
            out.append(flat if self.traj_format == "cat" else split_trajectories(flat))
        return out
