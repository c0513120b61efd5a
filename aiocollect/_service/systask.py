"""A background task owned by an object rather than by the caller's task: a collector started in
one notebook cell and closed in another must not tie its task group to either cell's task."""

from __future__ import annotations

import asyncio
import sys
from typing import Any, Awaitable, Callable


def spawn_system_task(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``fn()`` in the current event loop, outside any caller's cancel scope.

    ``fn`` must not raise (it reports through its owner); returns a handle to keep alive.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:
        return loop.create_task(fn())  # type: ignore[arg-type]
    trio = sys.modules.get("trio")
    if trio is not None:  # pragma: no cover - trio is optional
        return trio.lowlevel.spawn_system_task(fn)
    raise RuntimeError("aiocollect needs a running asyncio (or uvloop, or trio) event loop")
