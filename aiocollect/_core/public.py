"""The public face: names that :mod:`aiocollect` exports show ``aiocollect`` as their module (as
anyio's do), so that their repr, ``help()`` and pickles stay the same wherever the private module
that defines them lives."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def public(obj: T) -> T:
    """Mark ``obj`` (a class or a function exported by :mod:`aiocollect`) as ``aiocollect.<name>``."""
    obj.__module__ = "aiocollect"
    return obj


__all__ = ["public"]
