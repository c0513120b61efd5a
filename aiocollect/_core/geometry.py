"""The collector's geometry: how many workers, env copies and env rows there are, how a batch's
frames split over them, and the seeds derived from ``seed``; worked out and checked once.

Words, with one meaning each here and in :class:`~aiocollect._core.layout.SlotLayout`:

- an env *copy* is what ``create_env_fn`` returns: ``envs_per_worker`` per worker;
- a *row* is one env that steps, a row of the batch: a single env, or one sub-env of a vector
  env (``sub_envs`` rows per copy, learned once the workers made their envs);
- ``frames_per_row`` (``T``) is the frames of each row in a batch: the steps each row takes per
  batch; ``frames_per_copy`` is the frames of a copy's rows together.

Imported by worker processes: nothing beyond the standard library and ``_core``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .errors import ConfigError
from .limits import check_seed


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The collector's counts of workers, env copies and rows, and how ``frames_per_batch``
    splits over them. Frozen; checked at construction (and by :meth:`with_sub_envs`).

    Raises :class:`ConfigError` when ``frames_per_batch`` is not a multiple of the rows that fill
    a batch, naming the multiples next to it.

    Examples:
        >>> g = Geometry(workers=2, envs_per_worker=3, frames_per_batch=48)
        >>> g.total_envs, g.frames_per_row, g.seed_offset
        (6, 8, 7)
        >>> v = g.with_sub_envs(4)  # vector envs of 4 sub-envs
        >>> v.rows_per_worker, v.total_rows, v.frames_per_row, v.frames_per_copy
        (12, 24, 2, 8)
    """

    workers: int
    """Rollout workers (at least 1: ``num_workers=0`` is one worker in the collector's process)."""
    envs_per_worker: int
    """Env copies of each worker (what ``create_env_fn`` returns: a single env or a vector env)."""
    frames_per_batch: int
    """Frames of each delivered batch."""
    sync: bool = True
    """A batch holds every worker's rows (``delivery="sync"``), else one worker's (``"async"``)."""
    sub_envs: int = 1
    """Rows of each env copy: a vector env's ``num_envs``, 1 for single envs (learned once the
    workers made their envs: :meth:`with_sub_envs`)."""

    def __post_init__(self) -> None:
        for name in ("workers", "envs_per_worker", "frames_per_batch", "sub_envs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Geometry({name}={value!r}): must be a positive int")
        rows = self.rows_per_batch
        if self.frames_per_batch % rows == 0:
            return
        if self.sub_envs == 1:
            who = "num_workers * envs_per_worker" if self.sync and self.workers > 1 else "envs_per_worker"
            raise ConfigError(
                f"frames_per_batch={self.frames_per_batch} is not a multiple of the {rows} envs that fill "
                f"each batch ({who}); {self.fix(rows)}"
            )
        who = f"{self.envs_per_worker} envs_per_worker x {self.sub_envs} sub-envs (num_envs)"
        if self.sync and self.workers > 1:
            who = f"{self.workers} workers x {who}"
        raise ConfigError(
            f"frames_per_batch={self.frames_per_batch} is not a multiple of the {rows} env rows that fill each batch "
            f"({who}: each sub-env of a vector env is a row of the batch); {self.fix(rows)}, or vector envs with "
            f"another num_envs"
        )

    def with_sub_envs(self, sub_envs: int) -> Geometry:
        """This geometry where each env copy is ``sub_envs`` rows (the workers' vector envs have
        ``num_envs=sub_envs``), checked again: :class:`ConfigError` when ``frames_per_batch`` does
        not split over the rows."""
        return self if sub_envs == self.sub_envs else dataclasses.replace(self, sub_envs=sub_envs)

    # -- counts -----------------------------------------------------------------------------------
    @property
    def total_envs(self) -> int:
        """Env copies of all workers."""
        return self.workers * self.envs_per_worker

    @property
    def rows_per_worker(self) -> int:
        """Rows of each worker (its copies' sub-envs)."""
        return self.envs_per_worker * self.sub_envs

    @property
    def total_rows(self) -> int:
        """Rows of all workers; global row ``k`` is row ``k % rows_per_worker`` of worker
        ``k // rows_per_worker``."""
        return self.workers * self.rows_per_worker

    @property
    def copies_per_batch(self) -> int:
        """Env copies whose frames make up one batch: every worker's (sync), or one worker's (async)."""
        return self.total_envs if self.sync else self.envs_per_worker

    @property
    def rows_per_batch(self) -> int:
        """Rows of one batch (the ``E`` of its ``[E, T]`` shape)."""
        return self.copies_per_batch * self.sub_envs

    @property
    def frames_per_row(self) -> int:
        """``T``: frames of each row in a batch, the steps each row takes per batch."""
        return self.frames_per_batch // self.rows_per_batch

    @property
    def frames_per_copy(self) -> int:
        """Frames of each env copy's rows together in a batch."""
        return self.frames_per_batch // self.copies_per_batch

    def per_copy(self, frames: int) -> int:
        """Frames of each env copy for ``frames`` in all, spread evenly over the copies and
        rounded up (``init_random_frames``)."""
        return -(-frames // self.total_envs)

    def fix(self, rows: int) -> str:
        """The way out for a ``frames_per_batch`` that is not a multiple of ``rows``: the
        multiples next to it."""
        lower = self.frames_per_batch // rows * rows
        upper = lower if lower == self.frames_per_batch else lower + rows
        return f"use frames_per_batch={upper}" + (f" or {lower}" if lower else "")

    # -- seeds ------------------------------------------------------------------------------------
    @property
    def seed_offset(self) -> int:
        """The largest seed derived from ``seed`` is ``seed + seed_offset``: row ``k`` gets
        ``seed + k`` (:meth:`row_seed`), worker ``w``'s torch generator ``seed + total_rows + w``
        (:meth:`worker_seed`)."""
        return self.total_rows + self.workers - 1

    def row_seed(self, seed: int, row: int) -> int:
        """The seed of global row ``row``."""
        return seed + row

    def worker_seed(self, seed: int, worker: int) -> int:
        """The seed of worker ``worker``'s torch generator (after every row's)."""
        return seed + self.total_rows + worker

    def check_seed(self, seed: object, name: str = "seed", *, optional: bool = True) -> None:
        """``seed`` leaves room for every seed derived from it (:class:`ConfigError` if not)."""
        check_seed(seed, name, offset=self.seed_offset, optional=optional)

    def check_counters(self, counters: Sequence[int] | None) -> None:
        """Trajectory counters to resume from (one per row; ``None``: none) fit this geometry's
        rows: :class:`ConfigError` if not."""
        if counters is not None and len(counters) != self.total_rows:
            kind = f" ({self.total_envs} vector envs of {self.sub_envs} sub-envs)" if self.sub_envs > 1 else ""
            raise ConfigError(
                f"the state loaded with load_state_dict() has trajectory counters for {len(counters)} envs, this "
                f"collector has {self.total_rows}{kind}; resume with the same num_workers, envs_per_worker and "
                f"num_envs"
            )
