"""Events and hooks: react to what happens during collection without polling.

    .venv/bin/python examples/events.py --frames 20480

- a hook (AfterRollout) that adds a key to each batch before you get it,
- a handler counting episode ends (EpisodeEnded is computed in the workers),
- a subscription streaming BatchReady events to a separate task (it can never slow collection),
- collector.stats() at the end.
"""

from __future__ import annotations

import argparse

import anyio
import torch

from aiocollect import Collector
from aiocollect.events import AfterRollout, BatchReady, CollectorStopped, EpisodeEnded


async def main(args: argparse.Namespace) -> None:
    collector = Collector("CartPole-v1", frames_per_batch=args.frames_per_batch, total_frames=args.frames,
                          num_workers=2, envs_per_worker=4, seed=0)
    long_episodes = 0

    @collector.on(EpisodeEnded)
    def count_long(event: EpisodeEnded) -> None:
        nonlocal long_episodes
        long_episodes += event.length >= 30

    @collector.on(AfterRollout)
    async def add_batch_index(event: AfterRollout) -> None:  # hooks are awaited, in order
        event.batch["batch_index"] = torch.full(event.batch.batch_size, event.index)

    collector.on(CollectorStopped, lambda e: print(f"stopped ({e.reason}) after {e.frames} frames"))

    async def watch(subscription) -> None:
        async for event in subscription:
            if event.index % 5 == 0:
                t = event.timing
                print(f"batch {event.index}: env {t['env'] * 1e3:.1f} ms, policy {t['policy'] * 1e3:.1f} ms, "
                      f"waiting {t['wait'] * 1e3:.1f} ms, delivery {t['delivery'] * 1e3:.2f} ms")

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch, collector.subscribe(BatchReady, max_buffer=64))
        async with collector:
            async for batch in collector:
                assert (batch["batch_index"] == collector.batches - 1).all()
    stats = collector.stats()
    print(f"{stats.frames} frames in {stats.batches} batches, {stats.episodes} episodes "
          f"(mean return {stats.mean_return:.1f}), {long_episodes} of 30 steps or more")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=20_480)
    parser.add_argument("--frames-per-batch", type=int, default=1024)
    anyio.run(main, parser.parse_args())
