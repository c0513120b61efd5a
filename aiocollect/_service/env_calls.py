"""What the collector and the evaluator share of reaching into their workers' envs (``call``,
``get_attr``, ``set_attr``, ``map_fn``): the env rows a call names, the calls a replacement
worker applies again, and the env epochs (:class:`EnvCallLog`). Each sends the
:class:`~aiocollect._core.wire.EnvCall` messages its own way (the collector:
:mod:`aiocollect._collector.env_calls`; the evaluator: :mod:`aiocollect._evaluator.run`); the
worker side, for both, is :mod:`aiocollect._worker.env_calls`.

Calls that change the envs (``call``, ``set_attr``, ``map_fn``) are made one at a time, each
starting a new *env epoch* (1, 2, ...). ``set_attr`` calls, and calls made with
``persist=True``, are kept: a worker replaced after a failure applies them, in order, once its
envs are made.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Awaitable, Callable

import anyio

from .._core.errors import ConfigError
from .._core.wire import EnvCall

CHANGES = frozenset({"call", "set", "fn"})  # (kinds that start an env epoch)


@dataclasses.dataclass
class Kept:
    """A call a replacement applies again (``rows``: global env rows; ``values``: ``set``'s, per row)."""

    kind: str
    name: str
    args: tuple
    kwargs: dict
    rows: list[int]
    values: list | None
    epoch: int


class EnvCallLog:
    """A run's env epochs and the calls that replacements apply again."""

    def __init__(self) -> None:
        self.epoch = 0  # the last epoch started
        self.kept: list[Kept] = []
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

    def keep(self, entry: Kept) -> None:
        """Keep ``entry``; a ``set_attr`` overrides earlier ones of the same attribute on its rows."""
        if entry.kind == "set":
            rows = set(entry.rows)
            for old in self.kept:
                if old.kind == "set" and old.name == entry.name:
                    pairs = [(r, v) for r, v in zip(old.rows, old.values or []) if r not in rows]
                    old.rows, old.values = [r for r, _ in pairs], [v for _, v in pairs]
            self.kept = [k for k in self.kept if k.rows]
        self.kept.append(entry)

    def forget(self, entry: Kept) -> None:
        if entry in self.kept:
            self.kept.remove(entry)

    def kept_for(self, worker: int) -> tuple[EnvCall, ...]:
        """The kept calls, as worker ``worker``'s replacement applies them (its own rows), in
        order. A call the failed worker had not answered is among them (applied before the
        replacement's first step) and is also sent to the replacement, which answers it from
        the replay (:func:`aiocollect._worker.env_calls.replay`)."""
        R = self.rows_per_worker
        out = []
        for k in self.kept:
            mine = [(r - worker * R, i) for i, r in enumerate(k.rows) if worker * R <= r < (worker + 1) * R]
            if mine:
                out.append(message(self.next_id(), k.kind, k.name, k.args, k.kwargs, k.values, mine, k.epoch))
        return tuple(out)

    async def make(
        self, kind: str, name: str, args: tuple, kwargs: dict, rows: list[int], values: list | None, persist: bool,
        send: Callable[[int], Awaitable[list]],
    ) -> tuple[list, int]:
        """Make a call through ``send(epoch)``; returns its results and its epoch. A read
        (``"get"``, ``"policy"``) is sent at once with epoch 0; a change waits for the changes
        before it (one at a time: epochs are applied in order), starts the next epoch and, for
        ``set_attr`` or ``persist=True``, is kept (before it is sent, so that a replacement built
        meanwhile gets it; forgotten again if ``send`` raises)."""
        if kind not in CHANGES:
            return await send(0), 0
        async with self.lock:
            self.epoch += 1
            epoch = self.epoch
            entry = None
            if kind == "set" or persist:
                entry = Kept(kind, name, args, kwargs, rows, values, epoch)
                self.keep(entry)
            try:
                return await send(epoch), epoch
            except BaseException:
                if entry is not None:
                    self.forget(entry)
                raise


def message(
    call_id: int, kind: str, name: str, args: tuple, kwargs: dict, values: list | None, mine: list[tuple[int, int]],
    epoch: int,
) -> EnvCall:
    """The EnvCall for one worker: ``mine`` pairs its local rows with their positions in the call."""
    from .._core import pickling as _pickling

    if kind == "set":
        assert values is not None
        args = ([values[i] for _, i in mine],)
    return EnvCall(call_id, kind, name, _pickling.dumps((args, kwargs)), tuple(r for r, _ in mine), epoch)


def rows_named(what: str, total: int, R: int, workers: int, indices: Any, worker_ids: Any) -> list[int]:
    """The global env rows a call names (``indices``: rows; ``worker_ids``: every row of those
    workers; neither: all), in the order given; a :class:`ConfigError` for rows that are not."""
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


def values_for(what: str, value: Any, rows: list[int]) -> list:
    """``set_attr``'s value per row: a list or tuple gives one per row, anything else is the
    value of every row."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(rows):
            raise ConfigError(
                f"{what}: {len(value)} values for {len(rows)} env rows; pass one value per row, or one value "
                f"(not a list or tuple) for all (wrap a list that is the value itself: [value] * rows)"
            )
        return list(value)
    return [value] * len(rows)


def not_torchrl_map_fn(what: str, fn: Any) -> None:
    """``map_fn`` given a name, as TorchRL's ``map_fn(method_name, list_of_args)`` takes: a
    :class:`ConfigError` that says what ours does and how to write TorchRL's call."""
    if isinstance(fn, str):
        raise ConfigError(
            f"{what} takes a function fn(env, *args) applied to every env, not a name ({fn!r}); TorchRL's "
            f"map_fn(method_name, list_of_args) calls a method of each worker with its own arguments: use "
            f"call({fn.rpartition('.')[2]!r}, *args, workers=[i]) for worker i (call() reaches a method of the envs)"
        )
    if not callable(fn):
        raise ConfigError(f"{what}: fn={fn!r:.100} is not callable; pass a function fn(env, *args)")


__all__ = ["CHANGES", "EnvCallLog", "Kept", "message", "not_torchrl_map_fn", "rows_named", "values_for"]
