"""Start-up: what ``from aiocollect import Collector`` imports, and what the first collector
imports while its workers start."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_tensordict_is_imported_while_the_first_collector_starts(loop):
    """``from aiocollect import Collector`` does not import tensordict (which imports
    ``torch._dynamo``: seconds); the first collector imports it while its workers start, and
    delivers TensorDicts, also with ``split_trajs``."""
    code = textwrap.dedent(
        """
        import sys
        import anyio
        from aiocollect import Collector

        assert "tensordict" not in sys.modules and "torch._dynamo" not in sys.modules

        async def main():
            async with Collector("CartPole-v1", frames_per_batch=32, total_frames=64, num_workers=1,
                                 envs_per_worker=2, split_trajs=True, seed=0) as c:
                batches = [b async for b in c]
            from tensordict import TensorDictBase

            assert len(batches) == 2 and all(isinstance(b, TensorDictBase) for b in batches)
            assert all(b["collector", "mask"].any() for b in batches)

        anyio.run(main, backend_options={"use_uvloop": LOOP == "uvloop"})
        """
    ).replace("LOOP", repr(loop))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50, cwd=REPO)
