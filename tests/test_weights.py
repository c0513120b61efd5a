"""Weight synchronisation: versioned, shared memory, applied at batch boundaries only, never
half-written, acknowledged; every frame carries the version of the weights that chose it."""

from __future__ import annotations

import contextlib
import gc
import os

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule

from aiocollect import AiocollectError, Collector, ConfigError
from aiocollect.events import WeightsApplied, WeightsUpdated
from aiocollect.testing import CountingEnv
from conftest import _shm_in_use


class Marked(torch.nn.Module):
    """Writes its weights' identity into every frame: all 256 entries of `w` hold the same value,
    set to the version number by the test, and the policy outputs their mean and max-min spread.
    A frame whose `weight_id` differs from its policy_version, or whose spread is not 0 (a torn,
    half-written copy), breaks the invariant."""

    def __init__(self, size: int = 256) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(size))

    def forward(self, obs):
        n = obs.shape[0]
        w = self.w.detach()
        return (torch.zeros(n, dtype=torch.int64), w.mean().expand(n).clone(), (w.max() - w.min()).expand(n).clone())


def marked_policy(size: int = 256) -> tuple[Marked, TensorDictModule]:
    net = Marked(size)
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


async def test_a_big_policy_is_written_in_parts_while_the_loop_runs_and_each_version_lands_whole(monkeypatch):
    """Worker inference, a policy of 4 MiB written into the shared store: the loop runs between
    the parts of the copy (a task on it sees the store being written), two updates started
    together land whole and in order, and one cancelled while its copy is under way still lands
    (its version is made); every later frame acts with the weights its version names."""
    from aiocollect._collector import weightsync
    from aiocollect._worker.weights import PART_BYTES

    monkeypatch.setattr(weightsync, "WRITE_SLICE_S", 0.0)  # let the loop run after every part
    size = 4 * PART_BYTES // 4
    net, policy = marked_policy(size)
    async with Collector(counting, policy, frames_per_batch=16, num_workers=2, envs_per_worker=2, prefetch=0) as c:
        await c.collect()
        store = c._run.shared.sync.store
        seen_writing = 0

        async def watch(stop: anyio.Event) -> None:
            nonlocal seen_writing
            while not stop.is_set():
                seen_writing += int(any(int(seq) & 1 for seq in store.header[:2]))
                await anyio.lowlevel.checkpoint()

        async def update(value: float, versions: dict[int, float]) -> None:
            weights = {"w": torch.full((size,), value)}
            versions[await c.update_weights(weights, wait=False)] = value

        stop, versions = anyio.Event(), {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, stop)
            async with anyio.create_task_group() as updates:  # (which one gets version 1: the loop's choice)
                updates.start_soon(update, 1.0, versions)
                updates.start_soon(update, 2.0, versions)
            stop.set()
        assert seen_writing >= 2, "the loop should run while the store is written"
        assert sorted(versions) == [1, 2] and store.latest_version == 2
        assert store.views[int(store.header[2])][0].eq(versions[2]).all()

        with anyio.CancelScope() as scope:  # cancelled once its copy is under way
            async with anyio.create_task_group() as tg:
                tg.start_soon(update, 3.0, {})
                while not any(int(seq) & 1 for seq in store.header[:2]):
                    await anyio.lowlevel.checkpoint()
                scope.cancel()
        assert store.latest_version == 3 == c.policy_version
        with anyio.fail_after(30):
            batch = await c.collect()
            while not (batch["collector", "policy_version"] == 3).all():  # (applied at a batch boundary)
                batch = await c.collect()
        assert (batch["weight_id"] == 3.0).all() and (batch["spread"] == 0).all()


