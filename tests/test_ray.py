"""backend="ray": each worker a Ray actor on a local Ray instance (2 CPUs, started once for the
module). The same data as the process backend for the same seed, weights through one ``ray.put``
per version, events, a dead actor (``ray.kill``) raising or being replaced, hung envs under
``step_timeout``, and no actor left after ``aclose``, even on cancellation.

Skipped without Ray (``pip install 'aiocollect[ray]'``); CI runs this module in a step of its own
(``scripts/run.sh test`` installs Ray for it)."""

from __future__ import annotations

import gc
import math
import os
import signal
import sys
import threading
import time

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict

ray = pytest.importorskip("ray")

from aiocollect import BrokenWorkerError, Collector, ConfigError, WorkerError, WorkerTimeoutError  # noqa: E402
from aiocollect import events as ev  # noqa: E402
from aiocollect import events as ev_events  # noqa: E402
from aiocollect.testing import CountingEnv, InjectedFailure  # noqa: E402

from procs import local_ray  # noqa: E402

# Ray's actors cost seconds to start: most tests run on asyncio only; the complete user program
# runs on asyncio, uvloop and trio (the only loop-specific code: Ray's thread waking the loop).
pytestmark = [pytest.mark.timeout(120), pytest.mark.loops("asyncio")]


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    """One local Ray instance for the module (2 CPUs: one per actor of most tests)."""
    with local_ray():
        yield


def _ours_alive() -> list[str]:
    """Actors of this process that Ray still counts alive (ours are RolloutActor)."""
    from ray._private.state import actors  # (the state API proper needs Ray's dashboard)

    return [k for k, a in actors().items() if a["ActorClassName"] == "RolloutActor" and a["State"] != "DEAD"]


_pids: list[int] = []


@pytest.fixture(autouse=True)
def no_leftovers():
    """Overrides the suite's check (Ray's driver keeps threads of its own, some of them
    registered by Python as dummy threads on first use): every actor process a test saw is gone,
    no shared memory of ours is left, and no thread of ours is left."""
    from conftest import _shm_in_use

    threads_before = set(threading.enumerate())
    del _pids[:]
    yield
    gc.collect()
    deadline = time.monotonic() + 20  # (generous, as the suite's: only a test that leaves something waits)
    while any(os.path.exists(f"/proc/{p}") for p in _pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [p for p in _pids if os.path.exists(f"/proc/{p}")]
    assert not left, f"actor processes left running: {left}"
    assert not _shm_in_use(), f"shared memory left mapped or open: {_shm_in_use()}"
    deadline = time.monotonic() + 20  # (as the suite's check: a loaded machine is slow to end a thread)
    while True:
        extra = [
            t for t in threading.enumerate()
            if t not in threads_before and t.is_alive() and not isinstance(t, threading._DummyThread)
            and "ray" not in t.name.lower()
        ]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not extra, f"threads left running: {extra}"


def seen(c: Collector) -> tuple[int, ...]:
    """The actors' pids, remembered for the leak check."""
    pids = c.worker_pids
    _pids.extend(pids)
    return pids


class Greedy(torch.nn.Module):
    """A deterministic MLP (4-16-2, argmax) with fixed initial weights."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, observation):
        return self.net(observation).argmax(-1)


def check_cartpole(batch: TensorDict) -> None:
    """Within each env row: the next observation of frame t is the observation of frame t+1
    unless the episode ended at t (then t+1 starts a new trajectory)."""
    obs, nxt = batch["observation"], batch["next", "observation"]
    done = batch["next", "done"].squeeze(-1)
    traj = batch["collector", "traj_ids"]
    same = (nxt[:, :-1] == obs[:, 1:]).all(-1)
    assert bool((same | done[:, :-1]).all())
    assert bool((traj[:, 1:] == traj[:, :-1])[~done[:, :-1]].all())
    assert bool((traj[:, 1:] != traj[:, :-1])[done[:, :-1]].all())


async def gather(backend: str, **kw) -> tuple[list[TensorDict], list[tuple]]:
    episodes: list[tuple] = []
    c = Collector("CartPole-v1", Greedy(), frames_per_batch=128, total_frames=128 * 4, num_workers=2,
                  envs_per_worker=2, seed=7, backend=backend, **kw)
    c.on(ev.EpisodeEnded, lambda e: episodes.append((e.worker, e.env, e.length, round(e.ret, 4))))
    batches = []
    async with c:
        async for batch in c:
            seen(c)
            batches.append(batch.clone())
    return batches, sorted(episodes)


async def test_same_data_as_the_process_backend():
    """Same seed, same deterministic policy: the Ray backend delivers exactly the process
    backend's batches (every key, every frame) and the same episodes."""
    with anyio.fail_after(100):
        ray_batches, ray_eps = await gather("ray")
        proc_batches, proc_eps = await gather("process")
    assert len(ray_batches) == len(proc_batches) == 4
    for a, b in zip(ray_batches, proc_batches):
        assert a.batch_size == b.batch_size == torch.Size([4, 32])
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        check_cartpole(a)
    assert ray_eps == proc_eps and len(ray_eps) > 5


@pytest.mark.loops("asyncio", "uvloop", "trio")
@pytest.mark.asyncio_and_uvloop  # (a thread wakes the loop)
async def test_user_program_with_weight_updates():
    """The loop users write: iterate to total_frames, train, update weights after each batch,
    close. Frames carry the version current at their batch's start, every actor acknowledges each
    version, and each version is put in Ray's object store once for both actors."""
    policy = Greedy()
    applied: list[tuple[int, int]] = []
    c = Collector("CartPole-v1", policy, frames_per_batch=200, total_frames=200 * 6, num_workers=2,
                  envs_per_worker=2, backend="ray", prefetch=0)
    c.on(ev.WeightsApplied, lambda e: applied.append((e.worker, e.version)))
    versions = []
    with anyio.fail_after(60):
        async with c:
            async for batch in c:
                seen(c)
                check_cartpole(batch)
                v = batch["collector", "policy_version"]
                assert bool((v == v[0, 0]).all())  # one version per batch (prefetch=0, both workers)
                versions.append(int(v[0, 0]))
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(0.01)
                version = await c.update_weights(policy)
                assert version == len(versions)
            puts = c._run.shared.pool.workers[0].snapshots.puts if c._run.shared.pool.workers else None
        assert c.frames == 1200
    assert versions[0] == 0 and versions[1:] == sorted(versions[1:]) and versions[-1] >= 4
    assert {w for w, v in applied if v == versions[-1]} == {0, 1}
    assert puts is None or puts == versions[-1] + 1  # (the run may be over: its workers gone)


async def test_weights_put_once_per_version_and_acknowledged():
    """update_weights(wait=True) returns once both actors applied the version; one ray.put per
    version; an idle actor applies at once."""
    policy = Greedy()
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=64, num_workers=2, envs_per_worker=2,
                             backend="ray", prefetch=0) as c:
            await c.collect()
            seen(c)
            snapshots = c._run.shared.pool.workers[0].snapshots
            assert c._run.shared.pool.workers[1].snapshots is snapshots
            before = snapshots.puts
            for k in range(3):
                with torch.no_grad():
                    policy.net[0].bias.fill_(float(k))
                version = await c.update_weights(policy, wait=True)
                assert c._run.shared.sync.acked == [version, version]
            assert snapshots.puts - before == 3
            batch = await c.collect()
            assert bool((batch["collector", "policy_version"] == version).all())


