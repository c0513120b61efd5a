"""Helpers of benchmarks/throughput.py: measuring windows, CPU accounting, process hygiene."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

_PR_SET_CHILD_SUBREAPER = 36
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Long-lived helper processes, by command line: multiprocessing's exit with the interpreter,
# aiocollect's launcher (the template its workers are forked from) is kept until shutdown_launcher().
# The leftover check walks through them to their children but, where told to keep them, does not
# count them.
MP_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
HELPERS = (*MP_HELPERS, "aiocollect._backends.launcher")
LOCKSTEP = "limit meeting at each batch"  # the row of :func:`lockstep_slices`


def limit_step(policy: nn.Module, envs: Sequence[Any], obs: list[Any]) -> None:
    """One step of the limit's loop (``throughput.py``, ``step_cost.py``): one batched forward of
    ``obs`` (under the caller's ``torch.no_grad``), then each env's step, reset where its episode
    ended; the observations go back into ``obs``."""
    actions = policy(torch.from_numpy(np.stack(obs))).tolist()
    for i, env in enumerate(envs):
        o, _, terminated, truncated, _ = env.step(actions[i])
        if terminated or truncated:
            o, _ = env.reset()
        obs[i] = o


class ArgmaxMLP(nn.Module):
    """The benchmarks' CartPole policy: a 4-64-2 MLP acting greedily (argmax of its logits),
    float32 observations [B, 4] -> int64 actions [B]. (Workers get it by reference: aiocollect's
    launcher gives them this process's sys.path, where this module is.)"""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)


class WideArgmaxMLP(nn.Module):
    """4 -> width -> ... -> width -> 2 (``hidden`` hidden layers, tanh between them), argmax: a
    CartPole policy with many weights and a long forward pass."""

    def __init__(self, width: int, hidden: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(4, width), nn.Tanh()]
        for _ in range(hidden - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        layers.append(nn.Linear(width, 2))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)


# --------------------------------------------------------------------------------------------------
# results and measurement helpers


@dataclass
class Result:
    """One measured setup."""

    name: str
    fps: float | None = None
    frames: int = 0
    seconds: float = 0.0
    startup_s: float | None = None  # section start -> first batch (batch-based setups)
    note: str = ""  # why there is no figure (skipped, failed, not installed)
    cpu: dict[str, float] = field(default_factory=dict)  # cores used in the window, see cpu_usage()
    extra: dict[str, Any] = field(default_factory=dict)


class Meter:
    """Warm-up then a fixed measuring window, fed with one call per batch received."""

    def __init__(self, seconds: float, warmup_s: float, warmup_batches: int = 2) -> None:
        self.seconds = seconds
        self.warmup_s = warmup_s
        self.warmup_batches = warmup_batches
        self.t_section = time.perf_counter()
        self.t_first: float | None = None
        self.t0: float | None = None  # start of the measuring window
        self.t1: float | None = None  # end of the measuring window
        self.warm_batches = 0
        self.frames = 0
        self.cpu0: CpuSnapshot | None = None
        self.cpu1: CpuSnapshot | None = None

    def add(self, frames: int) -> bool:
        """Account for one batch just received; True once the measuring window is over."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        if self.t0 is None:
            self.warm_batches += 1
            if self.warm_batches >= self.warmup_batches and now - self.t_first >= self.warmup_s:
                self.cpu0 = cpu_snapshot()
                self.t0 = now
            return False
        self.frames += frames
        if now - self.t0 >= self.seconds:
            self.t1 = now
            self.cpu1 = cpu_snapshot()
            return True
        return False

    def result(self, name: str) -> Result:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError(f"{name}: the measuring window never closed")
        elapsed = self.t1 - self.t0
        startup = None if self.t_first is None else self.t_first - self.t_section
        return Result(name, self.frames / elapsed, self.frames, elapsed, startup, cpu=cpu_usage(self.cpu0, self.cpu1))


async def next_batch(batches: Any, patience: float) -> Any:
    """The next batch of the collector ``batches``, or None when none came within ``patience``
    seconds: a setup that starves (the idle server thread on a machine whose cores are busy) ends
    with what it had instead of holding the benchmark forever. (``collect()`` may be cancelled and
    called again: nothing is lost.)"""
    import anyio

    with anyio.move_on_after(patience):
        return await anext(batches)
    return None


def percentiles_ms(samples: list[float], pcts: tuple[int, ...] = (50, 99), mean: bool = False) -> dict[str, float]:
    """The percentiles ``pcts``, max (and mean) of durations given in seconds, in ms, with the
    sample count ``n``."""
    if not samples:
        return {"n": 0}
    arr = np.asarray(samples) * 1e3
    out = {f"p{p}": float(np.percentile(arr, p)) for p in pcts}
    out["max"] = float(arr.max())
    if mean:
        out["mean"] = float(arr.mean())
    out["n"] = int(arr.size)
    return out


def machine() -> dict[str, Any]:
    """What the figures were measured on: core count, Python, torch, gymnasium, aiocollect (if
    imported by now: the throughput benchmark times its import later), platform."""
    import importlib
    import platform

    def version(name: str) -> str:
        module = sys.modules.get(name)
        return getattr(module, "__version__", "?") if module is not None else "not imported"

    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": importlib.import_module("torch").__version__,
        "gymnasium": importlib.import_module("gymnasium").__version__,
        "aiocollect": version("aiocollect"),
        "platform": platform.platform(),
    }


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"machine: {m['cpu_count']} cores (os.cpu_count()), Python {m['python']}, torch {m['torch']}, "
        f"gymnasium {m['gymnasium']}, aiocollect {m['aiocollect']}, {m['platform']}"
    )


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------------
# process hygiene: find (and stop) whatever a section left running


@dataclass
class _Proc:
    pid: int
    ppid: int
    session: int
    cpu_s: float  # user + system time so far
    cmdline: str


def _processes() -> dict[int, _Proc]:
    """All live (non-zombie) processes, from /proc (Linux); empty elsewhere."""
    procs: dict[int, _Proc] = {}
    if not os.path.isdir("/proc"):
        return procs
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # comm may contain spaces and parentheses
        if fields[0] in ("Z", "X"):
            continue
        cpu_s = (int(fields[11]) + int(fields[12])) / _CLK_TCK
        procs[int(entry)] = _Proc(int(entry), int(fields[1]), int(fields[3]), cpu_s, cmdline)
    return procs


def _children_map(procs: dict[int, _Proc]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    return children


@dataclass(frozen=True)
class CpuSnapshot:
    """Machine-wide busy CPU time and the CPU time of each process of this benchmark's tree."""

    t: float
    busy_s: float
    ours: dict[int, float]


def cpu_snapshot() -> CpuSnapshot | None:
    """None where /proc is not there."""
    try:
        with open("/proc/stat") as f:
            # cpu  user nice system idle iowait irq softirq steal ...
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    procs = _processes()
    children = _children_map(procs)
    ours: dict[int, float] = {}
    stack = [os.getpid()]
    while stack:
        pid = stack.pop()
        if pid in procs:
            ours[pid] = procs[pid].cpu_s
        stack.extend(children.get(pid, []))
    busy = (user + nice + system + irq + softirq + steal) / _CLK_TCK
    return CpuSnapshot(time.perf_counter(), busy, ours)


def cpu_usage(a: CpuSnapshot | None, b: CpuSnapshot | None) -> dict[str, float]:
    """Cores used between two snapshots: by this benchmark's processes ("ours"; "main": by this one
    alone) and by everything else on the machine, hypervisor steal included ("elsewhere"). Empty
    without /proc."""
    if a is None or b is None or b.t <= a.t:
        return {}
    ours = sum(cpu - a.ours.get(pid, 0.0) for pid, cpu in b.ours.items())  # new processes: all of it
    me = os.getpid()
    main = b.ours.get(me, 0.0) - a.ours.get(me, 0.0)
    wall = b.t - a.t
    return {"ours": ours / wall, "main": main / wall, "elsewhere": max(0.0, b.busy_s - a.busy_s - ours) / wall}


def become_subreaper() -> bool:
    """Have orphaned descendants (say, of a subprocess that exited) reparented to this process rather
    than to init, so that the leftover check still sees them. Linux only; True if it worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def descendants() -> list[_Proc]:
    """Live descendants of this process."""
    procs = _processes()
    children = _children_map(procs)
    found: list[_Proc] = []
    stack = list(children.get(os.getpid(), []))
    while stack:
        proc = procs[stack.pop()]
        found.append(proc)
        stack.extend(children.get(proc.pid, []))
    return found


def _leftovers(keep: tuple[str, ...], baseline: frozenset[int]) -> list[_Proc]:
    return [p for p in descendants() if p.pid not in baseline and not any(k in p.cmdline for k in keep)]


def reap(
    stage: str, *, keep: tuple[str, ...] = HELPERS, baseline: frozenset[int] = frozenset(), grace_s: float = 3.0
) -> list[str]:
    """Wait up to grace_s for a section's processes to go; terminate (then kill) those still there.

    Looks at this process's descendants, less the helpers in ``keep`` (but not their children) and
    the pids in ``baseline``. Returns their descriptions (empty when the section cleaned up after
    itself).
    """
    deadline = time.monotonic() + grace_s
    left = _leftovers(keep, baseline)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _leftovers(keep, baseline)
    if not left:
        return []
    described = [f"{p.pid} {p.cmdline[:100]}" for p in left]
    log(f"  WARNING: {len(left)} process(es) still running after {stage}; terminating them:")
    for d in described:
        log(f"    {d}")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, sig)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            alive = {q.pid for q in _leftovers(keep, baseline)}
            left = [p for p in left if p.pid in alive]
            if not left:
                break
            time.sleep(0.05)
        if not left:
            break
    for child in mp.active_children():  # reaps zombies of multiprocessing children
        child.join(0)
    return described


@contextlib.contextmanager
def child_signals() -> Iterator[None]:
    """While starting worker processes: SIGINT ignored, SIGTERM default.

    Forked and spawned children inherit that (a fork also inherits Python-level handlers), so Ctrl-C
    reaches only this process, which then stops them, and their SIGTERM just ends them.
    """
    previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous_int)
        signal.signal(signal.SIGTERM, previous_term)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Let SIGTERM unwind like Ctrl-C so every section's clean-up runs."""

    def handler(signum: int, frame: Any) -> None:
        log("SIGTERM received")
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------------------------------
# the limit: independent processes, no communication


class LimitPool:
    """The limit's processes (``with LimitPool(...) as limit``): ``workers`` "spawn" processes
    running ``target(*args_of(rank), counter, ready, go, stop)``, started and made ready on
    entry, then kept stopped (SIGSTOP) until :meth:`resume` (SIGCONT); :meth:`pause` stops them
    again. In a sliced comparison they take turns with the setup measured, a few seconds each,
    on the same cores. A drift of the
    machine's speed (this VM's moves by 10-50% within a minute) then hits both alike, where
    setups measured one after the other each see a different machine. Each process adds to a
    counter of its own (no lock that a stopped process could hold). ``on_stop`` is called once
    the processes are told to stop (say, to break a barrier they wait at)."""

    def __init__(self, target: Any, args_of: Any, workers: int, on_stop: Callable[[], Any] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._on_stop = on_stop
        self.counters = [ctx.RawValue("q", 0) for _ in range(workers)]
        self._readies = [ctx.Event() for _ in range(workers)]
        self._go, self._stop = ctx.Event(), ctx.Event()
        self.procs = [
            ctx.Process(target=target, args=(*args_of(rank), self.counters[rank], self._readies[rank], self._go,
                                              self._stop), name=f"limit-{rank}", daemon=True)
            for rank in range(workers)
        ]

    def __enter__(self) -> "LimitPool":
        try:
            with child_signals():
                for p in self.procs:
                    p.start()
            deadline = time.monotonic() + 120.0
            for p, ready in zip(self.procs, self._readies):
                while not ready.wait(0.1):
                    if not p.is_alive():
                        raise RuntimeError(f"{p.name} exited with code {p.exitcode} before it was ready")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{p.name} not ready after 120 s")
            self._go.set()  # (before they are stopped: setting it waits for the sleepers to wake)
            self.pause()
        except BaseException:
            self.__exit__()
            raise
        return self

    def frames(self) -> int:
        return sum(c.value for c in self.counters)

    def pause(self) -> None:
        signal_all([p.pid for p in self.procs], signal.SIGSTOP)

    def resume(self) -> None:
        for p in self.procs:
            if not p.is_alive():
                raise RuntimeError(f"{p.name} died (exit code {p.exitcode})")
        signal_all([p.pid for p in self.procs], signal.SIGCONT)

    def __exit__(self, *exc: Any) -> None:
        signal_all([p.pid for p in self.procs], signal.SIGCONT)  # (first: setting an event waits for them)
        self._stop.set()
        self._go.set()
        if self._on_stop is not None:
            self._on_stop()
        for p in self.procs:
            if p.pid is not None:
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()


def meet(barrier: Any) -> bool:
    """In a limit's process of :func:`lockstep_slices`: wait at ``barrier`` for the others; False
    once the pool is closing (it breaks the barrier)."""
    import threading

    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        return False
    return True


def lockstep_slices(limit: LimitPool, target: Any, args_of: Any, workers: int, turns: int, turn_s: float) -> Slices:
    """The limit's processes meeting at a barrier (``target(*args_of(rank, barrier), ...)`` calls
    :func:`meet` every so many steps), taking turns with the free-running ``limit``'s as a setup
    does: what waiting for one another at each batch costs, with no collector at all."""
    import anyio

    barrier = mp.get_context("spawn").Barrier(workers)
    with LimitPool(target, lambda rank: args_of(rank, barrier), workers, on_stop=barrier.abort) as lockstep:
        slices = anyio.run(alternate, limit, [p.pid for p in lockstep.procs], lockstep.frames, turns, turn_s)
    log(f"  -> {slices.fps('setup'):,.0f} frames/s against the limit's {slices.fps('limit'):,.0f}: "
        f"{slices.ratio():.2f}" + ("" if slices.per_core() is None else f" (per core {slices.per_core():.2f})"))
    return slices


def over_lockstep(out: dict[str, Any], lockstep: str, steps: int) -> None:
    """After :func:`report_slices`: say what the ``lockstep`` row is, and each ``aiocollect sync``
    row over it (ratio and per-core ratio, added to ``out`` as ``over_lockstep`` and
    ``per_core_over_lockstep``)."""
    meeting = out.get(lockstep)
    if meeting is None:  # (it failed: said so where it did)
        return
    log(f"{lockstep}: the limit's processes meeting every {steps} steps (each one's share of a batch), as sync "
        "delivery's\n  workers do at each batch, with no collector: what waiting for one another costs by itself")
    for name, r in out.items():
        if not name.startswith("aiocollect sync"):
            continue
        r["over_lockstep"] = r["ratio"] / meeting["ratio"]
        line = f"{name} over the {lockstep}: {r['over_lockstep']:.2f}"
        if r["per_core"] is not None and meeting["per_core"]:
            r["per_core_over_lockstep"] = r["per_core"] / meeting["per_core"]
            line += f" (per core {r['per_core_over_lockstep']:.2f})"
        log(line)


def signal_all(pids: Any, sig: int) -> None:
    for pid in pids:
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


@dataclass
class Slices:
    """Frames and seconds of each turn of a sliced comparison, the limit's and the setup's, and
    the CPU-seconds this benchmark's processes used in each (empty without /proc)."""

    limit: list[tuple[int, float]] = field(default_factory=list)
    setup: list[tuple[int, float]] = field(default_factory=list)
    limit_cpu: list[float] = field(default_factory=list)
    setup_cpu: list[float] = field(default_factory=list)

    def fps(self, which: str) -> float:
        turns = getattr(self, which)
        return sum(f for f, _ in turns) / sum(s for _, s in turns)

    def ratio(self) -> float:
        """Setup over limit, over all turns."""
        return self.fps("setup") / self.fps("limit")

    def per_core(self) -> float | None:
        """Frames per CPU-second of the setup (its workers and this process, the collector and its
        consumer) over the limit's, over all turns: what the setup's own work costs, whether or
        not it kept every core busy. ``None`` without CPU figures."""
        limit_cpu, setup_cpu = sum(self.limit_cpu), sum(self.setup_cpu)
        if limit_cpu <= 0 or setup_cpu <= 0:
            return None
        return (sum(f for f, _ in self.setup) / setup_cpu) / (sum(f for f, _ in self.limit) / limit_cpu)

    def pair_ratios(self) -> list[float]:
        return [(f / s) / (lf / ls) for (f, s), (lf, ls) in zip(self.setup, self.limit)]

    def limit_drift(self) -> float:
        """How much the limit's first and last thirds of turns differ (a fraction of the larger)."""
        n = max(len(self.limit) // 3, 1)
        first, last = self.limit[:n], self.limit[-n:]
        a = sum(f for f, _ in first) / sum(s for _, s in first)
        b = sum(f for f, _ in last) / sum(s for _, s in last)
        return abs(a - b) / max(a, b)


def report_slices(rows: Sequence[tuple[str, Slices, int | None, int | None]], width: int) -> dict[str, Any]:
    """Print one line per setup of a sliced comparison, ``(name, slices, batches copied, batches
    delivered)`` (``None`` for a setup without batches), under a header; returns the figures by
    name."""
    head = ("limit f/s", "setup f/s", "ratio", "per-core", "turn ratios min / median / max", "limit drift",
            "copied batches")
    log(f"{'setup':<{width}}" + "".join(f"  {h}" for h in head))
    out = {}
    for name, slices, copied, batches in rows:
        pairs = sorted(slices.pair_ratios())
        per_core = slices.per_core()
        cells = (f"{slices.fps('limit'):,.0f}", f"{slices.fps('setup'):,.0f}", f"{slices.ratio():.2f}",
                 "n/a" if per_core is None else f"{per_core:.2f}",
                 f"{pairs[0]:.2f} / {pairs[len(pairs) // 2]:.2f} / {pairs[-1]:.2f}", f"{slices.limit_drift():.0%}",
                 "-" if batches is None else f"{copied} of {batches}")
        log(f"{name:<{width}}" + "".join(f"  {c:>{len(h)}}" for c, h in zip(cells, head)))
        out[name] = {"limit_fps": slices.fps("limit"), "fps": slices.fps("setup"), "ratio": slices.ratio(),
                     "per_core": per_core, "turn_ratios": pairs, "limit_drift": slices.limit_drift(),
                     "batches_copied": copied, "batches": batches}
    log("ratio: frames/s over the limit's in the turns; per-core: frames per CPU-second (workers and the "
        "collector's\n  process) over the limit's; limit drift: how much the limit's first and last thirds "
        "of turns differ")
    return out


def _tree_cpu() -> float | None:
    """CPU-seconds used so far by this process and its descendants alive now (None without /proc)."""
    snap = cpu_snapshot()
    return None if snap is None else sum(snap.ours.values())


async def alternate(limit: LimitPool, setup_pids: Any, delivered: Any, turns: int, turn_s: float) -> Slices:
    """Take turns: the limit runs while the setup's processes are stopped, then the setup while the
    limit's are, ``turns`` times each, ``turn_s`` seconds per turn. ``delivered()`` counts the
    frames the setup has delivered so far; its frames are those delivered from the start of its
    first turn to the end of its last (what is in flight at a turn's end is delivered in the next
    one, so its turns are summed, not taken one by one: the count is off by at most the batches
    in flight, once). The CPU time of this process tree is read between turns, while both sides
    are stopped: what it used in a turn is that side's (this process's, mostly asleep in the
    limit's turns, included)."""
    import anyio

    out = Slices()
    signal_all(setup_pids, signal.SIGSTOP)
    counts: list[int] = []  # delivered at the start of each of the setup's turns, and at the end
    seconds: list[float] = []
    try:
        for _ in range(turns):
            c0 = _tree_cpu()
            f0, t0 = limit.frames(), time.perf_counter()
            limit.resume()
            await anyio.sleep(turn_s)
            limit.pause()
            out.limit.append((limit.frames() - f0, time.perf_counter() - t0))
            c1 = _tree_cpu()
            counts.append(delivered())
            t0 = time.perf_counter()
            signal_all(setup_pids, signal.SIGCONT)
            await anyio.sleep(turn_s)
            signal_all(setup_pids, signal.SIGSTOP)
            seconds.append(time.perf_counter() - t0)
            c2 = _tree_cpu()
            if c0 is not None and c1 is not None and c2 is not None:
                out.limit_cpu.append(c1 - c0)
                out.setup_cpu.append(c2 - c1)
        await anyio.sleep(0.3)  # batches completed in the last turn reach the consumer
        counts.append(delivered())
    finally:
        signal_all(setup_pids, signal.SIGCONT)
    out.setup = [(b - a, s) for a, b, s in zip(counts, counts[1:], seconds)]
    return out


async def collect_taking_turns(collector: Any, limit: LimitPool, warmup: float, turns: int,
                               turn_s: float) -> tuple[Slices, int, int]:
    """Consume the open ``collector`` (``async for``, each batch dropped when the next one comes,
    as a training loop does) while it takes turns with ``limit`` (:func:`alternate`), after its
    first batch and ``warmup`` seconds alone. Returns the turns, the batches the collector
    copied and the batches it delivered."""
    import anyio

    delivered = 0

    async def consume() -> None:
        nonlocal delivered
        async for batch in collector:
            delivered += batch.numel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        while delivered == 0:
            await anyio.sleep(0.05)
        await anyio.sleep(warmup)  # the setup alone; the limit's processes are stopped
        slices = await alternate(limit, collector.worker_pids, lambda: delivered, turns, turn_s)
        stats = collector.stats()
        tg.cancel_scope.cancel()
    return slices, stats.batches_copied, stats.batches


def run_limit_processes(
    target: Any, args_of: Any, workers: int, warmup_s: float, seconds: float, name: str
) -> Result:
    """Start ``workers`` "spawn" processes running ``target(*args_of(rank), counter, ready, go,
    stop)`` (a :class:`LimitPool`): each sets ``ready`` once its envs are made, waits for ``go``,
    then steps until ``stop``, adding the frames it steps to ``counter`` (a RawValue). fps is the
    sum over the processes in one common window after ``warmup_s``; CPU use is read over the same
    window."""
    with LimitPool(target, args_of, workers) as limit:
        limit.resume()
        time.sleep(warmup_s)
        cpu0 = cpu_snapshot()
        c0, t0 = [c.value for c in limit.counters], time.perf_counter()
        time.sleep(seconds)
        c1, t1 = [c.value for c in limit.counters], time.perf_counter()
        cpu1 = cpu_snapshot()
        for p in limit.procs:
            if not p.is_alive():
                raise RuntimeError(f"{p.name} died during the measurement (exit code {p.exitcode})")
    frames = sum(c1) - sum(c0)
    per_proc = [(b - a) / (t1 - t0) for a, b in zip(c0, c1)]
    return Result(name, frames / (t1 - t0), frames, t1 - t0, cpu=cpu_usage(cpu0, cpu1),
                  extra={"fps_per_process": per_proc})
