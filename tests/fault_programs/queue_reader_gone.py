"""A user's program: an async service feeds batches into an anyio memory object stream
(``start(queue=...)``) read by two consumer tasks, each with its own clone of the receive side.
Each consumer takes a few batches and then leaves, closing its clone, as a service shutting its
readers down does. Once nobody can read the stream, the collector must stop delivering on its
own (its state STOPPED, a CollectorStopped event with reason "queue_closed"), aclose() must
return without an error, the batches read must be the start of the collection with nothing
lost, repeated or swapped, and no worker process may be left."""

from __future__ import annotations

import asyncio
import sys
import time

import anyio
import torch

from aiocollect import Collector, CollectorState
from aiocollect.events import CollectorStopped
from aiocollect.testing import CountingEnv

FRAMES_PER_BATCH = 16
EPISODE = 10_000  # (longer than the run: an env's observation counts its steps)


def make_env():
    return CountingEnv(episode_length=EPISODE)


def fail(reason: str) -> None:
    print(f"FAILED: {reason}", flush=True)
    sys.exit(1)


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


async def consume(receive, taken: list, count: int) -> None:
    with receive:  # leaving closes this reader's clone
        for _ in range(count):
            taken.append(await receive.receive())
            await asyncio.sleep(0.01)  # (a training step)


async def main() -> None:
    collector = Collector(make_env, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1, num_workers=1, seed=0)
    reasons: list[str] = []
    collector.on(CollectorStopped, lambda e: reasons.append(e.reason))
    send, receive = anyio.create_memory_object_stream(2)
    taken: list = []
    async with asyncio.timeout(50):
        await collector.start(queue=send)
        pids = collector.worker_pids
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, receive.clone(), taken, 3)
            tg.start_soon(consume, receive, taken, 5)
        while collector.state is CollectorState.RUNNING:  # nobody reads now: it stops by itself
            await asyncio.sleep(0.01)
        state = collector.state
        await collector.aclose()  # nothing to raise: the readers ended the delivery
    if state is not CollectorState.STOPPED:
        fail(f"with every reader gone the collector is {state.value}, expected stopped")
    if reasons != ["queue_closed"]:
        fail(f"CollectorStopped reasons {reasons}, expected ['queue_closed']")
    obs = torch.cat([b["observation"][0, :, 0] for b in taken])  # in the order the readers took them
    if not torch.equal(obs, torch.arange(len(taken) * FRAMES_PER_BATCH, dtype=obs.dtype)):
        fail(f"the batches read are not the collection's first frames in order: {obs.tolist()}")
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not all(gone(pid) for pid in pids):
        fail(f"worker processes left after aclose(): {pids}")
    print(f"ok: the collector stopped once both readers closed the stream; {len(taken)} batches read in order, "
          f"aclose() clean, no worker left")


if __name__ == "__main__":
    asyncio.run(main())
