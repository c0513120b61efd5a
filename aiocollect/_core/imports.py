"""Which of torch and tensordict a worker will import to rebuild what the collector sends it,
besides its policy: the env factory of a module that imports torch (a training script's
``envs.py``, a test module) makes the worker import torch when it unpickles that factory, which
costs seconds of CPU per worker (``import torch`` again in each one). A worker that will import
them anyway is forked from the launcher's torch template instead, where they are imported once.

What a pickle makes its reader import is read from the pickle itself: the modules its globals
name (``GLOBAL``/``STACK_GLOBAL``; a function of a module, pickled by reference) and the module
names it holds as strings (cloudpickle's ``subimport("torch")`` for a module a function's body
uses). Of those this process has imported, a module whose namespace holds torch's or tensordict's
objects (its ``import torch``, ``from tensordict import TensorDict``), directly or through a module
it refers to (two levels down), is one whose import in the worker imports them too.
"""

from __future__ import annotations

import pickletools
import sys
import types
from typing import Any, Iterable

#: the top-level modules that a worker forked from the torch template has imported already
HEAVY = ("torch", "tensordict")
_DEPTH = 2  # how far from a module named by a pickle its references are followed
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                         "SHORT_BINSTRING"})
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def modules_named(payload: bytes) -> set[str]:
    """The names of modules ``payload`` (a pickle) imports when loaded, and any string it holds
    that names a module imported here."""
    found: set[str] = set()
    memo: dict[Any, Any] = {}
    pushed: list[Any] = [None, None]  # the last two values pushed (strings; None for anything else)
    for op, arg, _ in pickletools.genops(payload):
        name = op.name
        if name == "MEMOIZE":
            memo[len(memo)] = pushed[-1]
            continue
        if name in _PUT_OPS:
            memo[arg] = pushed[-1]
            continue
        if name == "GLOBAL":  # "module name"
            found.add(str(arg).partition(" ")[0])
        elif name == "STACK_GLOBAL" and isinstance(pushed[-2], str):
            found.add(pushed[-2])
        value = arg if name in _STRING_OPS else memo.get(arg) if name in _GET_OPS else None
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        pushed = [pushed[-1], value]
        if isinstance(value, str) and value in sys.modules:
            found.add(value)
    return found


def heavy_imports(modules: Iterable[str]) -> tuple[str, ...]:
    """Of :data:`HEAVY`, those that importing ``modules`` in a fresh process would import
    (as far as their namespaces here tell: a module not imported here counts for nothing)."""
    found: set[str] = set()
    seen: set[str] = set()
    level = [m for m in modules if m]
    for _ in range(_DEPTH + 1):
        following: list[str] = []
        for name in level:
            top = name.partition(".")[0]
            if top in HEAVY:
                found.add(top)
                continue
            if name in seen:
                continue
            seen.add(name)
            module = sys.modules.get(name)
            if isinstance(module, types.ModuleType) and not _builtin(module):
                following.extend(_referred(module))
        level = following
    return tuple(h for h in HEAVY if h in found)


def env_needs(env_fn: Any, env_kwargs: Any) -> tuple[str, ...]:
    """Of :data:`HEAVY`, those a worker imports to make its envs: what unpickling ``env_fn`` (a
    gymnasium id, a factory, or a list of them) and ``env_kwargs`` imports, and the modules of the
    ids' entry points."""
    from . import pickling, registry

    try:
        modules = modules_named(pickling.dumps((env_fn, env_kwargs)))
    except Exception:  # noqa: BLE001 - told, with its fix, when the workers' configs are pickled
        return ()
    for fn in env_fn if isinstance(env_fn, (list, tuple)) else (env_fn,):
        if isinstance(fn, str):
            modules.update(registry.entry_modules(fn))
    return heavy_imports(modules)


def _builtin(module: types.ModuleType) -> bool:
    """A module of the standard library (it imports no torch), or ``__main__`` (cloudpickle sends
    its functions by value: the worker does not import it)."""
    name = module.__name__.partition(".")[0]
    return name in sys.stdlib_module_names or name == "__main__"


def _referred(module: types.ModuleType) -> list[str]:
    """The modules whose objects ``module``'s namespace holds (imported modules, and the modules
    of its classes, functions and other values)."""
    names: list[str] = []
    try:
        values = list(vars(module).values())
    except Exception:  # noqa: BLE001 - a module object that is not one inside
        return names
    for value in values:
        try:
            if isinstance(value, types.ModuleType):
                owner = value.__name__
            elif isinstance(value, (type, types.FunctionType)):
                owner = value.__module__
            else:
                owner = type(value).__module__
        except Exception:  # noqa: BLE001 - an object that will not say: it names no module
            continue
        if isinstance(owner, str) and owner != module.__name__:
            names.append(owner)
    return names