async def test_per_worker_weights():
    """worker_ids: a store of the worker's own; the other worker keeps its version."""
    policy = Greedy()
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=64, num_workers=2, envs_per_worker=2,
                             backend="ray", prefetch=0) as c:
            await c.collect()
            seen(c)
            v = await c.update_weights(policy, worker_ids=[1], wait=True)
            batch = await c.collect()
            versions = batch["collector", "policy_version"]
            assert bool((versions[:2] == 0).all()) and bool((versions[2:] == v).all())


async def test_async_delivery_and_trajectories():
    """delivery="async": each batch one actor's, whole; trajs_per_batch works as with processes."""
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", None, frames_per_batch=64, total_frames=64 * 6, num_workers=2,
                             envs_per_worker=2, backend="ray", delivery="async", seed=3) as c:
            sizes = []
            async for batch in c:
                seen(c)
                sizes.append(batch.batch_size)
                check_cartpole(batch)
        assert sizes == [torch.Size([2, 32])] * 6
        async with Collector("CartPole-v1", None, frames_per_batch=64, num_workers=2, envs_per_worker=2,
                             backend="ray", trajs_per_batch=5, seed=3) as c:
            batch = await c.collect()
            seen(c)
            mask = batch["collector", "mask"]
            assert batch.batch_size[0] == 5
            lengths = mask.sum(-1)
            assert bool((lengths > 0).all())
            done = batch["next", "done"].squeeze(-1)
            for i, n in enumerate(lengths.tolist()):
                assert bool(done[i, n - 1]) and not bool(done[i, : n - 1].any())


def _sixty_steps():
    return CountingEnv(episode_length=60)


