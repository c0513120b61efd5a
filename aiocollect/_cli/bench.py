"""The side-by-side throughput comparison behind ``python -m aiocollect bench``.

For one gymnasium id, ``workers`` x ``envs_per_worker`` envs with random actions, four setups
are measured one after the other on this machine:

* **limit**: ``workers`` independent processes (multiprocessing "spawn"), each stepping
  ``envs_per_worker`` envs in a plain loop (``env.step(env.action_space.sample())``, reset at an
  episode's end), with no communication and no storage. It is what the machine can do with that
  many processes, and the reference of every ratio; it runs first and again last, and the mean
  of the two runs is used (their difference shows whether the machine's load changed).
* **gymnasium AsyncVectorEnv**: ``workers * envs_per_worker`` envs, one process per env
  (gymnasium's design), ``shared_memory=True``; the loop steps it with a batched random action,
  and the observations of each step are copied out of shared memory (``copy=True``), as a
  collector keeping them must.
* **aiocollect**, ``delivery="sync"`` and ``delivery="async"``: ``async for batch in
  collector`` (anyio, on uvloop where installed) with ``policy=None`` (random actions), counting
  ``batch.numel()`` frames.

Each setup has a warm-up (``warmup`` seconds, and for the batch-based ones at least two batches
or steps) and then a window of ``seconds``: fps = frames counted in the window / its duration.
``benchmarks/throughput.py`` (in the repository, not in the package) is the fuller benchmark for
CartPole with an MLP policy: CPU accounting, TorchRL, loop lag, time to the first batch.

Imported by the spawned limit processes: nothing heavy at import time (no torch).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

DEFAULT_STEPS_PER_BATCH = 128  # frames per batch: workers x envs_per_worker x this
SEED = 0


@dataclass(frozen=True)
class BenchConfig:
    """What ``python -m aiocollect bench`` measures (its options, one to one)."""

    env_id: str
    """A gymnasium id (``"CartPole-v1"``, ``"module:Id"``)."""
    workers: int = 2
    """Worker processes (the limit's processes; aiocollect's ``num_workers``)."""
    envs_per_worker: int = 8
    """Envs per process (aiocollect's ``envs_per_worker``); AsyncVectorEnv gets workers x this."""
    frames_per_batch: int = 0
    """aiocollect's ``frames_per_batch``; 0: 128 steps of every env."""
    seconds: float = 3.0
    """Measuring window of each setup."""
    warmup: float = 1.0
    """Warm-up before each window (batch-based setups also discard their first two batches)."""
    imports: tuple[str, ...] = ()
    """Modules to import first, in every process: packages that register envs on import."""

    @property
    def num_envs(self) -> int:
        return self.workers * self.envs_per_worker

    @property
    def batch_frames(self) -> int:
        return self.frames_per_batch or self.num_envs * DEFAULT_STEPS_PER_BATCH


@dataclass
class Row:
    """One measured setup: frames per second, or why there is no figure."""

    name: str
    fps: float | None = None
    frames: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass
class Stage:
    """One setup to measure: ``title`` for the progress display, ``run`` measures it."""

    key: str  # "limit", "async_vector", "aiocollect_sync", "aiocollect_async"
    name: str  # its row in the table
    title: str
    run: Callable[[], Row]


class Window:
    """Warm-up, then a measuring window of ``seconds``; fed with the frames of each batch (or
    vector step) as it arrives."""

    def __init__(self, seconds: float, warmup: float, warmup_batches: int = 2) -> None:
        self.seconds, self.warmup, self.warmup_batches = seconds, warmup, warmup_batches
        self.t_first: float | None = None
        self.t0: float | None = None
        self.t1: float | None = None
        self.batches = 0
        self.frames = 0

    def add(self, frames: int) -> bool:
        """Count one batch just received; True once the window is over."""
        now = time.perf_counter()
        if self.t0 is None:
            self.t_first = now if self.t_first is None else self.t_first
            self.batches += 1
            if self.batches >= self.warmup_batches and now - self.t_first >= self.warmup:
                self.t0 = now
            return False
        self.frames += frames
        if now - self.t0 >= self.seconds:
            self.t1 = now
            return True
        return False

    def row(self, name: str) -> Row:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError(f"{name}: the measuring window never closed")
        return Row(name, self.frames / (self.t1 - self.t0), self.frames, self.t1 - self.t0)


def _import_all(modules: tuple[str, ...]) -> None:
    for name in modules:
        importlib.import_module(name)


# -- the limit --------------------------------------------------------------------------------


def _limit_process(config: BenchConfig, rank: int, counter: Any, ready: Any, go: Any, stop: Any) -> None:
    """One of the limit's processes: step ``envs_per_worker`` envs with random actions until
    ``stop``, adding the frames stepped to ``counter`` (written by this process only)."""
    import gymnasium as gym

    _import_all(config.imports)
    envs = [gym.make(config.env_id) for _ in range(config.envs_per_worker)]
    try:
        for i, env in enumerate(envs):
            seed = SEED + rank * config.envs_per_worker + i
            env.reset(seed=seed)
            env.action_space.seed(seed)
        ready.set()
        go.wait()
        while not stop.is_set():
            for env in envs:
                _, _, terminated, truncated, _ = env.step(env.action_space.sample())
                if terminated or truncated:
                    env.reset()
            counter.value += len(envs)
    finally:
        for env in envs:
            env.close()


@contextlib.contextmanager
def _child_signals() -> Iterator[None]:
    """While starting processes: they ignore SIGINT (Ctrl-C is this process's to handle: it
    stops them) and die of SIGTERM."""
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)


