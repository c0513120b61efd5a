"""Fault suite (issue 8): every fault that ``aiocollect.testing`` can inject, through a real
``Collector(..., num_workers=1)`` in ``async with``, reaches the consumer as the error that says
who caused it, with a message that names the cause, and leaves nothing of ours behind.

- an exception of the env (in ``step``, in ``reset``) or of the policy: :class:`WorkerError`
  with the original as ``__cause__`` and the worker-side traceback in its message;
- a worker process that died (SIGKILL, SIGSEGV, ``os._exit``): :class:`BrokenWorkerError`
  naming the worker and its pid;
- data that does not match the spaces (an observation of the wrong shape or dtype, an action of
  the wrong shape): :class:`SpecError` naming the key and what was wrong.

After each, the worker process is gone and this process has the same file descriptors, the same
"aiocollect" memory mappings (memfd slots) and the same threads as before (the autouse fixture
in conftest checks worker pids and shared memory too).

- a hang (an env step that never returns) with ``step_timeout``: :class:`WorkerTimeoutError`
  naming the worker, the env and where it hung;
- NaN in an observation or an action with ``check_finite=True``: :class:`SpecError` naming it.
"""

from __future__ import annotations

import gc
import os
import threading

import anyio
import pytest

from aiocollect import BrokenWorkerError, Collector, SpecError, WorkerError, WorkerTimeoutError
from aiocollect._backends.launcher import get_launcher
from aiocollect.testing import CountingEnv, FaultyPolicy, InjectedFailure
from procs import alive


@pytest.fixture(scope="module", autouse=True)
def launcher_with_torch():
    """The policy faults need torch in the workers: the launcher imports it once."""
    get_launcher().ensure_started(("torch",))


def _ours() -> dict:
    """What of ours this process holds: its fds (by number and target), its "aiocollect" memory
    mappings and its threads."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed since
            pass
    with open("/proc/self/maps") as f:
        maps = [line.strip() for line in f if "aiocollect" in line]
    return {"fds": fds, "maps": maps, "threads": sorted(t.name for t in threading.enumerate())}


async def _fault(expected: type[BaseException], env_kwargs: dict | None = None, policy=None, **options) -> BaseException:
    """Collect from CountingEnv(**env_kwargs) with ``policy`` until the fault surfaces; check it
    has type ``expected`` exactly and that nothing is left behind; return it."""
    gc.collect()
    before = _ours()
    pids: list[int] = []
    with pytest.raises(expected) as info:
        async with Collector(
            CountingEnv,
            policy,
            frames_per_batch=8,
            total_frames=32,
            num_workers=1,
            create_env_kwargs={"episode_length": 3, **(env_kwargs or {})},
            **options,
        ) as collector:
            pids += collector.worker_pids
            with anyio.fail_after(30):
                async for _ in collector:
                    pass
    err = info.value
    # (an exception of the user's code arrives as a WorkerError subclass that is also its own type)
    assert type(err) is expected or (expected is WorkerError and type(err).__bases__[0] is WorkerError), repr(err)
    assert len(pids) == 1 and not alive(pids[0]), "the worker process outlived the collector"
    gc.collect()
    after = _ours()
    assert after["fds"] == before["fds"], "file descriptors left open or closed"
    assert after["maps"] == before["maps"] == [], "memory of ours left mapped"
    assert after["threads"] == before["threads"], "threads left running"
    err.pid = pids[0]  # for the message checks
    return err


def _assert_exception_with_traceback(err: WorkerError, text: str, where: str) -> None:
    """A WorkerError for an InjectedFailure: the original as __cause__, and the worker-side
    traceback (down to ``where``) in the message and in worker_traceback."""
    assert isinstance(err.__cause__, InjectedFailure), repr(err.__cause__)
    assert text in str(err.__cause__)
    assert err.worker == 0 and f"worker 0 (pid {err.pid})" in str(err)
    for tb in (str(err), err.worker_traceback):
        assert "traceback (most recent call last)" in tb.lower(), tb
        assert f'{where}", line' in tb and "InjectedFailure: " in tb and text in tb, tb


# ---- exceptions: WorkerError with the cause and the worker-side traceback ---------------------


async def test_env_raising_in_step_is_a_worker_error_with_cause_and_traceback():
    err = await _fault(WorkerError, {"fail_at_step": 5})
    _assert_exception_with_traceback(err, "injected failure at step 5", "testing/__init__.py")


async def test_env_raising_in_reset_is_a_worker_error_with_cause_and_traceback():
    """The 2nd reset (at the end of the first episode, in the middle of a batch) raises."""
    err = await _fault(WorkerError, {"fail_on_reset": 2})
    _assert_exception_with_traceback(err, "injected failure at reset 2", "testing/__init__.py")


async def test_policy_raising_is_a_worker_error_with_cause_and_traceback():
    """The policy's 3rd call (the 2nd step: the first call checks its outputs at start) raises."""
    err = await _fault(WorkerError, policy=FaultyPolicy("raise", at_call=3))
    _assert_exception_with_traceback(err, "injected failure at call 3", "testing/_torch.py")


