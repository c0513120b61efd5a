"""Resource counts for leak checks, shared by ``tests/test_leaks.py`` (the CI version),
``benchmarks/leaks.py`` (1,000 cycles) and ``benchmarks/soak.py`` (minutes at full speed).

Linux only (everything comes from /proc). What is counted, for a process:

* ``fds``: entries of ``/proc/<pid>/fd``;
* ``memfd_fds`` / ``memfd_maps``: those fds, and the lines of ``/proc/<pid>/maps``, that name a
  memfd or an aiocollect segment (``/memfd:aiocollect-<pid>-w0 (deleted)``): shared memory still
  held open or mapped;
* ``threads``: ``Threads`` of ``/proc/<pid>/status`` (every OS thread: Python's, torch's, the
  event loop's helpers) and, for this process only, ``threading.active_count()`` (Python's);
* ``rss_mb``: ``VmRSS`` of ``/proc/<pid>/status``;
* for this process, ``objects``: live objects of aiocollect's classes after a garbage collection;

and for the launcher (the template process aiocollect forks workers from), its live children:
workers that are still running, from ``/proc/<launcher>/task/*/children``.

Also here: the cycles the leak checks repeat, written as users write them (``async with``, a
notebook's separate calls, ``update_weights`` in the loop), and the policy they use. The policy
class lives in this module (not in a ``__main__``) so that workers import it by reference.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _util.py beside this file (tests import us as benchmarks._leaks)
from _util import ArgmaxMLP  # noqa: E402,F401 - (leaks.py, soak.py and tests/test_leaks.py take it from here)

_SHM_MARKERS = ("memfd:", "aiocollect")


# --------------------------------------------------------------------------------------------------
# counting


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process is gone (or not ours to read)
        return None


def _fd_links(pid: int | str) -> list[str] | None:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    links = []
    for name in names:
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:  # closed meanwhile (listdir's own directory fd is, by now)
            continue
    return links


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    stat = _read(f"/proc/{pid}/stat")
    return stat is not None and stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@dataclass(frozen=True)
class ProcessCounts:
    """Open fds, shared memory, threads and RSS of one process (see the module docstring)."""

    pid: int
    fds: int
    memfd_fds: int
    memfd_maps: int
    threads: int
    rss_mb: float

    @classmethod
    def of(cls, pid: int | None = None) -> "ProcessCounts | None":
        """The counts of process ``pid`` (default: this one); None if it is gone."""
        where: int | str = "self" if pid is None else pid
        links = _fd_links(where)
        maps = _read(f"/proc/{where}/maps")
        status = _read(f"/proc/{where}/status")
        if links is None or maps is None or status is None:
            return None
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        return cls(
            pid=os.getpid() if pid is None else pid,
            fds=len(links),
            memfd_fds=sum(any(m in link for m in _SHM_MARKERS) for link in links),
            memfd_maps=sum(any(m in line for m in _SHM_MARKERS) for line in maps.splitlines()),
            threads=int(fields["Threads"]),
            rss_mb=int(fields.get("VmRSS", "0 kB").split()[0]) / 1024,  # kernel threads have none
        )


def launcher_pid() -> int | None:
    """The pid of aiocollect's launcher, if it runs."""
    from aiocollect._backends.launcher import get_launcher

    return get_launcher().pid


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children = []
    for tid in tasks:
        text = _read(f"/proc/{pid}/task/{tid}/children") or ""
        children += [int(c) for c in text.split()]
    return [c for c in children if alive(c)]


def launcher_children() -> list[int]:
    """Live workers forked by aiocollect's launcher: the worker processes running now, of every
    collector of this process, from the light template and from its torch template (its child
    that leads a process group of its own, not counted itself); empty if the launcher does not run."""
    pid = launcher_pid()
    if pid is None:
        return []
    out = []
    for child in _children(pid):
        try:
            is_torch_template = os.getpgid(child) == child
        except OSError:  # (it ended meanwhile)
            continue
        out += _children(child) if is_torch_template else [child]
    return out


@dataclass(frozen=True)
class Snapshot:
    """What a leak check compares: this process's counts and the launcher's live children."""

    children: int  # live children of the launcher (running workers)
    fds: int
    memfd_fds: int
    memfd_maps: int
    threads: int  # OS threads (/proc/self/task)
    py_threads: int  # threading.active_count()
    rss_mb: float
    launcher_fds: int  # the launcher's own open fds (it receives one per worker it forks)
    objects: int = -1  # live objects of aiocollect's classes after a garbage collection (-1: not counted)

    #: the fields that must not grow at all
    EXACT = ("children", "fds", "memfd_fds", "memfd_maps", "threads", "py_threads", "launcher_fds", "objects")

    def growth(self, since: "Snapshot") -> dict[str, float]:
        """Field by field, this minus ``since``."""
        return {f.name: getattr(self, f.name) - getattr(since, f.name) for f in dataclasses.fields(self)}

    def problems(self, since: "Snapshot", rss_tolerance_mb: float) -> list[str]:
        """What grew since ``since``: any growth of a count, RSS beyond the tolerance. Empty: no leak."""
        grown = self.growth(since)
        found = [f"{name} {getattr(since, name)} -> {getattr(self, name)}" for name in self.EXACT
                 if grown[name] > 0 and (name != "objects" or since.objects >= 0)]
        if grown["rss_mb"] > rss_tolerance_mb:
            found.append(f"rss {since.rss_mb:.1f} MB -> {self.rss_mb:.1f} MB (+{grown['rss_mb']:.1f}, "
                         f"tolerance {rss_tolerance_mb:g} MB)")
        return found


