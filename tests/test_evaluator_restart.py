"""The Evaluator's worker when it dies or hangs: step_timeout finds a hung env (WorkerTimeoutError
naming the evaluator's worker, the env, what it was doing and its stack; the process is killed
and the next evaluation gets a new worker) and never an idle worker; under
on_worker_failure="restart" an evaluation whose worker died or hung runs again on a new worker and
returns the metrics an evaluation without a failure gives, with WorkerFailed then WorkerRestarted
events, within a budget past which the last error is raised with a note; an env's exception is not
a worker failure. And a training loop that triggers such an evaluator every batch runs to its end.
(The autouse fixture in conftest checks that no process, thread or shared memory is left.)"""

from __future__ import annotations

import os
import signal
import time

import anyio
import pytest
import torch

from aiocollect import BrokenWorkerError, Collector, ConfigError, WorkerError, WorkerTimeoutError
from aiocollect._evaluator.evaluator import Evaluator
from aiocollect._backends.launcher import get_launcher
from aiocollect.events import EvaluationFailed, WorkerFailed, WorkerRestarted
from aiocollect.testing import CountingEnv, InjectedFailure
from procs import alive


@pytest.fixture(scope="module", autouse=True)
def launcher_with_this_modules_imports():
    """Workers unpickle this module's policy by importing this module: the launcher they are
    forked from imports its heavy imports once."""
    get_launcher().ensure_started(("torch", "tensordict", "pytest", "anyio"))


class Greedy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation):
        return self.net(observation).argmax(-1)


class HangingPolicy(torch.nn.Module):
    """Action 0, except that its ``hang_at``-th call (the first is the start-up check) never returns."""

    def __init__(self, hang_at: int) -> None:
        super().__init__()
        self.hang_at = hang_at
        self.calls = 0

    def forward(self, observation):
        self.calls += 1
        while self.calls == self.hang_at:
            time.sleep(1.0)
        return torch.zeros(observation.shape[0], dtype=torch.int64)


def faulty_in_first_process(flag: str, faulty: dict, healthy: dict, index: int = 0):
    """An env factory: env ``index`` of the first process that builds envs is built with
    ``faulty`` kwargs, every other env (in that process and later ones) with ``healthy``."""
    state = {"built": 0, "first": None}  # per process: the closure is pickled by value

    def make():
        if state["first"] is None:
            try:
                os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
                state["first"] = True
            except FileExistsError:
                state["first"] = False
        n = state["built"]
        state["built"] += 1
        return CountingEnv(**(faulty if state["first"] and n == index else healthy))

    return make


def episodes(returns, lengths) -> dict:
    """metrics_fn exposing every episode, to compare evaluations exactly."""
    return {"returns": returns.tolist(), "lengths": lengths.tolist()}


def record(ev: Evaluator) -> list[tuple]:
    events: list[tuple] = []
    ev.on(WorkerFailed, lambda e: events.append(("failed", e.worker, e.pid, type(e.error))))
    ev.on(WorkerRestarted, lambda e: events.append(("restarted", e.worker, e.pid, e.old_pid)))
    ev.on(EvaluationFailed, lambda e: events.append(("evaluation failed", type(e.error))))
    return events


def healthy(**kw):
    kw = {"episode_length": 10, **kw}
    return lambda: CountingEnv(**kw)


async def kill_during_evaluation(ev: Evaluator, seconds: float) -> None:
    """SIGKILL the worker ``seconds`` after this starts, while an evaluation runs."""
    pid = ev.worker_pid
    await anyio.sleep(seconds)
    assert ev.pending == 1 and ev.worker_pid == pid, "the kill must land during the evaluation"
    os.kill(pid, signal.SIGKILL)