@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_trajectories_many_rounds_long_are_delivered(delivery):
    """trajs_per_batch with episodes 20 rounds long (3 frames per env and round): the actors are
    granted rounds until each delivery is made, to total_frames."""
    with anyio.fail_after(90):
        async with Collector(_sixty_steps, None, frames_per_batch=12, total_frames=12 * 42, num_workers=2,
                             envs_per_worker=2, backend="ray", delivery=delivery, trajs_per_batch=2,
                             prefetch=0, seed=3) as c:
            batches = [b async for b in c]
            seen(c)
    assert batches
    for batch in batches:
        assert batch.batch_size == torch.Size([2, 60]) and bool(batch["collector", "mask"].all())
        assert torch.equal(batch["observation"][..., 0] % 100, torch.arange(60.0).expand(2, 60))
    if delivery == "sync":  # every env ended 2 whole episodes
        assert len(batches) == 2 * 2 * 2 // 2


async def test_killed_actor_raises_broken_worker_error():
    with anyio.fail_after(60):
        c = Collector("CartPole-v1", None, frames_per_batch=64, num_workers=2, envs_per_worker=2, backend="ray")
        async with c:
            await c.collect()
            pids = seen(c)
            handle = c._run.shared.pool.workers[1].actor
            ray.kill(handle)
            with pytest.raises(BrokenWorkerError, match="worker 1 .*Ray actor.* died") as info:
                for _ in range(50):
                    await c.collect()
            assert info.value.worker == 1
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


async def test_killed_actor_is_replaced():
    """on_worker_failure="restart": a new actor takes the seat; the run reaches total_frames with
    consistent data and trajectory ids never reused."""
    failed, restarted = [], []
    c = Collector("CartPole-v1", None, frames_per_batch=64, total_frames=64 * 8, num_workers=2, envs_per_worker=2,
                  backend="ray", on_worker_failure="restart", seed=1)
    c.on(ev.WorkerFailed, failed.append)
    c.on(ev.WorkerRestarted, restarted.append)
    ids: set[int] = set()
    with anyio.fail_after(90):
        async with c:
            n = 0
            async for batch in c:
                seen(c)
                check_cartpole(batch)
                n += 1
                if n == 2:
                    ray.kill(c._run.shared.pool.workers[0].actor)
                    await anyio.sleep(0.5)
                ids |= set(batch["collector", "traj_ids"].unique().tolist())
            seen(c)
    assert n == 8 and c.frames == 512
    assert [e.worker for e in failed] == [0] and isinstance(failed[0].error, BrokenWorkerError)
    assert len(restarted) == 1 and restarted[0].pid != restarted[0].old_pid
    stats = c.stats()
    assert stats.restarts == 1 and stats.frames == 512


async def test_env_error_in_actor_names_the_worker():
    with anyio.fail_after(60):
        c = Collector(CountingEnv, None, frames_per_batch=8, num_workers=1, envs_per_worker=1, backend="ray",
                      create_env_kwargs={"fail_at_step": 5})
        async with c:
            with pytest.raises(WorkerError, match="worker 0 .*Ray actor.* raised InjectedFailure") as info:
                await c.collect()
            seen(c)
        assert isinstance(info.value.__cause__, InjectedFailure)
        assert "in step" in info.value.worker_traceback


async def test_step_timeout_kills_a_hung_actor():
    with anyio.fail_after(60):
        c = Collector(CountingEnv, None, frames_per_batch=8, num_workers=1, envs_per_worker=2, backend="ray",
                      step_timeout=0.5, create_env_kwargs={"episode_length": 50, "hang_at_step": 9})
        async with c:
            with pytest.raises(WorkerTimeoutError) as info:
                for _ in range(10):
                    await c.collect()
                    seen(c)
            seen(c)
    message = str(info.value)
    assert "worker 0" in message and "step()" in message and "step_timeout=0.5" in message
    assert "in _hang" in message  # the rollout thread's stack, taken from the actor's control thread


@pytest.mark.parametrize("delay", [0.0, 0.7, None])
async def test_cancellation_leaves_no_actor(delay):
    """A consumer cancelled while the actors start (after 0 s, 0.7 s) or mid-iteration (``None``:
    once a batch arrived, however long the actors took to start): aclose (from async with) still
    kills every actor."""
    pids: tuple[int, ...] = ()
    with anyio.fail_after(120), anyio.move_on_after(math.inf if delay is None else delay) as scope:
        async with Collector("CartPole-v1", None, frames_per_batch=64, num_workers=2, envs_per_worker=2,
                             backend="ray") as c:
            async for _ in c:
                pids = seen(c)
                if delay is None:
                    scope.cancel()  # (the next await, in the middle of the iteration, is cancelled)
    assert scope.cancelled_caught and (len(pids) == 2 or delay is not None)
    deadline = time.monotonic() + 5
    while _ours_alive() and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    assert not _ours_alive()
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


