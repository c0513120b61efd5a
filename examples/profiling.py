"""Profile worker 0 and the collector's process with torch.profiler.

    .venv/bin/python examples/profiling.py --out traces

Writes Chrome trace JSON files (open them in chrome://tracing or https://ui.perfetto.dev) and
prints where, as the ProfileTraceReady events arrive.
"""

from __future__ import annotations

import argparse
import os

import anyio
import torch
from torch import nn

from aiocollect import Collector
from aiocollect.events import ProfileTraceReady


class ArgmaxMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


async def main(args: argparse.Namespace) -> None:
    collector = Collector("CartPole-v1", ArgmaxMLP(), frames_per_batch=1024, total_frames=1024 * 8,
                          num_workers=2, envs_per_worker=4)
    collector.enable_profile(workers=[0], num_rollouts=4, warmup_rollouts=1,
                             save_path=os.path.join(args.out, "worker_{worker_idx}.json"))
    collector.on(ProfileTraceReady, lambda e: print(
        f"trace of {'the collector' if e.worker is None else f'worker {e.worker}'}: {e.path} "
        f"({os.path.getsize(e.path) / 1e3:.0f} kB)"))
    async with collector:
        async for _ in collector:
            pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="traces")
    anyio.run(main, parser.parse_args())
