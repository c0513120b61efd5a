"""How fast failures surface and are survived.

1. **SIGKILL -> WorkerFailed -> WorkerRestarted**: a collector with ``on_worker_failure="restart"``
   (CartPole-v1, ``--workers`` x 2 envs, collecting at full speed); ``--kills`` times (default 20)
   one worker is SIGKILLed and the time from the kill to the ``WorkerFailed`` event and to the
   ``WorkerRestarted`` event (the replacement forked from the launcher, configured, its envs
   built and its slots mapped) is measured. Between kills the consumer collects 3 batches and
   checks CartPole's dynamics on each.
2. **A hung env surfaces**: ``CountingEnv(hang_at_step=...)`` with ``step_timeout`` (default 1 s);
   time from the start of the hung call (the heartbeat's stamp: the last step that returned) to
   the consumer receiving :class:`WorkerTimeoutError`, ``--hangs`` times (default 5).

Prints medians and maxima; no threshold (the machine is shared and noisy).

    python benchmarks/recovery.py [--kills 20] [--hangs 5] [--step-timeout 1.0]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time

import anyio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine, machine_line  # noqa: E402

from aiocollect import Collector, WorkerTimeoutError  # noqa: E402
from aiocollect.events import WorkerFailed, WorkerRestarted  # noqa: E402
from aiocollect.testing import CountingEnv  # noqa: E402


def _check(batch) -> None:
    obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
    assert not bool((~(nxt[:, :-1] == obs[:, 1:]).all(-1) & ~done[:, :-1]).any())


async def kills(n: int, workers: int) -> tuple[list[float], list[float]]:
    failed: list[float] = []
    restarted: list[float] = []
    c = Collector("CartPole-v1", frames_per_batch=256, num_workers=workers, envs_per_worker=2,
                  on_worker_failure="restart", max_restarts=n + 1)
    marks: dict[str, float] = {}
    c.on(WorkerFailed, lambda e: marks.setdefault("failed", time.perf_counter()))
    c.on(WorkerRestarted, lambda e: marks.setdefault("restarted", time.perf_counter()))
    async with c:
        for _ in range(3):
            _check(await c.collect())
        for k in range(n):
            marks.clear()
            pid = c.worker_pids[k % workers]
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            with anyio.fail_after(30):
                while "restarted" not in marks:
                    _check(await c.collect())
            failed.append(marks["failed"] - t0)
            restarted.append(marks["restarted"] - t0)
            print(f"  kill {k + 1:2d}/{n}: WorkerFailed after {failed[-1] * 1e3:6.1f} ms, "
                  f"WorkerRestarted after {restarted[-1] * 1e3:6.1f} ms", flush=True)
            for _ in range(3):
                _check(await c.collect())
        assert c.stats().restarts == n
    return failed, restarted


async def hangs(n: int, step_timeout: float) -> list[float]:
    out = []
    for k in range(n):
        c = Collector(CountingEnv, frames_per_batch=16, num_workers=1, envs_per_worker=2, step_timeout=step_timeout,
                      create_env_kwargs={"episode_length": 50, "hang_at_step": 40})
        began: list[int] = []
        # the heartbeat's stamp still holds the start of the hung call when the failure is reported
        state = getattr(c._run, "shared", c._run)  # (private: the run's workers; older versions kept them on the run)
        c.on(WorkerFailed, lambda e: began.append(int(state.workers[0].monitor._words[0])))
        async with c:
            try:
                with anyio.fail_after(step_timeout * 10 + 10):
                    async for _ in c:
                        pass
            except WorkerTimeoutError:
                t1 = time.monotonic_ns()
        out.append((t1 - began[0]) / 1e9)
        print(f"  hang {k + 1}/{n}: WorkerTimeoutError {out[-1]:.2f} s after the hung call began "
              f"(step_timeout={step_timeout:g})", flush=True)
    return out


def _summary(name: str, xs: list[float], unit: float = 1e3, suffix: str = "ms") -> str:
    return (f"{name:44s} median {statistics.median(xs) * unit:7.1f} {suffix}   max {max(xs) * unit:7.1f} {suffix}"
            f"   (n={len(xs)})")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--hangs", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-timeout", type=float, default=1.0)
    a = p.parse_args()
    print(machine_line(machine()))
    print(f"SIGKILL of a worker, {a.kills} times ({a.workers} workers x 2 CartPole envs, restart):")
    failed, restarted = await kills(a.kills, a.workers)
    print(f"a hung env, {a.hangs} times (step_timeout={a.step_timeout:g} s):")
    hung = await hangs(a.hangs, a.step_timeout)
    print()
    print(_summary("SIGKILL -> WorkerFailed", failed))
    print(_summary("SIGKILL -> WorkerRestarted (replacement up)", restarted))
    print(_summary(f"hung call -> WorkerTimeoutError (timeout {a.step_timeout:g} s)", hung, 1, "s "))


if __name__ == "__main__":
    anyio.run(main)
