"""cloudpickle for what the collector sends to its workers (env factories, policies, configs),
keeping the user's file names and source lines.

cloudpickle rebuilds the functions and classes of a script's ``__main__`` (or a notebook cell)
by value in the worker; since version 3.1 it renames their code's file ``"<dynamic-code>"``,
so a worker's traceback would lose the user's file, and with it the source line. :func:`dumps`
keeps the file name, and sends the source lines that this process can read (the script, or a
notebook cell that IPython keeps in :mod:`linecache`), which the worker registers in its own
:mod:`linecache` where it cannot read that file itself (a notebook cell, another machine).
Where no source is known (``python -c``), the traceback still names the file and line.

Unpickled by plain ``cloudpickle.loads``; the worker's side needs only the standard library.
"""

from __future__ import annotations

import functools
import io
import linecache
import types
from typing import Any, Callable

#: the most source text sent for one file (a larger file travels without it)
_MAX_SOURCE_CHARS = 1 << 20

_DYNAMIC = "<dynamic-code>"


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, keeping the file names and source of the code it carries."""
    import cloudpickle

    buf = io.BytesIO()
    _pickler_class()(buf, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


@functools.cache
def _pickler_class() -> type:
    import collections

    import cloudpickle

    base = cloudpickle.Pickler
    table = getattr(base, "dispatch_table", None)
    reduce_code = table.get(types.CodeType) if table is not None else None
    if table is None or reduce_code is None:  # pragma: no cover - a cloudpickle that reduces code otherwise
        return base

    def reduce(code: types.CodeType) -> tuple:
        rebuild, args = reduce_code(code)
        filename = code.co_filename
        args = tuple(filename if type(a) is str and a == _DYNAMIC else a for a in args)
        lines = _source(filename)
        if not lines:
            return rebuild, args
        return _code_with_source, (rebuild, args, filename, lines)

    return type("Pickler", (base,), {"dispatch_table": collections.ChainMap({types.CodeType: reduce}, table)})


def _source(filename: str) -> list[str] | None:
    try:
        lines = linecache.getlines(filename)
    except Exception:  # noqa: BLE001 - no source: the traceback names the file and line only
        return None
    if not lines or sum(map(len, lines)) > _MAX_SOURCE_CHARS:
        return None
    return lines  # (linecache's own list: pickled once per payload, whatever the code objects)


def _code_with_source(rebuild: Callable[..., types.CodeType], args: tuple, filename: str, lines: list[str]) -> types.CodeType:
    """In the worker: the code object, its file's source registered where this process cannot
    read that file itself."""
    try:
        if not linecache.getlines(filename):
            linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
    except Exception:  # noqa: BLE001 - the source is a nicety; the code is what matters
        pass
    return rebuild(*args)


__all__ = ["dumps"]
