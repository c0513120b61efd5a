"""The collector as one more task inside an async server's event loop.

    .venv/bin/python examples/server.py --seconds 3

A stand-in for a web server (FastAPI/Starlette lifespan, aiohttp): a "request handler" task
answers a request every 2 ms and measures how late it is, while the collector fills a buffer in
the background of the same loop. The handler's latency shows the loop never stalls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio

from aiocollect import Collector


async def main(args: argparse.Namespace) -> None:
    frames = 0
    delays: list[float] = []

    async def handle_requests() -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(0.002)
            delays.append(time.perf_counter() - start - 0.002)

    async with Collector("CartPole-v1", frames_per_batch=2048, num_workers=2, envs_per_worker=8) as collector, \
            anyio.create_task_group() as server:
        server.start_soon(handle_requests)
        with anyio.move_on_after(args.seconds):
            async for batch in collector:
                frames += batch.numel()
        server.cancel_scope.cancel()
    delays.sort()
    print(f"collected {frames} frames in {args.seconds} s while serving {len(delays)} requests")
    print(f"request lateness: median {statistics.median(delays) * 1e3:.2f} ms, "
          f"p99 {delays[int(len(delays) * 0.99)] * 1e3:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    anyio.run(main, parser.parse_args(), backend_options={"use_uvloop": True})