@pytest.mark.asyncio_only
@pytest.mark.parametrize("where", ["copying", "waiting"])
async def test_an_update_cancelled_by_task_cancel_lands_whole_and_leaves_nothing_mapped(monkeypatch, where):
    """``task.cancel()`` (``asyncio.wait_for``'s timeout; a shield does not stop it) of an update
    while its copy of a 4 MiB policy is under way, or while it waits for another update's copy: the
    update being copied lands whole and the workers apply it, the cancellation is raised, and once
    the collector is closed none of its shared memory is mapped, with the garbage collector off: no
    reference cycle keeps the stores, or the batch the training loop held, until it runs."""
    import asyncio

    from aiocollect._collector import weightsync
    from aiocollect._worker.weights import PART_BYTES

    monkeypatch.setattr(weightsync, "WRITE_SLICE_S", 0.0)  # let the loop run after every part
    size = 4 * PART_BYTES // 4
    net, policy = marked_policy(size)
    gc.collect()
    gc.disable()
    try:
        async with Collector(counting, policy, frames_per_batch=16, num_workers=2, envs_per_worker=2,
                             prefetch=0) as c:
            batch = await c.collect()  # (held meanwhile, as a training loop holds it)
            store = c._run.shared.sync.store

            async def update(value: float) -> None:
                await c.update_weights({"w": torch.full((size,), value)}, wait=False)

            first = asyncio.ensure_future(update(1.0))
            with anyio.fail_after(30):
                while not any(int(seq) & 1 for seq in store.header[:2]):  # its copy is under way
                    await asyncio.sleep(0)
                if where == "copying":
                    first.cancel()
                    await asyncio.wait({first})
                    assert first.cancelled()
                else:
                    second = asyncio.ensure_future(update(2.0))
                    await asyncio.sleep(0)  # (waiting for the first one's copy)
                    second.cancel()
                    await asyncio.wait({first, second})
                    assert second.cancelled() and first.exception() is None
                    del second
                del first
                assert store.latest_version == 1 == c.policy_version
                del store
                batch = await c.collect()
                while not (batch["collector", "policy_version"] == 1).all():  # (applied at a batch boundary)
                    batch = await c.collect()
            assert (batch["weight_id"] == 1.0).all() and (batch["spread"] == 0).all()
        del batch
        assert _shm_in_use() == []
    finally:
        gc.enable()


@pytest.mark.parametrize("targets", ["all", "one"])
async def test_a_collector_closed_while_an_update_is_written_ends_the_update_cleanly(monkeypatch, targets):
    """``aclose()`` while an update's copy is under way (into the shared store, or a worker's own;
    the copy held until the collector closed): the update returns its version, nothing is left."""
    from aiocollect._collector import weightsync

    writing, closed = anyio.Event(), anyio.Event()
    write = weightsync._write

    async def held_write(*args):
        writing.set()
        await closed.wait()
        return await write(*args)

    monkeypatch.setattr(weightsync, "_write", held_write)
    net, policy = marked_policy()
    c = Collector(counting, policy, frames_per_batch=16, num_workers=2, envs_per_worker=2, prefetch=0)
    versions = []
    with anyio.fail_after(60):
        await c.collect()

        async def update() -> None:
            versions.append(await c.update_weights(net, worker_ids=None if targets == "all" else [1], wait=False))

        async with anyio.create_task_group() as tg:
            tg.start_soon(update)
            await writing.wait()
            await c.aclose()
            closed.set()
    assert versions == [1]


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


# -- several models per worker, and distinct policies per worker ----------------------------------


class Vec(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))


class TwoModels(torch.nn.Module):
    """An actor and a critic in one policy (``policy.actor``, ``policy.critic``): each frame
    records the identity of both weight vectors and whether either was torn."""

    def __init__(self, actor: int = 256, critic: int = 64) -> None:
        super().__init__()
        self.actor = Vec(actor)
        self.critic = Vec(critic)

    def forward(self, obs):
        n = obs.shape[0]
        a, c = self.actor.w.detach(), self.critic.w.detach()
        spread = (a.max() - a.min()) + (c.max() - c.min())
        return (torch.zeros(n, dtype=torch.int64), a.mean().expand(n).clone(), c.mean().expand(n).clone(),
                spread.expand(n).clone())


def two_models(actor: int = 256, critic: int = 64) -> TensorDictModule:
    return TensorDictModule(TwoModels(actor, critic), in_keys=["observation"],
                            out_keys=["action", "actor_id", "critic_id", "spread"])


def filled(n: int, value: float) -> Vec:
    v = Vec(n)
    with torch.no_grad():
        v.w.fill_(value)
    return v