async def test_actor_options_reach_ray():
    """ray_actor_options: a runtime_env variable the env factory reads, fractional CPUs; then one
    dict per worker placing each actor in its bundle of a placement group, and node affinity."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

    def make_env():
        assert os.environ.get("AIOCOLLECT_RAY_TEST") == "yes", "runtime_env did not reach the actor"
        return gym.make("CartPole-v1")

    with anyio.fail_after(60):
        async with Collector(make_env, None, frames_per_batch=32, num_workers=2, envs_per_worker=1, backend="ray",
                             ray_actor_options={"num_cpus": 0.5,
                                                "runtime_env": {"env_vars": {"AIOCOLLECT_RAY_TEST": "yes"}}}) as c:
            batch = await c.collect()
            seen(c)
        assert batch.batch_size == torch.Size([2, 16])
        pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}])
        try:
            await anyio.to_thread.run_sync(lambda: ray.get(pg.ready(), timeout=20))
            per_worker = [{"num_cpus": 0.5, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)}
                          for i in range(2)]
            async with Collector("CartPole-v1", None, frames_per_batch=32, num_workers=2, backend="ray",
                                 ray_actor_options=per_worker) as c:
                await c.collect()
                seen(c)
                key = f"CPU_group_{pg.id.hex()}"  # the group's CPUs, free while its bundles are unused
                for _ in range(50):  # (Ray's resource view lags a little)
                    if ray.available_resources().get(key, 0.0) == 0.0:
                        break
                    await anyio.sleep(0.1)
                assert ray.available_resources().get(key, 0.0) == 0.0, ray.available_resources()
        finally:
            remove_placement_group(pg)
        node = ray.get_runtime_context().get_node_id()
        async with Collector("CartPole-v1", None, frames_per_batch=32, num_workers=2, backend="ray",
                             ray_actor_options={"num_cpus": 0.5,
                                                "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}) as c:
            await c.collect()
            seen(c)
            assert {w.node for w in c._run.shared.pool.workers} == {node}


def test_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="num_workers=0"):
        Collector("CartPole-v1", frames_per_batch=8, num_workers=0, backend="ray")
    with pytest.raises(ConfigError, match="server inference"):
        Collector("CartPole-v1", frames_per_batch=8, backend="ray", inference="server")
    with pytest.raises(ConfigError, match="which Ray .* do not take"):
        Collector("CartPole-v1", frames_per_batch=8, backend="ray", ray_actor_options={"num_cpu": 1})
    with pytest.raises(ConfigError, match="'max_concurrency': aiocollect sets it itself"):
        Collector("CartPole-v1", frames_per_batch=8, backend="ray", ray_actor_options={"max_concurrency": 4})
    with pytest.raises(ConfigError, match="on_worker_failure='restart'"):
        Collector("CartPole-v1", frames_per_batch=8, backend="ray", ray_actor_options={"max_restarts": 2})
    with pytest.raises(ConfigError, match="one per worker"):
        Collector("CartPole-v1", frames_per_batch=8, num_workers=2, backend="ray", ray_actor_options=[{}])
    with pytest.raises(ConfigError, match="needs backend='ray'"):
        Collector("CartPole-v1", frames_per_batch=8, ray_actor_options={})
    with pytest.raises(ConfigError, match="'process', 'local' or 'ray'"):
        Collector("CartPole-v1", frames_per_batch=8, backend="dask")
    with pytest.raises(ConfigError, match="profiler"):
        Collector("CartPole-v1", frames_per_batch=8, backend="ray").enable_profile()
    from aiocollect import Evaluator

    with pytest.raises(ConfigError, match="'process' or 'ray'"):
        Evaluator("CartPole-v1", backend="dask")
    with pytest.raises(ConfigError, match="needs backend='ray'"):
        Evaluator("CartPole-v1", ray_actor_options={"num_cpus": 1})
    with pytest.raises(ConfigError, match="which Ray .* do not take"):
        Evaluator("CartPole-v1", backend="ray", ray_actor_options={"gpus": 1})
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ConfigError, match=r"pip install 'aiocollect\[ray\]'"):
        Evaluator("CartPole-v1", backend="ray")
    with pytest.raises(ConfigError, match=r"pip install 'aiocollect\[ray\]'"):
        Collector("CartPole-v1", frames_per_batch=8, backend="ray")


def test_bad_actor_option_values_are_config_errors():
    with pytest.raises(ConfigError, match="num_cpus"):
        Collector("CartPole-v1", frames_per_batch=8, backend="ray", ray_actor_options={"num_cpus": -1})


async def test_vector_env_zero_copy_and_split_trajs():
    """A gymnasium VectorEnv per actor (its sub-envs are rows), batches lent without a copy,
    split into trajectories: what worker processes give."""

    def make_vec():
        return gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="vector_entry_point")

    with anyio.fail_after(60):
        async with Collector(make_vec, None, frames_per_batch=2 * 4 * 16, total_frames=128 * 3, num_workers=2,
                             backend="ray", zero_copy=True, seed=5) as c:
            n = 0
            async for batch in c:
                seen(c)
                assert batch.batch_size == torch.Size([8, 16])
                check_cartpole(batch)
                n += 1
        assert n == 3
        async with Collector(make_vec, None, frames_per_batch=128, num_workers=2, backend="ray", split_trajs=True,
                             seed=5) as c:
            batch = await c.collect()
            seen(c)
    mask = batch["collector", "mask"]
    assert mask.ndim == 2 and int(mask.sum()) == 128
    traj = batch["collector", "traj_ids"]
    assert bool(((traj == traj[:, :1]) | ~mask).all())  # one trajectory per row


async def test_weights_before_the_first_batch_and_from_another_task():
    """update_weights right after entering `async with` (before any batch) and from a task of
    its own while the consumer iterates: the frames carry the versions, in order."""
    policy = Greedy()
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=64, total_frames=64 * 6, num_workers=2,
                             envs_per_worker=2, backend="ray", prefetch=0) as c:
            first = await c.update_weights(policy, wait=True)
            versions = []
            async with anyio.create_task_group() as tg:

                async def publisher():
                    for _ in range(3):
                        await c.update_weights(policy, wait=True)

                tg.start_soon(publisher)
                async for batch in c:
                    seen(c)
                    versions.append(int(batch["collector", "policy_version"].min()))
    assert first == 1 and versions[0] >= 1 and versions == sorted(versions) and versions[-1] >= 2


@pytest.mark.timeout(90)
def test_starts_ray_when_not_initialised(tmp_path):
    """Without ray.init the collector starts a local Ray instance, collects, and the script
    exits cleanly (what a user's first try looks like)."""
    import subprocess

    script = tmp_path / "first_try.py"
    script.write_text(
        "import asyncio, logging\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')\n"
        "from aiocollect import Collector\n"
        "async def main():\n"
        "    async with Collector('CartPole-v1', frames_per_batch=64, total_frames=128, num_workers=2,\n"
        "                         backend='ray') as c:\n"
        "        async for batch in c:\n"
        "            print('batch', tuple(batch.batch_size), flush=True)\n"
        "asyncio.run(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=80, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("batch (2, 32)") == 2
    assert "starting a local Ray instance" in out.stderr


# ---- the Evaluator as a Ray actor --------------------------------------------------------------------


def episodes(returns, lengths) -> dict:
    """metrics_fn that exposes every episode."""
    return {"returns": returns.tolist(), "lengths": lengths.tolist()}


async def test_evaluator_on_ray_gives_the_process_workers_results():
    """Same seed, same policy and weights: the actor's episodes are the worker process's."""
    from aiocollect import Evaluator

    policy = Greedy(seed=3)
    with torch.no_grad():  # a balancing controller: push towards the side the pole falls to
        for p in policy.parameters():
            p.zero_()
        policy.net[0].weight[0, 2:] = 1.0
        policy.net[2].weight[:, 0] = torch.tensor([-1.0, 1.0])
    results = {}
    with anyio.fail_after(60):
        for backend in ("process", "ray"):
            async with Evaluator("CartPole-v1", policy, num_trajectories=4, num_envs=2, seed=11, backend=backend,
                                 metrics_fn=episodes) as ev:
                first = await ev.evaluate(policy)
                bias = policy.net[2].bias.detach().clone()
                with torch.no_grad():
                    policy.net[2].bias.copy_(torch.tensor([5.0, -5.0]))  # always left: short episodes
                second = await ev.evaluate(policy)
                with torch.no_grad():
                    policy.net[2].bias.copy_(bias)
                if backend == "ray":
                    pid = ev.worker_pid
                    _pids.append(pid)
            results[backend] = (first["returns"], second["returns"])
    assert results["ray"] == results["process"]
    assert max(results["ray"][1]) < 20 and min(results["ray"][0]) >= 100
    assert pid is not None and not os.path.exists(f"/proc/{pid}")


async def test_training_loop_with_a_ray_collector_and_a_ray_evaluator():
    """The whole program on Ray: collect, train, update, evaluate in the background every other
    batch (results as events), to the end of total_frames; then both close and no actor is left."""
    from aiocollect import Evaluator
    from aiocollect.events import EvaluationCompleted

    policy = Greedy()
    completed = []
    with anyio.fail_after(90):  # (3 actors on the 2-CPU instance: fractions of a CPU each)
        async with Evaluator("CartPole-v1", policy, num_trajectories=2, seed=0, backend="ray",
                             busy_policy="queue", metrics_fn=episodes, ray_actor_options={"num_cpus": 0.5}) as evaluator, \
                Collector("CartPole-v1", policy, frames_per_batch=128, total_frames=128 * 6, num_workers=2,
                          envs_per_worker=2, backend="ray", ray_actor_options={"num_cpus": 0.5}) as collector:
            evaluator.on(EvaluationCompleted, completed.append)
            step = 0
            async for batch in collector:
                seen(collector)
                check_cartpole(batch)
                with torch.no_grad():
                    policy.net[0].weight.mul_(0.99)
                await collector.update_weights(policy)
                step += 1
                if step % 2 == 0:
                    evaluator.trigger(policy, step=step)
            await evaluator.wait()
            _pids.append(evaluator.worker_pid)
    assert [e.step for e in completed] == [2, 4, 6]
    assert all(len(e.metrics["returns"]) == 2 for e in completed)


async def test_evaluator_actor_killed_is_replaced_and_hangs_are_found(tmp_path):
    """on_worker_failure="restart": an actor killed between evaluations is replaced (events);
    step_timeout: a hung env fails the evaluation with WorkerTimeoutError and the actor's stack."""
    from aiocollect import Evaluator
    from aiocollect.events import WorkerRestarted

    restarted = []
    with anyio.fail_after(60):
        async with Evaluator("CartPole-v1", num_trajectories=2, seed=0, backend="ray",
                             on_worker_failure="restart", metrics_fn=episodes) as ev:
            ev.on(WorkerRestarted, restarted.append)
            await ev.evaluate()
            old = ev.worker_pid
            ray.kill(ev._run.proc.actor)
            for _ in range(100):  # noticed between evaluations (a ping every second), replaced
                if restarted:
                    break
                await anyio.sleep(0.1)
            metrics = await ev.evaluate()
            _pids.extend([old, ev.worker_pid])
        assert restarted and restarted[0].old_pid == old and ev.restarts == 1
        assert len(metrics["returns"]) == 2
        async with Evaluator(CountingEnv, num_trajectories=2, num_envs=2, seed=0, step_timeout=0.5, backend="ray",
                             env_kwargs={"episode_length": 5, "hang_at_step": 3}) as ev:
            with pytest.raises(WorkerTimeoutError) as info:
                await ev.evaluate()
            _pids.append(info.value and ev._run.proc.pid if ev._run.proc else None)
    message = str(info.value)
    assert "the evaluator's worker (Ray actor" in message and "step()" in message and "in _hang" in message


@pytest.mark.timeout(120)
def test_benchmark_runs(tmp_path):
    """benchmarks/ray_backend.py, shortened: it prints its table and writes its JSON."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "ray_backend.py"), "--seconds", "0.3", "--warmup", "0",
         "--rounds", "1", "--updates", "3", "--frames-per-batch", "256", "--ray-cpus", "2",
         "--json", str(tmp_path / "ray.json")],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ray.init (a local instance)" in out.stdout and "WeightsApplied collecting" in out.stdout
    rows = json.loads((tmp_path / "ray.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["process", "ray"] and all(r["fps"] > 0 for r in rows)


async def test_aclose_while_actors_wait_for_resources():
    """Actors that can never be scheduled (more CPUs than the instance has): aclose() (leaving
    `async with` on a timeout) ends the start-up, with no actor left waiting."""
    c = Collector("CartPole-v1", None, frames_per_batch=64, num_workers=2, envs_per_worker=2, backend="ray",
                  ray_actor_options={"num_cpus": 3})
    with anyio.move_on_after(3) as scope:
        async with c:
            await c.collect()
    assert scope.cancelled_caught and c.state.value == "closed"
    deadline = time.monotonic() + 5
    while _ours_alive() and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    assert not _ours_alive()


# ---- reaching into the actors' envs (call, get_attr, set_attr, map_fn) -----------------------------


class RewardScale(gym.Wrapper):
    """CartPole (reward 1 per step) whose rewards are multiplied by ``scale``: a frame's reward
    says under which setting it was stepped."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.scale = 1.0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward * self.scale, terminated, truncated, info

    def set_level(self, level: int) -> int:
        self.level = level
        return level


# each run starts 3 actors: sync delivery on asyncio, async on trio (uvloop: the user program above)
@pytest.mark.loops("asyncio")
async def test_a_curriculum_through_set_attr_holds_for_every_frame_across_a_killed_actor_sync():
    await curriculum_across_a_killed_actor("sync")


@pytest.mark.loops("trio")
async def test_a_curriculum_through_set_attr_holds_for_every_frame_across_a_killed_actor_async():
    await curriculum_across_a_killed_actor("async")


async def curriculum_across_a_killed_actor(delivery: str) -> None:
    """Every few batches set_attr raises the reward scale of the actors' envs: every frame carries
    the env epoch it was stepped under and that epoch's reward scale, an env row's epoch never goes
    back, and with sync delivery every frame of the batch after the call has the new epoch. An
    actor killed with ray.kill is replaced, and its new envs step under the latest scale
    (set_attr is replayed before its first batch) without the program noticing."""
    scales = {0: 1.0}
    last = np.zeros(4, np.int64)  # per env row: the epoch of its latest frame
    c = Collector(RewardScale, None, frames_per_batch=64, total_frames=-1, num_workers=2, envs_per_worker=2,
                  backend="ray", delivery=delivery, on_worker_failure="restart", seed=5)
    with anyio.fail_after(110):
        async with c:
            called = None
            for n in range(11):
                batch = await c.collect()
                seen(c)
                reward = batch["next", "reward"][..., 0].numpy()
                epoch = batch["collector", "env_epoch"].numpy()
                rows = (batch["collector", "traj_ids"][:, 0] % 4).numpy()
                np.testing.assert_array_equal(reward, np.vectorize(scales.get)(epoch))
                assert (np.diff(epoch, axis=1) >= 0).all() and (epoch[:, 0] >= last[rows]).all()
                last[rows] = epoch[:, -1]
                if delivery == "sync" and called is not None:
                    assert (epoch == called).all()  # the whole batch after the call
                called = None
                if n % 3 == 0:
                    new = float(n + 2)
                    e = await c.set_attr("scale", new)
                    assert e == c.env_epoch and e not in scales
                    scales[e], called = new, e
                    assert await c.get_attr("scale") == [new] * 4
                if n == 4:  # (noticed by the next batch it is asked for)
                    old = c.worker_pids[1]
                    ray.kill(c._run.shared.pool.workers[1].actor)
            assert c.stats().restarts == 1 and seen(c)[1] != old
            assert await c.get_attr("scale") == [scales[c.env_epoch]] * 4
        if delivery == "sync":  # (async: the last batch of a worker may be older than the last call)
            assert last.tolist() == [c.env_epoch] * 4


class Tagged(Greedy):
    tag = "mine"


def _boom(env):
    raise KeyError("no such level")


async def test_actors_at_a_lower_priority_than_this_process_are_told_once_with_the_fix(caplog, monkeypatch):
    """Ray's own ``ray.init`` starts actors at niceness 15, where a busy training loop on the same
    machine starves them: a collector says so once, naming ``RAY_worker_niceness=0``. The tests'
    Ray runs them at niceness 0: no such line."""
    import logging

    from aiocollect._backends import ray as ray_backend

    monkeypatch.setattr(ray_backend, "_niced_warned", False)
    with anyio.fail_after(90), caplog.at_level(logging.WARNING, logger="aiocollect"):
        async with Collector("CartPole-v1", None, frames_per_batch=16, num_workers=1, envs_per_worker=1,
                             backend="ray") as c:
            pid = seen(c)[0]
            await c.collect()
            assert not [r for r in caplog.records if "niceness" in r.getMessage()]
            os.setpriority(os.PRIO_PROCESS, pid, 10)  # (as Ray's own start would have it, at 15)
            workers = c._run.shared.pool.workers
            ray_backend._warn_if_niced(workers)
            ray_backend._warn_if_niced(workers)
    lines = [r.getMessage() for r in caplog.records if "niceness" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "1 of 1 Ray actors on this machine run at niceness 10" in lines[0] and "RAY_worker_niceness=0" in lines[0]


async def _until_dead(pid: int) -> None:
    """Until a local actor's process has exited (gone, or a zombie not yet reaped)."""
    with anyio.fail_after(30):
        while True:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        return
            except FileNotFoundError:
                return
            await anyio.sleep(0.01)


async def test_env_calls_on_actors_give_results_in_row_order_and_errors_with_the_actor_traceback():
    """call/get_attr/map_fn/getattr_env/getattr_policy reach the actors' envs and policy with one
    result per env row; an env's error arrives as its own type with the actor's traceback, and the
    actor goes on; a persisted call is made again by a replaced actor."""
    with anyio.fail_after(90):
        async with Collector(RewardScale, Tagged(), frames_per_batch=32, total_frames=-1, num_workers=2,
                             envs_per_worker=2, backend="ray", on_worker_failure="restart") as c:
            seen(c)
            assert await c.set_attr("scale", [1.0, 2.0, 3.0, 4.0]) == 1
            assert await c.get_attr("scale", indices=[3, 0]) == [4.0, 1.0]
            assert await c.map_fn(lambda env, k: env.get_wrapper_attr("scale") * k, 2, workers=[1]) == [6.0, 8.0]
            assert await c.getattr_env("_max_episode_steps") == 500
            assert await c.getattr_policy("tag") == "mine"
            with pytest.raises(KeyError, match="no such level") as info:
                await c.map_fn(_boom, indices=[2])
            assert isinstance(info.value, WorkerError) and info.value.worker == 1
            assert "_boom" in info.value.worker_traceback
            assert await c.call("set_level", 7, persist=True) == [7] * 4
            batch = await c.collect()
            assert (batch["collector", "env_epoch"] == c.env_epoch).all()
            dead = c.worker_pids[0]
            ray.kill(c._run.shared.pool.workers[0].actor)
            await _until_dead(dead)  # (ray.kill returns first: the actor could still answer the call)
            # (the idle actor's death is found by the call, which its replacement answers)
            assert await c.get_attr("level") == [7] * 4
            assert c.stats().restarts == 1
            seen(c)
            assert await c.get_attr("scale") == [1.0, 2.0, 3.0, 4.0]


async def test_the_evaluator_actors_envs_are_reached_and_kept_calls_survive_a_killed_actor():
    """Evaluator(backend="ray"): set_attr between evaluations holds for the next ones, an env's error
    arrives as its own type, and a new actor (after ray.kill, under restart) sets it again."""
    from aiocollect import Evaluator

    with anyio.fail_after(90):
        async with Evaluator(RewardScale, num_trajectories=2, num_envs=2, seed=0, backend="ray",
                             on_worker_failure="restart") as ev:
            _pids.append(ev.worker_pid)
            await ev.set_attr("scale", 3.0)
            metrics = await ev.evaluate()
            assert metrics["return_mean"] == 3.0 * metrics["episode_length_mean"]
            with pytest.raises(KeyError, match="no such level") as info:
                await ev.map_fn(_boom)
            assert "_boom" in info.value.worker_traceback
            ray.kill(ev._run.proc.actor)
            with anyio.fail_after(30):  # (noticed by its ping, every second)
                await ev.wait_for(ev_events.WorkerRestarted)
            _pids.append(ev.worker_pid)
            assert await ev.get_attr("scale") == [3.0, 3.0]


def test_zz_no_actor_alive_after_the_module():
    """(Run last in the module: every actor of the tests above is dead as Ray sees it.)"""
    deadline = time.monotonic() + 10
    while _ours_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ours_alive() == []
    assert np.ndim(0) == 0


# ---- stopped actors (SIGSTOP): found from outside ---------------------------------------------------


async def _stop(pid: int) -> None:
    """SIGSTOP a local actor's process and wait until it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    for _ in range(1000):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        await anyio.sleep(0.01)


async def test_a_stopped_actor_is_found_killed_and_replaced():
    """An actor frozen with SIGSTOP while it waits for the collector (prefetch=0): its control
    thread cannot answer the watchdog, so within about step_timeout it is declared hung (the
    error says it is stopped: the process is on this node), killed and replaced; the run goes on."""
    from aiocollect.events import WorkerFailed, WorkerRestarted

    failed, restarted = [], []
    with anyio.fail_after(100):
        c = Collector(CountingEnv, None, frames_per_batch=8, num_workers=1, envs_per_worker=2, backend="ray",
                      prefetch=0, step_timeout=1, on_worker_failure="restart",
                      create_env_kwargs={"episode_length": 50})
        c.on(WorkerFailed, failed.append)
        c.on(WorkerRestarted, restarted.append)
        async with c:
            await c.collect()
            (old,) = seen(c)
            await _stop(old)
            for _ in range(3):
                await c.collect()
            seen(c)
    assert len(failed) == 1 and len(restarted) == 1 and restarted[0].old_pid == old
    message = str(failed[0].error)
    assert isinstance(failed[0].error, WorkerTimeoutError)
    assert f"worker 0 (Ray actor, pid {old}) is stopped (process state T" in message and "step_timeout=1" in message


async def test_a_stopped_evaluator_actor_fails_the_evaluation():
    """The Evaluator's actor frozen with SIGSTOP between evaluations: the next evaluation fails
    with WorkerTimeoutError saying it is stopped, and the one after runs on a new actor."""
    from aiocollect import Evaluator

    with anyio.fail_after(100):
        async with Evaluator(CountingEnv, num_trajectories=2, seed=0, step_timeout=1, backend="ray",
                             env_kwargs={"episode_length": 5}) as ev:
            await ev.evaluate()
            old = ev.worker_pid
            _pids.append(old)
            await _stop(old)
            with pytest.raises(WorkerTimeoutError) as info:
                await ev.evaluate()
            assert (await ev.evaluate())["episode_length_mean"] == 5
            _pids.append(ev.worker_pid)
    message = str(info.value)
    assert f"the evaluator's worker (Ray actor, pid {old}) is stopped (process state T" in message
