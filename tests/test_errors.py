"""Every error names its cause: bad arguments fail at construction (no process started), bad data
gets a :class:`SpecError` naming the key and the shapes, a worker's exception reaches the consumer
with the worker-side traceback, a worker killed from outside is noticed at once, and an error
surfaces exactly once."""

from __future__ import annotations

import gc
import importlib
import os
import pathlib
import signal
import threading
import time

import anyio
import pytest
import torch
from tensordict import NonTensorData, TensorDict

import aiocollect
from aiocollect import (
    AiocollectError,
    BrokenWorkerError,
    Collector,
    ConfigError,
    ReplayBuffer,
    SpecError,
    State,
    WorkerError,
    split_trajectories,
)
from aiocollect._core import errors as _errors
from aiocollect._backends import workers as _workers
from aiocollect._service.bus import EventBus
from aiocollect._worker.policy import classify
from aiocollect.events import Event
from aiocollect._backends.launcher import get_launcher
from aiocollect.testing import BadObservationEnv, CountingEnv, InjectedFailure
from procs import alive as _alive


BACKENDS = pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])


# ---- bad arguments: ConfigError at construction -----------------------------------------------

def _policy_a(td):
    return td


def _policy_b(td):
    return td


CONFIG_ERRORS = [
    pytest.param(
        dict(frames_per_batch=10, total_frames=20, num_workers=1, envs_per_worker=3),
        r"frames_per_batch=10 is not a multiple of the 3 envs.*envs_per_worker.*frames_per_batch=(12|9)",
        id="frames_per_batch-not-multiple-of-envs",
    ),
    pytest.param(
        dict(frames_per_batch=6, num_workers=2, envs_per_worker=2),
        r"frames_per_batch=6 is not a multiple of the 4 envs.*num_workers \* envs_per_worker.*frames_per_batch=(8|4)",
        id="frames_per_batch-not-multiple-of-all-workers-envs",
    ),
    pytest.param(dict(frames_per_batch=0), r"frames_per_batch=0\b", id="frames_per_batch-zero"),
    pytest.param(dict(frames_per_batch=-16), r"frames_per_batch=-16\b", id="frames_per_batch-negative"),
    pytest.param(dict(frames_per_batch=16.0), r"frames_per_batch=16\.0\b", id="frames_per_batch-float"),
    pytest.param(dict(frames_per_batch=True), r"frames_per_batch=True\b", id="frames_per_batch-bool"),
    pytest.param(dict(frames_per_batch=16, total_frames=0), r"total_frames=0\b", id="total_frames-zero"),
    pytest.param(dict(frames_per_batch=16, total_frames=32.0), r"total_frames=32\.0\b", id="total_frames-float"),
    pytest.param(dict(frames_per_batch=16, num_workers=-1), r"num_workers=-1\b", id="num_workers-negative"),
    pytest.param(dict(frames_per_batch=16, envs_per_worker=0), r"envs_per_worker=0\b", id="envs_per_worker-zero"),
    pytest.param(dict(frames_per_batch=16, delivery="bogus"), r"delivery='bogus'", id="delivery-bogus"),
    pytest.param(dict(frames_per_batch=16, inference="server"), r"inference='server'", id="inference-server"),
    pytest.param(
        dict(frames_per_batch=16, policy=_policy_a, policy_factory=lambda: _policy_b),
        r"policy.*policy_factory|policy_factory.*policy",
        id="policy-and-policy_factory",
    ),
    pytest.param(dict(frames_per_batch=16, policy=42), r"policy=42\b", id="policy-not-callable"),
    pytest.param(dict(frames_per_batch=16, policy_factory="x"), r"policy_factory='x'", id="policy_factory-not-callable"),
    pytest.param(
        dict(create_env_fn="CartPol-v1", frames_per_batch=16),
        r"create_env_fn='CartPol-v1'.*'CartPole-v1'",
        id="unknown-env-id",
    ),
    pytest.param(dict(create_env_fn=42, frames_per_batch=16), r"create_env_fn=42\b", id="create_env_fn-not-callable"),
    pytest.param(
        dict(frames_per_batch=16, create_env_kwargs=[("episode_length", 3)]),
        r"create_env_kwargs=\[\('episode_length', 3\)\]",
        id="create_env_kwargs-not-dict",
    ),
    pytest.param(dict(frames_per_batch=16, exploration_type="bogus"), r"exploration_type='bogus'", id="exploration_type-bogus"),
    pytest.param(dict(frames_per_batch=16, prefetch=-1), r"prefetch=-1\b", id="prefetch-negative"),
    pytest.param(dict(frames_per_batch=16, seed="x"), r"seed='x'", id="seed-str"),
    pytest.param(dict(frames_per_batch=16, max_frames_per_traj=0), r"max_frames_per_traj=0\b", id="max_frames_per_traj-zero"),
    pytest.param(dict(frames_per_batch=16, split_trajs="yes"), r"split_trajs='yes'", id="split_trajs-not-bool"),
    pytest.param(dict(frames_per_batch=16, shutdown_timeout=-1.0), r"shutdown_timeout=-1\.0\b", id="shutdown_timeout-negative"),
]


