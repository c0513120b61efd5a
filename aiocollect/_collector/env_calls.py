"""Reaching into the workers' envs and policies: the work behind ``Collector.call``,
``get_attr``, ``set_attr``, ``map_fn``, ``getattr_env`` and ``getattr_policy``.

A call becomes one :class:`~aiocollect._core.wire.EnvCall` per worker it touches, applied by
the worker between two env steps (:mod:`aiocollect._worker.env_calls`), whatever the backend (a
worker process, a Ray actor, the local rollout); it returns once every worker applied it. Calls
that change the envs (``call``, ``set_attr``, ``map_fn``) are made one at a time, each starting a
new *env epoch* (1, 2, ...): the frames that an env steps after a call applied to it carry that
number in ``("collector", "env_epoch")``, so every frame whose step began after the call returned
carries it (or a later one).

``set_attr`` calls, and calls made with ``persist=True``, are kept
(:class:`~aiocollect._service.env_calls.EnvCallLog`): a worker replaced after a failure applies
them, in order, once its envs are made and before its first batch, so that a curriculum survives
a restart (its rows then carry the epoch of the last kept call applied to them: the effect of a
call that was not kept is gone with the old envs).

``getattr_policy`` reads worker 0's replica; with ``inference="server"`` it reads the
inference server's own copy of the policy, in this process (the weights that act).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import anyio

from .._core.errors import ConfigError
from .._service.env_calls import EnvCallLog, message, rows_named, values_for

if TYPE_CHECKING:  # pragma: no cover
    from .pool import WorkerPool


async def reach(
    pool: "WorkerPool", what: str, kind: str, name: str, args: tuple = (), kwargs: dict | None = None, *,
    indices: Any = None, workers: Any = None, value: Any = None, persist: bool = False,
) -> tuple[list, int]:
    """Apply a call to the pool's envs (``kind``: ``"call"``, ``"get"``, ``"set"``, ``"fn"``;
    ``"policy"``: an attribute of worker 0's policy, or of the first of ``workers``, or of the
    inference server's); its results in row order, and the env epoch it started (0: a read).
    The run's lifecycle (:meth:`~aiocollect._collector.run.Run.reach`) checked that the
    workers collect."""
    kwargs = kwargs or {}
    if kind == "policy" and pool.server is not None:  # inference="server": the policy acts in this process
        return [pool.server.policy_attr(name)], 0
    check_reachable(pool, what)
    log = pool.env_calls
    R = log.rows_per_worker
    rows = rows_named(what, pool.total_rows, R, pool.config.workers, indices, workers)
    if kind == "policy":
        rows = rows[:1] if workers is not None else [0]
    values = values_for(what, value, rows) if kind == "set" else None

    async def send(epoch: int) -> list:
        return await _send(pool, kind, name, args, kwargs, rows, values, epoch)

    return await log.make(kind, name, args, kwargs, rows, values, persist, send)


def check_reachable(pool: "WorkerPool", what: str) -> None:
    """A :class:`ConfigError` if the pool's workers cannot be reached between env steps."""
    if not all(w.reaches_envs for w in pool.workers):
        raise ConfigError(
            f"{what} is not supported with backend={pool.config.backend_name!r} (its workers cannot be reached "
            f"between env steps); use backend='process', 'ray' or num_workers=0"
        )


async def _send(
    pool: "WorkerPool", kind: str, name: str, args: tuple, kwargs: dict, rows: Sequence[int], values: list | None,
    epoch: int,
) -> list:
    """One EnvCall per worker that holds some of ``rows``, concurrently; the results in the order
    of ``rows``; the first worker's error (in worker order) if any raised."""
    R = pool.env_calls.rows_per_worker
    per: dict[int, list[tuple[int, int]]] = {}
    for i, r in enumerate(rows):
        per.setdefault(r // R, []).append((r % R, i))
    out: list[Any] = [None] * len(rows)
    errors: dict[int, BaseException] = {}

    async def one(w: int, mine: list[tuple[int, int]]) -> None:
        msg = message(pool.env_calls.next_id(), kind, name, args, kwargs, values, mine, epoch)
        if kind == "policy":
            msg = dataclasses.replace(msg, rows=None)
        try:
            got = await pool.workers[w].env_call(msg)
        except Exception as exc:  # noqa: BLE001 - raised below, the first worker's first
            errors[w] = exc
            return
        for (_, i), result in zip(mine, got):
            out[i] = result

    async with anyio.create_task_group() as tg:
        for w, mine in per.items():
            tg.start_soon(one, w, mine)
    if errors:
        raise errors[min(errors)]
    return out


__all__ = ["EnvCallLog", "check_reachable", "reach"]
