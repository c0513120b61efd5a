"""Whole episodes per batch when an episode is many times longer than a round: Pendulum's 200-step
episodes with 64 frames per batch (4 rounds per delivery), and CartPole with 32 frames per round
and 3 episodes per batch, with and without prefetch, in sync and async delivery. Each run must
deliver to its end (an outer timeout stops a hang)."""

import asyncio

import anyio

from aiocollect import Collector


async def run(env, *, expected=None, **kwargs):
    batches = 0
    with anyio.fail_after(120):  # a deadlock is a failure, not a wait
        async with Collector(env, **kwargs) as collector:
            async for batch in collector:
                mask = batch["collector", "mask"]
                done = batch["next", "done"][..., 0]
                for row, n in enumerate(mask.sum(1).tolist()):
                    assert done[row, n - 1] and not done[row, : n - 1].any(), "a whole episode"
                    ids = batch["collector", "traj_ids"][row, :n]
                    assert bool((ids == ids[0]).all()), "one id per episode"
                batches += 1
    assert batches > 0, f"{env} {kwargs}: no batch"
    if expected is not None:
        assert batches == expected, f"{env} {kwargs}: {batches} batches, expected {expected}"
    return batches


async def main():
    for delivery in ("sync", "async"):
        # 10 rounds of 64 frames: 640 frames, 3 whole 200-step episodes
        await run("Pendulum-v1", frames_per_batch=64, total_frames=640, num_workers=1, trajs_per_batch=1,
                  delivery=delivery, expected=3)
        for prefetch in (0, 2):
            await run("CartPole-v1", frames_per_batch=32, total_frames=32 * 40, num_workers=2, envs_per_worker=2,
                      trajs_per_batch=3, prefetch=prefetch, delivery=delivery, seed=1)
    print("ok: trajs_per_batch delivers with episodes several rounds long, sync and async, any prefetch")


asyncio.run(main())
