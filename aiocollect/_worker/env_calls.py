"""Calls on a worker's envs and policy (``Collector.call``, ``get_attr``, ``set_attr``,
``map_fn``, ``getattr_policy``): :func:`apply` runs one :class:`~aiocollect._core.wire.EnvCall`
on a rollout, between two env steps (the worker reads its messages there, or while idle), and
marks the rows it touched as entering the call's env epoch (:meth:`EnvEpochs.enter`), which the
rollout writes into each frame's ``("collector", "env_epoch")``.

A worker's rows are its envs, or its vector envs' sub-envs (reached through the vector env's own
``call`` / ``get_attr`` / ``set_attr``, as gymnasium's vector envs offer them); attributes are
looked up through gymnasium's wrappers (``get_wrapper_attr`` / ``set_wrapper_attr``), as
gymnasium's vector envs do. Runs in worker processes, in Ray actors (between two steps of the
batch in progress, or between batches: :class:`~aiocollect._backends.ray_actor.RolloutActor`), for
the local backend in the collector's process, and in the evaluator's worker (process or actor) on
its episodes' rollout, between evaluations. Imported by worker processes: numpy and cloudpickle only.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .._core.wire import EnvCall, EnvCallDone


class EnvEpochs:
    """Each row's env epoch (the last call applied to it, 0: none) and, while a batch is being
    filled, where in it the epochs changed: a call applied before step ``t`` of the batch holds
    for the frames from ``t`` on."""

    def __init__(self, rows: int, start: Sequence[int] | None = None) -> None:
        self.now = np.zeros(rows, np.int64) if start is None else np.asarray(start, np.int64).copy()
        self._first: np.ndarray | None = None  # the epochs at the start of the batch being filled
        self._marks: list[tuple[int, Any, int]] = []  # (step of the batch, rows, epoch)
        self._step: Callable[[], int] = lambda: 0
        self.replayed: dict[int, tuple[tuple[int, ...] | None, list]] = {}  # per epoch: rows, results of a replayed call

    def begin(self, step: Callable[[], int]) -> None:
        """A batch starts; ``step()`` is the number of its steps taken so far."""
        self._first, self._marks, self._step = self.now.copy(), [], step

    def enter(self, rows: Any, epoch: int) -> None:
        if epoch <= 0:
            return
        self.now[rows] = epoch
        if self._first is not None:
            self._marks.append((self._step(), rows, epoch))

    def write(self, buf: np.ndarray | None) -> None:
        """The batch is full: each frame's epoch into ``buf`` (``[E, T]``)."""
        first, marks, self._first, self._marks = self._first, self._marks, None, []
        if buf is None or first is None:
            return
        buf[...] = first[:, None]
        for t, rows, epoch in marks:
            buf[rows, t:] = epoch


def _get(env: Any, name: str) -> Any:
    get = getattr(env, "get_wrapper_attr", None)
    return get(name) if get is not None else getattr(env, name)


def _set(env: Any, name: str, value: Any) -> None:
    put = getattr(env, "set_wrapper_attr", None)
    if put is not None:
        put(name, value)
    else:
        setattr(env, name, value)


def _call(env: Any, name: str, args: tuple, kwargs: dict) -> Any:
    """gymnasium's vector ``call`` on one env: a method is called, any other attribute is returned."""
    attr = _get(env, name)
    return attr(*args, **kwargs) if callable(attr) else attr


def _on_env(env: Any, kind: str, name: str, args: tuple, kwargs: dict, value: Any) -> Any:
    if kind == "get":
        return _get(env, name)
    if kind == "set":
        _set(env, name, value)
        return None
    if kind == "fn":
        return args[0](env, *args[1:], **kwargs)
    return _call(env, name, args, kwargs)


def _sub_envs(vec: Any) -> list[Any] | None:
    """A vector env's sub-env objects, where it keeps them in this process (``SyncVectorEnv``)."""
    envs = getattr(getattr(vec, "unwrapped", vec), "envs", None)
    return list(envs) if isinstance(envs, (list, tuple)) else None


