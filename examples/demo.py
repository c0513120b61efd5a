"""aiocollect demo: collect CartPole-v1 experience with worker processes and a torch policy.

    bash scripts/run.sh demo                      # sets up .venv on first run
    .venv/bin/python examples/demo.py --frames 200000 --workers 2 --envs-per-worker 8

Shows a progress bar while collecting, then prints the batch layout, the episodes seen and the
frames per second, and checks that nothing was left running.
"""

from __future__ import annotations

import argparse
import time

import anyio
import torch
from torch import nn

from aiocollect import Collector


class ArgmaxMLP(nn.Module):
    """A 4-64-2 MLP acting greedily on CartPole observations (defined in __main__: it reaches the
    workers with cloudpickle, no import needed there)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    policy = ArgmaxMLP()
    t0 = time.perf_counter()
    collector = Collector(
        args.env,
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.frames,
        num_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        delivery=args.delivery,
        seed=0,
        progress=True,
    )
    episodes = 0
    returns: list[float] = []
    running: dict[int, float] = {}
    async with collector:
        first_batch_at = None
        async for batch in collector:
            if first_batch_at is None:
                first_batch_at = time.perf_counter() - t0
                t_steady = time.perf_counter()
                first = batch
                steady_frames = 0
            else:
                steady_frames += batch.numel()
            # per-trajectory reward sums; a trajectory may span batches (it keeps its id)
            ids, inverse = batch["collector", "traj_ids"].flatten().unique(return_inverse=True)
            sums = torch.zeros(len(ids)).index_add_(0, inverse, batch["next", "reward"].flatten())
            for tid, s in zip(ids.tolist(), sums.tolist()):
                running[tid] = running.get(tid, 0.0) + s
            for tid in batch["collector", "traj_ids"][batch["next", "done"][..., 0]].tolist():
                returns.append(running.pop(tid))
            episodes = len(returns)
        elapsed = time.perf_counter() - t_steady
        pids = collector.worker_pids
    print()
    print(f"env {args.env}: {args.workers} worker processes x {args.envs_per_worker} envs, "
          f"{args.delivery} delivery, {collector.batches} batches of {args.frames_per_batch} frames")
    print("batch layout:")
    print(first)
    print(f"first batch after {first_batch_at:.2f} s (constructor to batch, worker start-up included)")
    if steady_frames:
        print(f"throughput after the first batch: {steady_frames / elapsed:,.0f} frames/s")
    print(f"episodes ended: {episodes}" + (f", mean return {sum(returns) / len(returns):.1f}" if returns else ""))
    print(f"collector state: {collector.state.value}; worker processes still running: {len(pids)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="CartPole-v1",
                        help="gymnasium env id: 4 observations, 2 actions, as CartPole (default: %(default)s)")
    parser.add_argument("--frames", type=int, default=204_800,
                        help="total frames to collect, rounded up to whole batches of --frames-per-batch (default: %(default)s)")
    parser.add_argument("--frames-per-batch", type=int, default=2048,
                        help="frames in each batch (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default: %(default)s)")
    parser.add_argument("--envs-per-worker", type=int, default=8,
                        help="envs stepped by each worker process (default: %(default)s)")
    parser.add_argument("--delivery", choices=["sync", "async"], default="sync",
                        help="sync: each batch holds frames of every worker; async: each batch is the first "
                             "worker's batch ready (default: %(default)s)")
    anyio.run(main, parser.parse_args(), backend_options={"use_uvloop": True})
