"""Which CPUs worker processes run on (``worker_cpus``): checked here, set in each worker.

Linux's CPU affinity (``sched_setaffinity``), set by the worker itself before it makes its envs,
so that every thread and process it starts afterwards (torch's pool, a vector env's
subprocesses) inherits it; a replacement worker gets the same CPUs.

Also what ``server_priority="auto"`` decides from (:func:`crowded`, :func:`spare_one_cpu`): a
machine with fewer CPUs than busy threads gets the server's thread under ``SCHED_IDLE`` and the
workers kept off one CPU, left to the collector's process.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

from .errors import ConfigError

Cpus = tuple[tuple[int, ...], ...]  # one sorted tuple of CPU numbers per worker


def cpu_list(cpus: Any) -> str:
    """``{0, 1, 2, 5}`` as ``"0-2,5"`` (the kernel's way of writing CPU lists)."""
    out: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def _cpu_set(value: Any, what: str, allowed: set[int]) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{what}={value!r} must be CPU numbers (a set, list or range of ints)")
    cpus = list(value)
    bad = [c for c in cpus if isinstance(c, bool) or not isinstance(c, numbers.Integral)]
    if bad:
        raise ConfigError(f"{what} holds {bad[0]!r}, which is not a CPU number (an int)")
    if not cpus:
        raise ConfigError(f"{what} is empty: a worker needs at least one CPU to run on")
    chosen = {int(c) for c in cpus}
    if chosen - allowed:
        raise ConfigError(
            f"{what} names CPU {cpu_list(chosen - allowed)}, which this process may not run on (it may use CPUs "
            f"{cpu_list(allowed)}: os.sched_getaffinity(0)); choose among those"
        )
    return tuple(sorted(chosen))


def normalize_cpus(value: Any, workers: int, argument: str = "worker_cpus") -> Cpus | None:
    """``value`` as one tuple of CPUs per worker (``None`` stays ``None``): a set of CPU numbers
    for every worker, or a list of one set per worker; :class:`ConfigError` naming what is wrong
    otherwise (not CPU numbers, an empty set, a CPU this process may not use, a list of the wrong
    length)."""
    if value is None:
        return None
    if not hasattr(os, "sched_setaffinity"):  # pragma: no cover - Linux has it
        raise ConfigError(f"{argument} needs Linux's CPU affinity (os.sched_setaffinity), which this platform lacks")
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(
            f"{argument}={value!r} must be a set of CPU numbers for every worker (e.g. range(1, 4)) or a list of "
            f"one set per worker (e.g. [[1], [2]])"
        )
    items = list(value)
    allowed = os.sched_getaffinity(0)
    nested = [hasattr(x, "__iter__") for x in items]
    if items and all(nested):
        if len(items) != workers:
            raise ConfigError(
                f"{argument}={value!r:.200} is a list of {len(items)} CPU sets but there are {workers} workers; "
                f"pass one set per worker, or a single set of CPU numbers for all"
            )
        return tuple(_cpu_set(x, f"{argument}[{i}]", allowed) for i, x in enumerate(items))
    if any(nested):
        raise ConfigError(
            f"{argument}={value!r:.200} mixes CPU numbers and sets of them; pass a set of CPU numbers for every "
            f"worker (e.g. range(1, 4)) or a list of one set per worker (e.g. [[1], [2]])"
        )
    shared = _cpu_set(items, argument, allowed)
    return (shared,) * workers


def normalize_cpu_set(value: Any, argument: str) -> tuple[int, ...] | None:
    """``value``, the CPUs of one worker process, as a sorted tuple (``None`` stays ``None``)."""
    if value is None:
        return None
    items = list(value) if not isinstance(value, (str, bytes)) and hasattr(value, "__iter__") else None
    if items is None or any(hasattr(x, "__iter__") for x in items):
        raise ConfigError(f"{argument}={value!r:.200} must be one set of CPU numbers (e.g. {{3}} or range(2, 4))")
    cpus = normalize_cpus(items, 1, argument)
    return None if cpus is None else cpus[0]


def _our_cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def crowded(workers: int) -> bool:
    """Fewer CPUs for this process than busy threads while serving: the ``workers``, the event
    loop's thread and the inference server's."""
    return len(_our_cpus()) < workers + 2


def cpu_each(workers: int, cpus: Cpus | None = None) -> bool:
    """Whether each of ``workers`` worker processes has a CPU of its own, and the collector's
    process one more: as many CPUs as that for this process, or ``worker_cpus`` (``cpus``) that
    give no two workers a CPU in common and leave one of this process's CPUs to none."""
    ours = _our_cpus()
    if cpus is not None:
        placed = set().union(*cpus)
        return sum(len(c) for c in cpus) == len(placed) and bool(ours - placed)
    return len(ours) >= workers + 1


def spare_one_cpu(workers: int) -> tuple[int, ...] | None:
    """The CPUs that keep ``workers`` worker processes off this process's first CPU, when it is
    :func:`crowded` and has two CPUs or more (``None`` otherwise: the kernel places them)."""
    if not hasattr(os, "sched_setaffinity"):  # pragma: no cover - Linux has it
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or not crowded(workers):
        return None
    return tuple(cpus[1:])


def apply_cpus(cpus: tuple[int, ...] | None, who: str) -> None:
    """In a worker: run this process (and what it starts later) on ``cpus`` only."""
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"{who} could not be placed on CPUs {cpu_list(cpus)} (worker_cpus): {exc.strerror}; this process may "
            f"use CPUs {cpu_list(os.sched_getaffinity(0))}",
        ) from exc


def batch_scheduling() -> bool:
    """In a worker that acts with its own policy: Linux's ``SCHED_BATCH`` for this process (and what
    it starts later), if it runs under the default policy. Its share of the CPU and its niceness are
    unchanged; what changes is that it no longer preempts the task running on a CPU when it wakes.
    A worker wakes when the collector writes it its next credit: without this, on a machine with
    fewer free CPUs than workers, each woken worker could take the CPU from the collector's loop
    while it was still writing to the others (a quarter to half a millisecond each on a 2-core VM),
    and the last worker of a ``delivery="sync"`` round started that much later. Server inference
    keeps the default: its workers wait on the server's answers within a batch. Best effort (False
    where the policy is not the default or cannot be set)."""
    batch = getattr(os, "SCHED_BATCH", None)
    try:
        if batch is None or os.sched_getscheduler(0) != os.SCHED_OTHER:
            return False
        os.sched_setscheduler(0, batch, os.sched_param(0))
    except OSError:  # pragma: no cover - a seccomp profile or an exotic kernel
        return False
    return True


__all__ = ["Cpus", "apply_cpus", "batch_scheduling", "cpu_each", "cpu_list", "crowded", "normalize_cpu_set",
           "normalize_cpus", "spare_one_cpu"]