@pytest.mark.parametrize(("kwargs", "match"), CONFIG_ERRORS)
def test_bad_argument_raises_config_error_naming_argument_and_value_and_starts_no_process(kwargs, match):
    """An invalid argument raises ConfigError (a ValueError) at construction; its message names
    the argument and the value; no worker process is started for it."""
    kwargs = dict(kwargs)
    create_env_fn = kwargs.pop("create_env_fn", CountingEnv)
    pids_before = list(_workers.started_pids)
    launcher_before = get_launcher().pid
    with pytest.raises(ConfigError, match=match) as info:
        Collector(create_env_fn, **kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, AiocollectError)
    assert _workers.started_pids == pids_before
    assert get_launcher().pid == launcher_before


def test_config_error_is_exported_and_is_a_value_error():
    """ConfigError is public, a ValueError and an AiocollectError."""
    assert issubclass(aiocollect.ConfigError, ValueError)
    assert issubclass(aiocollect.ConfigError, aiocollect.AiocollectError)


# ---- policies that do not fit the action space: SpecError --------------------------------------

def _no_action_policy():
    def policy(td):  # a TensorDict callable that writes no action
        return td

    return policy


async def _first_error(collector: Collector) -> BaseException:
    """The error of ``start()`` or, when that succeeds, of the first ``collect()``."""
    try:
        await collector.start()
        await collector.collect()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("neither start() nor the first collect() raised")


@BACKENDS
async def test_policy_that_writes_no_action_raises_spec_error_naming_action(num_workers):
    """A TensorDict policy that returns the TensorDict without "action" gets a SpecError that
    mentions "action", from start() (or at the latest the first collect())."""
    c = Collector(CountingEnv, _no_action_policy(), frames_per_batch=16, total_frames=32, num_workers=num_workers)
    try:
        with anyio.fail_after(30):
            err = await _first_error(c)
    finally:
        await c.aclose()
    assert type(err) is SpecError, repr(err)
    assert "'action'" in str(err)
    assert "wrote no" in str(err)


@BACKENDS
async def test_action_of_wrong_shape_raises_spec_error_with_shape_and_hint(num_workers):
    """An nn.Module returning [E, 2] logits for Discrete(2) gets a SpecError naming the shape it
    wrote, the shape needed, and the hint to take the argmax."""
    policy = torch.nn.Linear(3, 2)
    c = Collector(CountingEnv, policy, frames_per_batch=12, total_frames=24, num_workers=num_workers, envs_per_worker=3)
    try:
        with anyio.fail_after(30):
            err = await _first_error(c)
    finally:
        await c.aclose()
    assert type(err) is SpecError, repr(err)
    msg = str(err)
    assert "(3, 2)" in msg and "(3,)" in msg, msg
    assert "argmax" in msg, msg


