"""The backend seam: aiocollect's backends come from one table, by name; a backend object passed
as ``backend=`` (a fake pool of workers here) is used as it is, without monkeypatching; every
kind of worker seat has the seam's verbs; and the failure texts every seat uses come from one
place."""

from __future__ import annotations

import ast
import pathlib
import socket

import pytest
import torch

import aiocollect
from aiocollect import Collector, ConfigError, Evaluator, ProfileConfig, State
from aiocollect._backends import failures
from aiocollect._backends.eval_process import EvalProcess
from aiocollect._backends.ray import RayWorker, _Snapshots
from aiocollect._backends.ray_eval import RayEvalWorker
from aiocollect._backends.seat import Backend, EvalSeat, RolloutSeat, Seat, WatchedSeat
from aiocollect._backends.table import (
    BACKENDS,
    EVALUATOR_BACKENDS,
    LocalBackend,
    ProcessBackend,
    backend_named,
    backend_object,
)
from aiocollect._backends.workers import LocalWorker, ProcessWorker, WorkerHandle
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

    with pytest.raises(ConfigError, match=r"lacks weights_in_parent, profiles, serves_inference, check_options, "
                                          r"warm_up, share_slots"):
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
        # only the seats whose stuck() can report a hang have declare_hung (none that only raises)
        assert [isinstance(seat, WatchedSeat) for seat in rollout_seats] == [True, True, False]
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


def test_seats_that_never_report_a_hang_have_no_declare_hung():
    for seat in (WorkerHandle, LocalWorker, FakeWorker):
        assert not hasattr(seat, "declare_hung"), seat.__name__
    assert FakeWorker(0, Script()).stuck(1.0) is None


# -- the config holds the backend ------------------------------------------------------------------

async def test_a_backend_object_reaches_the_config_and_is_warmed_up():
    fake = FakeBackend(Script(), Script())
    c = Collector("CartPole-v1", None, frames_per_batch=16, num_workers=2, backend=fake)
    try:
        assert c.config.backend is fake
        assert c.config.chosen_backend is fake
        assert c.config.backend_name == "fake"
        assert fake.warmed == [()]  # (a random policy imports nothing heavy)
    finally:
        await c.aclose()


@pytest.mark.parametrize("option, value, message", [
    ("ray_actor_options", {"num_cpus": 1}, r"ray_actor_options=\{'num_cpus': 1\} sets the options of the workers' Ray "
                                           r"actors, so it needs backend='ray', but backend='fake'; pass backend='ray'"),
    ("worker_cpus", [0], r"worker_cpus=\[0\] places the worker processes on CPUs, so it needs backend='process', but "
                         r"backend='fake'; pass backend='process' or drop it"),
    ("step_timeout", 5.0, r"step_timeout=5.0 declares a worker hung after that long, so it needs backend='process' or "
                          r"backend='ray', but backend='fake'; its workers are not watched"),
    ("inference", "server", r"backend='fake' does not support server inference .* yet: inference='server'"),
    ("profile", ProfileConfig(), r"backend='fake' does not support the profiler .* yet: profile="),
])
def test_options_of_another_backend_are_refused_for_a_backend_object(option, value, message):
    fake = FakeBackend(Script(), Script())
    with pytest.raises(ConfigError, match=message):
        Collector("CartPole-v1", None, frames_per_batch=16, num_workers=2, backend=fake, **{option: value})
    assert fake.warmed == []  # (refused before the collector was made)


def test_a_backend_checks_its_own_options_and_workers():
    class Picky(FakeBackend):
        def check_options(self, options, workers):
            if workers != 3:
                raise ConfigError(f"backend='picky' needs num_workers=3, got {workers}")

    with pytest.raises(ConfigError, match="needs num_workers=3, got 2"):
        Collector("CartPole-v1", None, frames_per_batch=16, num_workers=2, backend=Picky())
    with pytest.raises(ConfigError, match=r"backend='process' runs the envs in worker processes, but num_workers=0"):
        Collector("CartPole-v1", None, frames_per_batch=16, num_workers=0, backend="process")
    with pytest.raises(ConfigError, match=r"backend='local' runs the envs in the collector's own process, but "
                                          r"num_workers=2"):
        Collector("CartPole-v1", None, frames_per_batch=16, num_workers=2, backend="local")