# ---- options ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(on_worker_failure="retry"), r"on_worker_failure='retry' must be 'raise' .* or 'restart'"),
        (dict(max_restarts=-1), r"max_restarts=-1 must be an int >= 0"),
        (dict(max_restarts=1.5), r"max_restarts=1\.5 must be an int"),
        (dict(restart_window=0), r"restart_window=0 must be a positive, finite number of seconds, or None"),
        (dict(step_timeout=-1.0), r"step_timeout=-1\.0 must be a positive, finite number of seconds, or None"),
        (dict(step_timeout=float("inf")), r"step_timeout=inf must be"),
        (dict(step_timeout=True), r"step_timeout=True must be"),
    ],
)
def test_bad_failure_options_raise_config_error_naming_them(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Evaluator("CartPole-v1", **kwargs)


def test_failure_options_default_to_raise_without_a_timeout():
    c = Evaluator("CartPole-v1").config
    assert (c.on_worker_failure, c.max_restarts, c.restart_window, c.step_timeout) == ("raise", 3, 60.0, None)


# ---- hangs ------------------------------------------------------------------------------------------


async def test_a_hung_env_fails_the_evaluation_with_worker_timeout_error_naming_env_and_stack(tmp_path):
    """With step_timeout=0.5, env 1's step that never returns fails the evaluation with
    WorkerTimeoutError naming the evaluator's worker, env 1, "step()" and its stack (in _hang);
    EvaluationFailed carries it, the hung process is gone, and the next evaluation runs on a
    new worker (under the default "raise": no restart, no worker event)."""
    env_fn = faulty_in_first_process(
        str(tmp_path / "flag"), {"episode_length": 5, "hang_at_step": 3}, {"episode_length": 5}, index=1
    )
    with anyio.fail_after(60):
        async with Evaluator(env_fn, num_trajectories=2, num_envs=2, seed=0, step_timeout=0.5) as ev:
            events = record(ev)
            pid = ev.worker_pid
            with pytest.raises(WorkerTimeoutError) as info:
                await ev.evaluate(step=1)
            err = info.value
            assert err.worker is None and err.env == 1 and err.doing == "env 1's step()"
            message = str(err)
            assert f"the evaluator's worker (pid {pid}) is hung: env 1's step() has not returned" in message
            assert "step_timeout=0.5" in message and "in _hang" in message and "in step" in message
            assert events == [("evaluation failed", WorkerTimeoutError)] and ev.failed == 1
            metrics = await ev.evaluate(step=2)
            assert metrics["episode_length_mean"] == 5
            assert ev.worker_pid not in (None, pid) and not alive(pid)
    assert len(events) == 1 and ev.restarts == 0


async def test_a_hung_policy_is_named_as_the_policys_forward_pass():
    """A policy call that never returns: WorkerTimeoutError says it was the policy's forward
    pass (no env), with the policy's frame in the stack."""
    with anyio.fail_after(60):
        async with Evaluator(healthy(obs_shape=(4,)), HangingPolicy(hang_at=3), num_trajectories=1,
                             step_timeout=0.5) as ev:
            with pytest.raises(WorkerTimeoutError) as info:
                await ev.evaluate()
    err = info.value
    assert err.env is None and err.doing == "the policy's forward pass"
    assert "the policy's forward pass has not returned" in str(err) and "in forward" in str(err)


async def test_an_idle_evaluator_or_a_long_evaluation_of_short_steps_is_never_hung():
    """step_timeout counts one call at a time: an evaluation longer than the timeout made of
    short steps, and a worker idle for longer than the timeout between evaluations, are fine
    (same worker, no event, no error)."""
    with anyio.fail_after(60):
        async with Evaluator(healthy(step_sleep=0.02, episode_length=20), num_trajectories=2, seed=0, step_timeout=0.3,
                             on_worker_failure="restart") as ev:
            events = record(ev)
            pid = ev.worker_pid
            await anyio.sleep(1.0)  # idle before the first evaluation
            await ev.evaluate()  # 40 steps of 20 ms: longer than the timeout
            await anyio.sleep(1.0)  # idle between evaluations
            await ev.evaluate()
            assert ev.worker_pid == pid and ev.completed == 2
    assert events == [] and ev.restarts == 0


async def test_a_hang_under_restart_is_replaced_and_evaluate_returns_the_metrics_without_the_hang(tmp_path):
    """Under restart, a hang in the first worker: WorkerFailed (WorkerTimeoutError with the
    stack) then WorkerRestarted, and evaluate() returns exactly the metrics of an evaluation
    that never hung (same seed)."""
    async with Evaluator(healthy(), num_trajectories=3, seed=0, metrics_fn=episodes) as reference:
        expected = await reference.evaluate()
    env_fn = faulty_in_first_process(str(tmp_path / "flag"), {"episode_length": 10, "hang_at_step": 4},
                                     {"episode_length": 10})
    errors = []
    with anyio.fail_after(60):
        async with Evaluator(env_fn, num_trajectories=3, seed=0, metrics_fn=episodes, step_timeout=0.5,
                             on_worker_failure="restart") as ev:
            events = record(ev)
            ev.on(WorkerFailed, lambda e: errors.append(e.error))
            pid = ev.worker_pid
            metrics = await ev.evaluate(step=7)
            new = ev.worker_pid
    assert (metrics["returns"], metrics["lengths"]) == (expected["returns"], expected["lengths"])
    assert metrics["step"] == 7 and ev.completed == 1 and ev.failed == 0 and ev.restarts == 1
    assert events == [("failed", -1, pid, WorkerTimeoutError), ("restarted", -1, new, pid)]
    assert "in _hang" in str(errors[0]) and not alive(pid)


# ---- deaths -----------------------------------------------------------------------------------------


async def test_a_worker_killed_during_an_evaluation_under_restart_gives_the_metrics_of_one_without_the_kill():
    """SIGKILL of the worker in the middle of an evaluation under restart: evaluate() returns
    the same metrics as the evaluation before it (same seed, random policy), after WorkerFailed
    (BrokenWorkerError, old pid) then WorkerRestarted (new pid, old pid); nothing failed."""
    with anyio.fail_after(60):
        async with Evaluator(healthy(step_sleep=0.01), num_trajectories=4, seed=0, metrics_fn=episodes,
                             on_worker_failure="restart") as ev:
            expected = await ev.evaluate(step=0)
            events = record(ev)
            pid = ev.worker_pid
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_during_evaluation, ev, 0.1)  # it takes 40 steps of 10 ms
                metrics = await ev.evaluate(step=1)
            new = ev.worker_pid
            assert ev.poll() is None
    assert (metrics["returns"], metrics["lengths"]) == (expected["returns"], expected["lengths"])
    assert len(set(metrics["returns"])) > 1, "the random policy's actions vary: the comparison means something"
    assert events == [("failed", -1, pid, BrokenWorkerError), ("restarted", -1, new, pid)]
    assert new not in (None, pid) and not alive(pid)
    assert ev.restarts == 1 and ev.failed == 0 and ev.completed == 2