def _on_vector(vec: Any, subs: list[int], n: int, kind: str, name: str, args: tuple, kwargs: dict, values: list) -> list:
    """The call on sub-envs ``subs`` of the vector env ``vec`` (of ``n``), through its own
    ``call`` / ``get_attr`` / ``set_attr`` where it has them, else on its sub-env objects."""
    every = subs == list(range(n))
    own = getattr(vec, {"get": "get_attr", "set": "set_attr", "call": "call"}.get(kind, ""), None)
    if kind == "get" and own is not None:
        got = list(own(name))
        return [got[i] for i in subs]
    if kind == "set" and own is not None:
        now = [None] * n if every else list(vec.get_attr(name))
        for i, v in zip(subs, values):
            now[i] = v
        own(name, now)
        return [None] * len(subs)
    if kind == "call" and own is not None and every:
        return list(own(name, *args, **kwargs))
    envs = _sub_envs(vec)
    if envs is None:
        what = {"fn": "map_fn()", "call": "call() on some of its sub-envs"}.get(kind, f"the {kind} of an attribute")
        raise TypeError(
            f"{type(vec).__name__} keeps its sub-envs out of reach (in other processes, or as arrays) and has no "
            f"{'call' if kind == 'fn' else kind}: {what} needs them; use call(), get_attr() and set_attr() on "
            f"every row of it"
        )
    return [_on_env(envs[i], kind, name, args, kwargs, v) for i, v in zip(subs, values)]


def _policy(rollout: Any) -> Any:
    parts = getattr(rollout, "groups", None) or [rollout]
    runner = parts[0].runner
    if getattr(runner, "remote", False):
        raise TypeError("with inference='server' the policy runs in the collector's process, not in the workers")
    for attr in ("policy", "module"):
        policy = getattr(runner, attr, None)
        if policy is not None:
            return policy
    raise TypeError("the workers run a random policy (policy=None): there is no policy to read")


def apply(rollout: Any, call: EnvCall) -> list:
    """Apply ``call`` to the rows of ``rollout`` it names; its results, one per row in the
    order of ``call.rows`` (``"policy"``: one). Raises what the env (or the policy) raised."""
    import cloudpickle

    if call.kind == "policy":
        return [getattr(_policy(rollout), call.name)]
    parts = getattr(rollout, "groups", None) or [rollout]  # (worker_groups: Rollouts of a few rows each)
    replayed = parts[0].env_epochs.replayed.pop(call.epoch, None) if call.epoch else None
    if replayed is not None and replayed[0] == call.rows:
        return list(replayed[1])  # (the call of the worker this one replaces: applied already, by replay())
    args, kwargs = cloudpickle.loads(call.payload)
    where = [(p, i) for p in parts for i in range(p.rows)]
    rows = range(len(where)) if call.rows is None else call.rows
    values = list(args[0]) if call.kind == "set" else [None] * len(rows)
    out: list[Any] = [None] * len(rows)
    # rows grouped by the env that holds them (a vector env holds several), in row order
    by_env: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k, row in enumerate(rows):
        part, i = where[row]
        n = getattr(part, "n", None) if getattr(part, "vecs", None) is not None else None
        c, sub = (i // n, i % n) if n else (i, -1)
        by_env.setdefault((id(part), c), []).append((k, sub))
    parts_by_id = {id(p): p for p in parts}
    for (pid, c), items in by_env.items():
        part = parts_by_id[pid]
        env = part.envs[c]
        if items[0][1] >= 0:  # sub-envs of a vector env
            got = _on_vector(env, [s for _, s in items], part.n, call.kind, call.name, args, kwargs,
                             [values[k] for k, _ in items])
        else:
            got = [_on_env(env, call.kind, call.name, args, kwargs, values[items[0][0]])]
        for (k, _), result in zip(items, got):
            out[k] = result
    if call.epoch:
        for part in parts:
            local = [i for p, i in (where[r] for r in rows) if p is part]
            if local:
                part.env_epochs.enter(np.asarray(local, np.intp), call.epoch)
    return out


def answer(rollout: Any, call: EnvCall) -> EnvCallDone:
    """Apply ``call`` and say how it went (an exception travels pickled, with its traceback: the
    worker goes on)."""
    import traceback

    import cloudpickle

    try:
        return EnvCallDone(call.id, cloudpickle.dumps(apply(rollout, call)))
    except Exception as exc:  # noqa: BLE001 - reported to the caller, raised there
        from .peer import pack_exception

        return EnvCallDone(call.id, pack_exception(exc), traceback.format_exc())


def replay(rollout: Any, calls: Sequence[EnvCall]) -> None:
    """A replacement's envs are made: apply the calls kept for it (``set_attr`` and persisted
    calls) in order, before its first reset; raises what one raised. The call that the failed
    worker had not answered is among them and is sent again: :func:`apply` answers it with the
    results of its replay, and does not apply it twice."""
    parts = getattr(rollout, "groups", None) or [rollout]
    for call in calls:
        results = apply(rollout, call)
        parts[0].env_epochs.replayed[call.epoch] = (call.rows, results)


__all__ = ["EnvEpochs", "answer", "apply", "replay"]
