"""A user's program whose env factory never returns (a simulator waiting for a licence server that
is down): it gives up after a while with a cancel scope around `async with Collector(...)` (and
around `async with Evaluator(...)`). The entry must give control back (what does not stop within
shutdown_timeout is killed), and the worker process stuck in the factory must be gone when it
does. The local backend's factory, in a thread of this process, is left there: the entry returns
all the same."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time

from aiocollect import Collector, Evaluator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (tests/: its helpers)
from procs import alive, forked_workers  # noqa: E402

MARKS = tempfile.mkdtemp(prefix="factory-never-returns-")


def licensed_env():
    """Writes its process id where the script can read it, then waits for ever."""
    with open(os.path.join(MARKS, f"{os.getpid()}-{time.monotonic_ns()}"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(3600)


def factory_pids() -> list[int]:
    # (from the marks' names: a mark is seen as soon as it is created, perhaps before its text)
    return [int(name.split("-")[0]) for name in os.listdir(MARKS)]


async def wait_until_a_factory_runs(known: int) -> None:
    """Until one more factory has written its mark: the start-up is stuck in it."""
    while len(os.listdir(MARKS)) <= known:
        await asyncio.sleep(0.05)


async def give_up_on(make, known: int) -> None:
    entered = False

    async def enter() -> None:
        nonlocal entered
        async with make():
            entered = True

    task = asyncio.ensure_future(enter())
    waiting = asyncio.ensure_future(wait_until_a_factory_runs(known))
    await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        waiting.cancel()
        task.result()  # raises the start-up's error
        sys.exit("the entry returned although the env factory never returns")
    task.cancel()  # the user gives up: as a cancel scope expiring, or Ctrl-C under asyncio.run
    try:
        await task
    except asyncio.CancelledError:
        pass
    if entered:
        sys.exit("the entry succeeded although the env factory never returns")


async def main() -> None:
    me = os.getpid()
    cases = [
        ("Collector, 2 worker processes",
         lambda: Collector(licensed_env, frames_per_batch=32, num_workers=2, shutdown_timeout=1.0)),
        ("Evaluator", lambda: Evaluator(licensed_env, shutdown_timeout=1.0)),
        ("Collector, local backend",
         lambda: Collector(licensed_env, frames_per_batch=32, num_workers=0, shutdown_timeout=1.0)),
    ]
    for what, make in cases:
        await give_up_on(make, len(os.listdir(MARKS)))
        left = [p for p in factory_pids() if p != me and alive(p)]
        if left:
            sys.exit(f"{what}: processes stuck in the factory still run after the entry gave up: {left}")
        workers = forked_workers(me)  # (by the templates workers are forked from, kept for reuse)
        if workers:
            sys.exit(f"{what}: worker processes still run after the entry gave up: {workers}")
        print(f"{what}: the entry gave up and left no process", flush=True)
    print("ok: a cancelled start-up stuck in an env factory gives control back and leaves no worker process")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(MARKS, ignore_errors=True)
