"""Bounds that no configuration can exceed on this machine, or ever: memory, processes, file
descriptors, seeds. Checked by the constructors, so that a size that can never work is refused
there (a :class:`ConfigError`), not after worker processes started, nor by the kernel's OOM
killer while they fill shared memory.

Every bound is a *lower* bound of what a setting needs, so that no configuration that could work
is refused. Imported by worker processes: standard library only.
"""

from __future__ import annotations

import numbers
import os
from typing import Any

from .errors import ConfigError

SEED_MAX = 2**64 - 1
"""The largest seed torch accepts (``torch.manual_seed``); gymnasium wants seeds >= 0."""

MIN_FRAME_NBYTES = 30
"""Bytes that every frame takes in a worker's batch slots at least, whatever the env and the
policy: ``("next", "reward")`` (float32), ``("next", "terminated")`` and ``("next", "truncated")``
(bool), ``("collector", "traj_ids")``, ``("collector", "policy_version")`` and ``("collector",
"env_epoch")`` (int64); the
observations and actions come on top."""

MIN_FDS_PER_WORKER = 2
"""File descriptors each worker holds open in the collector's process at least: its socket and
its shared-memory segment."""


def memory_nbytes() -> int | None:
    """RAM plus swap of this machine (``None``: unknown). A shared-memory segment larger than
    this can never be filled."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal") if k in fields) or None
    except (OSError, ValueError, KeyError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):  # pragma: no cover - not Linux
        return None


def max_worker_processes() -> tuple[int, str] | None:
    """``(limit, what)``: the most worker processes this process can have, and the limit that
    says so (``None``: no limit known)."""
    import resource

    limits: list[tuple[int, str]] = []
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            limits.append((int(f.read()), "kernel.pid_max (the most processes the kernel runs)"))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:  # root is not held to RLIMIT_NPROC
        limits.append((soft, "the limit on processes of this user (ulimit -u)"))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        limits.append((
            soft // MIN_FDS_PER_WORKER,
            f"the limit on open files (ulimit -n = {soft}; each worker holds {MIN_FDS_PER_WORKER} or more in "
            f"the collector's process)",
        ))
    return min(limits) if limits else None


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def check_fits_in_memory(nbytes: int, what: str, fix: str) -> None:
    """Raise :class:`ConfigError` if ``nbytes`` (a lower bound of what ``what`` needs) exceeds
    this machine's memory and swap."""
    total = memory_nbytes()
    if total is not None and nbytes > total:
        raise ConfigError(
            f"{what} needs at least {gib(nbytes)} of memory, more than this machine has ({gib(total)} of RAM "
            f"and swap); {fix}"
        )


def check_seed(seed: Any, name: str = "seed", *, offset: int = 0, optional: bool = True) -> None:
    """``seed`` is ``None`` (if ``optional``) or an int from 0 to ``SEED_MAX - offset`` (the
    largest seed derived from it is ``seed + offset``)."""
    if seed is None and optional:
        return
    high = SEED_MAX - offset
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= high:
        none = " or None" if optional else ""
        why = f" (seeds up to seed + {offset} are derived from it)" if offset else ""
        numpy_int = isinstance(seed, numbers.Integral) and not isinstance(seed, (bool, int))  # np.int64 ...
        fix = f"; pass {name}=int({name}) (a Python int, not {type(seed).__name__})" if numpy_int else ""
        raise ConfigError(
            f"{name}={seed!r} must be an int from 0 to {high}{none}{why}: gymnasium takes seeds >= 0 and "
            f"torch seeds < 2**64{fix}"
        )
