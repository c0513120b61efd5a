"""A plain synchronous `for` loop (no async code of yours): the collector runs its event loop in
a helper thread (an anyio blocking portal); `with` closes both.

    .venv/bin/python examples/sync_loop.py
"""

from aiocollect import Collector

with Collector("CartPole-v1", frames_per_batch=1000, total_frames=10_000, num_workers=2, envs_per_worker=5) as collector:
    for i, batch in enumerate(collector):
        print(f"batch {i}: {tuple(batch.batch_size)}, episodes ended: {int(batch['next', 'done'].sum())}")
