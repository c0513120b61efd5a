"""A user's program: CartPole with two workers, step_timeout=1 and on_worker_failure="restart".
Between two batches, while the workers wait for the collector, one of them is frozen with
SIGSTOP (what a debugger, a container freeze or a swapped-out machine look like). The stopped
worker must be found (it cannot help: it does not run), killed and replaced, the collection must
reach total_frames, and no stopped process may remain."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from aiocollect import Collector, WorkerTimeoutError
from aiocollect.events import WorkerFailed, WorkerRestarted

FRAMES_PER_BATCH = 64
TOTAL_FRAMES = FRAMES_PER_BATCH * 8


def state(pid: int) -> str | None:
    """The process's state letter ("R", "S", "T" for stopped, "Z" ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def gone(pid: int) -> bool:
    return state(pid) in (None, "Z", "X")


def fail(reason: str) -> None:
    print(f"FAILED: {reason}", flush=True)
    sys.exit(1)


async def main() -> None:
    failures: list[BaseException] = []
    restarts: list[tuple[int, int | None]] = []
    collector = Collector("CartPole-v1", frames_per_batch=FRAMES_PER_BATCH, total_frames=TOTAL_FRAMES, num_workers=2,
                          envs_per_worker=2, prefetch=0, step_timeout=1, on_worker_failure="restart", seed=0)
    collector.on(WorkerFailed, lambda e: failures.append(e.error))
    collector.on(WorkerRestarted, lambda e: restarts.append((e.pid, e.old_pid)))
    frames = 0
    stopped = None
    all_pids: set[int] = set()
    async with asyncio.timeout(50):
        async with collector:
            async for batch in collector:
                frames += batch.numel()
                all_pids.update(collector.worker_pids)
                if stopped is None and frames >= 2 * FRAMES_PER_BATCH:
                    stopped = collector.worker_pids[1]
                    os.kill(stopped, signal.SIGSTOP)  # prefetch=0: it waits for the collector now
                    while state(stopped) not in ("T", "t"):
                        await asyncio.sleep(0.01)
            if any(state(pid) in ("T", "t") for pid in collector.worker_pids):
                fail(f"a worker is still stopped: {collector.worker_pids}")
    if frames != TOTAL_FRAMES:
        fail(f"collected {frames} frames, expected total_frames={TOTAL_FRAMES}")
    if len(restarts) != 1 or restarts[0][1] != stopped:
        fail(f"expected one restart, of the stopped worker (pid {stopped}); got {restarts}")
    if len(failures) != 1 or not isinstance(failures[0], WorkerTimeoutError) or "is stopped" not in str(failures[0]):
        fail(f"expected a WorkerTimeoutError saying the worker is stopped; got {failures!r}")
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in all_pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = [pid for pid in all_pids if not gone(pid)]
    if left:
        fail(f"worker processes left after close: {left} ({[state(p) for p in left]})")
    print(f"ok: the stopped worker (pid {stopped}) was found, replaced and is gone; {frames} frames collected")


if __name__ == "__main__":
    asyncio.run(main())