@pytest.mark.parametrize("num_workers,delivery", [(0, "sync"), (2, "sync"), (2, "async")])
async def test_weights_dict_updates_several_models_as_one_version(num_workers, delivery):
    frames = []
    async with Collector(counting, two_models(), frames_per_batch=16, total_frames=16 * 30, num_workers=num_workers,
                         envs_per_worker=2, delivery=delivery) as c:
        updated = []
        c.on(WeightsUpdated, updated.append)

        async def updater():
            version = 0
            while True:
                version += 1
                got = await c.update_weights(
                    weights_dict={"policy.actor": filled(256, version), "policy.critic": filled(64, version)}, wait=False
                )
                assert got == version
                await anyio.sleep(0.003)

        async with anyio.create_task_group() as tg:
            tg.start_soon(updater)
            async for batch in c:
                frames.append(batch)
                if len(frames) == 29:
                    tg.cancel_scope.cancel()
    data = torch.cat([b.reshape(-1) for b in frames])
    version = data["collector", "policy_version"].float()
    assert len(version.unique()) >= 2, "the updates should land during collection"
    torn = (data["actor_id"] != version) | (data["critic_id"] != version)
    assert not torn.any(), (
        f"{int(torn.sum())} frames saw one model's weights without the other's: versions {version[torn][:8].tolist()}, "
        f"actor {data['actor_id'][torn][:8].tolist()}, critic {data['critic_id'][torn][:8].tolist()}"
    )
    assert (data["spread"] == 0).all(), "half-written weights"
    assert updated[0].model_ids == ("policy.actor", "policy.critic") and updated[0].model_id == "policy.actor"


async def test_a_submodule_update_leaves_the_rest_of_the_policy_as_it_was():
    policy = two_models()
    with torch.no_grad():
        policy.module.critic.w.fill_(-1)  # what the workers start with
    async with Collector(counting, policy, frames_per_batch=16, num_workers=2, envs_per_worker=2, prefetch=0) as c:
        assert await c.update_weights(filled(256, 5), model_id="policy.actor") == 1
        batch = await c.collect()
        assert (batch["actor_id"] == 5).all() and (batch["critic_id"] == -1).all()
        # the TensorDictModule's own path, and a state dict of the submodule, work too
        await c.update_weights(filled(64, 7).state_dict(), model_id="policy.module.critic")
        batch = await c.collect()
        assert (batch["actor_id"] == 5).all() and (batch["critic_id"] == 7).all()
        assert (batch["collector", "policy_version"] == 2).all()
        # and so does the whole policy (or its state dict) with a submodule's id: only that part is taken
        whole = two_models()
        with torch.no_grad():
            whole.module.actor.w.fill_(8)
            whole.module.critic.w.fill_(8)
        await c.update_weights(whole, model_id="policy.critic")
        await c.update_weights(whole.state_dict(), model_id="policy.critic")
        batch = await c.collect()
        assert (batch["actor_id"] == 5).all() and (batch["critic_id"] == 8).all()
        await c.update_weights(filled(64, 7), model_id="policy.critic")
        # worker 1 alone gets a whole policy; then a broadcast of the actor: the newest change of
        # each tensor wins, whichever store it came through
        full = TwoModels()
        with torch.no_grad():
            full.actor.w.fill_(3)
            full.critic.w.fill_(3)
        await c.update_weights(full, worker_ids=[1])
        await c.update_weights(filled(256, 9), model_id="policy.actor")
        batch = await c.collect()
    assert batch["actor_id"].eq(9).all()
    assert batch["critic_id"][:2].eq(7).all() and batch["critic_id"][2:].eq(3).all()
    assert batch["collector", "policy_version"].eq(7).all()


async def test_none_updates_a_submodule_from_the_constructors_policy():
    policy = two_models()
    async with Collector(counting, policy, frames_per_batch=16, num_workers=1, envs_per_worker=2, prefetch=0) as c:
        with torch.no_grad():
            policy.module.actor.w.fill_(4)
            policy.module.critic.w.fill_(4)
        await c.update_weights(model_id="policy.critic")
        batch = await c.collect()
    assert (batch["critic_id"] == 4).all() and (batch["actor_id"] == 0).all()


