"""Cancellation wins in start-up too, and a start-up that fails or is cancelled leaves nothing
running: a cancel scope expiring during `async with` entry while an env factory never returns
gives control back (what does not stop within shutdown_timeout is killed), for the Collector
(worker processes and the local backend) and the Evaluator; one Ctrl-C ends such a script; when
a failed start's error reaches the caller, none of its worker processes is alive, whether or not
it had said hello; and workers whose stop is interrupted (the event loop going away) are killed
and their sockets closed.

The bounds asserted are hang checks (before, these never returned), not timings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from aiocollect import Collector, ConfigError, Evaluator
from aiocollect._backends.launcher import get_launcher
from aiocollect.testing import CountingEnv
from procs import alive, ctrl_c, template_workers

SCRIPTS = Path(__file__).resolve().parent / "scripts"
RETURNS_WITHIN = 45.0  # seconds: shutdown_timeout (1 s) and a second or two, with room for a loaded machine
# shutdown_timeout of the tests that check that a start-up still in its env factories does not wait
# for it: a return before it is the property (it takes about a second), and no loaded machine
# takes 30 s more
LONG_SHUTDOWN = 30.0


def launcher_children() -> list[int]:
    """Live processes forked by the launcher's templates (this test's workers: tests run one at a time)."""
    return template_workers(get_launcher().pid)


def marking_factory(marks: str):
    """An env factory that records its process id in ``marks`` and never returns."""

    def licensed_env():
        name = f"{os.getpid()}-{time.monotonic_ns()}"
        with open(os.path.join(marks, f".{name}"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(marks, f".{name}"), os.path.join(marks, name))  # (seen whole, or not at all)
        while True:
            time.sleep(3600)

    return licensed_env


def marked_pids(marks: Path) -> list[int]:
    """The pids the factories recorded (a mark is written under a dot name, then renamed)."""
    return [int(p.read_text()) for p in marks.iterdir() if not p.name.startswith(".")]


async def give_up_once_a_factory_runs(make, marks: Path) -> float:
    """Enter ``make()`` under a cancel scope that expires once a factory has started (the entry is
    then stuck in it); returns the seconds from the cancellation until the entry gave control back."""
    cancelled_at: list[float] = []

    async def expire(scope: anyio.CancelScope) -> None:
        while not marked_pids(marks):
            await anyio.sleep(0.02)
        cancelled_at.append(time.monotonic())
        scope.cancel()

    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(expire, scope)
            async with make():
                pytest.fail("the entry returned although the env factory never returns")
    assert cancelled_at, "the scope was not cancelled by the test"
    return time.monotonic() - cancelled_at[0]


@pytest.mark.timeout(120)
async def test_a_cancel_scope_ends_a_collector_entry_stuck_in_a_factory_and_kills_the_workers(tmp_path):
    """`async with Collector(...)` whose env factory never returns (in 2 worker processes),
    cancelled while it is stuck there: control comes back (the workers get shutdown_timeout, then
    are killed), and no worker process is left, those in the factory included."""
    took = await give_up_once_a_factory_runs(
        lambda: Collector(marking_factory(str(tmp_path)), frames_per_batch=32, num_workers=2, shutdown_timeout=1.0),
        tmp_path,
    )
    assert took < RETURNS_WITHIN, took
    pids = marked_pids(tmp_path)
    assert pids and not any(alive(p) for p in pids), pids
    assert launcher_children() == []


@pytest.mark.timeout(120)
async def test_a_cancelled_start_up_stuck_in_factories_does_not_wait_for_shutdown_timeout(tmp_path):
    """Nothing is collected while the env factories run: cancelled there, the entry gives control
    back without giving the workers shutdown_timeout (30 s here) to close envs they do not have
    yet; they are killed, none is left."""
    took = await give_up_once_a_factory_runs(
        lambda: Collector(marking_factory(str(tmp_path)), frames_per_batch=32, num_workers=2,
                          shutdown_timeout=LONG_SHUTDOWN),
        tmp_path,
    )
    assert took < LONG_SHUTDOWN, took
    pids = marked_pids(tmp_path)
    assert pids and not any(alive(p) for p in pids), pids
    assert launcher_children() == []


def _closing_env_factories(marks: str, events: str, slow_worker: int):
    """Env factories, one per worker: worker ``slow_worker``'s never returns (it marks its pid in
    ``marks``); the others' envs write ``built-<worker>`` and ``closed-<worker>`` into ``events``."""

    def factory(worker: int):
        def make():
            if worker == slow_worker:
                return marking_factory(marks)()
            env = CountingEnv()
            close = env.close

            def closing():
                close()
                open(os.path.join(events, f"closed-{worker}"), "w").close()

            env.close = closing
            open(os.path.join(events, f"built-{worker}"), "w").close()
            return env

        return make

    return factory


