"""aiocollect example: evaluate a policy in the background while a collector feeds training.

    .venv/bin/python examples/evaluator.py --batches 40 --eval-every 5

The "training" imitates a hand-written CartPole controller (push towards the side the pole falls
to) on the observations of each batch, so the evaluated return climbs; the new weights go to the
collector's workers after each step. Every ``--eval-every``
batches the current weights go to an :class:`Evaluator`, whose env and policy replica live in a
process of its own: ``trigger`` returns at once, the loop keeps collecting, and results are
printed by an ``EvaluationCompleted`` handler as they arrive (a trigger while one is still
running is skipped: ``busy_policy="skip"``; ``--busy-policy queue`` evaluates every trigger, in
order).
"""

from __future__ import annotations

import argparse
import time

import anyio
import gymnasium
import torch
from torch import nn

from aiocollect import Collector, Evaluator
from aiocollect.events import EvaluationCompleted, EvaluationFailed


class ArgmaxMLP(nn.Module):
    """A 4-64-2 MLP acting greedily (defined in __main__: it reaches the workers with cloudpickle)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


def train_step(policy: ArgmaxMLP, optimizer: torch.optim.Optimizer, batch) -> float:
    """One step of imitation of the controller ``action = [angle + angular velocity > 0]``."""
    obs = batch["observation"].reshape(-1, 4)
    target = (obs[:, 2] + obs[:, 3] > 0).long()
    loss = nn.functional.cross_entropy(policy.net(obs), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()  # a number for printing (float(loss) warns: the loss requires grad)


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    policy = ArgmaxMLP()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    collector = Collector(
        "CartPole-v1",
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=args.frames_per_batch * args.batches,
        num_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        seed=0,
    )
    evaluator = Evaluator(
        lambda: gymnasium.make("CartPole-v1"),  # an id works too; a factory travels with cloudpickle
        policy,  # copied now; later weights are passed to trigger()
        num_trajectories=args.trajectories,
        max_steps=args.max_steps,
        seed=1000,  # the same start states in every evaluation: results are comparable
        busy_policy=args.busy_policy,
    )

    @evaluator.on(EvaluationCompleted)
    def show(event: EvaluationCompleted) -> None:
        m = event.metrics
        print(
            f"eval  batch {event.step:4d}: return_mean {m['return_mean']:7.1f} ± {m['return_std']:5.1f} "
            f"(min {m['return_min']:.0f}, max {m['return_max']:.0f}), {m['seconds'] * 1e3:.0f} ms",
            flush=True,
        )

    @evaluator.on(EvaluationFailed)
    def failed(event: EvaluationFailed) -> None:
        print(f"eval  batch {event.step}: failed: {event.error!r}", flush=True)

    t0 = time.perf_counter()
    async with collector, evaluator:
        async for batch in collector:
            loss = train_step(policy, optimizer, batch)
            index = collector.batches
            print(f"train batch {index:4d}: {batch.numel()} frames, imitation loss {loss:.3f}", flush=True)
            await collector.update_weights(policy, wait=False)  # the workers collect with them next
            if index % args.eval_every == 0:
                evaluator.trigger(policy, step=index)  # weights copied now; returns at once
        if collector.batches % args.eval_every:  # the final weights were not evaluated yet
            await evaluator.evaluate(policy, step=collector.batches)  # waits its turn
        final = await evaluator.wait()  # the last evaluation's metrics
    print(
        f"final evaluation (batch {final['step']}): return_mean {final['return_mean']:.1f}, "
        f"episode_length_mean {final['episode_length_mean']:.1f} "
        f"({evaluator.completed} evaluations, {evaluator.skipped} triggers skipped, "
        f"{time.perf_counter() - t0:.1f} s)"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=40, help="batches to collect")
    p.add_argument("--eval-every", type=int, default=5, help="trigger an evaluation every N batches")
    p.add_argument("--trajectories", type=int, default=5, help="episodes per evaluation")
    p.add_argument("--max-steps", type=int, default=500, help="truncate evaluation episodes")
    p.add_argument("--frames-per-batch", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=4)
    p.add_argument("--busy-policy", choices=("skip", "queue"), default="skip",
                   help="a trigger while an evaluation runs: skip it, or queue it (every trigger is evaluated)")
    return p.parse_args()


if __name__ == "__main__":
    anyio.run(main, parse_args())
