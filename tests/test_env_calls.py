"""Reaching into the workers' envs (call, get_attr, set_attr, map_fn, getattr_env,
getattr_policy): one result per env row in row order; a change is applied between two env steps
and every frame whose step began after the call returned carries its env epoch in
("collector", "env_epoch") and steps under it; set_attr (and persist=True calls) survive a
SIGKILLed and restarted worker; an env's error arrives as its own type with the worker's
traceback, and the worker goes on."""

from __future__ import annotations

import os
import pathlib
import signal
import time

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch

from aiocollect import Collector, ConfigError, WorkerError
from aiocollect.events import WorkerRestarted

pytestmark = pytest.mark.loops("asyncio", "uvloop", "trio")


class RewardScale(gym.Wrapper):
    """CartPole (reward 1 per step) whose rewards are multiplied by ``scale``: a frame's reward
    says under which setting it was stepped."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.scale = 1.0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward * self.scale, terminated, truncated, info

    def raise_scale(self, by: float) -> float:
        self.scale += by
        return self.scale

    def raise_scale_slowly(self, by: float, started: str) -> float:
        """As raise_scale, after touching the file ``started`` and a second's sleep."""
        pathlib.Path(started).touch()
        time.sleep(1.0)
        return self.raise_scale(by)


def rows_of(batch) -> tuple[np.ndarray, np.ndarray]:
    return batch["next", "reward"][..., 0].numpy(), batch["collector", "env_epoch"].numpy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_a_curriculum_holds_from_the_call_on_across_a_restarted_worker(delivery):
    """Every few batches set_attr raises the reward scale: every frame carries the epoch it was
    stepped under and its reward is that epoch's scale; with sync delivery every frame of the
    next batch has the new one; a SIGKILLed worker's replacement steps under the latest scale
    (set_attr is replayed before its first batch) without the program noticing."""
    scales = {0: 1.0}
    async with Collector(RewardScale, None, frames_per_batch=64, total_frames=-1, num_workers=2, envs_per_worker=2,
                         delivery=delivery, on_worker_failure="restart") as c:
        killed = False
        for n in range(12):
            batch = await c.collect()
            reward, epoch = rows_of(batch)
            expected = np.vectorize(scales.get)(epoch)
            np.testing.assert_array_equal(reward, expected)
            if delivery == "sync" and n % 3 == 1:
                assert (epoch == c.env_epoch).all()  # (the batch after the call: all of it)
            if n % 3 == 0:
                new = float(n + 2)
                e = await c.set_attr("scale", new)
                assert e == c.env_epoch and e not in scales
                scales[e] = new
                assert await c.get_attr("scale") == [new] * 4
            if n == 6 and not killed:
                pid = c.worker_pids[1]
                os.kill(pid, signal.SIGKILL)
                await c.wait_for(WorkerRestarted)
                killed = True
                assert c.worker_pids[1] != pid
                assert await c.get_attr("scale") == [scales[c.env_epoch]] * 4
        assert c.stats().restarts == 1


async def test_sync_delivery_every_frame_after_the_call_is_under_it_with_the_local_backend():
    async with Collector(RewardScale, None, frames_per_batch=32, total_frames=-1, num_workers=0,
                         envs_per_worker=2) as c:
        await c.collect()
        e = await c.set_attr("scale", 5.0)
        reward, epoch = rows_of(await c.collect())
        assert (epoch == e).all() and (reward == 5.0).all()


async def test_call_get_set_and_map_fn_give_one_result_per_row_in_row_order():
    async with Collector(RewardScale, None, frames_per_batch=32, total_frames=-1, num_workers=2,
                         envs_per_worker=2) as c:
        assert c.env_epoch == 0
        assert await c.set_attr("scale", [1.0, 2.0, 3.0, 4.0]) == 1  # (one value per row)
        assert await c.get_attr("scale") == [1.0, 2.0, 3.0, 4.0]
        assert await c.get_attr("scale", indices=[3, 0]) == [4.0, 1.0]
        assert await c.get_attr("scale", workers=[1]) == [3.0, 4.0]
        assert await c.call("raise_scale", 10.0, indices=[2]) == [13.0]
        assert await c.map_fn(lambda env, k: env.get_wrapper_attr("scale") * k, 2) == [2.0, 4.0, 26.0, 8.0]
        # attributes through gymnasium's wrappers (TimeLimit's), TorchRL's getattr_env: the first env's
        assert await c.get_attr("_max_episode_steps") == [500] * 4
        assert await c.getattr_env("_max_episode_steps") == 500
        assert c.env_epoch == 3
        reward, epoch = rows_of(await c.collect())
        np.testing.assert_array_equal(reward, np.array([1.0, 2.0, 13.0, 4.0])[:, None].repeat(reward.shape[1], 1))
        assert (epoch == 3).all()  # (map_fn starts an epoch too, on every row it reached)