@pytest.mark.timeout(120)
async def test_a_cancelled_start_up_closes_the_envs_of_workers_that_built_them(tmp_path):
    """Cancelled while worker 1 is stuck in its factory, after worker 0 built its env: worker 1 is
    killed without waiting for shutdown_timeout, worker 0 is asked to stop and closes its env (a
    simulator's close() runs: it is not killed), and none is left."""
    marks, events = tmp_path / "marks", tmp_path / "events"
    marks.mkdir()
    events.mkdir()
    factory = _closing_env_factories(str(marks), str(events), slow_worker=1)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def expire() -> None:
                while not marked_pids(marks) or not (events / "built-0").exists():
                    await anyio.sleep(0.02)
                await anyio.sleep(1.0)  # (worker 0 tells its spaces to the collector, which reads them)
                cancelled_at.append(time.monotonic())
                scope.cancel()

            cancelled_at: list[float] = []
            tg.start_soon(expire)
            async with Collector([factory(0), factory(1)], frames_per_batch=32, num_workers=2,
                                 shutdown_timeout=LONG_SHUTDOWN):
                pytest.fail("the entry returned although an env factory never returns")
    assert time.monotonic() - cancelled_at[0] < LONG_SHUTDOWN
    assert sorted(p.name for p in events.iterdir()) == ["built-0", "closed-0"]
    pids = marked_pids(marks)
    assert pids and not any(alive(p) for p in pids), pids
    assert launcher_children() == []


@pytest.mark.timeout(120)
async def test_a_cancel_scope_ends_an_evaluator_entry_stuck_in_a_factory_and_kills_its_worker(tmp_path):
    """The same for `async with Evaluator(...)`: its worker, stuck in the factory, is killed."""
    took = await give_up_once_a_factory_runs(
        lambda: Evaluator(marking_factory(str(tmp_path)), shutdown_timeout=1.0), tmp_path
    )
    assert took < RETURNS_WITHIN, took
    pids = marked_pids(tmp_path)
    assert pids and not any(alive(p) for p in pids), pids
    assert launcher_children() == []


class _Released:
    """The local backend's factory: waits until the test releases it (a thread cannot be killed),
    then returns an env whose closing is recorded."""

    go = threading.Event()
    started = threading.Event()
    envs: list[CountingEnv] = []

    @classmethod
    def factory(cls) -> CountingEnv:
        cls.started.set()
        cls.go.wait()
        env = CountingEnv()
        cls.envs.append(env)
        return env


@pytest.mark.parametrize("shutdown_timeout", [1.0, LONG_SHUTDOWN])
@pytest.mark.timeout(120)
async def test_a_cancel_scope_ends_a_local_backend_entry_stuck_in_a_factory(shutdown_timeout):
    """The local backend runs the factory in a thread of this process: cancelled while the
    factory does not return, the entry gives control back all the same, without waiting for
    shutdown_timeout, and the env the factory returns later is closed (nobody can use it)."""
    _Released.go.clear()
    _Released.started.clear()
    _Released.envs.clear()
    cancelled_at: list[float] = []

    async def expire(scope: anyio.CancelScope) -> None:
        while not _Released.started.is_set():
            await anyio.sleep(0.02)
        cancelled_at.append(time.monotonic())
        scope.cancel()

    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(expire, scope)
                async with Collector(_Released.factory, frames_per_batch=32, num_workers=0,
                                     shutdown_timeout=shutdown_timeout):
                    pytest.fail("the entry returned although the env factory has not")
        took = time.monotonic() - cancelled_at[0]
        assert took < min(RETURNS_WITHIN, LONG_SHUTDOWN), took
        assert _Released.envs == []  # (it returned control while the factory still waited)
    finally:
        _Released.go.set()  # the factory returns: its env is closed in its thread, which ends
    with anyio.fail_after(20):
        while not (_Released.envs and _Released.envs[0].closed):
            await anyio.sleep(0.02)


