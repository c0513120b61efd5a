"""A policy trained in place is never silently stale: the workers run a copy of the policy, so a
script ported from TorchRL's in-process collector (which steps the user's module itself, and
whose docs call ``update_policy_weights_()`` a no-op there) would collect with the first weights
for ever. The collector says so once, with the fix; the on-policy setting (``prefetch=0``) gives
batches whose every frame carries the newest version; ``update_policy_weights_`` takes TorchRL
0.14.1's keywords."""

from __future__ import annotations

import logging

import anyio
import pytest
import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector, CollectorState, ConfigError
from aiocollect._core.errors import ConfigTypeError
from aiocollect._collector.weightsync import STALE_POLICY, InPlaceWatch
from aiocollect.testing import CountingEnv

STALE = STALE_POLICY.split("(", 1)[0][:60]  # the start of the message


class Scored(torch.nn.Module):
    """Action 0 always; writes its weights' mean into each frame (as ``weight_id``), so a frame
    says which weights chose it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(8))

    def forward(self, obs):
        n = obs.shape[0]
        return torch.zeros(n, dtype=torch.int64), self.w.detach().mean().expand(n).clone()


def make_policy() -> tuple[Scored, TensorDictModule, torch.optim.Optimizer]:
    net = Scored()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action", "weight_id"])
    return net, policy, torch.optim.SGD(net.parameters(), lr=1.0)


def train_step(net: Scored, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step on the policy, in place: every weight goes up by 1."""
    optimizer.zero_grad()
    (-net.w.sum()).backward()
    optimizer.step()


def counting():
    return CountingEnv(episode_length=20)


def stale_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aiocollect" and r.getMessage().startswith(STALE)]


@pytest.fixture(autouse=True)
def _warnings_logged(caplog):
    caplog.set_level(logging.WARNING, logger="aiocollect")


@pytest.mark.parametrize("num_workers, inference", [(0, "worker"), (2, "worker"), (2, "server")],
                         ids=["local", "workers", "server"])
async def test_a_policy_trained_in_place_without_an_update_is_said_once_with_the_fix(caplog, num_workers, inference):
    """Also with server inference, whose forward passes run a copy of the weights of their own."""
    net, policy, optimizer = make_policy()
    async with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 6, num_workers=num_workers,
                         envs_per_worker=2, inference=inference) as c:
        ids = []
        async for batch in c:  # the ported loop: trains in place, never publishes
            ids.append(float(batch["weight_id"].max()))
            train_step(net, optimizer)
    assert ids == [0.0] * 6, "the workers and the server (as documented) keep the weights they were given"
    (record,) = stale_records(caplog)  # once, not once per batch
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    for fix in ("await collector.update_weights(policy)", "update_policy_weights_()", "update_at_each_batch=True",
                "prefetch=0"):
        assert fix in message, f"the message should name {fix!r}: {message}"


async def test_a_fused_optimizer_is_seen_too(caplog):
    """Fused optimizers change parameters without bumping their version counters: their new
    gradients give them away."""
    net, policy, _ = make_policy()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1, fused=True)
    async with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 3, num_workers=0,
                         envs_per_worker=2) as c:
        async for _ in c:
            train_step(net, optimizer)
    assert len(stale_records(caplog)) == 1


@pytest.mark.parametrize("order", ["train_then_update", "update_then_train"])
async def test_an_update_every_batch_is_never_warned_about(caplog, order):
    net, policy, optimizer = make_policy()
    async with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 6, num_workers=1,
                         envs_per_worker=2) as c:
        async for _ in c:
            if order == "update_then_train":  # publishes the previous step's weights, then trains
                await c.update_weights(policy)
                train_step(net, optimizer)
            else:
                train_step(net, optimizer)
                await c.update_weights(policy)
    assert stale_records(caplog) == []


async def test_updates_after_the_workers_are_done_count_as_updates(caplog):
    """Once total_frames are collected, update_weights publishes nothing (no worker will collect
    again) but still returns a new version; the batches still buffered then are not stale."""
    net, policy, optimizer = make_policy()
    async with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 3, num_workers=1,
                         envs_per_worker=2, prefetch=2) as c:
        async for _ in c:
            if c.batches == 1:
                with anyio.fail_after(30):
                    while c.state is not CollectorState.STOPPED:  # every batch collected, two still buffered
                        await anyio.sleep(0.01)
            train_step(net, optimizer)
            await c.update_weights(policy)
    assert c.batches == 3 and c.policy_version == 3
    assert stale_records(caplog) == []


async def test_update_at_each_batch_is_never_warned_about(caplog):
    net, policy, optimizer = make_policy()
    async with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 6, num_workers=1, envs_per_worker=2,
                         update_at_each_batch=True) as c:
        async for _ in c:
            train_step(net, optimizer)
    assert stale_records(caplog) == []


