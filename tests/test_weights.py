"""Weight synchronisation: versioned, shared memory, applied at batch boundaries only, never
half-written, acknowledged; every frame carries the version of the weights that chose it."""

from __future__ import annotations

import anyio
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from aiocollect import AiocollectError, Collector, ConfigError
from aiocollect.events import WeightsApplied, WeightsUpdated
from aiocollect.testing import CountingEnv


class Marked(torch.nn.Module):
    """Writes its weights' identity into every frame: all 256 entries of `w` hold the same value,
    set to the version number by the test, and the policy outputs their mean and max-min spread.
    A frame whose `weight_id` differs from its policy_version, or whose spread is not 0 (a torn,
    half-written copy), breaks the invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(256))

    def forward(self, obs):
        n = obs.shape[0]
        w = self.w.detach()
        return (torch.zeros(n, dtype=torch.int64), w.mean().expand(n).clone(), (w.max() - w.min()).expand(n).clone())


def marked_policy() -> tuple[Marked, TensorDictModule]:
    net = Marked()
    return net, TensorDictModule(net, in_keys=["observation"], out_keys=["action", "weight_id", "spread"])


def counting():
    return CountingEnv(episode_length=20, step_sleep=0.0005)


@pytest.mark.parametrize("num_workers,delivery", [(0, "sync"), (2, "sync"), (2, "async")])
async def test_no_frame_carries_a_version_whose_weights_it_was_not_collected_with(num_workers, delivery):
    net, policy = marked_policy()
    frames = []
    async with Collector(counting, policy, frames_per_batch=16, total_frames=16 * 40, num_workers=num_workers,
                         envs_per_worker=2, delivery=delivery) as c:
        async def updater():
            version = 0
            while True:  # until the collection is over
                version += 1
                with torch.no_grad():
                    net.w.fill_(version)
                assert await c.update_weights(net, wait=False) == version
                await anyio.sleep(0.003)

        async with anyio.create_task_group() as tg:
            tg.start_soon(updater)
            async for batch in c:
                frames.append(batch)
                if len(frames) == 39:  # stop updating before the collector stops
                    tg.cancel_scope.cancel()
    data = torch.cat([b.reshape(-1) for b in frames])
    version = data["collector", "policy_version"]
    wrong = data["weight_id"] != version.float()
    assert not wrong.any(), (
        f"{int(wrong.sum())} frames collected with other weights than their version: "
        f"versions {version[wrong][:10].tolist()} weights {data['weight_id'][wrong][:10].tolist()}"
    )
    assert (data["spread"] == 0).all(), "half-written weights"
    assert len(version.unique()) >= 2, f"the updates should land during collection, versions: {version.unique().tolist()}"
    per_batch_worker = [b["collector", "policy_version"] for b in frames]
    for pv in per_batch_worker:  # constant within each worker's part of a batch
        rows = pv.reshape(-1, 2, pv.shape[-1]) if num_workers and delivery == "sync" else pv.reshape(1, -1, pv.shape[-1])
        for part in rows:
            assert (part == part.flatten()[0]).all(), f"version changed within a worker batch: {part.tolist()}"


async def test_wait_returns_once_every_worker_applied_and_events_report_latency():
    net, policy = marked_policy()
    async with Collector(counting, policy, frames_per_batch=16, num_workers=2, envs_per_worker=2, prefetch=0) as c:
        updated, applied = [], []
        c.on(WeightsUpdated, updated.append)
        c.on(WeightsApplied, applied.append)
        await c.collect()
        with torch.no_grad():
            net.w.fill_(7)
        with anyio.fail_after(10):  # prefetch=0: the workers are idle, and apply at once
            version = await c.update_weights(net)
        assert c.worker_versions == (version, version) == (1, 1) and c.policy_version == 1
        assert [(e.version, e.workers) for e in updated] == [(1, (0, 1))]
        assert sorted((e.version, e.worker) for e in applied) == [(1, 0), (1, 1)]
        assert all(e.latency >= 0 for e in applied)
        batch = await c.collect()
        assert (batch["collector", "policy_version"] == 1).all() and (batch["weight_id"] == 7).all()


async def test_update_at_each_batch_pulls_the_reference_policy():
    net, policy = marked_policy()
    async with Collector(counting, policy, frames_per_batch=16, total_frames=16 * 6, num_workers=1, envs_per_worker=2,
                         update_at_each_batch=True, prefetch=0) as c:
        async for batch in c:
            pv = int(batch["collector", "policy_version"][0, 0])
            assert (batch["weight_id"] == float(c.batches - 1)).all() and pv == c.batches
            with torch.no_grad():
                net.w.fill_(c.batches)  # picked up before the next batch


async def test_updates_reach_workers_after_the_policy_moves_to_another_device_or_dtype():
    """Regression (TorchRL): update, .to(), update again: the workers see the latest weights."""
    net, policy = marked_policy()
    target = "cuda" if torch.cuda.is_available() else torch.float64
    async with Collector(counting, policy, frames_per_batch=16, num_workers=1, envs_per_worker=2, prefetch=0) as c:
        with torch.no_grad():
            net.w.fill_(1)
        await c.update_weights(policy)
        net.to(target)
        with torch.no_grad():
            net.w.fill_(2)
        await c.update_weights(policy)
        batch = await c.collect()
    assert (batch["weight_id"] == 2).all() and (batch["collector", "policy_version"] == 2).all()


@pytest.mark.parametrize("form", ["module", "tdmodule", "tensordict", "state_dict"])
async def test_weights_in_every_form(form):
    net, policy = marked_policy()
    async with Collector(counting, policy, frames_per_batch=16, num_workers=1, envs_per_worker=2, prefetch=0) as c:
        source = Marked()
        with torch.no_grad():
            source.w.fill_(5)
        weights = {"module": source, "tdmodule": TensorDictModule(source, ["observation"], ["action"]),
                   "tensordict": TensorDict.from_module(source), "state_dict": source.state_dict()}[form]
        await c.update_weights(weights)
        batch = await c.collect()
    assert (batch["weight_id"] == 5).all()


async def test_per_worker_update_changes_only_the_targeted_workers():
    net, policy = marked_policy()
    async with Collector(counting, policy, frames_per_batch=16, num_workers=2, envs_per_worker=2, prefetch=0) as c:
        with torch.no_grad():
            net.w.fill_(3)
        version = await c.update_weights(net, worker_ids=[1])
        assert c.worker_versions == (0, version)
        batch = await c.collect()
    assert batch["weight_id"][:2].eq(0).all() and batch["weight_id"][2:].eq(3).all()
    assert batch["collector", "policy_version"][:2].eq(0).all() and batch["collector", "policy_version"][2:].eq(1).all()


async def test_weight_sync_errors_name_the_cause():
    net, policy = marked_policy()
    with pytest.raises(ConfigError, match="update_at_each_batch=True"):
        Collector(counting, frames_per_batch=8, update_at_each_batch=True)
    async with Collector(counting, policy, frames_per_batch=16, num_workers=1, envs_per_worker=2) as c:
        with pytest.raises(ValueError, match="model_id='value'"):
            await c.update_weights(net, model_id="value")
        with pytest.raises(ValueError, match="worker_ids=\\[4\\]"):
            await c.update_weights(net, worker_ids=[4])
        with pytest.raises(KeyError, match="lack \\['w'\\]"):
            await c.update_weights({"other": torch.zeros(3)})
    async with Collector(counting, frames_per_batch=16, num_workers=1) as c:
        with pytest.raises(AiocollectError, match="no weights"):
            await c.update_weights(net)