@pytest.mark.parametrize("shutdown_timeout", [0.0, 5.0])
@pytest.mark.timeout(240)
async def test_no_worker_of_a_failed_start_is_alive_when_its_error_arrives(shutdown_timeout):
    """`Collector(lambda: None, num_workers=4)` fails to start (the factory returns no env): at
    the moment the caller catches the error, none of the four worker processes is alive, also
    those whose hello had not been read when the first one failed. Ten times."""
    for attempt in range(10):
        with pytest.raises(ConfigError, match="returned NoneType, not a gymnasium.Env"):
            async with Collector(lambda: None, frames_per_batch=64, num_workers=4, shutdown_timeout=shutdown_timeout):
                pass  # pragma: no cover
        assert launcher_children() == [], f"attempt {attempt}"


@pytest.mark.timeout(120)
async def test_no_worker_is_alive_when_an_entry_cancelled_at_once_returns():
    """An entry cancelled as soon as its first worker process exists (the others perhaps not
    forked yet, none has said hello): when the cancellation reaches the caller, every worker
    forked is gone. Five times."""

    async def expire(scope: anyio.CancelScope) -> None:
        while not launcher_children():
            await anyio.sleep(0.001)
        scope.cancel()

    for attempt in range(5):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(expire, scope)
                async with Collector("CartPole-v1", frames_per_batch=64, num_workers=4, shutdown_timeout=0.0):
                    pytest.fail("the entry was not cancelled")  # pragma: no cover
        assert launcher_children() == [], f"attempt {attempt}"


class _HangsInClose(CountingEnv):
    def close(self):
        if not self.closed:
            time.sleep(60)  # a simulator that does not shut down
        super().close()


@pytest.mark.timeout(120)
async def test_workers_whose_stop_is_interrupted_are_killed_and_their_sockets_closed():
    """The event loop going away (asyncio.run's end, a test's loop closing) cancels the run's
    task while it waits for its workers to exit: they are killed, and their sockets closed (a
    socket left open was a ResourceWarning), even though their seats had let go of them."""
    import asyncio

    c = Collector(_HangsInClose, frames_per_batch=16, num_workers=1, shutdown_timeout=60.0)
    await c.start()
    run = c._run
    proc = run.shared.pool.workers[0].proc
    pid = proc.pid
    run.request_close()  # as aclose() does, without waiting
    run.shared.stop.set()
    with anyio.fail_after(20):
        while run.shared.pool.workers[0].proc is not None:  # its seat let go: stopping it
            await anyio.sleep(0.01)
    await anyio.sleep(0.2)  # waiting for the worker, stuck in its env's close()
    run.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run.task
    assert proc.sock.fileno() == -1, "the worker's socket was left open"
    assert not alive(pid)
    await c.aclose()


@pytest.mark.parametrize(("kind", "shutdown_timeout"), [
    ("collector", 1.0), ("local", 1.0), ("evaluator", 1.0), ("collector", LONG_SHUTDOWN), ("local", LONG_SHUTDOWN),
])
@pytest.mark.timeout(150)
def test_one_ctrl_c_ends_a_script_whose_factory_never_returns(kind, shutdown_timeout):
    """A script in a terminal whose env factory never returns, stopped with one Ctrl-C (SIGINT to
    its process group) while `async with` is starting: it ends with KeyboardInterrupt, without
    waiting for shutdown_timeout (nothing was collected: no env to close), and neither its
    session nor a process stuck in the factory is left."""
    from test_cli import in_session

    with subprocess.Popen(
        [sys.executable, str(SCRIPTS / "ctrl_c_startup.py"), kind, str(shutdown_timeout)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,  # as a shell starts a job: its own session and group
    ) as proc:  # fmt: skip
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().split()
            if not line or line[0] != "factory":
                pytest.fail(f"the factory did not start: {line}\n{proc.communicate(timeout=30)[1]}")
            factory_pid = int(line[1])
            interrupted_at = time.monotonic()
            out, err = ctrl_c(proc)  # once
            took = time.monotonic() - interrupted_at
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 130, (out, err)
    assert out.splitlines()[-1] == "interrupted", out
    if shutdown_timeout == LONG_SHUTDOWN:
        assert took < LONG_SHUTDOWN, took
    assert "started" not in out.split(), out
    deadline = time.monotonic() + 5
    while (in_session(proc.pid) or alive(factory_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not in_session(proc.pid)
    assert not alive(factory_pid)
