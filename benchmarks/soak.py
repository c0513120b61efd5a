"""Soak benchmark: collect at full speed for minutes and watch memory, fds and threads for trends.

One collector (CartPole-v1, a 4-64-2 MLP acting greedily, ``--workers`` 2 x ``--envs-per-worker``
8 envs, 2048 frames per batch, ``total_frames=-1``) is consumed with ``async for`` for
``--minutes`` (default 10); every ``--update-every`` batches (default 4) a stand-in for a trainer
nudges the policy's weights and calls ``await collector.update_weights(policy)``, as a training
loop does. Every ``--every`` seconds (default 15) it samples, for the collector's process and for
each worker (``collector.worker_pids``), the RSS (``VmRSS`` of ``/proc/<pid>/status``), the open
fds (``/proc/<pid>/fd``) and the OS threads, and prints a row (the progress); frames per second
over the interval and the weight version go with it.

At the end, a summary per series: first, last, min, max and the trend, the slope per minute of a
least-squares line through the samples after the first minute (start-up and warm-up excluded);
with ``--plot out.png``, a PNG of the trends (needs matplotlib: ``pip install aiocollect[plots]``).
A worker replaced during the run (it should not be) is reported, and its series restarts.

Run::

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--every 15] [--plot soak.png]

Ctrl-C ends the run early, with the summary of what was sampled.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field

import anyio
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _util.py and _leaks.py beside this file
from _leaks import ENV_ID, ArgmaxMLP, ProcessCounts  # noqa: E402
from _util import log, machine, machine_line, sigterm_as_interrupt  # noqa: E402

SERIES = ("rss_mb", "fds", "threads")
_UNITS = {"rss_mb": "MB", "fds": "fds", "threads": "threads"}


@dataclass
class Sample:
    t: float  # seconds since the first batch
    fps: float  # frames per second since the previous sample
    version: int  # weight version published by then
    procs: dict[str, ProcessCounts]  # "collector", "worker 0", ...


@dataclass
class Soak:
    samples: list[Sample] = field(default_factory=list)
    frames: int = 0
    batches: int = 0
    notes: list[str] = field(default_factory=list)


def _header(names: list[str]) -> str:
    top = f"{'':>6} {'':>9} {'':>7}" + "".join(f" | {name:^24}" for name in names)
    sub = f"{'t min':>6} {'frames/s':>9} {'version':>7}" + " | {:>8} {:>6} {:>8}".format("RSS MB", "fds", "threads") * len(names)
    return f"{top}\n{sub}"


def _row(s: Sample, names: list[str]) -> str:
    cells = ""
    for name in names:
        p = s.procs.get(name)
        cells += " | " + (f"{p.rss_mb:>8.1f} {p.fds:>6} {p.threads:>8}" if p else f"{'gone':>24}")
    return f"{s.t / 60:>6.2f} {s.fps:>9,.0f} {s.version:>7}" + cells


def _slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mt) * (v - mv) for t, v in points) / var * 60


def series(soak: Soak, name: str, key: str) -> list[tuple[float, float]]:
    return [(s.t, float(getattr(s.procs[name], key))) for s in soak.samples if name in s.procs]


def summary(soak: Soak, names: list[str], skip_s: float) -> None:
    if not soak.samples:
        log("no sample taken")
        return
    elapsed = soak.samples[-1].t
    log("")
    log(f"{soak.frames:,} frames in {soak.batches:,} batches over {elapsed / 60:.1f} min "
        f"({soak.frames / max(elapsed, 1e-9):,.0f} frames/s); weight version {soak.samples[-1].version} at the end")
    log(f"trend: least-squares slope per minute over the samples after {skip_s / 60:g} min")
    log(f"{'process':<10} {'series':<8} {'first':>9} {'last':>9} {'min':>9} {'max':>9} {'slope/min':>10}")
    for name in names:
        for key in SERIES:
            pts = series(soak, name, key)
            if not pts:
                continue
            vals = [v for _, v in pts]
            slope = _slope_per_min([(t, v) for t, v in pts if t >= skip_s])
            fmt = "{:>9.1f}" if key == "rss_mb" else "{:>9.0f}"
            cells = " ".join(fmt.format(v) for v in (vals[0], vals[-1], min(vals), max(vals)))
            trend = "-" if slope is None else f"{slope:+.3f}"
            log(f"{name:<10} {key.replace('_mb', ''):<8} {cells} {trend:>10}  {_UNITS[key]}")
    for note in soak.notes:
        log(f"note: {note}")


def plot(soak: Soak, names: list[str], path: str, title: str, skip_s: float) -> None:
    """Four panels over time: RSS change since the first sample (each process's own start in the
    legend, with its trend), open fds, OS threads, and frames per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]  # workers overlap: tell them apart
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True, height_ratios=(3, 2, 2, 1.5))
    for ax, key in zip(axes, SERIES, strict=False):
        for k, name in enumerate(names):
            pts = series(soak, name, key)
            if not pts:
                continue
            first = pts[0][1]
            slope = _slope_per_min([(t, v) for t, v in pts if t >= skip_s])
            trend = "" if slope is None else f", {slope:+.2f}/min"
            if key == "rss_mb":
                values, label = [v - first for _, v in pts], f"{name} (from {first:.0f} MB{trend})"
            else:
                values, label = [v for _, v in pts], f"{name}{trend}"
            line, marker = styles[k % len(styles)]
            ax.plot([t / 60 for t, _ in pts], values, linestyle=line, marker=marker, markersize=4, label=label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", fontsize=8, ncols=min(len(names), 3))
    axes[0].set_ylabel("RSS change (MB)")
    lo, hi = axes[0].get_ylim()
    axes[0].set_ylim(min(lo, -5), max(hi, 5) * 1.4)  # a few MB of noise must not look like a slope
    for ax, label in ((axes[1], "open fds"), (axes[2], "OS threads")):
        ax.set_ylabel(label)
        ax.set_ylim(0, max(ax.get_ylim()[1], 1) * 1.4)  # small integers: no zoom into a flat line
    fps = [(s.t / 60, s.fps) for s in soak.samples[1:]]
    axes[3].plot([t for t, _ in fps], [v / 1e3 for _, v in fps], color="gray", marker=".")
    axes[3].set_ylabel("k frames/s")
    axes[3].set_ylim(bottom=0)
    axes[3].grid(True, alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"plot written to {path}")


def _names(workers: int) -> list[str]:
    return ["collector", *(f"worker {i}" for i in range(workers))]


async def soak_run(args: argparse.Namespace, soak: Soak) -> None:
    from aiocollect import Collector

    torch.manual_seed(0)
    torch.set_num_threads(1)
    policy = ArgmaxMLP()
    names = _names(args.workers)
    pids: dict[str, int] = {}
    deadline = args.minutes * 60

    async with Collector(ENV_ID, policy, frames_per_batch=args.frames_per_batch, total_frames=-1,
                         num_workers=args.workers, envs_per_worker=args.envs_per_worker, seed=0) as collector:
        t0 = time.perf_counter()
        last = (0.0, 0)

        def sample() -> None:
            nonlocal last
            now = time.perf_counter() - t0
            procs: dict[str, ProcessCounts] = {}
            me = ProcessCounts.of()
            if me is not None:
                procs["collector"] = me
            for i, pid in enumerate(collector.worker_pids):
                name = f"worker {i}"
                if pids.setdefault(name, pid) != pid:
                    soak.notes.append(f"{name} was replaced at {now / 60:.2f} min (pid {pids[name]} -> {pid})")
                    pids[name] = pid
                counts = ProcessCounts.of(pid)
                if counts is not None:
                    procs[name] = counts
            fps = (soak.frames - last[1]) / (now - last[0]) if now > last[0] else 0.0
            last = (now, soak.frames)
            s = Sample(now, fps, collector.policy_version, procs)
            soak.samples.append(s)
            log(_row(s, names))

        async def sampler() -> None:
            k = 0
            while True:
                sample()
                k += 1
                await anyio.sleep(max(0.0, t0 + k * args.every - time.perf_counter()))

        log(_header(names))
        async with anyio.create_task_group() as tg:
            tg.start_soon(sampler)
            async for batch in collector:
                soak.frames += batch.numel()
                soak.batches += 1
                if soak.batches % args.update_every == 0:
                    with torch.no_grad():  # a stand-in for an optimiser step
                        for p in policy.parameters():
                            p.add_(torch.randn_like(p), alpha=1e-3)
                    await collector.update_weights(policy)
                if time.perf_counter() - t0 >= deadline:
                    break
            if time.perf_counter() - t0 - soak.samples[-1].t > 1.0:
                sample()  # the end
            tg.cancel_scope.cancel()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long to collect (default 10)")
    p.add_argument("--every", type=float, default=15.0, help="seconds between samples (default 15)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--envs-per-worker", type=int, default=8, help="envs per worker (default 8)")
    p.add_argument("--frames-per-batch", type=int, default=2048, help="frames per batch (default 2048)")
    p.add_argument("--update-every", type=int, default=4, help="update_weights every N batches (default 4)")
    p.add_argument("--plot", metavar="PNG", help="write a plot of the trends to this PNG file (needs matplotlib)")
    args = p.parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib, which is not installed: pip install 'aiocollect[plots]' "
                "(or pip install matplotlib)")
    if args.frames_per_batch % (args.workers * args.envs_per_worker):
        p.error("--frames-per-batch must be a multiple of workers x envs-per-worker")
    return args


