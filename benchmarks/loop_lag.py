"""Where the event loop's lag comes from while collecting (``docs/inference.md``).

A probe task sleeps 1 ms again and again and records how late it wakes up. For each late wake-up
(more than 1 ms late) it also reads how long the loop's thread waited, runnable, for a core
meanwhile (``run_delay`` in ``/proc/self/task/<tid>/schedstat``): a late wake-up whose lateness
is that wait was the kernel's scheduler; one without it was the loop's own work or the GIL.

1. **In the collector's process** (the loop that collects): worker inference, the server at
   default options ("server"; ``server_priority="auto"``: on fewer CPUs than workers + 2, the
   server's thread under ``SCHED_IDLE`` and the workers kept off this process's first CPU), that
   with ``worker_groups=2``, the server thread at normal priority (the default before "auto"),
   under ``server_priority="idle"``, and that with the workers kept off this process's first CPU
   by hand (``worker_cpus``; where it may use two or more). ``--update-weights`` publishes the
   policy after each batch, as a training loop does; ``--policy-width N`` acts with a 4-N-N-2 MLP
   (CartPole), whose forward pass is long.
2. **In another process** (``--other-process``): the whole collector in a child process, in this
   process's session or in a session of its own, and only a bare event loop with the probe here:
   what a server process (instead of a thread) would leave to the user's loop.

Pong (``ALE/Pong-v5``, 84x84 grey, 4 frames, a Nature-CNN; needs ``pip install -e .[atari]``) or
``--env cartpole`` (CartPole-v1, the 4-64-2 MLP). No figure here is a test: run it on a quiet
machine, and compare setups of one run.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from _util import (ArgmaxMLP, WideArgmaxMLP, log, machine, machine_line, next_batch, percentiles_ms, reap,
                   sigterm_as_interrupt)

#: name: (inference, options (server_priority, worker_groups), the workers kept off this process's first CPU by hand)
SETUPS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "worker": ("worker", {}, False),
    "server": ("server", {}, False),  # the defaults
    "2 groups": ("server", {"worker_groups": 2}, False),
    "server, normal": ("server", {"server_priority": "normal"}, False),
    "server, idle": ("server", {"server_priority": "idle"}, False),
    "idle, pinned": ("server", {"server_priority": "idle"}, True),
}


def workload(args: argparse.Namespace) -> tuple[Any, torch.nn.Module, int]:
    """The env, the policy and the steps per env per batch."""
    if args.env == "pong":
        from inference import NatureCNN, make_pong

        return make_pong, NatureCNN(), 16
    if args.policy_width:
        return "CartPole-v1", WideArgmaxMLP(args.policy_width, hidden=2), 32
    return "CartPole-v1", ArgmaxMLP(), 32


class Probe:
    """Sleeps 1 ms in a loop; for each wake-up, how late it was and the loop thread's run-queue
    wait meanwhile (both in seconds)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.waits: list[float] = []
        self.running = True
        self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)

    def _run_delay(self) -> float:
        return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9

    async def run(self) -> None:
        import anyio

        try:
            while self.running:
                w0, t0 = self._run_delay(), time.perf_counter()
                await anyio.sleep(0.001)
                self.lags.append(time.perf_counter() - t0 - 0.001)
                self.waits.append(self._run_delay() - w0)
        finally:
            os.close(self._fd)

    def summary(self) -> dict[str, float]:
        """p50, p99 and max lag (ms); the share of wake-ups more than 1 ms late, their mean lag and
        their mean wait for a core (ms)."""
        lags, waits = np.asarray(self.lags) * 1e3, np.asarray(self.waits) * 1e3
        late = lags > 1.0
        return {**percentiles_ms(self.lags), "late_pct": float(late.mean() * 100),
                "late_lag": float(lags[late].mean()) if late.any() else 0.0,
                "late_wait": float(waits[late].mean()) if late.any() else 0.0}