async def test_a_worker_killed_between_evaluations_under_restart_is_replaced_at_once_without_an_error():
    """Under restart, a worker killed while idle is replaced at once (WorkerFailed then
    WorkerRestarted, before any evaluation asks for it); no background error is raised and the
    next evaluation runs on the replacement."""
    with anyio.fail_after(60):
        async with Evaluator(healthy(), num_trajectories=2, seed=0, on_worker_failure="restart") as ev:
            events = record(ev)
            pid = ev.worker_pid
            os.kill(pid, signal.SIGKILL)
            restarted = await ev.wait_for(WorkerRestarted)
            assert ev.poll() is None
            assert restarted.old_pid == pid and ev.worker_pid == restarted.pid
            assert (await ev.evaluate())["episode_length_mean"] == 10
            assert ev.worker_pid == restarted.pid
    assert events == [("failed", -1, pid, BrokenWorkerError), ("restarted", -1, restarted.pid, pid)]


async def test_past_max_restarts_the_last_error_fails_the_evaluation_with_a_note():
    """A worker that crashes in every evaluation: max_restarts=2 new workers, then the third
    crash fails the evaluation with a note naming max_restarts; each crash was a WorkerFailed."""
    with anyio.fail_after(60):
        async with Evaluator(healthy(crash_at_step=3), num_trajectories=1, on_worker_failure="restart",
                             max_restarts=2) as ev:
            events = record(ev)
            with pytest.raises(BrokenWorkerError) as info:
                await ev.evaluate()
    assert "max_restarts=2 restarts within restart_window=60 s were used" in "".join(info.value.__notes__)
    assert [e[0] for e in events] == ["failed", "restarted", "failed", "restarted", "failed", "evaluation failed"]
    assert ev.restarts == 2 and ev.failed == 1


async def test_an_env_exception_is_not_a_worker_failure_even_under_restart():
    """An env's exception fails its evaluation as WorkerError (InjectedFailure as the cause):
    the worker reported it and stays usable, so it is not replaced and the evaluation is not run
    again; the next evaluation runs on the same worker."""
    with anyio.fail_after(60):
        async with Evaluator(healthy(fail_at_step=3), num_trajectories=2, on_worker_failure="restart") as ev:
            events = record(ev)
            pid = ev.worker_pid
            with pytest.raises(WorkerError) as info:
                await ev.evaluate()
            assert isinstance(info.value.__cause__, InjectedFailure)
            assert (await ev.evaluate())["episode_length_mean"] == 10
            assert ev.worker_pid == pid
    assert [e[0] for e in events] == ["evaluation failed"] and ev.restarts == 0
    assert events[0][1].__bases__[0] is WorkerError  # (a WorkerError that is also the env's own exception type)


# ---- a user program ---------------------------------------------------------------------------------


async def test_training_loop_triggering_a_restarting_evaluator_every_batch_runs_to_its_end(tmp_path):
    """A collector's training loop that triggers an evaluation every batch (queued, so every one
    runs) with an evaluator whose first worker hangs: the hung worker is replaced, every
    evaluation completes, in order, and the loop reaches total_frames."""
    policy = Greedy()
    env_fn = faulty_in_first_process(str(tmp_path / "flag"), {"obs_shape": (4,), "episode_length": 20, "hang_at_step": 5},
                                     {"obs_shape": (4,), "episode_length": 20})
    results: list[dict] = []
    collector = Collector("CartPole-v1", policy, frames_per_batch=128, total_frames=128 * 5, num_workers=1,
                          envs_per_worker=2, seed=0)
    evaluator = Evaluator(env_fn, policy, num_trajectories=2, seed=0, busy_policy="queue", max_queued=8,
                          on_worker_failure="restart", step_timeout=0.5, on_result=results.append)
    restarts = []
    evaluator.on(WorkerRestarted, restarts.append)
    with anyio.fail_after(120):
        async with collector, evaluator:
            steps = 0
            async for batch in collector:
                assert batch.batch_size == (2, 64)
                with torch.no_grad():
                    policy.net.weight.add_(0.01)
                await collector.update_weights(policy)
                steps += 1
                assert evaluator.trigger(policy, step=steps)
            last = await evaluator.wait()
    assert steps == 5 and [r["step"] for r in results] == [1, 2, 3, 4, 5] and last == results[-1]
    assert all(r["episode_length_mean"] == 20 for r in results)
    assert len(restarts) == 1 and evaluator.restarts == 1 and evaluator.failed == 0
    assert not alive(restarts[0].old_pid) and evaluator.completed == 5