def run_limit(config: BenchConfig) -> Row:
    """``workers`` independent processes started together; fps summed over them, in one common
    window after the warm-up."""
    name = limit_name(config)
    ctx = mp.get_context("spawn")
    counters = [ctx.RawValue("q", 0) for _ in range(config.workers)]
    readies = [ctx.Event() for _ in range(config.workers)]
    go, stop = ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=_limit_process, args=(config, rank, counters[rank], readies[rank], go, stop),
                    name=f"limit-{rank}", daemon=True)
        for rank in range(config.workers)
    ]  # fmt: skip
    try:
        with _child_signals():
            for proc in procs:
                proc.start()
        deadline = time.monotonic() + 120.0
        for proc, ready in zip(procs, readies):
            while not ready.wait(0.1):
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} before its envs were made")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{proc.name}: its envs were not made within 120 s")
        go.set()
        time.sleep(config.warmup)
        c0, t0 = sum(c.value for c in counters), time.perf_counter()
        time.sleep(config.seconds)
        c1, t1 = sum(c.value for c in counters), time.perf_counter()
        for proc in procs:
            if not proc.is_alive():
                raise RuntimeError(f"{proc.name} died during the measurement (exit code {proc.exitcode})")
    finally:
        stop.set()
        go.set()
        for proc in procs:
            if proc.pid is not None:
                proc.join(5.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return Row(name, (c1 - c0) / (t1 - t0), c1 - c0, t1 - t0)


# -- gymnasium's AsyncVectorEnv -----------------------------------------------------------------


def run_async_vector(config: BenchConfig) -> Row:
    """gymnasium's AsyncVectorEnv with shared memory, stepped with batched random actions."""
    import gymnasium as gym

    n = config.num_envs
    name = f"AsyncVectorEnv x{n} ({plural(n, 'proc')}, shm)"
    window = Window(config.seconds, config.warmup)
    with _child_signals():
        envs = gym.vector.AsyncVectorEnv([functools.partial(gym.make, config.env_id)] * n, shared_memory=True)
    clean = False
    try:
        envs.reset(seed=SEED)
        envs.action_space.seed(SEED)
        while not window.add(n):
            envs.step(envs.action_space.sample())
        clean = True
    finally:
        envs.close(terminate=not clean)
    return window.row(name)


# -- aiocollect ------------------------------------------------------------------------------------


async def _collect(config: BenchConfig, delivery: Literal["sync", "async"], window: Window) -> None:
    from .. import Collector

    async with Collector(
        config.env_id,
        None,
        frames_per_batch=config.batch_frames,
        total_frames=-1,
        num_workers=config.workers,
        envs_per_worker=config.envs_per_worker,
        delivery=delivery,
        seed=SEED,
    ) as collector:
        async for batch in collector:
            if window.add(batch.numel()):
                break


def run_aiocollect(config: BenchConfig, delivery: Literal["sync", "async"]) -> Row:
    """A collector with random actions, consumed by ``async for`` on uvloop (where installed)."""
    import anyio

    window = Window(config.seconds, config.warmup)
    try:
        import uvloop  # noqa: F401
    except ImportError:
        options = {}
    else:
        options = {"use_uvloop": True}
    anyio.run(_collect, config, delivery, window, backend_options=options)
    return window.row(f"aiocollect {delivery}")


# -- the whole comparison --------------------------------------------------------------------------


def plural(n: int, word: str, words: str = "") -> str:
    """``"1 env"``, ``"2 envs"`` (``words``: the plural where it is not ``word + "s"``)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def limit_name(config: BenchConfig) -> str:
    return f"limit ({plural(config.workers, 'proc')} x {plural(config.envs_per_worker, 'env')})"


def stages(config: BenchConfig) -> list[Stage]:
    """The setups in the order they run: the limit first and last."""
    n = config.num_envs
    vector = f"AsyncVectorEnv x{n} ({plural(n, 'proc')}, shm)"
    limit = (f"limit: {plural(config.workers, 'independent process', 'independent processes')} x "
             f"{plural(config.envs_per_worker, 'env')}")
    return [
        Stage("limit", limit_name(config), limit, functools.partial(run_limit, config)),
        Stage("async_vector", vector, f"gymnasium AsyncVectorEnv x{n} (shared memory, {plural(n, 'process', 'processes')})",
              functools.partial(run_async_vector, config)),
        Stage("aiocollect_sync", "aiocollect sync", 'aiocollect delivery="sync"',
              functools.partial(run_aiocollect, config, "sync")),
        Stage("aiocollect_async", "aiocollect async", 'aiocollect delivery="async"',
              functools.partial(run_aiocollect, config, "async")),
        Stage("limit", limit_name(config), f"{limit}, again (did the machine's load change?)",
              functools.partial(run_limit, config)),
    ]  # fmt: skip


def describe(exc: BaseException) -> str:
    """``Type: message`` of an error, exception groups unwrapped (anyio's task groups raise them)."""
    inner: tuple[BaseException, ...] = getattr(exc, "exceptions", ())
    while len(inner) == 1:
        exc = inner[0]
        inner = getattr(exc, "exceptions", ())
    return f"{type(exc).__name__}: {exc}"


def live_children() -> list[tuple[int, str]]:
    """(pid, command line) of this process's live children (Linux /proc; empty elsewhere)."""
    found = []
    me = str(os.getpid())
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):
            continue
        if ppid == me and state not in ("Z", "X"):
            found.append((int(entry), cmdline))
    return found


# Long-lived helpers that may stay between setups: multiprocessing's resource tracker and
# aiocollect's launcher (the template its workers fork from; stopped at the end).
KEEP = ("multiprocessing.resource_tracker", "aiocollect._backends.launcher")


def stop_leftovers() -> list[str]:
    """Children of this process still running after a setup (helpers in :data:`KEEP` aside),
    given a second to go, then killed; returns their descriptions."""
    deadline = time.monotonic() + 1.0
    left = [(pid, cmd) for pid, cmd in live_children() if not any(k in cmd for k in KEEP)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [(pid, cmd) for pid, cmd in live_children() if not any(k in cmd for k in KEEP)]
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for child in mp.active_children():  # reaps multiprocessing's children
        child.join(0)
    return [f"{pid} {cmd[:100]}" for pid, cmd in left]


def combine_limits(rows: list[Row]) -> Row:
    """The limit's row: the mean of its runs (at the start and at the end)."""
    ok = [r for r in rows if r.fps is not None]
    if not ok:
        return rows[0]
    fps = [r.fps for r in ok if r.fps is not None]
    return Row(ok[0].name, sum(fps) / len(fps), sum(r.frames for r in ok), sum(r.seconds for r in ok))


def machine() -> dict[str, Any]:
    """What the figures were measured on (versions read from the installed distributions)."""
    import platform

    from .. import __version__

    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "python": platform.python_version(),
        "torch": dist_version("torch"),
        "gymnasium": dist_version("gymnasium"),
        "aiocollect": __version__,
        "platform": platform.platform(),
    }


def machine_line(m: dict[str, Any]) -> str:
    usable = "" if m["usable_cores"] in (None, m["cores"]) else f", {m['usable_cores']} usable by this process"
    return (
        f"machine: {m['cores']} cores{usable}, Python {m['python']}, torch {m['torch']}, "
        f"gymnasium {m['gymnasium']}, aiocollect {m['aiocollect']}, {m['platform']}"
    )


def dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def shutdown_aiocollect() -> None:
    """Stop aiocollect's launcher, if a collector started it."""
    if "aiocollect._backends.launcher" in sys.modules:
        from .._backends.launcher import shutdown_launcher

        shutdown_launcher()
