"""Reaching into the workers' envs and policies: the work behind ``Collector.call``,
``get_attr``, ``set_attr``, ``map_fn``, ``getattr_env`` and ``getattr_policy``.

A call becomes one :class:`~aiocollect._core.wire.EnvCall` per worker it touches, applied by
the worker between two env steps (:mod:`aiocollect._worker.env_calls`); it returns once every
worker applied it. Calls that change the envs (``call``, ``set_attr``, ``map_fn``) are made one
at a time, each starting a new *env epoch* (1, 2, ...): the frames that an env steps after a call
applied to it carry that number in ``("collector", "env_epoch")``, so every frame whose step began
after the call returned carries it (or a later one).

``set_attr`` calls, and calls made with ``persist=True``, are kept (:class:`EnvCallLog`): a
worker replaced after a failure applies them, in order, once its envs are made and before its
first batch, so that a curriculum survives a restart (its rows then carry the epoch of the last
kept call applied to them: the effect of a call that was not kept is gone with the old envs).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import anyio

from .._core.errors import CollectorClosedError, ConfigError
from .._core.wire import EnvCall

if TYPE_CHECKING:  # pragma: no cover
    from .run import Run

_CHANGES = frozenset({"call", "set", "fn"})  # (kinds that start an env epoch)


@dataclasses.dataclass
class _Kept:
    """A call a replacement applies again (``rows``: global env rows; ``values``: ``set``'s, per row)."""

    kind: str
    name: str
    args: tuple
    kwargs: dict
    rows: list[int]
    values: list | None
    epoch: int


class EnvCallLog:
    """The run's env epochs and the calls that replacements apply again."""

    def __init__(self) -> None:
        self.epoch = 0  # the last epoch started
        self.kept: list[_Kept] = []
        self.rows_per_worker = 1  # (set once the workers' specs are known)
        self._ids = 0
        self._lock: anyio.Lock | None = None

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    @property
    def lock(self) -> anyio.Lock:
        if self._lock is None:  # (made on the loop that uses it)
            self._lock = anyio.Lock()
        return self._lock

    def keep(self, entry: _Kept) -> None:
        """Keep ``entry``; a ``set_attr`` overrides earlier ones of the same attribute on its rows."""
        if entry.kind == "set":
            rows = set(entry.rows)
            for old in self.kept:
                if old.kind == "set" and old.name == entry.name:
                    pairs = [(r, v) for r, v in zip(old.rows, old.values or []) if r not in rows]
                    old.rows, old.values = [r for r, _ in pairs], [v for _, v in pairs]
            self.kept = [k for k in self.kept if k.rows]
        self.kept.append(entry)

    def forget(self, entry: _Kept) -> None:
        if entry in self.kept:
            self.kept.remove(entry)

    def kept_for(self, worker: int) -> tuple[EnvCall, ...]:
        """The kept calls, as worker ``worker``'s replacement applies them (its own rows)."""
        R = self.rows_per_worker
        out = []
        for k in self.kept:
            mine = [(r - worker * R, i) for i, r in enumerate(k.rows) if worker * R <= r < (worker + 1) * R]
            if mine:
                out.append(_message(self.next_id(), k.kind, k.name, k.args, k.kwargs, k.values, mine, k.epoch))
        return tuple(out)


def _message(
    call_id: int, kind: str, name: str, args: tuple, kwargs: dict, values: list | None, mine: list[tuple[int, int]],
    epoch: int,
) -> EnvCall:
    """The EnvCall for one worker: ``mine`` pairs its local rows with their positions in the call."""
    from .._core import pickling as _pickling

    if kind == "set":
        assert values is not None
        args = ([values[i] for _, i in mine],)
    return EnvCall(call_id, kind, name, _pickling.dumps((args, kwargs)), tuple(r for r, _ in mine), epoch)


def _rows(what: str, total: int, R: int, workers: int, indices: Any, worker_ids: Any) -> list[int]:
    """The global env rows a call names (``indices``: rows; ``worker_ids``: every row of those
    workers; neither: all), in the order given."""
    if indices is not None and worker_ids is not None:
        raise ConfigError(f"{what}: pass indices= (env rows) or workers= (every row of those workers), not both")
    if worker_ids is not None:
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        bad = [w for w in ids if not isinstance(w, int) or not 0 <= w < workers]
        if bad or len(set(ids)) != len(ids):
            raise ConfigError(f"{what}: workers={worker_ids!r} must name distinct workers 0..{workers - 1}")
        return [w * R + r for w in ids for r in range(R)]
    if indices is None:
        return list(range(total))
    rows = [indices] if isinstance(indices, int) else list(indices)
    bad = [r for r in rows if not isinstance(r, int) or not 0 <= r < total]
    if bad or len(set(rows)) != len(rows):
        raise ConfigError(
            f"{what}: indices={indices!r} must name distinct env rows 0..{total - 1} (a batch's rows: each worker's "
            f"envs, a vector env's sub-envs each a row)"
        )
    return rows


async def reach(
    run: "Run", what: str, kind: str, name: str, args: tuple = (), kwargs: dict | None = None, *,
    indices: Any = None, workers: Any = None, value: Any = None, persist: bool = False,
) -> list:
    """Apply a call to the workers' envs (``kind``: ``"call"``, ``"get"``, ``"set"``, ``"fn"``;
    ``"policy"``: an attribute of worker 0's policy, or of the first of ``workers``); the results
    in row order. Starts a collector not started yet."""
    s = run.shared
    kwargs = kwargs or {}
    if not s.workers_ready and not s.phase.closing:
        await run.start()  # (as update_weights: a call before the start starts the collector)
    run.check_loop()
    if not all(getattr(w, "reaches_envs", False) for w in s.workers):
        raise ConfigError(
            f"{what} is not supported yet with backend={s.config.backend_name!r} (its workers cannot be reached between "
            f"env steps yet); use backend='process' or num_workers=0"
        )
    if not s.collecting:
        if s.errors.error is None and not s.phase.closing:
            raise CollectorClosedError(f"{what}: every batch of total_frames is collected, and the workers are gone")
        raise run.closed_error(what)
    log = s.env_calls
    R = log.rows_per_worker = s.rows_per_worker
    rows = _rows(what, s.total_rows, R, s.config.workers, indices, workers)
    if kind == "policy":
        rows = rows[:1] if workers is not None else [0]
    values: list | None = None
    if kind == "set":
        if isinstance(value, (list, tuple)):
            if len(value) != len(rows):
                raise ConfigError(
                    f"{what}: {len(value)} values for {len(rows)} env rows; pass one value per row, or one value "
                    f"(not a list or tuple) for all (wrap a list that is the value itself: [value] * rows)"
                )
            values = list(value)
        else:
            values = [value] * len(rows)
    if kind not in _CHANGES:
        return await _send(run, kind, name, args, kwargs, rows, values, 0)
    async with log.lock:  # (one change at a time: epochs are applied in order)
        log.epoch += 1
        entry = None
        if kind == "set" or persist:
            entry = _Kept(kind, name, args, kwargs, rows, values, log.epoch)
            log.keep(entry)  # (before it is sent: a replacement built meanwhile gets it)
        try:
            return await _send(run, kind, name, args, kwargs, rows, values, log.epoch)
        except BaseException:
            if entry is not None:
                log.forget(entry)
            raise


async def _send(
    run: "Run", kind: str, name: str, args: tuple, kwargs: dict, rows: Sequence[int], values: list | None, epoch: int,
) -> list:
    """One EnvCall per worker that holds some of ``rows``, concurrently; the results in the order
    of ``rows``; the first worker's error (in worker order) if any raised."""
    s = run.shared
    R = s.env_calls.rows_per_worker
    per: dict[int, list[tuple[int, int]]] = {}
    for i, r in enumerate(rows):
        per.setdefault(r // R, []).append((r % R, i))
    out: list[Any] = [None] * len(rows)
    errors: dict[int, BaseException] = {}

    async def one(w: int, mine: list[tuple[int, int]]) -> None:
        msg = _message(s.env_calls.next_id(), kind, name, args, kwargs, values, mine, epoch)
        if kind == "policy":
            msg = dataclasses.replace(msg, rows=None)
        try:
            got = await s.workers[w].env_call(msg)
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


__all__ = ["EnvCallLog", "reach"]
