"""A user's program: server inference on CartPole, 2 workers x 8 envs, new weights (a whole
state_dict) after each of 150 batches, with a plain Python thread busy beside the collector.
Every frame's ``("collector", "policy_version")`` must name the weights that chose its action:
the policy's action reveals its weight ``w`` (set to the version by each update), and the policy
writes ``w`` as an extra output too. A forward pass must never give version v's tag to version
v+1's weights."""

from __future__ import annotations

import asyncio
import sys
import threading

import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector

BATCHES = 150  # (tests/test_version_tags.py runs 400 in each inference mode)
FRAMES_PER_BATCH = 2 * 8 * 2


class Revealing(torch.nn.Module):
    """``action = (pole angle > 0) XOR (w odd)``; ``w`` is written beside it, and a value head
    (an MLP, trained like the rest) too."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()), requires_grad=False)
        self.value = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                         torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, observation):
        w = self.w.expand(observation.shape[0]).clone()
        return action_of(observation, w), w, self.value(observation)


def action_of(observation, w):
    return ((observation[..., 2] > 0).long() + w.long()) % 2


async def main() -> int:
    policy = TensorDictModule(Revealing(), in_keys=["observation"], out_keys=["action", "w", "state_value"])
    trained = Revealing()  # what the trainer updates, loaded into the served policy after each batch
    stop = threading.Event()

    def spin() -> None:  # the user's busy thread (logging, metrics, a data loader ...)
        n = 0
        while not stop.is_set():
            n += 1

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    wrong_w = wrong_action = frames = 0
    versions: set[int] = set()
    try:
        async with Collector("CartPole-v1", policy, frames_per_batch=FRAMES_PER_BATCH,
                             total_frames=FRAMES_PER_BATCH * BATCHES, num_workers=2, envs_per_worker=8,
                             inference="server", seed=0) as collector:
            k = 0
            async for batch in collector:
                v = batch["collector", "policy_version"]
                wrong_w += int((batch["w"] != v.to(batch["w"].dtype)).sum())
                wrong_action += int((batch["action"] != action_of(batch["observation"], v)).sum())
                frames += batch.numel()
                versions.update(v.unique().tolist())
                k += 1
                with torch.no_grad():  # a training step: every weight changes, and w is the next version
                    for p in trained.value.parameters():
                        p.add_(0.001)
                    trained.w.fill_(k)
                version = await collector.update_weights(trained.state_dict())
                if version != k:
                    print(f"update_weights returned version {version} for update {k}", file=sys.stderr)
                    return 1
                del batch
    finally:
        stop.set()
        busy.join()
    if frames != FRAMES_PER_BATCH * BATCHES:
        print(f"collected {frames} frames, expected {FRAMES_PER_BATCH * BATCHES}", file=sys.stderr)
        return 1
    if len(versions) < BATCHES // 10:
        print(f"only {len(versions)} versions were seen in {BATCHES} batches: the weights hardly changed",
              file=sys.stderr)
        return 1
    if wrong_w or wrong_action:
        print(f"{wrong_w} of {frames} frames carry a version whose weights did not compute them ({wrong_action} "
              f"actions are not their version's)", file=sys.stderr)
        return 1
    print(f"ok: every one of {frames} frames over {BATCHES} weight updates ({len(versions)} versions seen) has the "
          f"action and output of the weights its policy_version names")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
