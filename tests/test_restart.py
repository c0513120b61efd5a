"""Failures a long run survives: with on_worker_failure="restart" a worker that dies (SIGKILL,
an exception, its launcher killed) or hangs (step_timeout) is replaced and the collection goes
on with data that obey the env's dynamics and trajectory ids never reused; within a budget,
after which the last error is raised. Hung workers are found by step_timeout and named."""

from __future__ import annotations

import os
import signal
import time

import anyio
import gymnasium as gym
import pytest
import torch

from aiocollect import Collector, State, WorkerError, WorkerTimeoutError
from aiocollect._backends.launcher import get_launcher
from aiocollect.events import WorkerFailed, WorkerRestarted
from aiocollect.testing import CountingEnv, InjectedFailure
from procs import alive


class SlowCartPole(gym.Wrapper):
    """CartPole whose steps take ~1 ms: a batch lasts long enough to be killed in its middle."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))

    def step(self, action):
        time.sleep(0.001)
        return self.env.step(action)


class Greedy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation):
        return self.net(observation).argmax(-1)


def once(flag: str, faulty: dict, healthy: dict | None = None):
    """An env factory whose first env, in whichever process, is built with ``faulty`` kwargs."""

    def make():
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            return CountingEnv(**faulty)
        except FileExistsError:
            return CountingEnv(**(healthy or {"episode_length": 50}))

    return make


def record(c: Collector) -> list[tuple]:
    events: list[tuple] = []
    c.on(WorkerFailed, lambda e: events.append(("failed", e.worker, e.pid, type(e.error), time.monotonic())))
    c.on(WorkerRestarted, lambda e: events.append(("restarted", e.worker, e.pid, e.old_pid, time.monotonic())))
    return events


def check_dynamics(batch) -> None:
    obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
    broken = ~(nxt[:, :-1] == obs[:, 1:]).all(-1) & ~done[:, :-1]
    assert not bool(broken.any()), f"{int(broken.sum())} frames break the dynamics"
    ids = batch["collector", "traj_ids"]
    starts = ids[:, 1:] != ids[:, :-1]
    assert bool((~starts | done[:, :-1]).all()), "a trajectory id changed without an episode end"


@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_sigkill_mid_batch_is_survived_with_continuous_data_and_fresh_trajectory_ids(delivery):
    """SIGKILL of a worker in the middle of a batch under on_worker_failure="restart": a new
    worker replaces it, WorkerFailed then WorkerRestarted are emitted, and over the next 20
    batches every frame obeys CartPole's dynamics and no trajectory id is reused (per env,
    ids only grow; the trajectory the kill cut is never continued)."""
    c = Collector(SlowCartPole, Greedy(), frames_per_batch=128, num_workers=2, envs_per_worker=2,
                  delivery=delivery, on_worker_failure="restart", seed=3, prefetch=1)
    events = record(c)
    per_env: dict[int, list[int]] = {}
    last: dict[int, tuple[int, torch.Tensor]] = {}  # env -> (traj id, next observation) at its last frame
    with anyio.fail_after(60):
        async with c:
            old = c.worker_pids
            for n in range(21):
                batch = await c.collect()
                if n == 0:
                    await anyio.sleep(0.02)  # the workers are inside their next batches (~0.13 s each)
                    os.kill(old[1], signal.SIGKILL)
                check_dynamics(batch)
                for ids, obs, nxt in zip(batch["collector", "traj_ids"], batch["observation"], batch["next", "observation"]):
                    env = int(ids[0]) % 4
                    per_env.setdefault(env, []).extend(ids.tolist())
                    if env in last and last[env][0] == int(ids[0]):  # a trajectory crossing batches goes on
                        assert torch.equal(obs[0], last[env][1]), f"env {env}: trajectory {int(ids[0])} is reused"
                    last[env] = (int(ids[-1]), nxt[-1])
            assert c.state is State.RUNNING
            new = c.worker_pids
    assert new[0] == old[0] and new[1] != old[1] and not alive(old[1])
    assert [e[0] for e in events] == ["failed", "restarted"]
    assert events[0][1:3] == (1, old[1]) and events[1][1:4] == (1, new[1], old[1])
    assert c.stats().restarts == 1
    for env, ids in per_env.items():
        assert ids == sorted(ids), f"env {env} reuses a trajectory id"
        assert all(i % 4 == env for i in ids)


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_worker_exception_is_replaced_and_the_run_reaches_total_frames(tmp_path, num_workers):
    """An env that raises once: its worker is replaced (also on the local backend), the run
    delivers all total_frames, and the replacement's trajectories get fresh ids."""
    env_fn = once(str(tmp_path / "flag"), {"episode_length": 50, "fail_at_step": 7})
    c = Collector(env_fn, frames_per_batch=16, total_frames=16 * 8, num_workers=num_workers, envs_per_worker=2,
                  on_worker_failure="restart", seed=0)
    events = record(c)
    with anyio.fail_after(60):
        async with c:
            batches = [b async for b in c]
    assert len(batches) == 8
    assert [e[0] for e in events] == ["failed", "restarted"]
    assert events[0][3].__bases__[0] is WorkerError  # (a WorkerError that is also the env's own exception type)
    ids = [i for b in batches for i in b["collector", "traj_ids"][0].tolist()]
    assert ids == sorted(ids)
    for b in batches:
        check_dynamics(b)
    assert c.stats().restarts == 1