@BACKENDS
async def test_float_action_for_discrete_space_raises_spec_error_with_dtype(num_workers):
    """An nn.Module returning float actions of the right shape for Discrete(2) gets a SpecError
    naming the dtype."""
    policy = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Flatten(0))
    c = Collector(CountingEnv, policy, frames_per_batch=16, total_frames=32, num_workers=num_workers)
    try:
        with anyio.fail_after(30):
            err = await _first_error(c)
    finally:
        await c.aclose()
    assert type(err) is SpecError, repr(err)
    assert "dtype" in str(err) and "float32" in str(err), str(err)


# ---- envs whose observations do not match their space -----------------------------------------

def _has_worker_traceback_note(err: BaseException) -> bool:
    """The error carries a note with a formatted (worker-side) traceback."""
    return any("traceback" in n and 'File "' in n for n in getattr(err, "__notes__", []))


@BACKENDS
async def test_bad_observation_at_reset_raises_spec_error_from_start(num_workers):
    """An env whose reset observation does not match its space: start() raises a SpecError (as
    itself, not wrapped) naming the key and both shapes, with the worker traceback as a note."""
    c = Collector(BadObservationEnv, frames_per_batch=16, total_frames=32, num_workers=num_workers)
    try:
        with anyio.fail_after(30), pytest.raises(SpecError) as info:
            await c.start()
    finally:
        await c.aclose()  # the error was seen: closing does not raise it again
    err = info.value
    assert type(err) is SpecError
    msg = str(err)
    assert "'observation'" in msg and "(2,)" in msg and "(3,)" in msg, msg
    assert _has_worker_traceback_note(err), getattr(err, "__notes__", None)
    assert c.state is State.CLOSED


@BACKENDS
async def test_bad_observation_at_later_step_raises_spec_error_from_collect(num_workers):
    """An env whose observations go wrong after a few steps: the consumer's collect() raises a
    SpecError naming the key and both shapes, with the worker-side traceback in __notes__."""
    c = Collector(
        BadObservationEnv,
        frames_per_batch=16,
        total_frames=64,
        num_workers=num_workers,
        create_env_kwargs={"bad_shape": (4, 5), "bad_at_step": 3},
    )
    try:
        with anyio.fail_after(30):
            await c.start()
            with pytest.raises(SpecError) as info:
                await c.collect()
    finally:
        await c.aclose()
    err = info.value
    assert type(err) is SpecError
    msg = str(err)
    assert "'observation'" in msg and "(4, 5)" in msg and "(3,)" in msg, msg
    notes = "\n".join(getattr(err, "__notes__", []))
    assert _has_worker_traceback_note(err), notes
    assert "rollout.py" in notes, notes
    if num_workers:
        assert "worker 0 (pid" in notes, notes


# ---- an env's exception in a worker: WorkerError with the worker-side traceback ---------------

@BACKENDS
async def test_env_exception_reaches_consumer_as_worker_error_with_cause_and_traceback(num_workers):
    """CountingEnv(fail_at_step=N): collect() raises WorkerError whose __cause__ is the
    InjectedFailure and whose message and worker_traceback hold the worker-side traceback."""
    c = Collector(
        CountingEnv,
        frames_per_batch=16,
        total_frames=64,
        num_workers=num_workers,
        create_env_kwargs={"fail_at_step": 5},
    )
    try:
        with anyio.fail_after(30), pytest.raises(WorkerError) as info:
            async for _ in c:
                pass
    finally:
        await c.aclose()
    err = info.value
    assert type(err).__bases__ == (WorkerError, InjectedFailure)  # (also caught as the env's own type)
    assert isinstance(err.__cause__, InjectedFailure), repr(err.__cause__)
    assert "injected failure at step 5" in str(err.__cause__)
    assert err.worker == (0 if num_workers else None)
    for text in (str(err), err.worker_traceback):
        assert "testing/__init__.py" in text, text
        assert "InjectedFailure" in text, text
    if num_workers:
        assert "worker 0 (pid" in str(err)
    else:
        assert "local worker" in str(err)