class FellBack(logging.Handler):
    """Counts the ``server_priority="auto"`` server's going back to normal priority (it starved)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "normal priority from now on" in record.getMessage():
            self.count += 1


FELL_BACK = FellBack()


async def collect(args: argparse.Namespace, setup: str, seconds: float, probe: Probe | None,
                  ready: Any = None, stop: threading.Event | None = None) -> float:
    """Collect for ``seconds`` (or, given ``stop``, until it is set) after ``--warmup`` seconds of
    warm-up, the probe running meanwhile; frames/s."""
    import anyio

    from aiocollect import Collector

    env, policy, steps = workload(args)
    inference, options, pinned = SETUPS[setup]
    extra = dict(options)
    if pinned:
        extra["worker_cpus"] = sorted(os.sched_getaffinity(0))[1:]
    async with Collector(env, policy, frames_per_batch=args.workers * args.envs * steps, num_workers=args.workers,
                         envs_per_worker=args.envs, inference=inference, delivery=args.delivery, seed=0,
                         **extra) as c:
        it = aiter(c)
        t_end = time.perf_counter() + args.warmup
        while time.perf_counter() < t_end:
            if await next_batch(it, args.patience) is None:
                log(f"  {setup}: no batch within {args.patience:g} s (--patience): starved, counted as 0 frames/s")
                break
        if ready is not None:
            ready()
        frames = 0
        async with anyio.create_task_group() as tg:
            if probe is not None:
                tg.start_soon(probe.run)
            t0 = time.perf_counter()
            while (not stop.is_set()) if stop is not None else (time.perf_counter() - t0 < seconds):
                if (batch := await next_batch(it, args.patience)) is None:
                    break
                frames += batch.numel()
                if args.update_weights:  # (as the README's loop does after each training step)
                    await c.update_weights(policy)
            elapsed = time.perf_counter() - t0
            if probe is not None:
                probe.running = False
    return frames / elapsed


def run_loop(coro_fn: Any, *args: Any) -> Any:
    import anyio

    return anyio.run(coro_fn, *args, backend="asyncio", backend_options={"use_uvloop": True})


def in_process(args: argparse.Namespace) -> None:
    rows = []
    logger = logging.getLogger("aiocollect")
    logger.addHandler(FELL_BACK)
    logger.setLevel(logging.INFO)  # (the server's going back to normal priority is an INFO record)
    fell_back = []
    for setup in SETUPS:
        if SETUPS[setup][2] and len(os.sched_getaffinity(0)) < 2:
            continue  # (one CPU: nothing to keep for the loop)
        log(f"in the collector's process: {setup} ({args.seconds:g} s) ...")
        probe = Probe()
        before = FELL_BACK.count
        try:
            fps = run_loop(collect, args, setup, args.seconds, probe)
        finally:
            reap(setup)
        rows.append((setup, fps, probe.summary()))
        if FELL_BACK.count > before:
            fell_back.append(setup)
    from aiocollect._core.affinity import cpu_list, crowded, spare_one_cpu

    how = "its thread under SCHED_IDLE" if crowded(args.workers) else "its thread at normal priority"
    spare = spare_one_cpu(args.workers)
    log(f"\nThe loop that collects ({args.env}, {args.workers} workers x {args.envs} envs"
        + (f", a 4-{args.policy_width}-{args.policy_width}-2 MLP" if args.policy_width else "")
        + (f", {args.delivery} delivery" if args.delivery != "sync" else "")
        + (", update_weights after each batch)" if args.update_weights else ")"))
    log(f"(\"server\" and \"2 groups\": default options; here {how}"
        + (f", the workers on CPUs {cpu_list(spare)})" if spare else ")"))
    log(f"{'setup':<14} {'frames/s':>9}  {'loop lag p50 / p99 / max (ms)':>29}  {'late (>1 ms)':>12}  "
        f"{'their lag':>9}  {'of it waiting for a core':>24}")
    for setup, fps, s in rows:
        log(f"{setup:<14} {fps:>9,.0f}  {s['p50']:>10.2f} / {s['p99']:>5.2f} / {s['max']:>6.2f}  {s['late_pct']:>11.1f}%  "
            f"{s['late_lag']:>6.2f} ms  {s['late_wait']:>21.2f} ms")
    if fell_back:
        log(f"(the server's thread went back to normal priority, starved of CPU, in: {', '.join(fell_back)})")


def other_process(args: argparse.Namespace) -> None:
    rows = []
    for setup in ("worker", "server, idle"):
        for own_session in (False, True):
            where = "its own session" if own_session else "this session"
            log(f"collector in another process ({where}): {setup} ...")
            cmd = [sys.executable, os.path.abspath(__file__), "--child", setup, "--env", args.env,
                   "--workers", str(args.workers), "--envs", str(args.envs), "--warmup", str(args.warmup),
                   "--patience", str(args.patience), "--policy-width", str(args.policy_width),
                   "--delivery", args.delivery]
            cmd += ["--update-weights"] if args.update_weights else []
            # (it collects from its "ready" until this process's "stop", sent once the probe is done)
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    start_new_session=own_session)
            try:
                assert proc.stdout is not None
                while (line := proc.stdout.readline()).strip() != "ready":
                    if not line:
                        raise RuntimeError(f"the collector's process did not start ({setup})")
                    log(line.rstrip())  # (its progress: a setup that starved says so)
                probe = Probe()

                async def probe_for(seconds: float, probe: Probe = probe) -> None:
                    import anyio

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(probe.run)
                        await anyio.sleep(seconds)
                        probe.running = False

                run_loop(probe_for, args.seconds)
                fps = float(proc.communicate("stop\n", timeout=3 * args.patience + 60)[0].split()[-1])
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                reap(f"{setup} in another process")
            rows.append((setup, where, fps, probe.summary()))
    log(f"\nA bare event loop here, the collector in another process ({args.env}, {args.workers} workers x {args.envs} envs)")
    log(f"{'setup':<14} {'that process in':<16} {'frames/s':>9}  {'loop lag p50 / p99 / max (ms)':>29}  {'late (>1 ms)':>12}")
    for setup, where, fps, s in rows:
        log(f"{setup:<14} {where:<16} {fps:>9,.0f}  {s['p50']:>10.2f} / {s['p99']:>5.2f} / {s['max']:>6.2f}  "
            f"{s['late_pct']:>11.1f}%")


def child(args: argparse.Namespace) -> int:
    """The collector of ``--other-process``: it collects from its "ready" until the parent's "stop"
    on its standard input (or that input's end: the parent is gone)."""
    stop = threading.Event()

    def wait_for_the_parent() -> None:
        sys.stdin.readline()
        stop.set()

    threading.Thread(target=wait_for_the_parent, name="waits for the parent's stop", daemon=True).start()
    fps = run_loop(collect, args, args.child, 0.0, None, lambda: print("ready", flush=True), stop)
    print(f"{fps:.1f}", flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.child:
        return child(args)
    if args.env == "pong":
        from inference import pong_problem

        problem = pong_problem()
        if problem is not None:
            log(f"Pong: {problem}; use --env cartpole")
            return 2
    log(machine_line(machine()))
    in_process(args)
    if args.other_process:
        other_process(args)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", choices=("pong", "cartpole"), default="pong", help="default pong")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--envs", type=int, default=4, help="envs per worker (default 4)")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring window per setup (default 5)")
    p.add_argument("--warmup", type=float, default=1.0,
                   help="seconds of collecting before each setup's window, not measured (default 1)")
    p.add_argument("--patience", type=float, default=60.0,
                   help="the longest wait for one batch before a setup counts as starved (default 60 s)")
    p.add_argument("--delivery", choices=("sync", "async"), default="sync", help="default sync")
    p.add_argument("--update-weights", action="store_true",
                   help="publish the policy's weights after each batch (update_weights), as a training loop does")
    p.add_argument("--policy-width", type=int, default=0,
                   help="CartPole: a 4-N-N-2 MLP instead of the 4-64-2 one (a long forward pass; default: not)")
    p.add_argument("--other-process", action="store_true",
                   help="also: the collector in another process, a bare event loop here")
    p.add_argument("--child", choices=tuple(SETUPS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.policy_width and args.env != "cartpole":
        p.error("--policy-width sets CartPole's policy: add --env cartpole")
    return args


if __name__ == "__main__":
    with sigterm_as_interrupt():
        sys.exit(main(parse_args()))
