"""A user's program: two workers, each with its own env factory (CartPole capped at 20 steps, and
a plain CartPole), decorrelated with max_decorrelation_steps, and on_worker_failure="restart".
After the first batch, worker 1 is killed with SIGKILL. It must be replaced by a worker that makes
its envs with worker 1's factory again; every row must carry its factory's index and obey its
factory's episode cap; the first batch must show the envs at different phases of their episodes;
the collection must reach total_frames, and no worker process may remain."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import gymnasium as gym

from aiocollect import Collector
from aiocollect.events import WorkerRestarted

FRAMES_PER_BATCH = 128
TOTAL_FRAMES = FRAMES_PER_BATCH * 8
CAPS = (20, 500)  # CartPole's max_episode_steps in factory 0 and factory 1


def short_cartpole() -> gym.Env:
    return gym.make("CartPole-v1", max_episode_steps=CAPS[0])


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def fail(reason: str) -> None:
    print(f"FAILED: {reason}", flush=True)
    sys.exit(1)


def check_rows(batch) -> None:
    """Rows 0-1 are worker 0's (factory 0), rows 2-3 worker 1's (factory 1); no trajectory of a
    row is longer than its factory's cap (step_count counts a trajectory's frames)."""
    index = batch["collector", "env_fn_index"]
    if index[:, 0].tolist() != [0, 0, 1, 1] or not bool((index == index[:, :1]).all()):
        fail(f"rows' factory indices are {index[:, 0].tolist()}, expected [0, 0, 1, 1] in every frame")
    for row, cap in zip(batch["next", "step_count"][..., 0], (CAPS[0], CAPS[0], CAPS[1], CAPS[1])):
        if int(row.max()) > cap:
            fail(f"a trajectory of {int(row.max())} frames in a row of a factory capped at {cap}")


async def main() -> None:
    restarts: list[tuple[int, int | None]] = []
    collector = Collector([short_cartpole, "CartPole-v1"], frames_per_batch=FRAMES_PER_BATCH, total_frames=TOTAL_FRAMES,
                          num_workers=2, envs_per_worker=2, seed=7, max_decorrelation_steps=15,
                          max_frames_per_traj=1000, on_worker_failure="restart")
    collector.on(WorkerRestarted, lambda e: restarts.append((e.pid, e.old_pid)))
    frames = 0
    killed = None
    all_pids: set[int] = set()
    async with asyncio.timeout(50):
        async with collector:
            async for batch in collector:
                if frames == 0:
                    phases = batch["step_count"][:, 0, 0]
                    if len(set(phases.tolist())) < 2:
                        fail(f"the envs start at the same step of their episodes: {phases.tolist()}")
                frames += batch.numel()
                check_rows(batch)
                all_pids.update(collector.worker_pids)
                if killed is None:
                    killed = collector.worker_pids[1]
                    os.kill(killed, signal.SIGKILL)
    if frames != TOTAL_FRAMES:
        fail(f"collected {frames} frames, expected total_frames={TOTAL_FRAMES}")
    if len(restarts) != 1 or restarts[0][1] != killed:
        fail(f"expected one restart, of the killed worker (pid {killed}); got {restarts}")
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in all_pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = [pid for pid in all_pids if not gone(pid)]
    if left:
        fail(f"worker processes left after close: {left}")
    print(f"ok: worker 1 (pid {killed}) was killed and rebuilt with its own factory; every row kept its "
          f"factory's index and episode cap; the envs started out of phase; {frames} frames collected")


if __name__ == "__main__":
    asyncio.run(main())
