"""Leak benchmark: many open / collect / close cycles, some cancelled at random points; nothing
may accumulate.

After a few warm-up cycles (the first ones import modules and start the launcher), it runs
``--cycles`` cycles that each open a collector (CartPole-v1, a 4-64-2 MLP acting greedily,
2 workers x 2 envs, 64 frames per batch), collect one batch and close it, in turn written three
ways as users write them: ``async with ... async for`` (``with``), the same with
``update_weights`` after the batch (``weights``), and a notebook's separate ``await c.start()``
/ ``await c.collect()`` / ``await c.aclose()`` (``notebook``). Between them, at random places,
``--cancellations`` cycles of a random kind are cancelled 0 to ``--longest`` seconds (default
0.3) after their start or after their entry (they collect until cancelled), or 0 to a tenth of
that after they began closing (they collect one batch), by an anyio cancel scope around them or by ``task.cancel()`` of
the asyncio task running them: while they start (entering ``async with``, ``await c.start()``),
while they collect, or while they close (``--targets`` picks among these). A notebook cycle
interrupted before its closing cell still runs it.

Every ``--every`` cycles (default 100; cancelled ones count) it prints this process's open fds,
memfd fds and memfd mappings, OS and Python threads, the live objects of aiocollect's classes
(after a garbage collection), RSS, the live children of aiocollect's launcher (workers still
running) and the launcher's open fds (see ``benchmarks/_leaks.py``).
Verdict: a leak if any count rose above its value after the warm-up at a checkpoint, if any
warning was emitted (a ``ResourceWarning`` says a collector was left to its finalizer), or if RSS
grew by more than ``--rss-tolerance-mb`` (default 16 MB) from the first checkpoint to the last
(not from the warm-up: the allocator and torch's caches settle during the first hundred cycles).
It also counts the cycles that returned while something of theirs was still there (a process not
yet exited, an fd not yet closed), which should be none. Exit status 1 on a leak.

Run::

    .venv/bin/python benchmarks/leaks.py [--cycles 1000] [--cancellations 200] [--seed 0]

The default run takes about 3 minutes on an idle 2-core VM.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import warnings
from collections import Counter

import anyio
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _leaks.py beside this file
from _leaks import (  # noqa: E402
    CYCLES,
    ArgmaxMLP,
    Cancel,
    CycleSettings,
    Phases,
    TARGETS,
    Snapshot,
    random_cancel,
    run_cycle,
    settled_snapshot,
    snapshot,
)

KINDS = tuple(CYCLES)
_COLUMNS = ("cycles", "cancelled", "children", "fds", "memfd fds", "memfd maps", "threads", "py threads",
            "launcher fds", "objects", "RSS MB", "elapsed s")


def _row(cells: tuple[object, ...]) -> str:
    return "  ".join(f"{cell!s:>{len(head)}}" for cell, head in zip(cells, _COLUMNS, strict=True))


def _snap_row(done: int, cancelled: int, snap: Snapshot, elapsed: float) -> str:
    return _row((done, cancelled, snap.children, snap.fds, snap.memfd_fds, snap.memfd_maps, snap.threads,
                 snap.py_threads, snap.launcher_fds, snap.objects, f"{snap.rss_mb:.1f}", f"{elapsed:.0f}"))


async def main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    policy = ArgmaxMLP()
    settings = CycleSettings()
    rng = random.Random(args.seed)
    total = args.cycles + args.cancellations
    cancelled_at = set(rng.sample(range(total), args.cancellations))

    print(f"leak benchmark: {args.cycles} cycles + {args.cancellations} cancelled at random points "
          f"(0-{args.longest * 1e3:.0f} ms after: {', '.join(args.targets)}; closing: 0-{args.longest * 1e2:.0f} ms), {settings.num_workers} workers x "
          f"{settings.envs_per_worker} envs, CartPole-v1, seed {args.seed}, {args.loop}", flush=True)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        await run_cycle(KINDS[i % len(KINDS)], policy, settings, seed=i)
        await run_cycle(KINDS[i % len(KINDS)], policy, settings, seed=i,
                        cancel=random_cancel(rng, args.longest, (Phases.ENTRY, Phases.COLLECTING)))
    baseline = await settled_snapshot()
    print(f"warm-up: {2 * args.warmup} cycles in {time.perf_counter() - t0:.1f} s", flush=True)
    print(_row(_COLUMNS), flush=True)
    print(_snap_row(0, 0, baseline, 0.0), "  <- after warm-up", flush=True)

    phases: Counter[str] = Counter()
    ways: Counter[str] = Counter()
    after: Counter[str] = Counter()
    snaps: list[Snapshot] = []
    problems: list[str] = []
    unsettled: list[str] = []  # cycles that returned with something of theirs still there
    cancelled = 0
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a collector left to its finalizer warns (ResourceWarning)
        for step in range(total):
            kind = rng.choice(KINDS) if step in cancelled_at else KINDS[step % len(KINDS)]
            cancel: Cancel | None = None
            if step in cancelled_at:
                cancel = random_cancel(rng, args.longest, args.targets)
                cancelled += 1
            phase = await run_cycle(kind, policy, settings, seed=step, cancel=cancel)
            if cancel is not None:
                phases[phase] += 1
                ways[f"{kind}, {cancel.how}"] += 1
                after[cancel.after] += 1
            else:
                assert phase == Phases.DONE, phase
            now = snapshot()  # at once, as the cycle returns: closing must not leave anything for later
            if now.problems(baseline, float("inf")):
                unsettled.append(f"cycle {step + 1} ({kind}, {'cancelled in ' + phase if cancel else 'not cancelled'}): "
                                 + "; ".join(now.problems(baseline, float("inf"))))
            done = step + 1
            if done % args.every == 0 or done == total:
                snap = await settled_snapshot(baseline)
                snaps.append(snap)
                print(_snap_row(done, cancelled, snap, time.perf_counter() - t0), flush=True)
                problems += [f"after {done} cycles: {p}" for p in snap.problems(baseline, float("inf"))]
            elif done % 10 == 0 and sys.stdout.isatty():
                print(f"  ... {done}/{total}", end="\r", flush=True)
        gc.collect()  # a forgotten collector's finalizer runs now at the latest

    elapsed = time.perf_counter() - t0
    print(f"{total} cycles in {elapsed:.0f} s ({elapsed / total * 1e3:.0f} ms each)")
    print("cancellations timed from: " + ", ".join(f"{after[t]} {t}" for t in args.targets))
    print("cancellations hit: " + ", ".join(f"{phases[p]} {p}" for p in (Phases.ENTRY, Phases.COLLECTING))
          + "".join(f", {phases[p]} {p}" for p in (Phases.CLOSING, Phases.DONE) if phases[p])
          + "; by cycle and way: " + ", ".join(f"{k} {v}" for k, v in sorted(ways.items())))
    print(f"cycles that returned with something of theirs still there: {len(unsettled)}")
    for line in unsettled[:10]:
        print(f"  {line}")
    if len(unsettled) > 10:
        print(f"  ... and {len(unsettled) - 10} more")
    rss_growth = snaps[-1].rss_mb - snaps[0].rss_mb
    if rss_growth > args.rss_tolerance_mb:
        problems.append(f"RSS grew by {rss_growth:.1f} MB from the first checkpoint to the last "
                        f"(tolerance {args.rss_tolerance_mb:g} MB)")
    rss = (f"RSS {snaps[0].rss_mb:.1f} -> {snaps[-1].rss_mb:.1f} MB from the first checkpoint to the last "
           f"({rss_growth:+.1f} MB, tolerance {args.rss_tolerance_mb:g} MB; {snaps[-1].rss_mb - baseline.rss_mb:+.1f} "
           f"MB since the warm-up)")
    late = [f"warning: {w.category.__name__}: {w.message}" for w in caught]
    if unsettled:
        late.insert(0, f"{len(unsettled)} cycles returned (their aclose() ended) while their workers or shared "
                       f"memory were still there")
    if problems:
        print("VERDICT: LEAK\n  " + "\n  ".join(problems[:20] + late[:10]))
        return 1
    if late:
        print("VERDICT: NOT CLOSED ON RETURN: nothing accumulated (every count at every checkpoint at its value "
              f"after the warm-up; {rss}), but\n  " + "\n  ".join(late[:10]))
        return 1
    print("VERDICT: no leak. Launcher children, fds, memfd fds and mappings, threads, aiocollect objects and the "
          "launcher's fds never rose above their values after the warm-up, neither at a checkpoint nor at once "
          f"after a cycle; no warning (no collector was left to its finalizer); {rss}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=1000, help="open / collect one batch / close cycles (default 1000)")
    p.add_argument("--cancellations", type=int, default=200, help="cycles cancelled at random points (default 200)")
    p.add_argument("--longest", type=float, default=0.3, help="longest cancellation delay in seconds (default 0.3)")
    p.add_argument("--every", type=int, default=100, help="count every N cycles (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up rounds (a plain and a cancelled cycle each; default 5)")
    p.add_argument("--rss-tolerance-mb", type=float, default=16.0, help="allowed RSS growth (default 16 MB)")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help=f"phases a cancellation's delay counts from (default {','.join(TARGETS)}): entry (the "
                        f"cycle's start), collecting (the end of its entry), closing (the start of its aclose())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="event loop (default uvloop)")
    args = p.parse_args(argv)
    args.targets = tuple(args.targets.split(","))
    if not args.targets or set(args.targets) - set(TARGETS):
        p.error(f"--targets {','.join(args.targets)}: choose among {','.join(TARGETS)}")
    return args


if __name__ == "__main__":
    _args = parse_args()
    try:
        code = anyio.run(main, _args, backend_options={"use_uvloop": _args.loop == "uvloop"})
    except KeyboardInterrupt:
        code = 130
    finally:
        from aiocollect import shutdown_launcher

        shutdown_launcher()
    sys.exit(code)