@BACKENDS
@pytest.mark.parametrize("how", ["fail_on_reset", "factory_raises"])
async def test_env_construction_failure_raises_from_start(num_workers, how):
    """An env that fails at its first reset, or a factory that raises, makes start() raise a
    WorkerError whose __cause__ is the original exception."""
    if how == "fail_on_reset":
        env_fn, kwargs = CountingEnv, {"fail_on_reset": 1}
    else:
        def env_fn():
            raise InjectedFailure("the factory refuses")

        kwargs = None
    c = Collector(env_fn, frames_per_batch=16, total_frames=32, num_workers=num_workers, create_env_kwargs=kwargs)
    try:
        with anyio.fail_after(30), pytest.raises(WorkerError) as info:
            await c.start()
    finally:
        await c.aclose()
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert "InjectedFailure" in info.value.worker_traceback
    assert c.state is State.CLOSED


# ---- a worker process that dies: BrokenWorkerError ---------------------------------------------

async def test_worker_killed_from_outside_raises_broken_worker_error_quickly():
    """SIGKILL of one worker (while a batch takes ~10 s) is noticed within 5 s: collect() raises
    BrokenWorkerError naming the worker index and its pid; the other worker is shut down."""
    c = Collector(
        CountingEnv,
        frames_per_batch=2048,  # 1024 steps of 0.01 s per env: a batch takes ~10 s
        num_workers=2,
        create_env_kwargs={"step_sleep": 0.01},
    )
    async with c:
        pids = c.worker_pids
        assert len(pids) == 2
        await anyio.sleep(0.2)  # both workers are inside their first batch
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with anyio.fail_after(5), pytest.raises(BrokenWorkerError) as info:
            await c.collect()
        assert time.monotonic() - t0 < 5
    err = info.value
    assert err.worker == 1
    assert "worker 1" in str(err) and f"pid {pids[1]}" in str(err), str(err)
    assert isinstance(err, WorkerError)
    assert c.state is State.CLOSED
    assert not any(_alive(p) for p in pids)


async def test_env_crashing_its_own_process_raises_broken_worker_error():
    """CountingEnv(crash_at_step=N) SIGKILLs its worker: collect() raises BrokenWorkerError."""
    async with Collector(
        CountingEnv, frames_per_batch=16, total_frames=64, num_workers=1, create_env_kwargs={"crash_at_step": 3}
    ) as c:
        pid = c.worker_pids[0]
        with anyio.fail_after(10), pytest.raises(BrokenWorkerError) as info:
            await c.collect()
    assert info.value.worker == 0
    assert f"pid {pid}" in str(info.value)


async def test_one_failing_worker_stops_the_healthy_one_and_error_names_it(tmp_path):
    """Of two workers, the first to build its env fails at step 4, the other is healthy and slow
    (a batch takes seconds): collect() raises the failing worker's error, naming its index and
    pid, and the healthy worker is shut down at once."""
    flag = str(tmp_path / "first")

    def env_fn():
        try:  # the first env built (in whichever worker) is the failing one
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            return CountingEnv(fail_at_step=4)
        except FileExistsError:
            return CountingEnv(step_sleep=0.01)

    c = Collector(env_fn, frames_per_batch=1024, num_workers=2)
    async with c:
        pids = c.worker_pids
        with anyio.fail_after(5), pytest.raises(WorkerError) as info:
            await c.collect()
    err = info.value
    assert type(err).__bases__ == (WorkerError, InjectedFailure)  # (also caught as the env's own type)
    assert isinstance(err.__cause__, InjectedFailure)
    assert err.worker in (0, 1)
    assert f"worker {err.worker} (pid {pids[err.worker]})" in str(err)


async def test_worker_killed_while_nobody_collects_is_reported_to_the_next_collect():
    """A worker SIGKILLed while nobody is collecting: the failure is not lost; the next collect()
    (after at most the batch collected before the kill) raises BrokenWorkerError."""
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=1) as c:
        pid = c.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(10):
            while c.state is not State.STOPPED:
                await anyio.sleep(0.01)
            with pytest.raises(BrokenWorkerError, match=f"pid {pid}"):
                for _ in range(2):
                    await c.collect()


async def test_worker_killed_while_nobody_collects_is_raised_by_aclose():
    """A worker SIGKILLed and no collect() after it: leaving `async with` raises
    BrokenWorkerError rather than dropping it."""
    with anyio.fail_after(10), pytest.raises(BrokenWorkerError):
        async with Collector(CountingEnv, frames_per_batch=16, num_workers=1) as c:
            os.kill(c.worker_pids[0], signal.SIGKILL)
            while c.state is not State.STOPPED:
                await anyio.sleep(0.01)
    assert c.state is State.CLOSED