def aiocollect_objects() -> int:
    """Live objects of aiocollect's classes (collectors, runs, worker handles ...) that the garbage
    collector tracks, after a collection: those still reachable. Slow-ish (a walk over every
    object): for checkpoints, not for every cycle."""
    gc.collect()
    count = 0
    for o in gc.get_objects():
        module = getattr(type(o), "__module__", None)  # (a class's own __module__ may be a descriptor)
        count += isinstance(module, str) and module.startswith("aiocollect")
    return count


def snapshot(objects: bool = False) -> Snapshot:
    """Counts of this process and of the launcher, as they are (no garbage collection: what a
    closed collector released must be released at once); with ``objects``, also the live
    aiocollect objects (after a garbage collection)."""
    me = ProcessCounts.of()
    assert me is not None
    lpid = launcher_pid()
    launcher = ProcessCounts.of(lpid) if lpid is not None else None
    return Snapshot(
        children=len(launcher_children()),
        fds=me.fds,
        memfd_fds=me.memfd_fds,
        memfd_maps=me.memfd_maps,
        threads=me.threads,
        py_threads=threading.active_count(),
        rss_mb=me.rss_mb,
        launcher_fds=launcher.fds if launcher is not None else 0,
        objects=aiocollect_objects() if objects else -1,
    )


async def settled_snapshot(baseline: Snapshot | None = None, timeout: float = 5.0) -> Snapshot:
    """A snapshot with the live aiocollect objects, once what is on its way out has gone:
    retaken (up to ``timeout`` seconds) while it shows more than ``baseline`` in a count. A leak
    stays."""
    snap = snapshot(objects=True)
    if baseline is None:
        return snap
    with anyio.move_on_after(timeout):
        while snap.problems(baseline, float("inf")):
            await anyio.sleep(0.05)
            snap = snapshot(objects=True)
    return snap


# --------------------------------------------------------------------------------------------------
# the cycles


ENV_ID = "CartPole-v1"


@dataclass
class CycleSettings:
    """The collector every cycle opens: real worker processes on CartPole, small batches."""

    num_workers: int = 2
    envs_per_worker: int = 2
    frames_per_batch: int = 64
    batches_until_cancelled: int = 1000  # a cancelled cycle collects until it is cancelled


def open_collector(policy: nn.Module, s: CycleSettings, seed: int) -> Any:
    from aiocollect import Collector

    return Collector(ENV_ID, policy, frames_per_batch=s.frames_per_batch, num_workers=s.num_workers,
                     envs_per_worker=s.envs_per_worker, seed=seed)


class Phases:
    """Where a cycle is: entering (``async with``, ``start()``), collecting (entered: waiting for
    batches, handling them), closing, done. For a cancelled cycle: where the cancellation hit."""

    ENTRY, COLLECTING, CLOSING, DONE = "entry", "collecting", "closing", "done"

    def __init__(self) -> None:
        self._now = self.ENTRY
        self._on: dict[str, Callable[[], None]] = {}

    @property
    def now(self) -> str:
        return self._now

    @now.setter
    def now(self, phase: str) -> None:
        self._now = phase
        fn = self._on.pop(phase, None)
        if fn is not None:
            fn()

    def on(self, phase: str, fn: Callable[[], None]) -> None:
        """Call ``fn()`` when the cycle reaches ``phase`` (now, if it is there)."""
        if phase == self._now:
            fn()
        else:
            self._on[phase] = fn


@dataclass(frozen=True)
class Cancel:
    """When and how a cycle is cancelled: ``delay`` seconds after it reaches phase ``after``
    (``"entry"``: its start; ``"collecting"``: the end of its entry; ``"closing"``: the start of
    its ``aclose()``, after one batch), by ``how``: ``"scope"``, an anyio cancel scope around it
    (what ``move_on_after`` does), or ``"task"``, ``task.cancel()`` of the asyncio task running it
    (what ``asyncio.wait_for`` or a server shutting down does)."""

    delay: float
    after: str = Phases.ENTRY
    how: str = "scope"


HOWS = ("scope", "task")
#: the phases a cancellation's delay may count from
TARGETS = (Phases.ENTRY, Phases.COLLECTING, Phases.CLOSING)


def random_cancel(rng: random.Random, longest: float = 0.3, targets: tuple[str, ...] = TARGETS) -> Cancel:
    """A cancellation ``0..longest`` seconds after one of ``targets`` (default: the start, the
    entry, the start of closing), by a scope or ``task.cancel()``. After the start of closing,
    which takes some tens of milliseconds, ``0..longest / 10``."""
    after = rng.choice(targets)
    delay = rng.uniform(0.0, longest / 10 if after == Phases.CLOSING else longest)
    return Cancel(delay, after, rng.choice(HOWS))


