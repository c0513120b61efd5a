"""A user's program with a broken env factory (it returns None) and four worker processes: the
start-up fails, and at the moment the error reaches the program no worker process of the
collector may still run, whichever of them had said hello when the first one failed. Ten times,
then the same with the Evaluator; then entries cancelled as soon as their first worker exists."""

from __future__ import annotations

import asyncio
import os
import sys

from aiocollect import Collector, ConfigError, Evaluator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # (tests/: its helpers)
from procs import forked_workers  # noqa: E402


def broken_factory():
    return None  # a factory that forgot its `return gym.make(...)`


def workers_alive() -> list[int]:
    """Processes forked by the template process (the launcher, this process's child)."""
    return forked_workers(os.getpid())


async def enter_and_give_up_at_once(make) -> None:
    """The entry cancelled (a timeout of the caller's) as soon as its first worker process
    exists: the others may not be forked yet, none has said hello."""
    task = asyncio.ensure_future(make().__aenter__())
    while not workers_alive() and not task.done():
        await asyncio.sleep(0.001)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return
    sys.exit("the entry cancelled at once did not raise CancelledError")


async def main() -> None:
    for attempt in range(10):
        try:
            # (shutdown_timeout=0: nothing waits for a worker to exit by itself)
            async with Collector(broken_factory, frames_per_batch=64, num_workers=4, envs_per_worker=1,
                                 shutdown_timeout=0.0 if attempt % 2 else 5.0):
                sys.exit("the collector started although its env factory returns None")
        except ConfigError:  # (a ConfigTypeError: the factory returned no env)
            left = workers_alive()  # at once: not a moment later
            if left:
                sys.exit(f"attempt {attempt}: worker processes still run when the error arrives: {left}")
    for attempt in range(3):
        try:
            async with Evaluator(broken_factory):
                sys.exit("the evaluator started although its env factory returns None")
        except ConfigError:  # (a ConfigTypeError: the factory returned no env)
            left = workers_alive()
            if left:
                sys.exit(f"evaluator, attempt {attempt}: its worker still runs when the error arrives: {left}")
    for attempt in range(5):
        await enter_and_give_up_at_once(
            lambda: Collector("CartPole-v1", frames_per_batch=64, num_workers=4, shutdown_timeout=0.0))
        left = workers_alive()
        if left:
            sys.exit(f"cancelled entry, attempt {attempt}: worker processes still run when it returns: {left}")
    print("ok: a failed start-up leaves no worker process running when its error reaches the caller")


if __name__ == "__main__":
    asyncio.run(main())