def small_factory():
    return two_models(actor=256, critic=64)


def large_factory():
    return two_models(actor=512, critic=64)


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_one_policy_factory_per_worker_each_with_its_own_weights(num_workers):
    factories = [small_factory, large_factory][: max(num_workers, 1)]
    async with Collector(counting, policy_factory=factories, frames_per_batch=16, num_workers=num_workers,
                         envs_per_worker=2, prefetch=0) as c:
        last = factories[-1]
        with pytest.raises(ValueError, match=r"worker 0: .*'actor.w' of shape \(512,\).* shape \(256,\)") if num_workers else contextlib.nullcontext():
            # distinct shapes: the large actor does not fit worker 0's policy
            await c.update_weights(last().module, worker_ids=None)
        for w, n in enumerate([256, 512][: c.config.workers]):
            model = TwoModels(actor=n)
            with torch.no_grad():
                model.actor.w.fill_(10 + w)
                model.critic.w.fill_(10 + w)
            await c.update_weights(model, worker_ids=[w])
        # the critic has the same shape in both: one broadcast updates it everywhere
        version = await c.update_weights(filled(64, 1), model_id="policy.critic")
        assert c.worker_versions == (version,) * c.config.workers
        batch = await c.collect()
    for w in range(c.config.workers):
        rows = slice(2 * w, 2 * w + 2)
        assert batch["actor_id"][rows].eq(10 + w).all() and batch["critic_id"][rows].eq(1).all()


async def test_multi_model_errors_name_the_cause():
    with pytest.raises(ConfigError, match="list of 3 factories but there are 2 workers"):
        Collector(counting, policy_factory=[small_factory] * 3, frames_per_batch=16, num_workers=2)
    with pytest.raises(ConfigError, match=r"policy_factory\[1\]=3 is not callable"):
        Collector(counting, policy_factory=[small_factory, 3], frames_per_batch=16, num_workers=2)
    async with Collector(counting, two_models(), frames_per_batch=16, num_workers=1, envs_per_worker=2) as c:
        with pytest.raises(ValueError, match="no submodule 'value'.*\\['policy.actor', 'policy.critic'\\]"):
            await c.update_weights(filled(64, 1), model_id="policy.value")
        with pytest.raises(ValueError, match="'policy' and 'policy.actor' overlap"):
            await c.update_weights(weights_dict={"policy": TwoModels(), "policy.actor": filled(256, 1)})
        with pytest.raises(ValueError, match="'policy.actor' and 'policy.module.actor' overlap: both update 'actor.w'"):
            await c.update_weights(weights_dict={"policy.actor": filled(256, 1), "policy.module.actor": filled(256, 2)})
        with pytest.raises(ValueError, match="either weights_dict"):
            await c.update_weights(TwoModels(), weights_dict={"policy.actor": filled(256, 1)})
        with pytest.raises(ValueError, match="non-empty"):
            await c.update_weights(weights_dict={})
        with pytest.raises(KeyError, match=r"^the weights given for 'policy.critic' lack \['w'\] .* tensors: \['w'\]\);"):
            await c.update_weights({"v": torch.zeros(64)}, model_id="policy.critic")
        assert c.policy_version == 0  # nothing was published
    async with Collector(counting, policy_factory=small_factory, frames_per_batch=16, num_workers=1) as c:
        with pytest.raises(ValueError, match="no policy of its own"):
            await c.update_weights(model_id="policy.actor")


# -- the store itself --------------------------------------------------------------------------


def store_and_reader(values=(0.0, 0.0)):
    from aiocollect._worker.weights import WeightReader, WeightStore

    def model():
        m = torch.nn.Module()
        m.a, m.b = filled(8, values[0]), filled(4, values[1])
        return m

    worker = model()
    reader = WeightReader(worker)
    store = WeightStore.create(reader.layout, bytearray(reader.layout.nbytes))
    reader.add(store)
    return store, reader, worker