def test_the_blocking_ported_loop_with_update_policy_weights_is_never_warned_about(caplog):
    net, policy, optimizer = make_policy()
    with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 5, num_workers=1, envs_per_worker=2,
                   prefetch=0) as c:
        ids = []
        for batch in c:
            ids.append(float(batch["weight_id"].max()))
            train_step(net, optimizer)
            c.update_policy_weights_()  # TorchRL's idiom: the constructor's policy, as it is now
    assert ids == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert stale_records(caplog) == []


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("delivery", ["sync"])
async def test_prefetch_0_gives_every_frame_the_latest_version_after_each_update(num_workers, delivery):
    """The on-policy setting, as a user program: construct, iterate to the end training in place
    and publishing after each step, close; then every frame of each batch was collected with the
    version published last before that batch was asked for."""
    net, policy, optimizer = make_policy()
    c = Collector(counting, policy, frames_per_batch=8, total_frames=8 * 6, num_workers=num_workers,
                  envs_per_worker=2, delivery=delivery, prefetch=0)
    seen = []  # per batch: (the latest version when it was asked for, its frames' versions, their weights)
    latest = 0
    async with c:
        async for batch in c:
            seen.append((latest, batch["collector", "policy_version"].clone(), batch["weight_id"].clone()))
            train_step(net, optimizer)
            latest = await c.update_weights(policy)
    assert c.state.value == "closed"
    assert len(seen) == 6
    for i, (want, versions, weights) in enumerate(seen):
        assert want == i
        assert (versions == want).all(), f"batch {i}: versions {versions.unique().tolist()}, want only {want}"
        assert (weights == float(want)).all(), f"batch {i}: collected with weights {weights.unique().tolist()}"


# -- update_policy_weights_ with TorchRL 0.14.1's keywords -------------------------------------------


@pytest.mark.parametrize("keyword", ["positional", "policy_or_weights", "policy", "weights", "policy_weights"])
def test_update_policy_weights_takes_torchrls_names_for_the_weights(keyword):
    net, policy, _ = make_policy()
    with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 4, num_workers=1, envs_per_worker=2,
                   prefetch=0) as c:
        next(iter(c))
        with torch.no_grad():
            net.w.fill_(5.0)
        given = policy if keyword in ("positional", "policy_or_weights", "policy") else policy.state_dict()
        if keyword == "positional":
            version = c.update_policy_weights_(given)
        else:
            version = c.update_policy_weights_(**{keyword: given})
        assert version == 1 and c.worker_versions == (1,)
        batch = next(iter(c))
        assert (batch["weight_id"] == 5.0).all()


def test_update_policy_weights_takes_worker_ids_model_id_and_weights_dict():
    net, policy, _ = make_policy()
    with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 4, num_workers=2, envs_per_worker=2,
                   prefetch=0) as c:
        next(iter(c))
        with torch.no_grad():
            net.w.fill_(2.0)
        assert c.update_policy_weights_(policy=policy, worker_ids=[1]) == 1
        assert c.worker_versions == (0, 1)
        assert c.update_policy_weights_(weights=net.state_dict(), model_id="policy") == 2
        assert c.update_policy_weights_(weights_dict={"policy": net}, worker_ids=0, model_id=None) == 3
        assert c.update_policy_weights_(model_id=None) == 4  # TorchRL's default: the whole policy
        assert c.worker_versions == (4, 4)
        batch = next(iter(c))
        assert (batch["weight_id"] == 2.0).all()


def test_update_policy_weights_refuses_what_has_no_meaning_here_naming_it():
    net, policy, _ = make_policy()
    with Collector(counting, policy, frames_per_batch=8, total_frames=8 * 2, num_workers=1, envs_per_worker=2) as c:
        with pytest.raises(ConfigError, match="both policy_or_weights= and weights="):
            c.update_policy_weights_(policy, weights=policy.state_dict())
        with pytest.raises(ConfigError, match="both weights= and policy="):
            c.update_policy_weights_(weights=policy.state_dict(), policy=policy)
        with pytest.raises(ConfigError, match=r"worker_ids=device\(type='cpu'\).*by index"):
            c.update_policy_weights_(policy, worker_ids=torch.device("cpu"))
        with pytest.raises(ConfigError, match=r"worker_ids=\[device.*by index"):
            c.update_policy_weights_(policy, worker_ids=[torch.device("cpu")])
        with pytest.raises(ConfigError, match=r"worker index: weights.*worker_ids=\[index\]"):
            c.update_policy_weights_({0: policy.state_dict()})
        with pytest.raises(ConfigError, match="both model_id='policy' and weights_dict"):
            c.update_policy_weights_(weights_dict={"policy": policy}, model_id="policy")
        with pytest.raises(ConfigError, match="model_id='actor'.*'policy.<path>'"):
            c.update_policy_weights_(policy, model_id="actor")  # a TorchRL weight-sync scheme's name
        with pytest.raises(ConfigTypeError, match="keyword server_weights=.*does not take"):
            c.update_policy_weights_(policy, server_weights=True)
        assert c.policy_version == 0  # nothing was published
        for _ in c:
            pass


def test_the_watch_reads_version_counters_and_gradients():
    """The unit: in-place changes (optimizer steps, copy_, load_state_dict, buffers) and new
    gradients are changes; reading the policy is not."""
    net = torch.nn.BatchNorm1d(3)
    watch = InPlaceWatch(net)
    watch.mark(0)
    net.eval()
    net(torch.randn(4, 3))
    assert not watch.changed()
    net.train()
    net(torch.randn(4, 3))  # running statistics: buffers, changed in place
    assert watch.changed()
    watch.mark(1)
    net.load_state_dict(net.state_dict())
    assert watch.changed()
    net.eval()
    watch.mark(2)
    net(torch.randn(4, 3)).sum().backward()  # gradients only (what betrays a fused optimizer)
    assert watch.changed()
    watch.mark(3)
    assert not watch.changed()
    net.weight.grad.zero_()  # (gradients accumulated in place)
    assert watch.changed()
