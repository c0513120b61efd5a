"""A worker's seeds: each row's env seed, the seeded copies of the action spaces its random actions
are drawn from, and the seed of its policy's torch generator, all derived from the collector's
``seed`` (and a replacement worker's restart count).

Imported by worker processes: numpy only (torch where the worker has it already).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np


def derived_seed(seed: int, env: int, restart: int) -> int:
    """The seed of global env ``env`` in the ``restart``-th replacement of its worker."""
    return int(np.random.SeedSequence([seed & (2**63 - 1), env, restart]).generate_state(1, np.uint32)[0])


def row_seeds(seed: int | None, static_seed: bool, restart: int, env_ids: np.ndarray) -> list[int | None]:
    """The reset seed of each row (global env ids ``env_ids``): ``seed + id``; ``seed`` for every
    row with ``static_seed``; derived from the id and the restart count in a replacement worker
    (new episodes, still determined by the seed); ``None`` without a seed."""
    if seed is None:
        return [None] * len(env_ids)
    if static_seed:
        return [seed] * len(env_ids)
    if restart:
        return [derived_seed(seed, int(g), restart) for g in env_ids]
    return [seed + int(g) for g in env_ids]


def seeded_spaces(spaces: Sequence[Any], seeds: Sequence[int | None]) -> list[Any]:
    """A copy of each action space, seeded with its row's seed (the random actions' spaces)."""
    out = []
    for space, seed in zip(spaces, seeds):
        space = copy.deepcopy(space)
        space.seed(seed)
        out.append(space)
    return out


def seed_torch(seed: int | None, worker: int, restart: int, total_envs: int) -> None:
    """A worker process that runs its policy with torch: one intra-op thread (workers are the
    parallelism, not torch's pool), no autograd at all (cheaper than a no_grad context per step),
    and its generator seeded after the seeds of all ``total_envs`` envs."""
    import torch

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    if seed is not None:
        torch.manual_seed(derived_seed(seed, total_envs + worker, restart) if restart else seed + total_envs + worker)


__all__ = ["derived_seed", "row_seeds", "seed_torch", "seeded_spaces"]