async def _kill_launcher_during_collection_then_start_another() -> tuple[int, object]:
    """Kill the launcher under a running collector (expecting BrokenWorkerError), then collect
    with a new collector. Returns the old launcher's pid and its parent-side socket."""
    c = Collector(CountingEnv, frames_per_batch=1024, num_workers=2, create_env_kwargs={"step_sleep": 0.01})
    async with c:
        launcher = get_launcher().pid
        old_sock = get_launcher()._sock
        os.kill(launcher, signal.SIGKILL)
        with anyio.fail_after(5), pytest.raises(BrokenWorkerError):
            await c.collect()
    async with Collector(CountingEnv, frames_per_batch=16, num_workers=1) as c2:
        with anyio.fail_after(20):
            await c2.collect()
        assert get_launcher().pid not in (None, launcher)
    return launcher, old_sock


async def test_launcher_killed_breaks_its_workers_and_next_collector_gets_a_new_one():
    """SIGKILL of the launcher (template process) kills its workers (parent-death signal): the
    consumer gets BrokenWorkerError at once; the next collector starts a new launcher."""
    _, old_sock = await _kill_launcher_during_collection_then_start_another()
    old_sock.close()


async def test_dead_launchers_socket_is_closed_when_a_new_launcher_starts():
    """When a new launcher replaces a dead one, the dead one's socket is closed (no fd leak, no
    ResourceWarning)."""
    _, old_sock = await _kill_launcher_during_collection_then_start_another()
    leaked = old_sock.fileno() != -1
    old_sock.close()  # keep the ResourceWarning out of the run
    assert not leaked, "the dead launcher's socket is still open"


@BACKENDS
async def test_batches_completed_well_before_a_failure_are_delivered_before_the_error(num_workers):
    """Frames collected before an env fails are not dropped: the two batches completed (0.1 s)
    before the failure arrive, then the WorkerError."""
    c = Collector(CountingEnv, frames_per_batch=8, total_frames=80, num_workers=num_workers, seed=0,
                  create_env_kwargs={"fail_at_step": 21, "step_sleep": 0.02, "episode_length": 99})
    got = []
    with anyio.fail_after(30), pytest.raises(WorkerError):
        async with c:
            async for batch in c:
                got.append(batch)
    assert len(got) == 2
    assert got[1]["observation"][0, :, 0].tolist() == list(map(float, range(8, 16)))


async def test_batch_completed_right_before_a_failure_is_delivered_before_the_error():
    """The env fails on the very first step after a batch is complete: that complete batch still
    reaches the consumer before the error (local backend: deterministic)."""
    c = Collector(CountingEnv, frames_per_batch=16, total_frames=160, num_workers=0,
                  create_env_kwargs={"fail_at_step": 17})
    got = []
    with anyio.fail_after(30), pytest.raises(WorkerError):
        async with c:
            async for batch in c:
                got.append(batch)
    assert len(got) == 1


def test_worker_error_through_blocking_wrapper_leaves_no_thread():
    """A worker error in plain `with ...: for batch in c:` propagates as WorkerError; the
    collector is closed and the portal thread ends."""
    with pytest.raises(WorkerError) as info:
        with Collector(CountingEnv, frames_per_batch=16, total_frames=64, num_workers=1,
                       create_env_kwargs={"fail_at_step": 20}) as c:
            for _ in c:
                pass
    assert isinstance(info.value.__cause__, InjectedFailure)
    assert c.state is State.CLOSED


# ---- an error surfaces exactly once --------------------------------------------------------------

@BACKENDS
async def test_error_seen_by_consumer_is_not_raised_again_by_aclose(num_workers):
    """After collect() raised a worker's error, aclose() works and does not raise it again."""
    c = Collector(CountingEnv, frames_per_batch=16, total_frames=64, num_workers=num_workers,
                  create_env_kwargs={"fail_at_step": 3})
    with anyio.fail_after(30):
        await c.start()
        with pytest.raises(WorkerError):
            await c.collect()
        await c.aclose()
        await c.aclose()
    assert c.state is State.CLOSED


