"""Env ids registered in the user's process, made available in worker processes.

Workers are forked from our launcher, a fresh interpreter whose gymnasium registry holds only
what ``import gymnasium`` registers. An id the user registered (``gymnasium.register`` in a
script's ``__main__``, a notebook, their own module) or that a plugin registered when the user
imported it (``ale_py``) is missing there: ``gymnasium.make(id)`` in a worker raised
``NameNotFound`` (the problem every gymnasium vector env has, Farama-Foundation/Gymnasium#810).

:func:`snapshot` packs the user's registry (once per collector start, in the user's process);
:func:`install` puts every spec a worker lacks, or holds differently, into the worker's registry
before its first env is made. Whether the user passes the id or a callable that calls
``gymnasium.make(id)`` itself, the worker then sees the registry the user sees.

How the specs travel:

- Every spec is sent, gymnasium's own included: only the worker can tell which ones it lacks
  (it compares), and so a stock id the user registered again (another ``max_episode_steps``, say)
  reaches the workers too. Specs whose entry points are strings, or gymnasium's own objects, are
  plain data and travel in one blob (pickle shares their repeated strings: about 8 KiB for
  gymnasium's 63 specs, 200 KiB for 1400 ALE-like specs).
- A spec with any other entry point (a class or function of the user's: by reference when its
  module is importable, by value, with cloudpickle, when it lives in ``__main__`` or a notebook)
  is pickled on its own: one that cannot be pickled, or unpickled in the worker, costs only its
  own id. In the worker such an id becomes a stand-in whose creation raises a
  :class:`~aiocollect.ConfigError` naming the cause; :func:`snapshot` raises that error at once
  for the id the user asked for.
- A string entry point into ``__main__`` (``entry_point="__main__:MyEnv"``) names the user's
  ``__main__``, not the worker's: it is resolved in the user's process and sent by value.

Imported by worker processes: standard library, gymnasium and cloudpickle only.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import re
import warnings
from typing import Any, NamedTuple, Sequence

from gymnasium.envs import registration
from gymnasium.envs.registration import EnvSpec

from .errors import ConfigError


class Packed(NamedTuple):
    """Some registry entries, pickled (``blob``), or why they could not be (``error``)."""

    ids: tuple[str, ...]
    blob: bytes | None
    error: str | None = None
    plain: bool = False  # specs of plain data (see the module docstring), packed together


Snapshot = tuple[Packed, ...]


def _plain(obj: Any) -> bool:
    """A string (or nothing), or an object of gymnasium's own: pickled as data or by a
    reference that every worker can resolve."""
    if obj is None or isinstance(obj, str):
        return True
    module = getattr(obj, "__module__", None) or ""
    return module == "gymnasium" or module.startswith("gymnasium.")


def _resolve_main(spec: EnvSpec) -> EnvSpec:
    """The spec with ``"__main__:Name"`` entry points replaced by the objects they name here."""
    changes: dict[str, Any] = {}
    for field in ("entry_point", "vector_entry_point"):
        value = getattr(spec, field)
        if isinstance(value, str) and value.startswith("__main__:"):
            try:
                changes[field] = registration.load_env_creator(value)
            except Exception:  # noqa: BLE001 - left as it is: gymnasium.make reports it
                pass
    return dataclasses.replace(spec, **changes) if changes else spec


def _pack_one(spec: EnvSpec) -> Packed:
    from . import pickling as _pickling

    try:
        return Packed((spec.id,), _pickling.dumps(spec))
    except Exception as exc:  # noqa: BLE001 - only this id is lost; said where it is made
        return Packed((spec.id,), None, f"its spec could not be pickled ({type(exc).__name__}: {exc})")


def snapshot(require: str | None = None, argument: str = "create_env_fn") -> Snapshot:
    """Pack this process's gymnasium registry for worker processes (see the module docstring).

    ``require``: the env id the caller will make (``"module:EnvId"`` accepted): if its spec
    cannot be pickled, raise :class:`ConfigError` naming ``argument``, the id and the cause.
    Costs about 1 ms for gymnasium's own registry plus a few user entries.
    """
    import cloudpickle

    plain: list[EnvSpec] = []
    own: list[EnvSpec] = []
    for spec in list(registration.registry.values()):
        spec = _resolve_main(spec)
        if _plain(spec.entry_point) and _plain(spec.vector_entry_point):
            plain.append(spec)
        else:
            own.append(spec)
    packed: list[Packed] = []
    if plain:
        try:
            packed.append(Packed(tuple(s.id for s in plain), cloudpickle.dumps(plain), plain=True))
        except Exception:  # noqa: BLE001 - some kwargs do not pickle: find which, one by one
            own = plain + own
    packed.extend(_pack_one(spec) for spec in own)
    if require is not None:
        env_id = _bare_id(require)
        for p in packed:
            if p.blob is None and p.ids == (env_id,):
                _unsendable(argument, require, p.error)
    return tuple(packed)


def check_sendable(env_id: str, argument: str = "create_env_fn") -> None:
    """Raise :class:`ConfigError` if the registered spec of ``env_id`` cannot be pickled for the
    worker processes (what :func:`snapshot` checks for ``require``, for one spec only: cheap
    enough for a constructor)."""
    spec = registration.registry.get(_bare_id(env_id))
    if spec is None:
        return
    spec = _resolve_main(spec)
    if _plain(spec.entry_point) and _plain(spec.vector_entry_point):
        return
    p = _pack_one(spec)
    if p.blob is None:
        _unsendable(argument, env_id, p.error)


def entry_modules(env_id: str) -> list[str]:
    """The modules gymnasium imports to make ``env_id``: that of ``"module:EnvId"``, and that of
    the id's entry point (``"module:Class"``, or a callable's)."""
    found = [env_id.split(":", 1)[0]] if ":" in env_id else []
    entry = getattr(registration.registry.get(_bare_id(env_id)), "entry_point", None)
    if isinstance(entry, str):
        found.append(entry.partition(":")[0])
    elif isinstance(getattr(entry, "__module__", None), str):
        found.append(entry.__module__)
    return found


def _bare_id(env_id: str) -> str:
    """The id without the ``"module:"`` prefix of gymnasium's ``"module:EnvId"``."""
    return env_id.split(":", 1)[1] if ":" in env_id else env_id