async def cancellable(body: Callable[[], Awaitable[None]], phase: Phases, cancel: Cancel | None) -> None:
    """Run ``body()``, cancelled as ``cancel`` says (never if None). On asyncio (uvloop included)
    the delay is a loop timer; on trio, where only ``how="scope"`` exists, a task's sleep."""
    if cancel is None:
        await body()
        return
    import sniffio

    if sniffio.current_async_library() != "asyncio":
        await _cancellable_in_task_group(body, phase, cancel)
        return
    import asyncio

    loop = asyncio.get_running_loop()
    timers: list[asyncio.TimerHandle] = []

    def arm(fire: Callable[[], Any]) -> None:
        phase.on(cancel.after, lambda: timers.append(loop.call_later(cancel.delay, fire)))

    try:
        if cancel.how == "scope":
            with anyio.CancelScope() as scope:
                arm(scope.cancel)
                await body()
        elif cancel.how == "task":
            task = asyncio.ensure_future(body())
            arm(task.cancel)
            await asyncio.wait({task})
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        else:  # pragma: no cover
            raise ValueError(f"how={cancel.how!r} must be one of {HOWS}")
    finally:
        for timer in timers:
            timer.cancel()


async def _cancellable_in_task_group(body: Callable[[], Awaitable[None]], phase: Phases, cancel: Cancel) -> None:
    if cancel.how != "scope":
        raise ValueError(f"how={cancel.how!r}: task.cancel() is asyncio's; on trio only 'scope' exists")
    async with anyio.create_task_group() as timers:
        with anyio.CancelScope() as scope:

            async def fire() -> None:
                await anyio.sleep(cancel.delay)
                scope.cancel()

            phase.on(cancel.after, lambda: timers.start_soon(fire))
            try:
                await body()
            finally:
                timers.cancel_scope.cancel()


async def cycle_with(policy: nn.Module, s: CycleSettings, seed: int, batches: int, phase: Phases,
                     cancel: Cancel | None) -> None:
    """``async with Collector(...) as c: async for batch in c: ...`` for ``batches`` batches."""

    async def body() -> None:
        async with open_collector(policy, s, seed) as c:
            phase.now = Phases.COLLECTING
            n = 0
            async for _batch in c:
                n += 1
                if n == batches:
                    break
            phase.now = Phases.CLOSING
        phase.now = Phases.DONE

    await cancellable(body, phase, cancel)


async def cycle_weights(policy: nn.Module, s: CycleSettings, seed: int, batches: int, phase: Phases,
                        cancel: Cancel | None) -> None:
    """A training loop: after each batch a step that changes the weights, then ``update_weights``."""

    async def body() -> None:
        async with open_collector(policy, s, seed) as c:
            phase.now = Phases.COLLECTING
            n = 0
            async for _batch in c:
                with torch.no_grad():
                    policy.net[0].bias.add_(0.01)
                await c.update_weights(policy)
                n += 1
                if n == batches:
                    break
            phase.now = Phases.CLOSING
        phase.now = Phases.DONE

    await cancellable(body, phase, cancel)


async def cycle_notebook(policy: nn.Module, s: CycleSettings, seed: int, batches: int, phase: Phases,
                         cancel: Cancel | None) -> None:
    """A notebook's cells: ``c = Collector(...)``; ``await c.start()`` and ``await c.collect()``;
    then ``await c.aclose()``. Whichever cell runs when the cancellation comes is interrupted
    (the closing cell is never run again: ``aclose()`` finishes even when cancelled)."""
    c = open_collector(policy, s, seed)

    async def cells() -> None:
        await c.start()
        phase.now = Phases.COLLECTING
        for _ in range(batches):
            await c.collect()

    async def closing_cell() -> None:
        phase.now = Phases.CLOSING
        await c.aclose()
        phase.now = Phases.DONE

    if cancel is not None and cancel.after == Phases.CLOSING:
        await cells()
        await cancellable(closing_cell, phase, cancel)
    else:
        await cancellable(cells, phase, cancel)
        if cancel is None:
            phase.now = Phases.DONE
        await c.aclose()


Cycle = Callable[[nn.Module, CycleSettings, int, int, Phases, "Cancel | None"], Awaitable[None]]
CYCLES: dict[str, Cycle] = {"with": cycle_with, "weights": cycle_weights, "notebook": cycle_notebook}


async def run_cycle(kind: str, policy: nn.Module, s: CycleSettings, seed: int, cancel: Cancel | None = None) -> str:
    """One cycle of ``kind`` (see :data:`CYCLES`): one batch; or, with a ``cancel`` before
    closing, batches until it is cancelled. Returns the phase it ended in: where the cancellation
    hit, or ``"done"`` (closing is shielded: a cancellation while closing lets it finish)."""
    phase = Phases()
    batches = 1 if cancel is None or cancel.after == Phases.CLOSING else s.batches_until_cancelled
    await CYCLES[kind](policy, s, seed, batches, phase, cancel)
    return phase.now