@BACKENDS
async def test_error_never_seen_by_consumer_is_raised_by_aclose_once(num_workers):
    """A worker that fails while nobody is collecting: aclose() raises its error, once."""
    c = Collector(CountingEnv, frames_per_batch=16, total_frames=64, num_workers=num_workers,
                  create_env_kwargs={"fail_at_step": 3}, prefetch=1)
    with anyio.fail_after(30):
        await c.start()  # prefetch=1: the first batch is collected without a request
        while c.state is not State.STOPPED:
            await anyio.sleep(0.01)
        with pytest.raises(WorkerError) as info:
            await c.aclose()
        assert isinstance(info.value.__cause__, InjectedFailure)
        await c.aclose()  # once only
    assert c.state is State.CLOSED


@BACKENDS
async def test_error_raised_by_start_is_not_raised_again_by_aclose(num_workers):
    """start() raised the env's error: aclose() does not raise it a second time."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=num_workers, create_env_kwargs={"fail_on_reset": 1})
    with anyio.fail_after(30):
        with pytest.raises(WorkerError):
            await c.start()
        await c.aclose()
    assert c.state is State.CLOSED


async def test_error_in_async_with_body_wins_and_collector_is_closed():
    """An exception in the body of `async with` propagates unchanged (not replaced by a worker
    error that aclose would raise), and the collector is closed."""
    # (prefetch=1: the worker collects, and fails, without a request)
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1, create_env_kwargs={"fail_at_step": 3}, prefetch=1)
    with anyio.fail_after(30), pytest.raises(KeyError, match="body"):
        async with c:
            while c.state is not State.STOPPED:  # the worker has failed, nobody has seen it
                await anyio.sleep(0.01)
            raise KeyError("body")
    assert c.state is State.CLOSED


async def test_worker_error_at_end_of_async_with_is_raised_by_exit():
    """A worker error nobody saw, and a body that exits normally: `async with` raises it."""
    # (prefetch=1: the worker collects, and fails, without a request)
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1, create_env_kwargs={"fail_at_step": 3}, prefetch=1)
    with anyio.fail_after(30), pytest.raises(WorkerError):
        async with c:
            while c.state is not State.STOPPED:
                await anyio.sleep(0.01)
    assert c.state is State.CLOSED


async def test_failed_start_in_async_with_leaves_collector_closed():
    """`async with Collector(...)` whose start fails: the error propagates and the collector is
    closed (the body never ran, so nobody else could close it), without a ResourceWarning."""
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1, create_env_kwargs={"fail_on_reset": 1})
    try:
        with anyio.fail_after(30), pytest.raises(WorkerError):
            async with c:
                pass  # pragma: no cover
        state = c.state
    finally:
        await c.aclose()  # were it left open: keep the leftover check and ResourceWarning out
    assert state is State.CLOSED
    del c
    gc.collect()  # a ResourceWarning from __del__ would fail the test (warnings are errors)


def test_failed_start_in_blocking_with_leaves_no_thread():
    """`with Collector(...)` whose start fails: the error propagates, and neither the blocking
    portal's thread nor the collector is left open."""

    before = set(threading.enumerate())
    c = Collector(CountingEnv, frames_per_batch=16, num_workers=1, create_env_kwargs={"fail_on_reset": 1})
    try:
        with pytest.raises(WorkerError):
            with c:
                pass  # pragma: no cover
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        state = c.state
    finally:
        if getattr(c, "_blocking_portal", None) is not None:
            c.close()
    assert not extra, extra
    assert state is State.CLOSED


async def test_sending_to_a_dead_worker_raises_broken_worker_error_not_os_error():
    """A worker that dies between two messages (its reader has not seen the end-of-file yet)
    makes the next send raise BrokenWorkerError naming it, never a raw BrokenPipeError."""
    import socket

    from aiocollect._backends.child import ChildProcess

    ours, theirs = socket.socketpair()
    w = ChildProcess(ours, index=3, who="worker 3")
    theirs.close()
    try:
        with pytest.raises(BrokenWorkerError, match="worker 3"):
            for _ in range(3):  # the first send may still be buffered by the kernel
                await w.send(("credit", 1))
    finally:
        ours.close()