def _unsendable(argument: str, env_id: str, error: str | None) -> None:
    raise ConfigError(
        f"{argument}={env_id!r}: {error}, so it cannot be sent to the worker processes; register "
        f"the id with an entry point they can import or unpickle (a class or function of a module, "
        f"or one defined in __main__ without unpicklable state), or pass a function that builds the env"
    )


def size(snap: Snapshot) -> int:
    """Bytes of pickled specs in ``snap``."""
    return sum(len(p.blob) for p in snap if p.blob is not None)


def _unavailable(env_id: str, reason: str, **kwargs: Any) -> Any:
    raise ConfigError(
        f"env id {env_id!r} is registered in the process that started this worker, but {reason}; "
        f"register it with an entry point the workers can import or unpickle (a class or function "
        f"of a module, or one defined in __main__ without unpicklable state), or pass a function "
        f"that builds the env"
    )


def _stand_in(env_id: str, reason: str) -> EnvSpec:
    return EnvSpec(id=env_id, entry_point=functools.partial(_unavailable, env_id, reason))


def _same(a: EnvSpec | None, b: EnvSpec) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - kwargs whose == is not a bool (arrays): not known equal
        return False


_installed: set[str] = set()


def install(snap: Sequence[Packed]) -> None:
    """Worker side: register every spec of ``snap`` that this process lacks or holds differently.

    Idempotent. Specs go straight into ``gymnasium.registry`` (as ``gymnasium.register`` itself
    does, without rebuilding them). Once an id is installed, registering it again in this process
    (a plugin imported by the env's entry point, or an env factory that calls
    ``gymnasium.register`` itself) is silent: that is the user's own registration running again,
    not a conflict.
    """
    registry = registration.registry
    new: list[str] = []
    for p in snap:
        specs: list[EnvSpec]
        if p.blob is not None:
            try:
                loaded = pickle.loads(p.blob)
                specs = loaded if isinstance(loaded, list) else [loaded]
            except Exception as exc:  # noqa: BLE001 - only these ids are lost; said where made
                reason = f"its spec could not be unpickled in the worker ({type(exc).__name__}: {exc})"
                # a plain spec that this process has is gymnasium's own (or a plugin's): keep it
                specs = [_stand_in(i, reason) for i in p.ids if not (p.plain and i in registry)]
        else:
            specs = [_stand_in(i, p.error or "its spec could not be sent") for i in p.ids]
        for spec in specs:
            if not _same(registry.get(spec.id), spec):
                registry[spec.id] = spec
                if spec.id not in _installed:
                    _installed.add(spec.id)
                    new.append(spec.id)
    if new:
        ids = "|".join(re.escape(i) for i in new)
        # gymnasium's logger colours the text: match anywhere
        warnings.filterwarnings("ignore", message=rf".*Overriding environment (?:{ids}) already in registry")