async def test_an_env_error_arrives_as_its_type_with_the_worker_traceback_and_the_worker_goes_on():
    def boom(env):
        raise KeyError("no such level")

    async with Collector(RewardScale, None, frames_per_batch=32, total_frames=-1, num_workers=2,
                         envs_per_worker=1) as c:
        with pytest.raises(KeyError, match="no such level") as info:
            await c.map_fn(boom, indices=[1])
        assert isinstance(info.value, WorkerError) and info.value.worker == 1
        assert "boom" in info.value.worker_traceback
        with pytest.raises(AttributeError, match="nope"):
            await c.call("nope")
        assert (await c.collect()).shape[0] == 2  # the workers go on
        with pytest.raises(ConfigError, match="indices"):
            await c.get_attr("scale", indices=[7])
        with pytest.raises(ConfigError, match="2 values for 1 env rows"):
            await c.set_attr("scale", [1.0, 2.0], indices=[0])


@pytest.mark.timeout(120)
async def test_a_persisted_call_is_made_again_by_a_replacement_and_an_unpersisted_one_is_not():
    async with Collector(RewardScale, None, frames_per_batch=32, total_frames=-1, num_workers=1,
                         envs_per_worker=1, on_worker_failure="restart") as c:
        await c.collect()
        await c.call("raise_scale", 1.0, persist=True)  # 2.0, kept
        await c.call("raise_scale", 5.0)  # 7.0, gone with the envs
        assert await c.get_attr("scale") == [7.0]
        os.kill(c.worker_pids[0], signal.SIGKILL)
        await c.wait_for(WorkerRestarted)
        assert await c.get_attr("scale") == [2.0]
        reward, epoch = rows_of(await c.collect())
        assert (reward == 2.0).all() and (epoch == 1).all()  # (the epoch of the last kept call)


async def test_a_call_in_flight_when_its_worker_is_replaced_is_replayed_and_answered_once():
    """A replacement built while a change is in flight to the worker it replaces applies that
    change with the kept calls, before its first step (a Ray actor takes calls and batches on two
    threads: the call sent again could land after its first step), and answers the call sent again
    from that replay, without applying it a second time."""
    from types import SimpleNamespace

    from aiocollect._service.env_calls import EnvCallLog, message
    from aiocollect._worker.env_calls import EnvEpochs, apply, replay

    log = EnvCallLog()
    log.rows_per_worker = 2
    fresh = SimpleNamespace(rows=2, envs=[RewardScale(), RewardScale()], env_epochs=EnvEpochs(2), vecs=None)

    async def send(epoch: int) -> list:  # the worker dies with the call: its replacement starts meanwhile
        replay(fresh, log.kept_for(1))
        again = message(log.next_id(), "call", "raise_scale", (1.0,), {}, None, [(0, 0), (1, 1)], epoch)
        return apply(fresh, again)

    async def answered(epoch: int) -> list:
        return [None] * 4

    await log.make("set", "scale", ([2.0, 3.0, 4.0, 5.0],), {}, [0, 1, 2, 3], [2.0, 3.0, 4.0, 5.0], False, answered)
    results, epoch = await log.make("call", "raise_scale", (1.0,), {}, [2, 3], None, True, send)
    assert results == [5.0, 6.0] and epoch == 2
    assert [env.scale for env in fresh.envs] == [5.0, 6.0]  # (set_attr's 4.0 and 5.0, raised once)
    assert fresh.env_epochs.now.tolist() == [2, 2]