# ---- one error family ----------------------------------------------------------------------------

#: exceptions of aiocollect.testing that stand for the user's own code failing, not for aiocollect
USER_SIDE = {"InjectedFailure"}


def _exported_exceptions() -> list[tuple[str, type[BaseException]]]:
    found = []
    for module in (aiocollect, aiocollect.testing):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                found.append((f"{module.__name__}.{name}", value))
    return found


def test_every_exported_exception_is_an_aiocollect_error_from_the_errors_module():
    """Every exception class aiocollect or aiocollect.testing exports derives from
    AiocollectError, is defined in aiocollect._core.errors and says when it is raised; the only
    exception is testing's InjectedFailure, which plays the user's code failing."""
    found = _exported_exceptions()
    assert {name.rsplit(".", 1)[1] for name, _ in found} >= {"AiocollectError", "ConfigError", "SamplingError",
                                                            "SubscriptionOverflowError", "InjectedFailure"}
    for name, cls in found:
        short = name.rsplit(".", 1)[1]
        if short in USER_SIDE:
            assert not issubclass(cls, AiocollectError), name
            continue
        assert issubclass(cls, AiocollectError), name
        assert cls.__doc__ and cls.__doc__.strip(), f"{name} has no docstring saying when it is raised"
        assert cls.__module__ == "aiocollect" and getattr(_errors, short) is cls, name  # (public: shown as aiocollect.X)
        assert short in _errors.__all__, name


def test_no_module_defines_a_public_exception_outside_the_errors_module():
    """A new error class added anywhere but _errors.py fails here (private control-flow
    exceptions, named with a leading underscore, may live where they are used)."""
    package = pathlib.Path(aiocollect.__file__).parent
    for path in sorted(package.rglob("*.py")):  # (subpackages too)
        parts = path.relative_to(package.parent).with_suffix("").parts
        module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        for name, value in vars(module).items():
            if not (isinstance(value, type) and issubclass(value, BaseException)):
                continue
            if name.startswith("_") or value.__module__ not in (module.__name__, "aiocollect"):
                continue  # (private, or imported from another module)
            if getattr(_errors, name, None) is value or name in USER_SIDE:
                continue
            raise AssertionError(f"{module.__name__}.{name} is an exception class outside aiocollect._core.errors")


def test_every_class_in_the_errors_module_is_an_aiocollect_error():
    for name in _errors.__all__:
        assert issubclass(getattr(_errors, name), AiocollectError), name


def test_errors_keep_their_old_import_paths():
    """SubscriptionOverflowError, SamplingError and WeightsMismatchError moved to _errors.py;
    importing them from where they were still gives the same classes."""
    from aiocollect._service.bus import SubscriptionOverflowError
    from aiocollect._replay.samplers import SamplingError
    from aiocollect._worker.weights import WeightsMismatchError

    assert SubscriptionOverflowError is _errors.SubscriptionOverflowError is aiocollect.SubscriptionOverflowError
    assert SamplingError is _errors.SamplingError is aiocollect.SamplingError
    assert WeightsMismatchError is _errors.WeightsMismatchError


def test_weights_mismatch_error_is_a_config_error_and_a_key_error_printed_without_quotes():
    err = _errors.WeightsMismatchError("the weights given for 'policy' lack ['w']; pass the module")
    assert isinstance(err, ConfigError) and isinstance(err, KeyError) and isinstance(err, AiocollectError)
    assert str(err) == "the weights given for 'policy' lack ['w']; pass the module"