async def test_the_replacement_acts_with_the_newest_weights():
    """Weights published before a failure reach the replacement before its first batch: every
    frame it collects carries that version, and a later update(wait=True) is acknowledged."""
    policy = Greedy()
    c = Collector("CartPole-v1", policy, frames_per_batch=64, num_workers=2, envs_per_worker=2,
                  on_worker_failure="restart", prefetch=0)
    with anyio.fail_after(60):
        async with c:
            await c.collect()
            with torch.no_grad():
                policy.net.weight.mul_(-1)
            assert await c.update_weights(policy) == 1
            old = c.worker_pids[0]
            os.kill(old, signal.SIGKILL)
            await c.wait_for(WorkerRestarted)
            for _ in range(3):
                batch = await c.collect()
                assert bool((batch["collector", "policy_version"] == 1).all())
            assert await c.update_weights(policy) == 2
            assert c.worker_versions == (2, 2)


async def test_the_restart_budget_ends_the_run_with_the_last_error_and_says_so():
    """An env that always fails: after max_restarts replacements the next failure is raised,
    with a note naming max_restarts; every failure was a WorkerFailed event."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1, on_worker_failure="restart", max_restarts=2,
                  create_env_kwargs={"fail_at_step": 3})
    events = record(c)
    with anyio.fail_after(60), pytest.raises(WorkerError) as info:
        async with c:
            async for _ in c:
                pass
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert "max_restarts=2" in "".join(getattr(info.value, "__notes__", []))
    assert [e[0] for e in events] == ["failed", "restarted", "failed", "restarted", "failed"]


async def test_a_killed_launcher_is_replaced_and_so_are_its_workers():
    """SIGKILL of the launcher kills its workers (parent-death signal): under restart, a new
    launcher is started and both workers are replaced; collection goes on."""
    c = Collector(SlowCartPole, frames_per_batch=64, num_workers=2, envs_per_worker=2, on_worker_failure="restart")
    events = record(c)
    with anyio.fail_after(60):
        async with c:
            await c.collect()
            launcher = get_launcher().pid
            os.kill(launcher, signal.SIGKILL)
            while sum(e[0] == "restarted" for e in events) < 2:
                check_dynamics(await c.collect())
            for _ in range(3):
                check_dynamics(await c.collect())
            assert get_launcher().pid not in (None, launcher)
    assert sorted(e[1] for e in events if e[0] == "restarted") == [0, 1]


# ---- hangs --------------------------------------------------------------------------------------

async def test_a_hung_env_raises_worker_timeout_error_naming_worker_env_and_its_stack():
    """An env whose step never returns: with step_timeout=0.5 the consumer gets
    WorkerTimeoutError naming the worker, the env, what it was doing and where it hung (the
    worker's Python stack); the hung process is killed."""
    c = Collector(CountingEnv, frames_per_batch=8, num_workers=2, envs_per_worker=2, step_timeout=0.5,
                  create_env_kwargs={"episode_length": 50, "hang_at_step": 9})
    with anyio.fail_after(30), pytest.raises(WorkerTimeoutError) as info:
        async with c:
            pids = c.worker_pids
            async for _ in c:
                pass
    err = info.value
    assert err.worker in (0, 1) and err.env in (2 * err.worker, 2 * err.worker + 1)
    assert "step()" in err.doing
    message = str(err)
    assert f"worker {err.worker} (pid {pids[err.worker]}) is hung" in message
    assert "step_timeout=0.5" in message and "in _hang" in message and "in step" in message
    assert not any(alive(p) for p in pids)


async def test_a_hung_env_under_restart_is_replaced_and_the_run_goes_on(tmp_path):
    """A hang once, under restart: the worker is declared hung, replaced, and the run reaches
    total_frames with continuous data."""
    env_fn = once(str(tmp_path / "flag"), {"episode_length": 50, "hang_at_step": 5})
    c = Collector(env_fn, frames_per_batch=8, total_frames=8 * 6, num_workers=1, envs_per_worker=2,
                  step_timeout=0.5, on_worker_failure="restart")
    events = record(c)
    with anyio.fail_after(60):
        async with c:
            batches = [b async for b in c]
    assert len(batches) == 6
    assert [e[0] for e in events] == ["failed", "restarted"] and events[0][3] is WorkerTimeoutError
    for b in batches:
        check_dynamics(b)


async def test_idle_or_steadily_slow_workers_are_not_declared_hung():
    """step_timeout counts one call at a time: workers idle for longer (the consumer does not
    ask for batches) and batches longer than the timeout made of short steps are fine."""
    c = Collector(CountingEnv, frames_per_batch=64, total_frames=64 * 3, num_workers=1, step_timeout=0.3, prefetch=0,
                  create_env_kwargs={"episode_length": 50, "step_sleep": 0.01})  # a batch takes ~0.64 s
    with anyio.fail_after(60):
        async with c:
            async for _ in c:
                await anyio.sleep(0.6)  # the worker waits, idle, for longer than the timeout
    assert c.batches == 3
