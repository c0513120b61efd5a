"""Hangs found from outside: a worker that cannot help (frozen with SIGSTOP, as a debugger, a
container freeze or a swapped-out machine leave it) is found by what the parent sees alone (its
process state and CPU time, the messages it sends, its heartbeat), whatever it was doing:
waiting for the collector, in the middle of a round, or just past the batch it delivered. Under
on_worker_failure="restart" it is killed and replaced and the run goes on; under "raise" the
consumer gets WorkerTimeoutError saying it is stopped. A worker idle because the collector gave
it no work (a slow consumer, a full stream) is never hung."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import anyio
import pytest

from aiocollect import Collector, Evaluator, WorkerTimeoutError
from aiocollect._core.heartbeat import IDLE, NBYTES, WAITING, HeartbeatMonitor, ProgressWatch, process_state
from aiocollect.events import WorkerFailed, WorkerRestarted
from aiocollect.testing import CountingEnv
from procs import alive

pytestmark = pytest.mark.timeout(120)


class SelfStoppingEnv(CountingEnv):
    """CountingEnv whose ``stop_at_step``-th step stops its own process (SIGSTOP), once per
    ``flag`` file: in the middle of a round, as a debugger's breakpoint would."""

    def __init__(self, flag: str, stop_at_step: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.flag, self.stop_at, self.steps = flag, stop_at_step, 0

    def step(self, action):
        self.steps += 1
        if self.steps == self.stop_at:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
        return super().step(action)


def state(pid: int) -> str | None:
    found = process_state(pid)
    return None if found is None else found[0]


async def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    while state(pid) not in ("T", "t"):
        await anyio.sleep(0.01)


def record(obj) -> list[tuple]:
    events: list[tuple] = []
    obj.on(WorkerFailed, lambda e: events.append(("failed", e.worker, e.pid, e.error)))
    obj.on(WorkerRestarted, lambda e: events.append(("restarted", e.worker, e.pid, e.old_pid)))
    return events


def check_stopped_error(err: BaseException, who: str) -> None:
    assert isinstance(err, WorkerTimeoutError), repr(err)
    message = str(err)
    assert f"{who} is stopped (process state T, stopped by a signal" in message, message
    assert "step_timeout=1)" in message and "It was killed" in message and "cannot write its stack" in message
    assert "SIGCONT" in message and "step_timeout=None" in message


# ---- the collector's workers ----------------------------------------------------------------------


@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_a_worker_stopped_while_waiting_is_replaced_and_the_collection_goes_on(delivery):
    """The user's report: a worker frozen while it waits for the collector (prefetch=0: it is
    idle between batches), step_timeout=1, restart: it is declared hung (WorkerTimeoutError
    saying it is stopped), killed and replaced, and the collection goes on (sync: it needs a
    batch of every worker, so it would block for ever; async: the other worker carries on
    meanwhile; its workers have credits for the whole run, so it may be stopped mid-round).
    Three batches after the replacement, the replacement has contributed."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=2, envs_per_worker=2, delivery=delivery, prefetch=0,
                  step_timeout=1, on_worker_failure="restart", seed=0, create_env_kwargs={"episode_length": 50})
    events = record(c)
    with anyio.fail_after(90):
        async with c:
            await c.collect()
            old = c.worker_pids
            await stop(old[1])
            after, workers = 0, set()
            async for batch in c:
                if events and events[-1][0] == "restarted":
                    after += 1
                    envs = batch["collector", "traj_ids"][:, 0].remainder(4)  # (4 envs, 2 per worker)
                    workers |= set(envs.div(2, rounding_mode="floor").tolist())
                    if after >= 3 and 1 in workers:
                        break
            new = c.worker_pids
    assert [e[0] for e in events] == ["failed", "restarted"], events
    assert events[0][1:3] == (1, old[1]) and events[1][1:4] == (1, new[1], old[1])
    check_stopped_error(events[0][3], f"worker 1 (pid {old[1]})")
    if delivery == "sync":  # (async delivery grants every credit at once: the worker may be mid-round)
        assert "while it waited for the collector" in str(events[0][3]) or "before starting" in str(events[0][3])
    assert new[0] == old[0] and new[1] != old[1]
    assert not alive(old[1])
    assert c.stats().restarts == 1


async def test_a_worker_stopped_while_waiting_raises_worker_timeout_error_naming_it():
    """Under "raise": the consumer gets WorkerTimeoutError naming the worker, saying it is
    stopped (no stack: a stopped process cannot write one) and how to fix it; it is gone."""
    c = Collector(CountingEnv, frames_per_batch=8, num_workers=2, envs_per_worker=1, prefetch=0, step_timeout=1,
                  create_env_kwargs={"episode_length": 50})
    with anyio.fail_after(60), pytest.raises(WorkerTimeoutError) as info:
        async with c:
            await c.collect()
            pids = c.worker_pids
            await stop(pids[0])
            async for _ in c:
                pass
    err = info.value
    assert err.worker == 0 and err.env is None
    check_stopped_error(err, f"worker 0 (pid {pids[0]})")
    assert not alive(pids[0])


async def test_a_worker_stopped_mid_round_is_named_with_the_call_it_was_in(tmp_path):
    """A worker that stops in the middle of env 0's 5th step (as at a breakpoint): the error
    says it is stopped in env 0's step(); under restart the run goes on to total_frames."""
    flag = str(tmp_path / "flag")
    c = Collector(SelfStoppingEnv, frames_per_batch=8, total_frames=8 * 4, num_workers=1, step_timeout=1,
                  on_worker_failure="restart",
                  create_env_kwargs={"flag": flag, "stop_at_step": 5, "episode_length": 50})
    events = record(c)
    with anyio.fail_after(60):
        async with c:
            pid = c.worker_pids[0]
            n = 0
            async for _ in c:
                n += 1
    assert n == 4 and os.path.exists(flag)
    assert [e[0] for e in events] == ["failed", "restarted"], events
    err = events[0][3]
    check_stopped_error(err, f"worker 0 (pid {pid})")
    assert err.env == 0 and err.doing == "env 0's step()" and "in env 0's step()" in str(err)
    assert not alive(pid)


async def test_a_sigstop_landing_as_a_batch_is_delivered_is_found_each_time():
    """SIGSTOP right as a batch reaches the consumer (the worker, granted its next batch with
    prefetch=1, is just past sending the one delivered, or starting the next), three times:
    each time the stopped worker is found and replaced, and the collection goes on."""
    c = Collector(CountingEnv, frames_per_batch=8, num_workers=1, step_timeout=1, prefetch=1,
                  on_worker_failure="restart", max_restarts=5, create_env_kwargs={"episode_length": 50})
    events = record(c)
    stopped: list[int] = []
    with anyio.fail_after(100):
        async with c:
            async for _ in c:
                pid = c.worker_pids[0]
                if len(stopped) == 3 and pid not in stopped:
                    break  # the third replacement delivered
                if pid not in stopped:
                    stopped.append(pid)
                    await stop(pid)
    assert [e[0] for e in events] == ["failed", "restarted"] * 3, events
    assert [e[2] for e in events if e[0] == "failed"] == stopped
    for e in events[::2]:
        check_stopped_error(e[3], f"worker 0 (pid {e[2]})")
    assert not any(alive(p) for p in stopped)


@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_a_slow_consumer_is_never_declared_hung(delivery):
    """Backpressure is no hang: the consumer takes a batch only every 4 step_timeouts, so the
    workers sit idle for long (sync, prefetch=0: no credits; async: credits, but every slot
    full); no worker fails, none is replaced."""
    c = Collector(CountingEnv, frames_per_batch=8, num_workers=2, envs_per_worker=1, delivery=delivery,
                  prefetch=0 if delivery == "sync" else 1, step_timeout=0.25, create_env_kwargs={"episode_length": 50})
    events = record(c)
    with anyio.fail_after(60):
        async with c:
            pids = c.worker_pids
            for _ in range(4):
                await c.collect()
                await anyio.sleep(1.0)
            assert c.worker_pids == pids
    assert events == [] and c.stats().restarts == 0


# ---- the Evaluator's worker -----------------------------------------------------------------------


async def test_the_evaluators_worker_stopped_between_evaluations_is_replaced_under_restart():
    """The Evaluator's worker frozen while idle: the next evaluation finds it stopped, it is
    killed and replaced, and the evaluation runs on the new worker."""
    with anyio.fail_after(60):
        async with Evaluator(lambda: CountingEnv(episode_length=5), num_trajectories=2, seed=0, step_timeout=1,
                             on_worker_failure="restart") as ev:
            events = record(ev)
            await ev.evaluate(step=0)
            pid = ev.worker_pid
            await stop(pid)
            metrics = await ev.evaluate(step=1)
            assert metrics["episode_length_mean"] == 5
            assert ev.worker_pid not in (None, pid)
    assert [e[0] for e in events] == ["failed", "restarted"], events
    check_stopped_error(events[0][3], f"the evaluator's worker (pid {pid})")
    assert ev.restarts == 1 and not alive(pid)


async def test_the_evaluators_worker_stopped_fails_the_evaluation_under_raise():
    """Under "raise" the evaluation fails with WorkerTimeoutError saying the worker is stopped;
    the stopped process is gone and the next evaluation runs on a new worker."""
    with anyio.fail_after(60):
        async with Evaluator(lambda: CountingEnv(episode_length=5), num_trajectories=2, seed=0, step_timeout=1) as ev:
            await ev.evaluate(step=0)
            pid = ev.worker_pid
            await stop(pid)
            with pytest.raises(WorkerTimeoutError) as info:
                await ev.evaluate(step=1)
            check_stopped_error(info.value, f"the evaluator's worker (pid {pid})")
            assert (await ev.evaluate(step=2))["episode_length_mean"] == 5
            assert ev.worker_pid not in (None, pid) and not alive(pid)


# ---- the rule, on its own -------------------------------------------------------------------------


def test_progress_watch_finds_a_worker_given_work_that_makes_no_progress_and_never_an_unasked_one():
    """ProgressWatch on a live, sleeping process (state S, no CPU time): never hung while it was
    given no work, however long; given work, hung (WAITING) once it shows no progress for longer
    than the timeout; any progress (bytes received, a heartbeat) restarts the deadline."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        monitor = HeartbeatMonitor(bytearray(NBYTES), 0)
        watch, timeout = ProgressWatch(), 0.2
        deadline = time.monotonic() + 4 * timeout
        while time.monotonic() < deadline:  # not given work: never hung
            assert watch.check(proc.pid, timeout, None, 0, monitor) is None
            time.sleep(timeout / 4)
        assert watch.check(proc.pid, timeout, "work", 0, monitor) is None  # (the deadline starts now)
        found, give_up = None, time.monotonic() + 30
        while found is None and time.monotonic() < give_up:
            time.sleep(timeout / 4)
            found = watch.check(proc.pid, timeout, "work", 0, monitor)
        assert found is not None, "a worker given work and making no progress was never found"
        assert found[0] == WAITING and found[2] > timeout
        assert watch.check(proc.pid, timeout, "work", 1, monitor) is None  # a message arrived
        assert watch.check(proc.pid, timeout, "more work", 1, monitor) is None  # new work: a new deadline
        monitor._words[0] += 1  # its heartbeat moved
        assert watch.check(proc.pid, timeout, "more work", 1, monitor) is None
        assert monitor.doing()[0] == IDLE
        monitor.release()
    finally:
        proc.kill()
        proc.wait()
