"""A script whose env factory never returns (a simulator waiting for a licence server), run from a
terminal and stopped with one Ctrl-C while `async with` is still starting. `argv[1]`: "collector"
(worker processes), "local" (the local backend: the factory runs in this process) or
"evaluator"; `argv[2]`, if given: shutdown_timeout (1 s by default). The factory prints "factory
<pid>" when it starts; on Ctrl-C the script prints "interrupted"."""

import asyncio
import faulthandler
import os
import signal
import sys
import time

from aiocollect import Collector, Evaluator


def licensed_env():
    # one write of one line: two workers' factories print to the same pipe at once
    os.write(sys.stdout.fileno(), f"factory {os.getpid()}\n".encode())
    while True:
        time.sleep(3600)


faulthandler.register(signal.SIGUSR1, all_threads=True)  # (the test asks for the stacks if it hangs)
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's job starts (see ctrl_c.py)


async def main(kind: str, shutdown_timeout: float) -> None:
    if kind == "evaluator":
        resource = Evaluator(licensed_env, shutdown_timeout=shutdown_timeout)
    else:
        resource = Collector(licensed_env, frames_per_batch=32, num_workers=0 if kind == "local" else 2,
                             shutdown_timeout=shutdown_timeout)
    async with resource:
        print("started", flush=True)  # never: the factory never returns


try:
    asyncio.run(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1.0))
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