async def test_profiling_is_refused_by_capability_not_by_name():
    fake = FakeBackend(Script(), Script())
    c = Collector("CartPole-v1", None, frames_per_batch=16, num_workers=2, backend=fake)
    try:
        with pytest.raises(ConfigError, match=r"enable_profile\(\): backend='fake' does not support the profiler yet "
                                              r"\(its traces are files on the workers' machines\); use "
                                              r"backend='process' to profile"):
            c.enable_profile()
    finally:
        await c.aclose()

    class Profiling(FakeBackend):
        profiles = True

    c = Collector("CartPole-v1", None, frames_per_batch=16, num_workers=2, backend=Profiling(Script(), Script()))
    try:
        assert c.enable_profile(workers=[1]).workers == (1,)
    finally:
        await c.aclose()


# -- the evaluator -----------------------------------------------------------------------------------

class _WarmUpSpy(ProcessBackend):
    def __init__(self) -> None:
        self.warmed: list[tuple[str, ...]] = []

    def warm_up(self, needs: tuple[str, ...]) -> None:
        self.warmed.append(needs)


def test_the_evaluator_warms_its_backend_up_through_the_table(monkeypatch):
    spy = _WarmUpSpy()
    monkeypatch.setitem(BACKENDS, "process", spy)
    evaluator = Evaluator("CartPole-v1")
    assert evaluator.config.chosen_backend is spy
    assert spy.warmed == [()]  # (never started: the launcher was not asked to start)
    assert EVALUATOR_BACKENDS == ("process", "ray")
    with pytest.raises(ConfigError, match=r"backend='local' must be 'process' or 'ray'"):
        Evaluator("CartPole-v1", backend="local")


# -- no backend is told apart by name outside the table -------------------------------------------

def _names_compared(tree: ast.AST) -> list[tuple[int, str]]:
    """Every comparison (``==``, ``!=``, ``in``, ``not in``) with one of the table's names."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            consts = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            for const in consts:
                if isinstance(const, ast.Constant) and const.value in BACKENDS:
                    found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_backend_name_is_compared_outside_the_table():
    package = pathlib.Path(aiocollect.__file__).parent
    assert _names_compared(ast.parse('if c.backend == "ray" or backend in ("process", "x"): pass'))  # (it can fail)
    found = {}
    for path in package.rglob("*.py"):
        if path.relative_to(package).parts[0] == "_backends":
            continue
        hits = _names_compared(ast.parse(path.read_text(), str(path)))
        if hits:
            found[str(path.relative_to(package))] = hits
    assert found == {}


def test_the_collector_and_its_services_type_seats_as_the_seam():
    """The collector's wing and the services drive worker seats through the seam's protocol
    (:class:`RolloutSeat`), never through a backend's classes: nothing there imports
    ``_backends.workers`` (nor ``ray``), even for type checking."""
    package = pathlib.Path(aiocollect.__file__).parent
    found = {}
    for wing in ("_collector", "_service", "_core"):
        for path in (package / wing).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                        ("_backends.workers", "_backends.ray", "aiocollect._backends.workers", "aiocollect._backends.ray")):
                    found.setdefault(str(path.relative_to(package)), []).append(node.lineno)
    assert found == {}
    seat_members = set(RolloutSeat.__annotations__) | {m for m in vars(RolloutSeat) if not m.startswith("_")}
    for member in ("take", "ready", "credits_sent", "slots", "nudge", "give_store", "profile", "traces",
                   "calls_pending", "parked", "reaches_envs"):
        assert member in seat_members, member


def test_capabilities_are_attributes_of_the_backend_not_found_by_hasattr():
    assert EVALUATOR_BACKENDS == tuple(name for name, b in BACKENDS.items() if b.opens_evaluator) == ("process", "ray")
    assert [b.options_name for b in BACKENDS.values()] == [None, None, "ray_actor_options"]

    class NoCapabilities(FakeBackend):
        def __getattribute__(self, name):
            if name in ("opens_evaluator", "options_name"):
                raise AttributeError(name)
            return super().__getattribute__(name)

    with pytest.raises(ConfigError, match=r"lacks opens_evaluator, options_name"):
        Collector("CartPole-v1", None, frames_per_batch=16, num_workers=2, backend=NoCapabilities(Script(), Script()))