def main(args: argparse.Namespace) -> int:
    log(f"soak benchmark: {ENV_ID}, ArgmaxMLP 4-64-2, {args.workers} workers x {args.envs_per_worker} envs, "
        f"{args.frames_per_batch} frames/batch, update_weights every {args.update_every} batches, "
        f"{args.minutes:g} min, a sample every {args.every:g} s")
    import aiocollect  # noqa: F401 - (for its version in the machine line)

    log(machine_line(machine()))
    soak = Soak()
    names = _names(args.workers)
    code = 0
    with sigterm_as_interrupt():
        try:
            anyio.run(soak_run, args, soak, backend_options={"use_uvloop": True})
        except KeyboardInterrupt:
            log("interrupted: the summary covers what was sampled")
            code = 130
        finally:
            from aiocollect import shutdown_launcher

            shutdown_launcher()
    skip_s = 60.0 if soak.samples and soak.samples[-1].t > 120 else 0.0  # start-up, unless the run is short
    summary(soak, names, skip_s)
    if args.plot and soak.samples:
        title = (f"aiocollect soak: {ENV_ID}, {args.workers} workers x {args.envs_per_worker} envs, "
                 f"{soak.frames / max(soak.samples[-1].t, 1e-9):,.0f} frames/s, "
                 f"update_weights every {args.update_every} batches")
        plot(soak, names, args.plot, title, skip_s)
    return code


if __name__ == "__main__":
    sys.exit(main(parse_args()))