def test_store_partial_updates_carry_over_and_readers_copy_only_what_changed():
    store, reader, worker = store_and_reader(values=(-1, -2))
    store.publish({"a.w": torch.full((8,), 2.0)}, 1)  # only "a": "b" keeps the worker's own value
    assert reader.apply() == 1 and worker.a.w.eq(2).all() and worker.b.w.eq(-2).all()
    assert reader.have.tolist() == [1, 0]
    store.publish({"b.w": torch.full((4,), 3.0)}, 2)  # into the other buffer: "a" carried over
    store.publish({"b.w": torch.full((4,), 4.0)}, 3)
    with torch.no_grad():
        worker.a.w.fill_(99)  # a reader copies only tensors changed since its version: "a" is not
    assert reader.apply() == 3 and worker.a.w.eq(99).all() and worker.b.w.eq(4).all()
    assert reader.have.tolist() == [1, 3] and reader.apply() is None
    fresh_store_reader = store_and_reader()[1:]
    late, late_worker = fresh_store_reader
    late.add(store)  # a reader that saw nothing gets every tensor ever published, at its newest
    assert late.apply() == 3 and late_worker.a.w.eq(2).all() and late_worker.b.w.eq(4).all()


def test_store_failed_publish_is_never_seen_and_the_next_one_is_complete():
    store, reader, worker = store_and_reader()
    store.publish({"a.w": torch.full((8,), 1.0), "b.w": torch.full((4,), 1.0)}, 1)
    with pytest.raises(RuntimeError):
        store.publish({"a.w": torch.full((8,), 5.0), "b.w": torch.zeros(3)}, 2)  # "a" written, then it fails
    assert store.latest_version == 1 and all(int(s) % 2 == 0 for s in store.header[:2])
    assert reader.apply() == 1 and worker.a.w.eq(1).all()
    store.publish({"b.w": torch.full((4,), 6.0)}, 2)
    store.publish({"b.w": torch.full((4,), 7.0)}, 3)
    assert reader.apply() == 3 and worker.a.w.eq(1).all() and worker.b.w.eq(7).all()


