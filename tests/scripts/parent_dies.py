"""Starts a collector with a slow env, prints its worker pids and the launcher pid as JSON, then
SIGKILLs itself (used by tests/test_lifecycle.py: the workers and the launcher must exit)."""

import asyncio
import json
import os
import signal

from aiocollect import Collector
from aiocollect._backends.launcher import get_launcher
from aiocollect.testing import CountingEnv


async def main() -> None:
    collector = Collector(
        CountingEnv, frames_per_batch=1024, num_workers=2, create_env_kwargs={"step_sleep": 0.01}
    )
    await collector.start()
    await asyncio.sleep(0.1)  # the workers are in the middle of a batch
    print(json.dumps({"workers": list(collector.worker_pids), "launcher": get_launcher().pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


asyncio.run(main())