# ---- a worker process that died: BrokenWorkerError --------------------------------------------


@pytest.mark.parametrize(
    "env_kwargs",
    [{"crash_at_step": 5}, {"segfault_at_step": 5}, {"exit_at_step": 5, "exit_code": 3}],
    ids=["sigkill", "segfault", "os_exit"],
)
async def test_worker_process_dying_is_a_broken_worker_error_naming_it(env_kwargs):
    """SIGKILL, SIGSEGV and os._exit in the env's step end the worker process without an error
    report: BrokenWorkerError naming the worker, its pid and that it exited unexpectedly."""
    err = await _fault(BrokenWorkerError, env_kwargs)
    assert err.worker == 0
    assert f"worker 0 (pid {err.pid}) exited unexpectedly" in str(err), str(err)
    assert isinstance(err, WorkerError)


# ---- data that does not match the spaces: SpecError -------------------------------------------


async def test_observation_of_the_wrong_shape_is_a_spec_error_naming_key_and_shapes():
    err = await _fault(SpecError, {"wrong_shape_at_step": 5})
    msg = str(err)
    assert "'observation'" in msg and "(4,)" in msg and "(3,)" in msg, msg
    assert any(f"worker 0 (pid {err.pid})" in note for note in err.__notes__)


async def test_observation_of_the_wrong_dtype_is_a_spec_error_naming_key_and_dtype():
    """An int64 observation for a float32 space (another kind of number) at the 5th step."""
    err = await _fault(SpecError, {"wrong_dtype_at_step": 5})
    msg = str(err)
    assert "'observation'" in msg and "int64" in msg and "float32" in msg, msg


async def test_action_of_the_wrong_shape_is_a_spec_error_naming_key_and_shapes():
    """The policy's 3rd call (the 2nd step) returns actions [1, 3] for a Discrete space."""
    err = await _fault(SpecError, policy=FaultyPolicy("wrong_shape", at_call=3))
    msg = str(err)
    assert "'action'" in msg and "(1, 3)" in msg and "(1,)" in msg, msg


# ---- a hang: WorkerTimeoutError -----------------------------------------------------------------


async def test_env_hanging_in_step_is_a_worker_timeout_error_naming_env_and_stack():
    """With step_timeout=0.5, an env whose 5th step never returns: WorkerTimeoutError naming the
    worker, the env, what it did, and its stack (the env's own hanging frame)."""
    err = await _fault(WorkerTimeoutError, {"hang_at_step": 5}, step_timeout=0.5)
    assert err.worker == 0 and err.env == 0 and err.doing == "env 0's step()"
    msg = str(err)
    assert f"worker 0 (pid {err.pid}) is hung" in msg and "in _hang" in msg, msg


async def test_env_hanging_in_reset_is_a_worker_timeout_error():
    err = await _fault(WorkerTimeoutError, {"hang_on_reset": 2}, step_timeout=0.5)
    assert err.doing == "env 0's reset()", err.doing


# ---- NaN: SpecError with check_finite ----------------------------------------------------------


async def test_nan_observation_with_check_finite_is_a_spec_error_naming_it():
    err = await _fault(SpecError, {"nan_at_step": 5}, check_finite=True)
    msg = str(err)
    assert "'observation'" in msg and "nan" in msg.lower(), msg


async def test_nan_action_with_check_finite_is_a_spec_error_naming_it():
    """A policy returning NaN for a Box action: SpecError with check_finite=True."""
    import gymnasium as gym
    import torch

    from aiocollect.testing import SpacesEnv

    with pytest.raises(SpecError, match="(?i)nan"):
        async with Collector(
            SpacesEnv, FaultyPolicy("nan", at_call=3, action_shape=(2,), dtype=torch.float32), frames_per_batch=8, num_workers=1,
            check_finite=True,
            create_env_kwargs={"observation_space": gym.spaces.Box(-1, 1, (3,)), "action_space": gym.spaces.Box(-1, 1, (2,))},
        ) as collector:
            with anyio.fail_after(30):
                async for _ in collector:
                    pass
