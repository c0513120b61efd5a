"""Importing tensordict without ``torch._dynamo``.

tensordict marks a few of its functions for torch.compile when it is imported
(``torch.compiler.allow_in_graph``, ``assume_constant_result``), and each of those calls imports
``torch._dynamo``: over a second, most of tensordict's import, paid by every collector's first
start although nothing is compiled. :func:`import_module` imports tensordict with those two calls
deferred: the functions are recorded (``assume_constant_result`` only sets an attribute, so it is
done at once) and handed to ``torch._dynamo.allow_in_graph`` right after ``torch._dynamo`` is
imported, by whoever imports it (``torch.compile``, ``compile_policy``, a user's code): the
compiler then sees exactly the marks tensordict made. Used by the collector's process and the
launcher; a process that imported ``torch._dynamo`` already imports tensordict as it is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from typing import Any

_lock = threading.Lock()
_pending: list[Any] = []  # functions whose allow_in_graph waits for torch._dynamo


def _mark_constant(fn: Any) -> Any:
    fn._dynamo_marked_constant = True  # what torch._dynamo's assume_constant_result does, all of it
    return fn


def _defer_allow_in_graph(fn: Any) -> Any:
    if isinstance(fn, (list, tuple)):
        return [_defer_allow_in_graph(f) for f in fn]
    if not callable(fn):
        raise AssertionError("allow_in_graph expects a callable")  # (as torch's)
    _pending.append(fn)
    _AfterDynamo.install()
    return fn


def _apply_pending() -> None:
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    while True:
        try:
            fn = _pending.pop(0)
        except IndexError:  # (another thread took the last one)
            return
        dynamo.allow_in_graph(fn)


class _ExecThenApply(importlib.abc.Loader):
    """``torch._dynamo``'s own loader, then the deferred marks."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _apply_pending()

    def __getattr__(self, name: str) -> Any:  # (resource readers and the like: the real loader's)
        return getattr(self._loader, name)


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``torch._dynamo`` when it is imported."""

    installed: "_AfterDynamo | None" = None

    @classmethod
    def install(cls) -> None:
        if cls.installed is None and "torch._dynamo" not in sys.modules:
            cls.installed = cls()
            sys.meta_path.insert(0, cls.installed)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:  # pragma: no cover - removed by another thread meanwhile
            pass
        type(self).installed = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ExecThenApply(spec.loader)
                return spec
        return None


def import_module(name: str) -> Any:
    """``importlib.import_module(name)``; tensordict (and its submodules) without importing
    ``torch._dynamo`` if this process has not imported it yet."""
    if name.partition(".")[0] != "tensordict" or "torch._dynamo" in sys.modules or name in sys.modules:
        return importlib.import_module(name)
    import torch.compiler

    with _lock:  # (one deferral at a time: the attributes are the process's)
        allow, constant = torch.compiler.allow_in_graph, torch.compiler.assume_constant_result
        torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = _defer_allow_in_graph, _mark_constant  # type: ignore[assignment]
        try:
            return importlib.import_module(name)
        finally:
            torch.compiler.allow_in_graph, torch.compiler.assume_constant_result = allow, constant  # type: ignore[assignment]
            _apply_pending()  # (torch._dynamo imported meanwhile by another way: now)


__all__ = ["import_module"]
