"""The program a PPO user writes: the optimizer trains the constructor's policy in place, then
``await collector.update_weights(policy)``. Every frame must act with the weights its
``("collector", "policy_version")`` names, in every inference mode: the workers and the inference
server run copies of their own, which only ``update_weights`` changes.

The check is exact, not statistical: the policy writes its logits into the batch, and for every
frame they must be the logits that the weights of the frame's version (a snapshot taken when the
update was made) give for the frame's observation. After each optimizer step the test pauses
while collection runs on, so that a server running the trainer's own module (in place) would
serve frames with trained weights under the old version, and fail."""

from __future__ import annotations

import copy

import anyio
import pytest
import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector

ENVS = 4  # per worker
BATCHES = 24
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# torch.compile on a GPU with TF32 cores advises torch.set_float32_matmul_precision("high"): the
# user's choice (it would change the logits this test checks exactly), not an error
TF32_ADVICE = pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

    def forward(self, observation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.body(observation)
        return logits.argmax(-1), logits


def train_step(module: Net, optimizer: torch.optim.Optimizer, batch) -> None:
    """One real step on the batch (cross-entropy towards random actions: the weights move a lot)."""
    obs = batch["observation"].reshape(-1, 4).to(next(module.parameters()).device)
    target = torch.randint(0, 2, obs.shape[:1], device=obs.device)
    _, logits = module(obs)
    loss = torch.nn.functional.cross_entropy(logits, target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def wrong_frames(batch, reference: Net, snapshots: dict[int, dict]) -> int:
    """Frames whose logits (or action) are not those of the weights their version names (checked
    on the CPU, wherever the batch is stored)."""
    batch = batch.cpu()
    versions = batch["collector", "policy_version"]
    obs, logits, action = batch["observation"], batch["logits"], batch["action"]
    wrong = 0
    for v in versions.unique().tolist():
        rows = versions == v
        reference.load_state_dict(snapshots[int(v)])
        with torch.no_grad():
            _, expected = reference(obs[rows].float())
        close = torch.isclose(logits[rows].float().cpu(), expected, atol=1e-4, rtol=1e-4).all(-1)
        wrong += int((~close).sum()) + int((action[rows].cpu() != logits[rows].argmax(-1).cpu()).sum())
    return wrong


async def pause_while_collecting(c: Collector) -> None:
    """Let the collection run on for a while after the optimizer's step: until the inference
    server made a few more forward passes (a quarter of a second at most: with sync delivery the
    workers may have collected all they may ahead), or a moment with worker inference."""
    server = c.stats().server
    if server is None:
        await anyio.sleep(0.05)
        return
    before = server["passes"]
    with anyio.move_on_after(0.25):
        while (c.stats().server or {"passes": before})["passes"] < before + 3:
            await anyio.sleep(0.002)


CASES = [
    pytest.param(dict(inference="worker", delivery="sync"), id="worker-sync"),
    pytest.param(dict(inference="worker", delivery="async"), id="worker-async"),
    pytest.param(dict(inference="server", delivery="sync"), id="server-sync"),
    pytest.param(dict(inference="server", delivery="async"), id="server-async"),
    pytest.param(dict(inference="server", delivery="sync", worker_groups=2), id="server-groups2-sync"),
    pytest.param(dict(inference="server", delivery="async", worker_groups=2), id="server-groups2-async"),
    pytest.param(dict(inference="server", delivery="sync", compile_policy=True), id="server-compile-sync"),
    pytest.param(dict(inference="server", delivery="async", compile_policy=True), id="server-compile-async"),
    pytest.param(dict(inference="server", delivery="sync", policy_device="cuda"), id="server-cuda-sync", marks=CUDA),
    pytest.param(dict(inference="server", delivery="async", policy_device="cuda", worker_groups=2),
                 id="server-cuda-groups2-async", marks=CUDA),
    pytest.param(dict(inference="server", delivery="sync", policy_device="cuda", compile_policy=True),
                 id="server-cuda-compile-sync", marks=[CUDA, TF32_ADVICE]),
    pytest.param(dict(inference="server", delivery="sync", policy_device="cuda", cudagraph_policy=True),
                 id="server-cuda-cudagraph-sync", marks=CUDA),
    pytest.param(dict(inference="server", delivery="async", policy_device="cuda", storing_device="cuda"),
                 id="server-cuda-storing-async", marks=CUDA),
]


@pytest.mark.timeout(600)
@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("options", CASES)
async def test_a_policy_trained_in_place_acts_with_the_weights_its_version_names(options):
    """CartPole, 2 workers x 4 envs, collecting ahead (prefetch=2, so collection runs while the
    trainer steps): after each batch an optimizer step on the constructor's policy, a pause while
    collection goes on, then ``update_weights(policy)``. Every frame's logits are those of the
    weights its version names; the trainer's module stays where the user made it."""
    torch.manual_seed(0)
    cuda = options.get("policy_device") == "cuda"
    module = Net().to("cuda" if cuda else "cpu")  # (a trainer on the GPU trains there)
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action", "logits"])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    reference = copy.deepcopy(module).cpu()
    snapshots = {0: {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}}
    frames_per_batch = 2 * ENVS * 4
    wrong = frames = 0
    seen: set[int] = set()
    with anyio.fail_after(300):
        async with Collector("CartPole-v1", policy, frames_per_batch=frames_per_batch,
                             total_frames=frames_per_batch * BATCHES, num_workers=2, envs_per_worker=ENVS, seed=0,
                             prefetch=2, **options) as c:
            async for batch in c:
                wrong += wrong_frames(batch, reference, snapshots)
                frames += batch.numel()
                seen.update(batch["collector", "policy_version"].unique().tolist())
                train_step(module, optimizer, batch)
                await pause_while_collecting(c)
                version = await c.update_weights(policy)
                snapshots[version] = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
            del batch
    assert frames == frames_per_batch * BATCHES
    assert len(seen) >= BATCHES // 6, f"the weights hardly changed during the run: versions {sorted(seen)}"
    assert wrong == 0, f"{wrong} of {frames} frames act with weights other than those of their version"
    assert next(module.parameters()).device.type == ("cuda" if cuda else "cpu")


@pytest.mark.timeout(120)
@pytest.mark.loops("asyncio")
async def test_server_weights_shared_runs_the_users_module_itself():
    """``server_weights="shared"``: no second copy; the server runs the user's module, so an
    update with that module only makes a version, and weights loaded from another module land in
    the user's own (the documented trade for a policy too large to copy)."""
    torch.manual_seed(0)
    module, trained = Net(), Net()
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action", "logits"])
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=32, total_frames=32 * 3, num_workers=2,
                             envs_per_worker=2, inference="server", server_weights="shared") as c:
            async for batch in c:
                await c.update_weights(trained.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), trained.parameters()))


@pytest.mark.timeout(120)
@pytest.mark.loops("asyncio")
async def test_the_server_copy_leaves_the_users_module_as_it_is():
    """The default (``server_weights="copy"``): weights given to ``update_weights`` go to the
    server's copy, not into the user's module, which keeps its weights and its device."""
    torch.manual_seed(0)
    module, trained = Net(), Net()
    before = copy.deepcopy(module.state_dict())
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action", "logits"])
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=32, total_frames=32 * 3, num_workers=2,
                             envs_per_worker=2, inference="server", policy_device="cpu") as c:
            async for batch in c:
                await c.update_weights(trained.state_dict())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_a_policy_that_cannot_be_copied_says_how_to_run_it_without_a_copy():
    """A module whose deep copy fails: a ConfigError at start-up that names
    ``server_weights='shared'``."""
    from aiocollect import ConfigError
    from aiocollect._collector.inference_server import own_policy

    class Uncopyable(Net):
        def __deepcopy__(self, memo):
            raise TypeError("cannot copy a handle")

    with pytest.raises(ConfigError, match="server_weights='shared'"):
        own_policy(Uncopyable(), None, "copy")
    module = Uncopyable()
    assert own_policy(module, None, "shared") is module
