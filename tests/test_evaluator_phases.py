"""The Evaluator's lifecycle as phases: each phase reports the public ``evaluator.state`` it
stands for; the transition table's moves are the only ones a run can make (any other is refused:
a bug of the library, an ``AssertionError``); the Evaluator's real lives (created then closed;
started, evaluating, closed; a failed start; closed while starting; synchronous code) make only
allowed moves, along the expected paths; and nothing in the evaluator's wing changes its state
but ``EvalRun.move_to``."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import anyio
import pytest

from aiocollect import Evaluator, EvaluatorClosedError, EvaluatorState, WorkerError
from aiocollect._core.phases import Lifecycle, _PhaseError, checked_table
from aiocollect._evaluator.lifecycle import TRANSITIONS, EvalPhase
from aiocollect._evaluator.run import EvalRun
from aiocollect.testing import InjectedFailure
from phase_moves import path, record_moves
from procs import alive as _alive

pytestmark = [pytest.mark.timeout(90), pytest.mark.loops("asyncio", "uvloop", "trio")]

WING = Path(__file__).resolve().parents[1] / "aiocollect" / "_evaluator"
A_WHOLE_LIFE = [EvalPhase.CREATED, EvalPhase.STARTING, EvalPhase.RUNNING, EvalPhase.CLOSING, EvalPhase.CLOSED]


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[EvalPhase, EvalPhase]]:
    """Every phase move of every evaluator's run made during the test, each checked as it is made (:func:`phase_moves.record_moves`)."""
    return record_moves(monkeypatch, EvalRun, TRANSITIONS, lambda run: run.state)


def _raising_env():
    raise InjectedFailure("no env today")


def _env_that_never_comes():
    time.sleep(60)  # (killed by aclose() long before)


# ---- the table --------------------------------------------------------------------------------------


def test_every_phase_reports_one_public_state_and_every_public_state_has_a_phase():
    assert [(s.name, s.value) for s in EvaluatorState] == [
        ("CREATED", "created"), ("STARTING", "starting"), ("RUNNING", "running"), ("CLOSED", "closed"),
    ], "the public states are the four documented ones"
    for phase in EvalPhase:
        assert isinstance(phase.public, EvaluatorState), phase
        assert phase.meaning and isinstance(phase.meaning, str), phase
        assert phase.closing is (phase.public is EvaluatorState.CLOSED)
    assert {p.public for p in EvalPhase} == set(EvaluatorState)
    assert EvalPhase.CREATED.public is EvaluatorState.CREATED and EvalPhase.CLOSED.public is EvaluatorState.CLOSED


def test_the_table_lists_every_phase_and_the_public_state_never_goes_back():
    assert set(TRANSITIONS) == set(EvalPhase), "every phase has its moves listed"
    assert not TRANSITIONS[EvalPhase.CLOSED], "nothing leaves CLOSED: an evaluator cannot be reopened"
    order = list(EvaluatorState)
    for phase, nexts in TRANSITIONS.items():
        assert phase not in nexts, f"{phase.name} moves to itself"
        for nxt in nexts:
            assert order.index(nxt.public) >= order.index(phase.public), (phase, nxt)
    reachable, todo = {EvalPhase.CREATED}, [EvalPhase.CREATED]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reachable:
            reachable.add(nxt)
            todo.append(nxt)
    assert reachable == set(EvalPhase), "every phase can be reached from CREATED"
    for phase in EvalPhase:
        if phase is not EvalPhase.CLOSED:
            assert EvalPhase.CLOSED in TRANSITIONS[phase] or EvalPhase.CLOSING in TRANSITIONS[phase], (
                f"{phase.name} cannot be closed"
            )


@pytest.mark.parametrize("start", list(EvalPhase), ids=lambda p: p.name)
def test_the_tables_moves_are_the_only_ones_allowed(start):
    """From each phase: each move in the table is made, every other is refused with a _PhaseError
    (an AssertionError: a bug of ours), naming both phases, and leaves the phase as it was."""
    for target in EvalPhase:
        life = Lifecycle(start, TRANSITIONS, "an evaluator's run")
        if target in TRANSITIONS[start]:
            assert life.allows(target)
            life.move_to(target)
            assert life.phase is target
        else:
            assert not life.allows(target)
            refused = f"an evaluator's run cannot go from {start.name} to {target.name}"
            with pytest.raises(_PhaseError, match=refused) as info:
                life.move_to(target)
            assert isinstance(info.value, AssertionError)
            assert life.phase is start


def test_a_table_that_leaves_out_a_phase_or_names_a_stranger_is_refused_where_it_is_written():
    with pytest.raises(_PhaseError, match="lacks the moves of \\['CLOSED'\\]"):
        checked_table(EvalPhase, {p: frozenset() for p in EvalPhase if p is not EvalPhase.CLOSED})
    with pytest.raises(_PhaseError, match="names"):
        checked_table(EvalPhase, {**{p: frozenset() for p in EvalPhase}, EvalPhase.CLOSING: frozenset({"CLOSED"})})