class _ZeroActions(torch.nn.Module):
    """Action 0 for every env; two tensors of weights."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.b = torch.nn.Parameter(torch.zeros(1))

    def forward(self, obs):
        return torch.zeros(obs.shape[0], dtype=torch.int64)


async def test_update_weights_that_lack_a_tensor_raise_weights_mismatch_error():
    """Catchable as ConfigError and, as it first was, as KeyError; its str() is the message."""
    async with Collector(CountingEnv, _ZeroActions(), frames_per_batch=8, num_workers=0) as c:
        for kind in (ConfigError, KeyError, _errors.WeightsMismatchError):
            with pytest.raises(kind) as info:
                await c.update_weights({"w": torch.ones(3)})
            assert str(info.value).startswith("the weights given for 'policy' lack ['b']"), str(info.value)


def _split_batch(**entries) -> TensorDict:
    base = {("next", "done"): torch.zeros(1, 3, 1, dtype=torch.bool), "observation": torch.zeros(1, 3)}
    base.update(entries)
    return TensorDict(base, batch_size=[1, 3])


def _per_frame_note_batch() -> TensorDict:
    rows = [TensorDict({"note": NonTensorData(str(t)), ("collector", "traj_ids"): torch.tensor(0)}, []) for t in range(3)]
    return torch.stack(rows).unsqueeze(0)


def _handler(event):
    return None


#: (what is called, the type it raised before it was a ConfigError, a pattern of its message)
BAD_CALLS = [
    pytest.param(lambda: split_trajectories(split_trajectories(_split_batch())), ValueError, "already split",
                 id="split-already-split"),
    pytest.param(lambda: split_trajectories(TensorDict({"x": torch.zeros(1, 2, 3)}, [1, 2, 3])), ValueError,
                 r"batch_size \(1, 2, 3\)", id="split-three-dims"),
    pytest.param(lambda: split_trajectories(TensorDict({"x": torch.zeros(2, 3)}, [2, 3])), ValueError,
                 "neither", id="split-no-ids-no-done"),
    pytest.param(lambda: split_trajectories(_per_frame_note_batch()), TypeError, "'note'", id="split-per-frame-non-tensor"),
    pytest.param(lambda: EventBus().on(Event, 42), TypeError, "handler=42 is not callable", id="on-handler-not-callable"),
    pytest.param(lambda: EventBus().on(int, _handler), TypeError, "not an aiocollect.events.Event", id="on-not-an-event"),
    pytest.param(lambda: EventBus().subscribe(str), TypeError, "not an aiocollect.events.Event", id="subscribe-not-an-event"),
    pytest.param(lambda: ReplayBuffer(8).extend({"x": torch.zeros(2)}), TypeError, "expected a TensorDict batch, got dict",
                 id="replay-extend-not-a-tensordict"),
    pytest.param(lambda: classify(42), TypeError, "policy must be callable, got int", id="policy-not-callable"),
]


@pytest.mark.parametrize(("call", "old_type", "match"), BAD_CALLS)
def test_a_bad_argument_to_a_method_raises_config_error_that_is_still_its_old_type(call, old_type, match):
    """Bad arguments raise ConfigError (ConfigTypeError where a TypeError was raised before), so
    both `except ConfigError` and the `except ValueError`/`except TypeError` user code already
    has catch them; the message names the cause and the fix (after a semicolon), with no full
    stop at the end."""
    for kind in (ConfigError, old_type, AiocollectError):
        with pytest.raises(kind, match=match) as info:
            call()
    message = str(info.value)
    assert ";" in message, message
    assert not message.endswith("."), message
    if old_type is TypeError:
        assert isinstance(info.value, _errors.ConfigTypeError)


def _returns_no_env(**kwargs):
    return 42


@BACKENDS
async def test_env_factory_that_returns_no_env_raises_config_error_from_start(num_workers):
    """A create_env_fn that returns something other than an env: start() raises a ConfigError
    that is also a TypeError, naming create_env_fn and what it returned, with the worker-side
    traceback as a note."""
    c = Collector(_returns_no_env, frames_per_batch=8, total_frames=8, num_workers=num_workers)
    try:
        with anyio.fail_after(30), pytest.raises(ConfigError, match="create_env_fn returned int, not a gymnasium.Env") as info:
            await c.start()
    finally:
        await c.aclose()
    assert isinstance(info.value, TypeError)
    assert _has_worker_traceback_note(info.value)
    assert c.state is State.CLOSED