def test_store_written_in_parts_is_seen_only_once_complete():
    from aiocollect._worker.weights import PART_BYTES, WeightReader, WeightStore

    net = torch.nn.Module()
    net.big = torch.nn.Parameter(torch.zeros(3 * PART_BYTES // 4))  # float32: three parts
    net.small = torch.nn.Parameter(torch.zeros(4))
    reader = WeightReader(net)
    store = WeightStore.create(reader.layout, bytearray(reader.layout.nbytes))
    reader.add(store)
    store.publish({"big": torch.full_like(net.big, 1.0), "small": torch.full((4,), 1.0)}, 1)
    parts = store.publish_in_parts({"big": torch.arange(net.big.numel(), dtype=torch.float32),
                                    "small": torch.full((4,), 2.0)}, 2)
    next(parts), next(parts)  # a third of "big" written, then two
    assert store.latest_version == 1 and reader.apply() == 1 and net.big.eq(1).all()
    assert sum(1 for _ in parts) == 2  # the last part of "big", then "small"
    assert reader.apply() == 2 and net.big.equal(torch.arange(net.big.numel(), dtype=torch.float32))
    store.publish({"small": torch.full((4,), 3.0)}, 3)  # both buffers now hold version 2's "big"
    parts = store.publish_in_parts({"big": torch.full_like(net.big, 4.0), "small": torch.full((4,), 4.0)}, 4)
    next(parts)
    parts.close()  # given up a third of the way into "big": never seen, and the next one is complete
    assert store.latest_version == 3 and all(int(s) % 2 == 0 for s in store.header[:2])
    store.publish({"small": torch.full((4,), 5.0)}, 5)  # into the same buffer: "big" rewritten from version 2's
    fresh = WeightReader(torch.nn.Module())
    fresh.targets, fresh.have = [torch.zeros_like(net.big), torch.zeros(4)], np.zeros(2, dtype=np.int64)
    fresh.add(store)
    for r, big in ((reader, net.big), (fresh, fresh.targets[0])):
        assert r.apply() == 5 and big.equal(torch.arange(net.big.numel(), dtype=torch.float32))
    assert net.small.eq(5).all()


def test_a_released_store_is_unmapped_at_once_unless_a_write_holds_a_view_of_it():
    """``release()`` (the run ended) unmaps a store in shared memory whoever refers to the store
    object; while a write holds a view of it, it stays whole and readable until that write ends
    and it is released again."""
    from aiocollect._core import shm
    from aiocollect._worker.weights import WeightReader, WeightStore

    net = torch.nn.Module()
    net.w = torch.nn.Parameter(torch.zeros(8))
    reader = WeightReader(net)
    fd, mapping = shm.allocate(reader.layout.nbytes, f"aiocollect-{os.getpid()}-test-weights")
    os.close(fd)
    store = WeightStore.create(reader.layout, mapping)
    del mapping
    store.publish({"w": torch.full((8,), 1.0)}, 1)
    parts = store.publish_in_parts({"w": torch.full((8,), 2.0)}, 2)
    next(parts)  # a write under way: its views are in use
    assert not store.release() and store.closed and store.latest_version == 1
    assert sum(1 for _ in parts) == 0 and store.latest_version == 2  # (it ends whole)
    del parts
    assert store.release() and store.buffer.closed and not _shm_in_use()
    assert not store.release()  # (once)


@pytest.mark.parametrize("order", ["shared first", "own first"])
def test_reader_takes_the_newest_change_of_each_tensor_across_stores(order):
    from aiocollect._worker.weights import WeightReader, WeightStore

    shared, reader, worker = store_and_reader()
    own = WeightStore.create(reader.layout, bytearray(reader.layout.nbytes))
    r2 = WeightReader(worker)
    for s in ([shared, own] if order == "shared first" else [own, shared]):
        r2.add(s)
    shared.publish({"a.w": torch.full((8,), 1.0), "b.w": torch.full((4,), 1.0)}, 1)
    own.publish({"a.w": torch.full((8,), 2.0), "b.w": torch.full((4,), 2.0)}, 2)  # this worker only
    shared.publish({"a.w": torch.full((8,), 3.0)}, 3)  # everyone's "a"
    assert r2.apply() == 3
    assert worker.a.w.eq(3).all() and worker.b.w.eq(2).all()


def test_unknown_model_ids_are_answered_with_the_submodules_that_exist():
    from aiocollect._worker.weights import WeightLayout

    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Sequential(torch.nn.Linear(8, 2)))
    layout = WeightLayout.of(net.state_dict())
    with pytest.raises(ValueError, match=r"include \['policy.0', 'policy.2', 'policy.2.0'\]"):
        layout.select("policy.1")
    assert layout.select("policy.2.0") == ("2.0.", ("2.0.weight", "2.0.bias"))


class Greedy(torch.nn.Module):
    """CartPole: a body and a head, acting greedily (so actions can be recomputed exactly)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh())
        self.head = torch.nn.Linear(hidden, 2)

    def forward(self, obs):
        return self.head(self.body(obs)).argmax(-1)


def greedy16():
    return Greedy(16)


def greedy32():
    return Greedy(32)


async def test_distinct_policies_on_cartpole_act_with_the_weights_each_worker_was_sent():
    """CartPole-v1, two workers whose policies differ in width: each gets its own weights, then a
    new head for both of worker 1's models at once; every action in the batch is the one the
    matching reference model takes on its observation."""
    torch.manual_seed(0)
    refs = [Greedy(16), Greedy(32)]
    async with Collector("CartPole-v1", policy_factory=[greedy16, greedy32], frames_per_batch=64, num_workers=2,
                         envs_per_worker=2, prefetch=0, seed=3) as c:
        for w, ref in enumerate(refs):
            await c.update_weights(ref, worker_ids=w)
        new_head = torch.nn.Linear(32, 2)
        refs[1].head.load_state_dict(new_head.state_dict())
        await c.update_weights(weights_dict={"policy.head": new_head, "policy.body": refs[1].body}, worker_ids=[1])
        assert c.worker_versions == (1, 3)
        batch = await c.collect()
    for w, ref in enumerate(refs):
        rows = batch[2 * w: 2 * w + 2]
        assert (rows["collector", "policy_version"] == (1, 3)[w]).all()
        with torch.no_grad():
            expected = ref(rows["observation"])
        assert torch.equal(rows["action"], expected), f"worker {w} acted with other weights"
