"""A script's first collector, in a fresh interpreter that has not imported tensordict: the
collector imports it in a thread while its workers start, and no other start-up path may run
into the half-imported package (server inference with a plain callable policy did: "cannot
import name 'as_tensordict_module' from partially initialized module 'tensordict.nn'")."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
from procs import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""\
    import sys

    import anyio
    import numpy as np

    from aiocollect import Collector

    assert "tensordict" not in sys.modules


    def policy(td):  # a callable on TensorDicts, no import of its own
        td["action"] = np.zeros(td.batch_size, np.int64)
        return td


    async def main(inference, workers):
        frames = 0
        async with Collector("CartPole-v1", policy, frames_per_batch=8, total_frames=32, num_workers=workers,
                             envs_per_worker=2, inference=inference) as c:
            async for batch in c:
                assert (batch["action"] == 0).all()
                frames += batch.numel()
        print("ok", frames)


    anyio.run(main, sys.argv[1], int(sys.argv[2]))
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("inference, workers", [("server", 1), ("server", 2), ("worker", 1), ("worker", 0)])
def test_the_first_collector_of_a_fresh_interpreter_starts(tmp_path, inference, workers):
    script = tmp_path / "first.py"
    script.write_text(SCRIPT)
    # (the race was the server's, with a plain callable: give it more than one chance to show)
    for attempt in range(3 if inference == "server" else 1):
        proc = subprocess.run([sys.executable, "-W", "error", str(script), inference, str(workers)],
                              capture_output=True, text=True, timeout=150, cwd=tmp_path, env=child_env(ROOT))
        assert proc.returncode == 0 and proc.stdout.split() == ["ok", "32"], f"attempt {attempt}:\n{proc.stdout}\n{proc.stderr}"