@pytest.mark.timeout(120)
async def test_a_persisted_call_its_worker_died_in_is_made_once_by_the_replacement(tmp_path):
    """A worker SIGKILLed while it applies a persist=True call: its replacement makes the call (the
    caller gets its results) once, not also with the kept calls it applies as it starts."""
    started = tmp_path / "started"
    async with Collector(RewardScale, None, frames_per_batch=32, total_frames=-1, num_workers=1,
                         envs_per_worker=1, on_worker_failure="restart") as c:
        await c.set_attr("scale", 2.0)
        results = []

        async def call() -> None:
            results.append(await c.call("raise_scale_slowly", 1.0, str(started), persist=True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            while not started.exists():
                await anyio.sleep(0.01)
            started.unlink()
            os.kill(c.worker_pids[0], signal.SIGKILL)
        assert results == [[3.0]] and c.stats().restarts == 1
        assert await c.get_attr("scale") == [3.0]


async def test_vector_env_sub_envs_are_rows():
    def make():
        return gym.wrappers.vector.DictInfoToList(gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="sync"))

    async with Collector(make, None, frames_per_batch=60, total_frames=-1, num_workers=2, envs_per_worker=1) as c:
        await c.collect()
        assert await c.get_attr("gravity") == [9.8] * 6
        await c.set_attr("gravity", 5.0, indices=[1, 4])
        assert await c.get_attr("gravity") == [9.8, 5.0, 9.8, 9.8, 5.0, 9.8]
        assert await c.call("_max_episode_steps", indices=[5]) == [500]
        assert await c.map_fn(lambda env: type(env.unwrapped).__name__, indices=[2]) == ["CartPoleEnv"]
        epoch = (await c.collect())["collector", "env_epoch"]
        assert epoch.shape[0] == 6 and (epoch[[1, 4]] == 1).all()


class Tagged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.tag = "mine"

    def forward(self, observation):
        return self.net(observation).argmax(-1)


async def test_getattr_policy_reads_the_workers_replica():
    async with Collector("CartPole-v1", Tagged(), frames_per_batch=16, total_frames=-1, num_workers=1) as c:
        assert await c.getattr_policy("tag") == "mine"


async def test_getattr_policy_with_server_inference_reads_the_servers_own_copy():
    """inference="server": the policy that acts is the server's copy in this process; getattr_policy
    reads it (the weights of the last update_weights, not the caller's module changed in place)."""
    policy = Tagged()
    async with Collector("CartPole-v1", policy, frames_per_batch=16, total_frames=-1, num_workers=1,
                         inference="server") as c:
        await c.collect()
        assert await c.getattr_policy("tag") == "mine"
        net = await c.getattr_policy("net")
        assert net is not policy.net and torch.equal(net.weight, policy.net.weight)
        with torch.no_grad():
            policy.net.weight.add_(1.0)
        assert not torch.equal((await c.getattr_policy("net")).weight, policy.net.weight)
        await c.update_weights(policy)
        assert torch.equal((await c.getattr_policy("net")).weight, policy.net.weight)
        with pytest.raises(AttributeError, match="nope"):
            await c.getattr_policy("nope")


async def test_torchrls_map_fn_with_a_method_name_is_refused_with_the_call_to_make():
    """TorchRL's map_fn(method_name, list_of_args) calls a method of each worker; ours applies a
    function to every env: a name raises a ConfigError that shows the equivalent call()."""
    c = Collector(RewardScale, None, frames_per_batch=16, total_frames=-1, num_workers=0)
    try:
        with pytest.raises(ConfigError, match=r"call\('raise_scale', \*args, workers=\[i\]\)"):
            c.map_fn("env.raise_scale", list_of_args=[(1.0,)])
    finally:
        await c.aclose()


def test_the_blocking_wrapper_has_them_too():
    with Collector(RewardScale, None, frames_per_batch=16, total_frames=-1, num_workers=1, envs_per_worker=2) as c:
        next(iter(c))
        e = c.set_attr("scale", 4.0)
        assert c.get_attr("scale") == [4.0, 4.0]
        reward, epoch = rows_of(next(iter(c)))
        assert (epoch == e).all() and (reward == 4.0).all()


async def test_a_closed_collector_refuses():
    c = Collector(RewardScale, None, frames_per_batch=16, total_frames=-1, num_workers=0)
    await c.aclose()
    with pytest.raises(Exception, match="closed"):
        await c.get_attr("scale")
