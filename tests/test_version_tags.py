"""A frame's ``("collector", "policy_version")`` names the weights that chose its action, in every
inference mode, while the weights change after every batch.

The policy's action reveals its weight: a scalar parameter ``w`` that each ``update_weights`` sets
to the version it makes, so version ``v``'s weights have ``w == v``. The policy writes ``w`` as an
extra output (the weight its forward pass used) and an action that depends on ``w``'s parity and
the observation. For every frame the stored ``w`` must equal its version and the action must be
what version ``v``'s weights give for the frame's observation. A busy Python thread in this
process makes the GIL change hands often, which is when a forward pass of the inference server
would slip between a weight load and the version's change."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import pytest
import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector

BATCHES = 400
ENVS = 8  # per worker


class Revealing(torch.nn.Module):
    """Deterministic: ``action = (pole angle > 0) XOR (w odd)``, and ``w`` itself as an output."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w.expand(observation.shape[0]).clone()
        return expected_action(observation, w), w


def expected_action(observation: torch.Tensor, version: torch.Tensor) -> torch.Tensor:
    """What the weights of ``version`` (``w == version``) give for ``observation`` (``[..., 4]``)."""
    return ((observation[..., 2] > 0).long() + version.long()) % 2


@contextlib.contextmanager
def busy_thread() -> Iterator[None]:
    """A plain Python thread spinning beside the collector (a trainer's bookkeeping, a logger)."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, name="busy python thread", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def mismatches(batch) -> tuple[int, int]:
    """``(frames whose w is not their version, frames whose action is not their version's)``."""
    versions = batch["collector", "policy_version"]
    w = batch["w"]
    wrong_w = int((w != versions.to(w.dtype)).sum())
    wrong_action = int((batch["action"] != expected_action(batch["observation"], versions)).sum())
    return wrong_w, wrong_action


CASES = [
    pytest.param(dict(inference="worker", delivery="sync", num_workers=0), id="local-worker"),
    pytest.param(dict(inference="worker", delivery="sync"), id="worker-sync"),
    pytest.param(dict(inference="worker", delivery="async"), id="worker-async"),
    pytest.param(dict(inference="server", delivery="sync"), id="server-sync"),
    pytest.param(dict(inference="server", delivery="async"), id="server-async"),
    pytest.param(dict(inference="server", delivery="sync", worker_groups=2), id="server-groups2-sync"),
    pytest.param(dict(inference="server", delivery="async", worker_groups=2), id="server-groups2-async"),
    pytest.param(dict(inference="server", delivery="async", env_batch_size=ENVS), id="server-env_batch_size-async"),
    pytest.param(dict(inference="server", delivery="sync", policy_device="cuda"), id="server-cuda",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.timeout(600)
@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("options", CASES)
async def test_every_frames_action_is_its_versions_while_weights_change_every_batch(options):
    """CartPole, 2 workers x 8 envs, ``update_weights`` with new weights after each of 400
    batches (a busy thread beside): every frame's action and its policy's output ``w`` are exactly
    those of the weights its ``policy_version`` names, never of the version before or after."""
    module = Revealing()
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action", "w"])
    options = {"num_workers": 2, **options}
    frames_per_batch = 2 * ENVS * 2 if options["delivery"] == "sync" else ENVS * 4
    wrong_w = wrong_action = frames = 0
    seen: set[int] = set()
    updates = 0
    # the trainer's tensor, changed in place after each update: the update must have taken its value
    source = torch.zeros((), device=options.get("policy_device", "cpu"))
    with busy_thread():
        async with Collector("CartPole-v1", policy, frames_per_batch=frames_per_batch,
                             total_frames=frames_per_batch * BATCHES, envs_per_worker=ENVS, seed=0,
                             **options) as c:
            async for batch in c:
                a, b = mismatches(batch)
                wrong_w += a
                wrong_action += b
                frames += batch.numel()
                seen.update(batch["collector", "policy_version"].unique().tolist())
                updates += 1
                source.fill_(float(updates))
                version = await c.update_weights({"w": source})
                assert version == updates
            del batch  # (a view on the workers' memory: not kept by a failure's traceback)
    assert frames == frames_per_batch * BATCHES
    assert len(seen) > BATCHES // 10, f"the weights hardly changed during the run: versions {sorted(seen)[:20]} ..."
    assert (wrong_w, wrong_action) == (0, 0), (
        f"{wrong_w} of {frames} frames carry a version whose weights did not compute them, {wrong_action} have an "
        f"action that is not their version's"
    )
