"""The run's lifecycle as phases: every move the public API makes is one the transition table
allows, and each phase reports the public ``collector.state`` it stands for; a move the table
does not allow is refused (a bug of the library, an ``AssertionError``); and the run's parts
(the worker pool, the producer, the weights, the profiling ...) are built with what they need:
none of them refers to the ``Run`` (its lifecycle) or to the ``RunState`` (the whole run)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import anyio
import pytest

from aiocollect import Collector, CollectorState, ConfigError
from aiocollect._collector.run_state import TRANSITIONS, Phase, _PhaseError, RunState
from aiocollect.testing import CountingEnv, InjectedFailure
from phase_moves import path, record_moves

ROOT = Path(__file__).resolve().parents[1] / "aiocollect"

# the modules of the run's parts: none takes the whole run
PARTS = [
    "_collector/producer.py", "_collector/pool.py", "_collector/resume.py", "_collector/stats.py",
    "_collector/weightsync.py", "_collector/env_calls.py", "_collector/inference_server.py",
    "_collector/server_parts.py", "_collector/server_weights.py", "_collector/delivery.py", "_collector/plane.py",
    "_service/supervisor.py", "_core/profiling.py",
]


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Phase, Phase]]:
    """Every phase move of every run made during the test, each checked as it is made (:func:`phase_moves.record_moves`)."""
    return record_moves(monkeypatch, RunState, TRANSITIONS, lambda run: run.public_state)


def test_public_states_are_the_five_documented_ones():
    assert [(s.name, s.value) for s in CollectorState] == [
        ("CREATED", "created"), ("STARTING", "starting"), ("RUNNING", "running"), ("STOPPED", "stopped"),
        ("CLOSED", "closed"),
    ]
    assert {p.public for p in Phase} == set(CollectorState), "every public state has a phase"
    assert set(TRANSITIONS) == set(Phase), "every phase has its moves listed"
    assert not TRANSITIONS[Phase.CLOSED], "nothing leaves CLOSED: a collector cannot be reopened"
    for phase, nexts in TRANSITIONS.items():
        for nxt in nexts:  # the public state never goes back
            order = list(CollectorState)
            assert order.index(nxt.public) >= order.index(phase.public), (phase, nxt)


def test_a_move_the_lifecycle_does_not_allow_is_refused():
    c = Collector(CountingEnv, frames_per_batch=8, num_workers=0)
    state = c._run.shared
    for target in (Phase.RUNNING, Phase.STOPPED, Phase.ENDED, Phase.CREATED):
        with pytest.raises(_PhaseError, match=f"from CREATED to {target.name}") as info:
            state.move_to(target)
        assert isinstance(info.value, AssertionError)
    assert state.phase is Phase.CREATED and c.state is CollectorState.CREATED
    state.move_to(Phase.CLOSED)
    with pytest.raises(AssertionError):
        state.move_to(Phase.STARTING)
    assert c.state is CollectorState.CLOSED


async def test_closing_an_unstarted_collector(moves):
    c = Collector(CountingEnv, frames_per_batch=8, num_workers=0)
    await c.aclose()
    assert path(moves) == [Phase.CREATED, Phase.CLOSED]


async def test_a_run_to_total_frames_then_its_end_then_close(moves):
    c = Collector(CountingEnv, frames_per_batch=8, total_frames=16, num_workers=0)
    states = []
    async for _ in c:
        states.append(c.state)
    assert states[0] is CollectorState.RUNNING and len(states) == 2
    assert c.state is CollectorState.STOPPED
    await c.aclose()
    assert c.state is CollectorState.CLOSED
    assert path(moves) == [
        Phase.CREATED, Phase.STARTING, Phase.RUNNING, Phase.FINISHED, Phase.COMPLETED, Phase.ENDED,
        Phase.STOPPED_CLOSING, Phase.CLOSED,
    ]


async def test_closing_while_running(moves):
    async with Collector(CountingEnv, frames_per_batch=8, num_workers=0) as c:
        await c.collect()
        assert c.state is CollectorState.RUNNING
    assert c.state is CollectorState.CLOSED
    assert path(moves) == [
        Phase.CREATED, Phase.STARTING, Phase.RUNNING, Phase.CLOSING, Phase.STOPPED_CLOSING, Phase.CLOSED,
    ]


@pytest.mark.timeout(120)
async def test_closing_while_starting(moves):
    c = Collector(CountingEnv, frames_per_batch=8, num_workers=1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(c.start)
        with anyio.fail_after(60):
            while c.state is CollectorState.CREATED:
                await anyio.sleep(0)
        assert c.state is CollectorState.STARTING
        await c.aclose()
    assert c.state is CollectorState.CLOSED
    went = path(moves)
    assert went[:3] == [Phase.CREATED, Phase.STARTING, Phase.CANCELLING_START], went
    assert went[-1] is Phase.CLOSED and went[-2] in (Phase.STOPPED_CLOSING, Phase.LAUNCH_FAILED), went


async def test_a_failed_start_up(moves):
    c = Collector(functools.partial(CountingEnv, fail_on_reset=1), frames_per_batch=8, num_workers=0)
    with pytest.raises(Exception) as info:
        await c.start()
    assert not isinstance(info.value, ConfigError)
    assert c.state is CollectorState.CLOSED
    assert path(moves) == [Phase.CREATED, Phase.STARTING, Phase.LAUNCH_FAILED, Phase.CLOSED]


async def test_a_worker_failure_while_running(moves):
    c = Collector(functools.partial(CountingEnv, fail_at_step=20), frames_per_batch=8, num_workers=0)
    with pytest.raises(Exception) as info:
        async for _ in c:
            pass
    assert isinstance(info.value, InjectedFailure) or isinstance(info.value.__cause__, InjectedFailure), info.value
    assert c.state is CollectorState.STOPPED
    await c.aclose()
    assert path(moves) == [
        Phase.CREATED, Phase.STARTING, Phase.RUNNING, Phase.STOPPED, Phase.ENDED, Phase.STOPPED_CLOSING, Phase.CLOSED,
    ]


def _imports_run(path: Path) -> list[str]:
    """The lines of ``path`` that import or name ``Run`` or ``RunState`` (or their modules)."""
    found = []
    names = ("Run", "RunState")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[-1] in ("run", "run_state") and "_evaluator" not in module:
                found.append(f"line {node.lineno}: from {module} import ...")
            elif any(alias.name in ("run", "run_state") for alias in node.names) and module.endswith("_collector"):
                found.append(f"line {node.lineno}: from {module} import run")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.endswith(("_collector.run", "_collector.run_state"))]
        elif isinstance(node, ast.Name) and node.id in names:
            found.append(f"line {node.lineno}: refers to {node.id}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"line {node.lineno}: annotated as {node.value!r}")
    return found


@pytest.mark.parametrize("module", PARTS)
def test_the_runs_parts_never_take_the_whole_run(module):
    found = _imports_run(ROOT / module)
    assert not found, f"aiocollect/{module} refers to the run (build the part with what it needs): {found}"


def test_the_collector_reaches_into_no_part_of_its_run():
    """The public ``Collector`` asks its run (the lifecycle) for what it reports; it never reaches
    through it into the parts (``_run.shared.sync.watch...``)."""
    text = (ROOT / "_collector" / "collector.py").read_text()
    assert "shared." not in text.replace("shared memory", "").replace("shared-memory", "")


def test_the_import_check_can_fail(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .run import Run\n'
                      'def f(run: "Run") -> None: ...\n')
    assert len(_imports_run(sample)) == 2
    sample.write_text('from .run_state import Counters\ndef f(run: "RunState") -> None: ...\n')
    assert len(_imports_run(sample)) == 2
