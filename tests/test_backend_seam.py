"""The backend seam: aiocollect's backends come from one table, by name; a backend object passed
as ``backend=`` (a fake pool of workers here) is used as it is, without monkeypatching; every
kind of worker seat has the seam's verbs; and the failure texts every seat uses come from one
place."""

from __future__ import annotations

import socket

import pytest
import torch

from aiocollect import Collector, ConfigError, State
from aiocollect._backends import failures
from aiocollect._backends.eval_process import EvalProcess
from aiocollect._backends.ray import RayWorker, _Snapshots
from aiocollect._backends.ray_eval import RayEvalWorker
from aiocollect._backends.seat import Backend, EvalSeat, RolloutSeat, Seat
from aiocollect._backends.table import BACKENDS, LocalBackend, backend_named, backend_object
from aiocollect._backends.workers import ProcessWorker, WorkerHandle
from fake_workers import FakeBackend, FakeWorker, Script, value

pytestmark = pytest.mark.timeout(60)


def test_the_table_lists_exactly_the_known_backends():
    assert sorted(BACKENDS) == ["local", "process", "ray"]
    for name, backend in BACKENDS.items():
        assert backend.name == name
        assert isinstance(backend, Backend)
        assert backend_named(name) is backend


def test_an_unknown_backend_name_is_a_config_error_naming_the_choices():
    with pytest.raises(ConfigError, match=r"backend='thread'.*'process', 'local', 'ray'"):
        backend_named("thread")
    with pytest.raises(ConfigError, match=r"backend='local'.*'process', 'ray'"):
        backend_named("local", choices=("process", "ray"))  # (the evaluator's choices)
    with pytest.raises(ConfigError, match=r"backend='thread' must be 'process', 'local' or 'ray'"):
        Collector("CartPole-v1", None, frames_per_batch=8, num_workers=1, backend="thread")


def test_an_object_that_is_no_backend_is_a_config_error_saying_what_it_lacks():
    class Half:
        name = "half"

        async def start(self, launch):  # pragma: no cover - never started
            raise AssertionError

    with pytest.raises(ConfigError, match=r"lacks weights_in_parent, warm_up, share_slots"):
        backend_object(Half())
    with pytest.raises(ConfigError, match=r"neither a backend's name"):
        Collector("CartPole-v1", None, frames_per_batch=8, num_workers=1, backend=Half())


async def test_a_fake_backend_passed_in_collects_batches():
    """A complete user program: build a collector on a fake backend (no process, no env step),
    iterate, break, close; the batches hold what the fake workers wrote, and they are stopped."""
    fake = FakeBackend(Script(), Script())
    assert isinstance(fake, Backend)
    c = Collector("CartPole-v1", None, frames_per_batch=16, total_frames=16 * 10, num_workers=2,
                  envs_per_worker=2, backend=fake, prefetch=0)
    got = []
    async for batch in c:
        assert batch.batch_size == torch.Size([4, 4])
        got.append(batch["observation"][:, 0, 0].to(torch.int64).tolist())
        if len(got) == 3:
            break
    await c.aclose()
    assert c.state is State.CLOSED
    assert got == [[value(0, n)] * 2 + [value(1, n)] * 2 for n in range(3)]
    assert len(fake.pools) == 1 and all(w.stopped for w in fake.pools[0])


def test_every_seat_has_the_seams_verbs():
    ours, theirs = socket.socketpair()
    try:
        process = EvalProcess(ours, after_death="")
        rollout_seats = [
            ProcessWorker(0, launcher=None, needs=()),
            RayWorker(0, {}, _Snapshots()),
            FakeWorker(0, Script()),
        ]
        eval_seats = [process, RayEvalWorker(None, {}, after_death="")]
        for seat in rollout_seats:
            assert isinstance(seat, RolloutSeat), type(seat).__name__
            assert isinstance(seat, WorkerHandle)
        for seat in eval_seats:
            assert isinstance(seat, EvalSeat), type(seat).__name__
        for seat in rollout_seats + eval_seats:
            assert isinstance(seat, Seat)
    finally:
        ours.close()
        theirs.close()
    assert not isinstance(object(), Seat)


def test_a_seat_without_the_verbs_cannot_be_made():
    class Partial(WorkerHandle):
        async def grant(self, credits: int) -> None:  # pragma: no cover
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial(0)  # type: ignore[abstract]


async def test_the_local_backend_is_a_backend_in_the_table():
    assert isinstance(BACKENDS["local"], LocalBackend)
    async with Collector("CartPole-v1", None, frames_per_batch=8, total_frames=16, num_workers=0,
                         envs_per_worker=2) as c:
        batches = [b async for b in c]
    assert len(batches) == 2


def test_failure_texts_come_from_one_place():
    died = failures.exited_unexpectedly("worker 3 (pid 7)", 3, "; next")
    assert str(died).startswith("worker 3 (pid 7) exited unexpectedly: its control socket closed")
    assert "(SIGKILL, the OOM killer)" in str(died) and str(died).endswith("; next") and died.worker == 3
    actor = failures.actor_died("worker 1 (Ray actor, pid 9)", 1, RuntimeError("gone"), failures.REPLACE_DEAD, "while starting")
    assert str(actor).startswith("worker 1 (Ray actor, pid 9) died while starting: gone\nIt was killed from outside")
    assert "(ray.kill, a node failure, the OOM killer)" in str(actor)
    hung = failures.hung_error("worker 0 (pid 5)", 0, (1, 1, 3.0), 2.0, "  File x", None)
    assert str(hung).startswith("worker 0 (pid 5) is hung:") and "Its stack when it was declared hung:" in str(hung)
    assert str(hung).endswith(failures.REPLACE_HUNG)