async def test_a_run_refuses_a_move_its_lifecycle_does_not_allow():
    ev = Evaluator("CartPole-v1", num_trajectories=1)
    run = ev._run
    for target in (EvalPhase.RUNNING, EvalPhase.START_FAILED, EvalPhase.CLOSING, EvalPhase.CREATED):
        with pytest.raises(_PhaseError, match=f"from CREATED to {target.name}"):
            run.move_to(target)
    assert run.phase is EvalPhase.CREATED and ev.state is EvaluatorState.CREATED
    run.move_to(EvalPhase.CLOSED)
    with pytest.raises(AssertionError):
        run.move_to(EvalPhase.STARTING)
    assert ev.state is EvaluatorState.CLOSED
    await ev.aclose()  # closed already: nothing moves, nothing raises
    assert run.phase is EvalPhase.CLOSED


def test_nothing_in_the_evaluators_wing_sets_its_state_but_move_to():
    """The phase has one writer: no module of ``aiocollect/_evaluator`` assigns a ``state`` or a
    ``phase`` attribute (the run's public state is read from its phase)."""
    found = []
    for path in sorted(WING.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and sub.attr in ("state", "phase", "_phase"):
                        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not found, found


# ---- the Evaluator's real lives ------------------------------------------------------------------------


async def test_created_then_closed(moves):
    ev = Evaluator("CartPole-v1", num_trajectories=1)
    await ev.aclose()
    await ev.aclose()  # idempotent: no second move
    assert ev.state is EvaluatorState.CLOSED
    assert path(moves) == [EvalPhase.CREATED, EvalPhase.CLOSED]
    with pytest.raises(EvaluatorClosedError):
        await ev.start()


async def test_started_evaluating_then_closed(moves):
    ev = Evaluator("CartPole-v1", num_trajectories=2, seed=0)
    states = [ev.state]
    await ev.start()
    states.append(ev.state)
    metrics = await ev.evaluate(step=1)
    assert metrics["num_trajectories"] == 2
    assert ev.trigger(step=2)
    assert (await ev.wait())["step"] == 2
    states.append(ev.state)
    await ev.aclose()
    states.append(ev.state)
    assert states == [EvaluatorState.CREATED, EvaluatorState.RUNNING, EvaluatorState.RUNNING,
                      EvaluatorState.CLOSED]
    assert path(moves) == A_WHOLE_LIFE


async def test_started_by_its_first_trigger_then_closed_with_async_with(moves):
    async with Evaluator("CartPole-v1", num_trajectories=1, seed=0) as ev:
        assert ev.trigger(step=0)
        assert ev.state in (EvaluatorState.STARTING, EvaluatorState.RUNNING)
        assert (await ev.wait())["step"] == 0
    assert path(moves) == A_WHOLE_LIFE


async def test_a_failed_start(moves):
    """The worker's start-up fails: STARTING until the run's task has ended (as before the phase
    table), then CLOSED without aclose(); the aclose() that follows moves nothing."""
    ev = Evaluator(_raising_env, num_trajectories=1)
    with pytest.raises(WorkerError, match="no env today"):
        await ev.start()
    assert ev.state is EvaluatorState.CLOSED
    await ev.aclose()
    assert path(moves) == [EvalPhase.CREATED, EvalPhase.STARTING, EvalPhase.START_FAILED, EvalPhase.CLOSED]
    assert EvalPhase.START_FAILED.public is EvaluatorState.STARTING


async def test_closed_while_starting(moves):
    """aclose() while the worker is still in its env factory: the state reads CLOSED at once, the
    worker is killed, the waiting start() raises EvaluatorClosedError."""
    ev = Evaluator(_env_that_never_comes, num_trajectories=1, shutdown_timeout=0.2)
    outcome = []

    async def start() -> None:
        with pytest.raises(EvaluatorClosedError):
            await ev.start()
        outcome.append("closed")

    async with anyio.create_task_group() as tg:
        tg.start_soon(start)
        with anyio.fail_after(30):
            while ev.state is EvaluatorState.CREATED:
                await anyio.sleep(0.01)
        await anyio.sleep(0.3)  # (the worker is in the factory by now, or about to be)
        assert ev.state is EvaluatorState.STARTING
        with anyio.fail_after(30):
            await ev.aclose()
        assert ev.state is EvaluatorState.CLOSED
    assert outcome == ["closed"]
    assert path(moves) == [EvalPhase.CREATED, EvalPhase.STARTING, EvalPhase.CLOSING, EvalPhase.CLOSED]


async def test_closing_state_reads_closed_before_the_task_has_ended(moves):
    """aclose() makes the public state CLOSED at once (CLOSING), before its task has stopped the
    worker (CLOSED): what ``evaluator.state`` has always said."""
    ev = Evaluator("CartPole-v1", num_trajectories=1)
    await ev.start()
    pid = ev.worker_pid
    seen = []

    async def watch() -> None:
        while not ev._run.phase.closing:
            await anyio.sleep(0)
        seen.append((ev.state, ev._run.done.is_set()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await anyio.sleep(0)
        await ev.aclose()
    assert seen == [(EvaluatorState.CLOSED, False)]
    assert not _alive(pid)
    assert path(moves)[-2:] == [EvalPhase.CLOSING, EvalPhase.CLOSED]


@pytest.mark.loops("asyncio")
def test_synchronous_code_makes_the_same_moves(moves):
    """TorchRL's blocking calls run the evaluator in a helper thread's loop: the same path."""
    ev = Evaluator("CartPole-v1", num_trajectories=1, seed=0)
    try:
        assert ev.evaluate(step=3)["step"] == 3
        assert ev.state is EvaluatorState.RUNNING
    finally:
        ev.shutdown()
    assert ev.state is EvaluatorState.CLOSED
    assert path(moves) == A_WHOLE_LIFE
