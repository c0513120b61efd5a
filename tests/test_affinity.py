"""worker_cpus (the collector's) and cpus (the evaluator's): the CPUs worker processes run on.

Complete programs on real CartPole envs and real worker processes: the training loop with server
inference and the workers kept off this process's first CPU (the setting docs/inference.md
recommends for a responsive loop) runs to its end with continuous data, every thread of every
worker on its CPUs; one CPU per worker survives a restart; the evaluator's worker; and the
values refused, with what to do instead.
"""

from __future__ import annotations

import os
import signal

import anyio
import pytest
import torch

from aiocollect import Collector, ConfigError, Evaluator
from aiocollect.events import WorkerRestarted

from test_restart import check_dynamics
from test_user_programs import Greedy, check_batch, train

ALLOWED = sorted(os.sched_getaffinity(0))
#: the setting of docs/inference.md: every CPU but this process's first (all of them on one CPU)
REST = ALLOWED[1:] or ALLOWED


def threads_cpus(pid: int) -> dict[int, frozenset[int]]:
    """The CPUs each thread of ``pid`` may run on (a worker's torch pool and helpers included)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = frozenset(os.sched_getaffinity(int(tid)))
        except (ProcessLookupError, OSError):  # the thread ended meanwhile
            pass
    return out


async def test_server_training_loop_with_workers_off_the_first_cpu_runs_to_its_end():
    """`worker_cpus=sorted(os.sched_getaffinity(0))[1:]` with inference="server" (the server at
    the default priority, "auto": ``SCHED_IDLE`` as "idle" gives, and normal again should it starve,
    as it does by design on a machine whose cores other programs keep busy): the loop runs to
    total_frames with an update after each batch, every thread of both workers stays on those
    CPUs, this process keeps all of its own, and the data are continuous and carry the versions
    the server acted with."""
    policy = Greedy()
    batches = 0
    last = None  # each env row's last version
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=2 * 4 * 16, total_frames=2 * 4 * 16 * 5, seed=1,
                             num_workers=2, envs_per_worker=4, inference="server", server_priority="auto",
                             worker_cpus=sorted(os.sched_getaffinity(0))[1:] or None) as c:
            async for batch in c:
                check_dynamics(batch)  # (a server's frames carry the version of their forward pass)
                if len(ALLOWED) > 1:
                    for pid in c.worker_pids:
                        assert set(threads_cpus(pid).values()) == {frozenset(REST)}, pid
                assert os.sched_getaffinity(0) == set(ALLOWED)  # the collector's process is left alone
                versions = batch["collector", "policy_version"]
                # the server's versions, in order along each env's frames (one worker may be a slot
                # ahead of the other: the order holds per env, not across workers)
                assert bool((versions[:, 1:] >= versions[:, :-1]).all()) and int(versions.max()) <= batches
                assert last is None or bool((versions[:, 0] >= last).all())
                last = versions[:, -1].clone()
                batches += 1
                train(policy)
                await c.update_weights(policy)
    assert batches == 5
    assert c.config.worker_cpus == (tuple(REST),) * 2 or len(ALLOWED) == 1


def _policy_of_every_thread(pid: int) -> set[int]:
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(os.sched_getscheduler(int(tid)))
        except (ProcessLookupError, OSError):  # the thread ended meanwhile
            pass
    return out


@pytest.mark.parametrize("inference", ["worker", "server"])
async def test_workers_acting_with_their_own_policy_run_under_sched_batch_and_a_replacement_too(inference):
    """The README's loop: every thread of each worker process runs under SCHED_BATCH (a worker
    woken by its credit preempts no one), a replacement of a killed worker too; this process
    keeps its own policy. Server inference (its workers wait on the server within a batch)
    keeps the default. The data stay continuous across the restart."""
    mine = os.sched_getscheduler(0)
    want = os.SCHED_BATCH if inference == "worker" else os.SCHED_OTHER
    with anyio.fail_after(90):
        async with Collector("CartPole-v1", Greedy(), frames_per_batch=2 * 4 * 16, total_frames=2 * 4 * 16 * 6, seed=1,
                             num_workers=2, envs_per_worker=4, inference=inference,
                             on_worker_failure="restart") as c:
            n, first, checked = 0, None, set()
            async for batch in c:
                check_dynamics(batch)
                for pid in c.worker_pids:
                    assert _policy_of_every_thread(pid) == {want}, pid
                    checked.add(pid)
                if n == 1:
                    first = c.worker_pids[0]
                    os.kill(first, signal.SIGKILL)
                n += 1
    assert first is not None and len(checked) == 3  # (both workers and the replacement)
    assert os.sched_getscheduler(0) == mine
    assert n == 6


async def test_one_cpu_per_worker_is_kept_by_a_replacement():
    """`worker_cpus=[[a], [b]]` places each worker on its CPU; under on_worker_failure="restart"
    the replacement of a killed worker runs on the CPU of the one it replaces, and the run goes on
    with continuous data."""
    cpus = [[ALLOWED[0]], [ALLOWED[-1]]]
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", Greedy(), frames_per_batch=64, num_workers=2, envs_per_worker=2,
                             on_worker_failure="restart", worker_cpus=cpus, total_frames=64 * 8) as c:
            seen = 0
            async for batch in c:
                check_batch(batch)
                seen += 1
                if seen == 2:
                    assert [os.sched_getaffinity(p) for p in c.worker_pids] == [set(x) for x in cpus]
                    old = c.worker_pids[1]
                    os.kill(old, signal.SIGKILL)
                    await c.wait_for(WorkerRestarted)
                    assert c.worker_pids[1] != old
                    assert set(threads_cpus(c.worker_pids[1]).values()) == {frozenset(cpus[1])}
            assert seen == 8 and c.stats().restarts == 1


async def test_the_evaluators_worker_runs_on_its_cpus():
    """Evaluator(cpus=...): its worker process (and its threads) on those CPUs, at its niceness;
    evaluations give the same episodes as without."""
    cpu, policy = ALLOWED[-1], Greedy()
    with anyio.fail_after(60):
        async with Evaluator("CartPole-v1", policy, num_trajectories=3, seed=5) as plain:
            expected = await plain.evaluate()
        async with Evaluator("CartPole-v1", policy, num_trajectories=3, seed=5, cpus={cpu}, nice=2) as ev:
            got = await ev.evaluate()
            assert set(threads_cpus(ev.worker_pid).values()) == {frozenset({cpu})}
            assert os.getpriority(os.PRIO_PROCESS, ev.worker_pid) == os.getpriority(os.PRIO_PROCESS, 0) + 2
    assert got["return_mean"] == expected["return_mean"] and got["episode_length_mean"] == expected["episode_length_mean"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"worker_cpus": "01"}, r"a set of CPU numbers for every worker \(e.g. range\(1, 4\)\) or a list of one set per worker"),
    ({"worker_cpus": 1}, "a set of CPU numbers for every worker"),
    ({"worker_cpus": []}, "is empty: a worker needs at least one CPU"),
    ({"worker_cpus": [[0], []]}, r"worker_cpus\[1\] is empty"),
    ({"worker_cpus": [0.5]}, "holds 0.5, which is not a CPU number"),
    ({"worker_cpus": [True]}, "holds True, which is not a CPU number"),
    ({"worker_cpus": [[0]]}, "a list of 1 CPU sets but there are 2 workers; pass one set per worker"),
    ({"worker_cpus": [0, [1]]}, "mixes CPU numbers and sets of them"),
    ({"worker_cpus": [max(ALLOWED) + 1]}, rf"names CPU {max(ALLOWED) + 1}, which this process may not run on \(it may use CPUs"),
    ({"worker_cpus": [0], "num_workers": 0}, r"with num_workers=0 the envs run in this process.*os.sched_setaffinity"),
    ({"worker_cpus": [0], "backend": "ray"}, "use ray_actor_options"),
])
def test_worker_cpus_is_checked(kwargs, match):
    args = {"frames_per_batch": 64, "num_workers": 2, "envs_per_worker": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        Collector("CartPole-v1", **args)


def test_worker_cpus_takes_ranges_sets_and_generators_and_keeps_one_tuple_per_worker():
    cpu = ALLOWED[0]
    for value in (range(cpu, cpu + 1), {cpu}, (c for c in [cpu, cpu]), [torch.tensor(cpu).item()]):
        c = Collector("CartPole-v1", frames_per_batch=64, num_workers=2, envs_per_worker=2, worker_cpus=value)
        assert c.config.worker_cpus == ((cpu,), (cpu,))
        assert c.config.cpus_for(1) == (cpu,)
    assert Collector("CartPole-v1", frames_per_batch=64, num_workers=2, envs_per_worker=2).config.cpus_for(0) is None


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"cpus": [[0]]}, r"one set of CPU numbers \(e.g. \{3\} or range\(2, 4\)\)"),
    ({"cpus": "0"}, "one set of CPU numbers"),
    ({"cpus": set()}, "is empty"),
    ({"cpus": {max(ALLOWED) + 1}}, "which this process may not run on"),
    ({"cpus": {0}, "backend": "ray"}, "use ray_actor_options"),
])
def test_evaluator_cpus_is_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Evaluator("CartPole-v1", **kwargs)
