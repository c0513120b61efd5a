"""A user's program: 1 MB uint8 frames and a frames_per_batch whose batch alone needs more shared
memory than the machine has (18,080 frames with prefetch=0: 36 GB for one batch's frames and
next frames; more on a bigger machine, so that it never fits). The collector must refuse it with a
ConfigError naming the figures and the largest frames_per_batch that fits, before it fills any
memory; the same with 40,000 frames and the default prefetch. Then a batch that fits runs.

A guard for this program only: the env refuses to take more than 300 steps, so that a run that was
wrongly accepted stops there (an error, reported) instead of filling memory towards the OOM killer.
"""

from __future__ import annotations

import asyncio
import re
import sys

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from aiocollect import Collector, ConfigError

FRAME_SHAPE = (1000, 1000)  # 1 MB uint8 frames
FRAME_BYTES = 2 * 1000 * 1000  # the observation and the next one, per frame of a batch
MAX_STEPS = 300


class BigFrameEnv(gym.Env):
    observation_space = spaces.Box(0, 255, FRAME_SHAPE, np.uint8)
    action_space = spaces.Discrete(2)

    def __init__(self):
        self.frame = np.zeros(FRAME_SHAPE, np.uint8)
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.frame, {}

    def step(self, action):
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise RuntimeError(f"the program's guard: {MAX_STEPS} steps taken, the oversized run was accepted")
        self.t += 1
        self.frame[0, 0] = self.t % 256
        return self.frame.copy(), 1.0, self.t >= 50, False, {}


def machine_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
    return info["MemTotal"] + info.get("SwapTotal", 0)


async def refused(frames_per_batch: int, **kwargs) -> int:
    """Run the collector; it must be refused with the figures. Returns the largest batch named."""
    collector = Collector(BigFrameEnv, frames_per_batch=frames_per_batch, num_workers=1, envs_per_worker=2, **kwargs)
    try:
        async with collector:
            batch = await collector.collect()
    except ConfigError as exc:
        text = str(exc)
    else:
        raise SystemExit(f"frames_per_batch={frames_per_batch} was accepted and gave a batch of {batch.batch_size}")
    for part in (f"frames_per_batch={frames_per_batch}", "needs", "GiB of shared memory", "can give now", "fewer envs"):
        if part not in text:
            raise SystemExit(f"the refusal of frames_per_batch={frames_per_batch} does not say {part!r}: {text}")
    found = re.search(r"the largest frames_per_batch that fits with .* is (\d+)", text)
    if not found or not 0 < int(found.group(1)) < frames_per_batch:
        raise SystemExit(f"the refusal names no smaller frames_per_batch that fits: {text}")
    return int(found.group(1))


async def main() -> None:
    # one batch's frames alone more than RAM and swap: never fits, whatever the machine
    at_least = (machine_bytes() // FRAME_BYTES + 2) // 2 * 2
    first = await refused(max(18_080, at_least), prefetch=0)
    second = await refused(max(40_000, at_least), prefetch=2)  # (more slots: a smaller batch fits)
    if second >= first:
        raise SystemExit(f"prefetch=2 should allow a smaller batch than prefetch=0 ({second} >= {first})")
    # the collector still works with a batch that fits
    async with Collector(BigFrameEnv, frames_per_batch=8, total_frames=16, num_workers=1, envs_per_worker=2) as c:
        shapes = [tuple(b.batch_size) async for b in c]
    if shapes != [(2, 4), (2, 4)]:
        raise SystemExit(f"the small run gave batches {shapes}")
    print(f"ok: oversized batches refused before filling (largest that fits: {first} with prefetch=0, "
          f"{second} with prefetch=2); a small batch ran")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except SystemExit:
        raise
    except Exception as exc:
        print(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
