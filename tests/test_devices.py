"""Devices as TorchRL names them (device, policy_device, env_device, storing_device): what is
accepted and what is refused with a message that says what to use; nothing initialises CUDA
unless a CUDA device is asked for; and, where CUDA is there, the inference server on the GPU and
batches stored there (skipped cleanly without CUDA)."""

from __future__ import annotations

import anyio
import pytest
import torch

from aiocollect import Collector, ConfigError
from aiocollect.testing import CountingEnv

from test_user_programs import Greedy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")


def make(**kw):
    return Collector("CartPole-v1", Greedy(), frames_per_batch=16, num_workers=1, **kw)


def test_cpu_devices_are_accepted_and_device_fills_the_others():
    c = make(device="cpu", inference="server")
    devices = c.config.devices
    assert devices["policy_device"] == torch.device("cpu") and devices["storing_device"] == torch.device("cpu")
    assert devices["env_device"] is None
    assert make(env_device="cpu", storing_device=torch.device("cpu")).config.devices["storing_device"].type == "cpu"


@pytest.mark.parametrize("kwargs, match", [
    (dict(env_device="cuda"), "gymnasium envs step on the CPU"),
    (dict(policy_device="mps"), "supports 'cpu' and 'cuda'"),
    (dict(policy_device="gpu:0"), "not a device torch knows"),
    (dict(storing_device=3.5), "must be a device"),
])
def test_devices_that_cannot_work_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make(**kwargs)


@no_cuda
@pytest.mark.parametrize("name", ["device", "policy_device", "storing_device"])
def test_a_cuda_device_without_cuda_says_so(name):
    with pytest.raises(ConfigError, match="CUDA is not available"):
        make(inference="server", **{name: "cuda"})


@cuda
def test_worker_inference_on_cuda_is_refused():
    with pytest.raises(ConfigError, match="inference='server'"):
        make(policy_device="cuda")


@cuda
def test_zero_copy_with_a_cuda_storing_device_is_refused():
    with pytest.raises(ConfigError, match="zero_copy"):
        make(storing_device="cuda", zero_copy=True)


async def test_collecting_on_the_cpu_never_initialises_cuda():
    """Server inference and worker inference on the CPU: torch.cuda is not initialised."""
    if torch.cuda.is_initialized():
        pytest.skip("an earlier test in this process initialised CUDA")
    with anyio.fail_after(60):
        for inference in ("server", "worker"):
            async with Collector("CartPole-v1", Greedy(), frames_per_batch=32, total_frames=64, num_workers=1,
                                 envs_per_worker=2, inference=inference, device="cpu") as c:
                async for _ in c:
                    pass
    assert not torch.cuda.is_initialized()


class Half(torch.nn.Module):
    """Exact on any device: the action is the observation's first component's parity."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, observation):
        return (observation[..., 0] * self.scale % 2).long()


@cuda
@pytest.mark.parametrize("storing_device, wrap", [
    (None, {}), ("cuda", {}), (None, {"cudagraph_policy": True}), (None, {"compile_policy": True}),
], ids=["server", "storing", "cudagraph", "compile"])
async def test_server_on_cuda_gives_the_data_of_worker_inference(storing_device, wrap):
    """policy_device="cuda" (the policy moved there), the same seed as worker inference on the
    CPU: the same frames; with storing_device="cuda" the batches are on the GPU; an update made on
    the GPU is used (versions per frame); the same with CUDA graphs and with torch.compile."""
    async def collect(**kw):
        policy = Half()
        out = []
        async with Collector(lambda: CountingEnv(episode_length=7), policy, frames_per_batch=2 * 3 * 8,
                             total_frames=2 * 3 * 8 * 4, num_workers=2, envs_per_worker=3, seed=0, prefetch=0,
                             **kw) as c:
            async for batch in c:
                out.append(batch.to("cpu").clone())
                if kw:  # on the storing device; else built on the CPU from the workers' memory
                    where = {t.device.type for t in batch.values(include_nested=True, leaves_only=True)}
                    assert where == {"cuda" if storing_device else "cpu"}, where
                await c.update_weights(policy)
        return out

    with anyio.fail_after(120):
        gpu = await collect(inference="server", policy_device="cuda", storing_device=storing_device, **wrap)
        cpu = await collect()
    for g, c in zip(gpu, cpu):
        for key in ("observation", "action", ("next", "observation"), ("collector", "policy_version")):
            assert torch.equal(g[key], c[key]), key


class _Difference(torch.nn.Module):
    """Acts on ``a - b``: wrong wherever the two inputs (of one shape) arrive swapped or equal."""

    def forward(self, a, b):
        return ((a - b).sum(-1) > 0).long()


@cuda
async def test_server_on_cuda_keeps_two_inputs_of_one_shape_apart():
    """Two observation leaves of the same shape and dtype are staged in page-locked memory of their
    own each, so that the second's copy never overwrites the first's before it reached the GPU:
    the server on CUDA acts as worker inference on the CPU does."""
    from gymnasium import spaces
    from tensordict.nn import TensorDictModule

    from aiocollect.testing import SpacesEnv

    box = spaces.Box(-1.0, 1.0, (64,), dtype="float32")

    def env():
        return SpacesEnv(spaces.Dict({"a": box, "b": box}), spaces.Discrete(2), episode_length=9)

    async def collect(**kw):
        policy = TensorDictModule(_Difference(), in_keys=["a", "b"],
                                  out_keys=["action"])
        async with Collector(env, policy, frames_per_batch=2 * 4 * 8, total_frames=2 * 4 * 8 * 3, num_workers=2,
                             envs_per_worker=4, seed=0, **kw) as c:
            return [batch.to("cpu").clone() async for batch in c]

    with anyio.fail_after(120):
        gpu = await collect(inference="server", policy_device="cuda")
        cpu = await collect()
    for g, c in zip(gpu, cpu):
        assert torch.equal(g["action"], c["action"])
