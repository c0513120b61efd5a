"""A user's program ported from TorchRL: a policy trained in place (an optimizer on the very module
given to the Collector), on CartPole, 2 workers x 4 envs.

1. The loop as TorchRL's in-process collector lets one write it: train, never publish. The workers
   hold a copy of the policy, so they keep collecting with its first weights: the collector must
   say so, once, on the ``aiocollect`` logger, naming the fix.
2. The fixed on-policy loop: ``prefetch=0`` and ``await collector.update_weights(policy)`` after
   each training step. Nothing is said, and every frame of every batch carries the version
   published last before that batch was asked for, and was chosen by those weights (the policy
   writes the mean of its output bias beside each action)."""

from __future__ import annotations

import asyncio
import logging
import sys

import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector

BATCHES = 6
FRAMES_PER_BATCH = 2 * 4 * 16


class Actor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

    def forward(self, observation):
        logits = self.net(observation)
        mark = self.net[2].bias.detach().mean().expand(observation.shape[0]).clone()
        return logits.argmax(-1), mark


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def train_step(actor: Actor, optimizer: torch.optim.Optimizer, batch) -> None:
    """A (made-up) loss on the batch's observations; what matters is that the weights change."""
    optimizer.zero_grad()
    loss = actor.net(batch["observation"].reshape(-1, 4)).logsumexp(-1).mean() - actor.net[2].bias.sum()
    loss.backward()
    optimizer.step()


async def run(fixed: bool) -> tuple[list[str], list[str]]:
    """Returns (what the collector said, what went wrong)."""
    torch.manual_seed(0)
    actor = Actor()
    policy = TensorDictModule(actor, in_keys=["observation"], out_keys=["action", "mark"])
    optimizer = torch.optim.Adam(actor.parameters(), lr=0.05)
    records = Records()
    logger = logging.getLogger("aiocollect")
    logger.addHandler(records)
    wrong: list[str] = []
    try:
        async with Collector("CartPole-v1", policy, frames_per_batch=FRAMES_PER_BATCH,
                             total_frames=FRAMES_PER_BATCH * BATCHES, num_workers=2, envs_per_worker=4, seed=0,
                             prefetch=0 if fixed else 2) as collector:
            latest, latest_mark = 0, float(actor.net[2].bias.detach().mean())
            async for batch in collector:
                versions, marks = batch["collector", "policy_version"], batch["mark"]
                if fixed and not bool((versions == latest).all()):
                    wrong.append(f"batch {collector.batches}: versions {versions.unique().tolist()}, latest {latest}")
                if fixed and not torch.allclose(marks, torch.full_like(marks, latest_mark)):
                    wrong.append(f"batch {collector.batches}: collected with other weights than version {latest}")
                if not fixed and bool((versions != 0).any()):
                    wrong.append(f"batch {collector.batches}: versions {versions.unique().tolist()} without an update")
                train_step(actor, optimizer, batch)
                if fixed:
                    latest = await collector.update_weights(policy)
                    latest_mark = float(actor.net[2].bias.detach().mean())
        if collector.batches != BATCHES:
            wrong.append(f"{collector.batches} batches delivered, not {BATCHES}")
    finally:
        logger.removeHandler(records)
    return records.messages, wrong


async def main() -> int:
    said, wrong = await run(fixed=False)
    stale = [m for m in said if "changed in place" in m]
    if len(stale) != 1:
        print(f"FAIL: the loop that trains in place without publishing was told {len(stale)} times (want once): "
              f"{said}", file=sys.stderr)
        return 1
    for fix in ("update_weights(policy)", "update_policy_weights_()", "update_at_each_batch=True", "prefetch=0"):
        if fix not in stale[0]:
            print(f"FAIL: the message does not name {fix!r}: {stale[0]}", file=sys.stderr)
            return 1
    if wrong:
        print("FAIL: " + "; ".join(wrong), file=sys.stderr)
        return 1
    said, wrong = await run(fixed=True)
    if said or wrong:
        print(f"FAIL: the fixed on-policy loop: said {said}; {'; '.join(wrong)}", file=sys.stderr)
        return 1
    print(f"ok: a policy trained in place without update_weights was said once, naming the fix; with prefetch=0 and "
          f"update_weights after each step, every frame of {BATCHES} batches had the newest version and weights")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
