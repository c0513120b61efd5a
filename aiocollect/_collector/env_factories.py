"""One env factory per worker or per env (TorchRL's list of ``create_env_fn`` and
``create_env_kwargs``): the lists checked at construction, and each worker's share of them.

A list of ``num_workers`` entries gives each worker its own (all its envs made by it); a list of
as many entries as envs (``num_workers * envs_per_worker``; with ``num_workers=0``,
``envs_per_worker``) gives each env its own, worker ``w``'s envs being entries
``w * envs_per_worker`` to ``(w + 1) * envs_per_worker - 1``. Each row of a batch then carries the
index of its factory in ``("collector", "env_fn_index")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .._core.errors import ConfigError, SpecError
from .._service.options import check_env_id, check_kwargs

if TYPE_CHECKING:  # pragma: no cover
    from .._core.geometry import Geometry


class EnvOptions(Protocol):
    """The options these read (the collector's :class:`~aiocollect.CollectorConfig`)."""

    @property
    def create_env_fn(self) -> Any: ...

    @property
    def create_env_kwargs(self) -> Any: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def envs_per_worker(self) -> int: ...

    @property
    def geometry(self) -> Geometry: ...


def listed(value: Any) -> bool:
    """Whether ``create_env_fn`` or ``create_env_kwargs`` is a list of one per worker or per env."""
    return isinstance(value, (list, tuple))


def has_factory_list(config: EnvOptions) -> bool:
    """Whether the envs have factories (or keyword arguments) of their own."""
    return listed(config.create_env_fn) or listed(config.create_env_kwargs)


def _lengths(config: EnvOptions) -> str:
    workers = "" if config.num_workers == 0 else f"num_workers={config.num_workers} (one per worker) or "
    per_env = (
        f"the {config.geometry.total_envs} envs (one per env: num_workers={config.num_workers} x envs_per_worker="
        f"{config.envs_per_worker})" if config.num_workers else
        f"envs_per_worker={config.envs_per_worker} (one per env; with num_workers=0 the envs share one process)"
    )
    return workers + per_env


def _check_length(config: EnvOptions, name: str, value: list | tuple) -> None:
    allowed = {config.geometry.total_envs} | ({config.num_workers} if config.num_workers else set())
    if len(value) not in allowed:
        raise ConfigError(
            f"{name} is a list of {len(value)} entries ({value!r:.200}); it must have as many as {_lengths(config)}; "
            f"pass a list of that length, or a single {'factory' if name == 'create_env_fn' else 'dict'} for every env"
            + (f" (one per worker, as TorchRL's multi collectors: pass num_workers={len(value)})"
               if config.num_workers and len(value) > config.num_workers else "")
        )


def check_env_factories(config: EnvOptions) -> None:
    """``create_env_fn`` and ``create_env_kwargs``: single, or lists (made tuples) of one per
    worker or per env, each entry a gymnasium id or a callable (a dict of str keys or ``None``);
    two lists of the same length. Raises :class:`ConfigError` naming the entry or the lengths."""
    fns: Any = config.create_env_fn
    kwargs: Any = config.create_env_kwargs
    if listed(fns):
        _check_length(config, "create_env_fn", fns)  # (the list as given: its message shows it)
        fns = tuple(fns)
        for i, fn in enumerate(fns):
            if isinstance(fn, str):
                check_env_id(fn, f"create_env_fn[{i}]")
            elif not callable(fn):
                raise ConfigError(
                    f"create_env_fn[{i}]={fn!r:.100} is neither a gymnasium env id nor a callable returning a "
                    f"gymnasium.Env; every entry of the list must be one"
                )
        object.__setattr__(config, "create_env_fn", fns)
    if not listed(kwargs):
        check_kwargs("create_env_kwargs", kwargs)
        return
    for i, kw in enumerate(kwargs):
        if kw is not None and not isinstance(kw, dict):  # (a list of pairs is a dict misspelt, more likely)
            raise ConfigError(
                f"create_env_kwargs={kwargs!r:.200} is a list, so each entry must be a dict (or None), the keyword "
                f"arguments of one worker's or one env's factory, and create_env_kwargs[{i}]={kw!r:.100} is not; "
                f"pass a dict for every env, or a list of dicts"
            )
        check_kwargs(f"create_env_kwargs[{i}]", kw)
    _check_length(config, "create_env_kwargs", kwargs)  # (the list as given: its message shows it)
    kwargs = tuple(kwargs)
    if listed(fns) and len(kwargs) != len(fns):
        raise ConfigError(
            f"create_env_kwargs is a list of {len(kwargs)} dicts but create_env_fn a list of {len(fns)} factories; "
            f"pass one dict per factory (or a single dict for every factory)"
        )
    object.__setattr__(config, "create_env_kwargs", kwargs)


def env_ids(config: EnvOptions) -> list[str]:
    """The gymnasium ids among ``create_env_fn`` (one or a list)."""
    fns = config.create_env_fn if listed(config.create_env_fn) else (config.create_env_fn,)
    return [fn for fn in fns if isinstance(fn, str)]


def worker_factories(config: EnvOptions, worker: int) -> dict[str, Any]:
    """What :class:`~aiocollect._worker.rollout.RolloutConfig` gets for ``worker``: ``env_fn``,
    ``env_kwargs`` (one for all its envs, or a tuple of one per env) and ``env_fn_index`` (per env
    of the worker: its entry in the lists; ``None`` without lists)."""
    fns: Any = config.create_env_fn
    kwargs: Any = config.create_env_kwargs
    if not has_factory_list(config):
        return {"env_fn": fns, "env_kwargs": dict(kwargs or {}), "env_fn_index": None}
    E = config.envs_per_worker
    length = len(fns) if listed(fns) else len(kwargs)
    if length == config.geometry.total_envs:
        index = tuple(range(worker * E, (worker + 1) * E))
    else:  # one per worker
        index = (worker,) * E

    def pick(value: Any, is_kwargs: bool) -> Any:
        if not listed(value):
            return dict(value or {}) if is_kwargs else value
        entries = tuple(dict(value[i] or {}) if is_kwargs else value[i] for i in index)
        return entries[0] if len(set(index)) == 1 else entries  # (one per worker: a single one)

    return {"env_fn": pick(fns, False), "env_kwargs": pick(kwargs, True), "env_fn_index": index}




def check_same_spaces(specs: list[dict], configs: list[Any]) -> None:
    """Once the workers started: where envs have factories of their own, every worker's envs
    must have the same spaces (each worker checked its own envs); raises :class:`SpecError`
    naming the two factories and their spaces."""
    first = specs[0].get("spaces")
    for w, spec in enumerate(specs[1:], 1):
        spaces = spec.get("spaces")
        if spaces is not None and first is not None and spaces != first:
            raise SpecError(
                f"worker {w}'s envs (made by create_env_fn[{configs[w].env_fn_index[0]}]) have observation space "
                f"{spaces[0]} and action space {spaces[1]}, but worker 0's (made by create_env_fn"
                f"[{configs[0].env_fn_index[0]}]) have {first[0]} and {first[1]}: every env factory must make envs "
                f"with the same spaces (they share one batch and one policy)"
            )


__all__ = ["check_env_factories", "check_same_spaces", "env_ids", "has_factory_list", "listed", "worker_factories"]
