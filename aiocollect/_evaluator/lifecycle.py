"""The evaluator's lifecycle as phases: :class:`EvalPhase` (each reports one public
:class:`~aiocollect.EvaluatorState`) and :data:`TRANSITIONS`, the moves its run may make;
:meth:`EvalRun.move_to <aiocollect._evaluator.run.EvalRun.move_to>` is the one place that
makes them (through :class:`~aiocollect._core.phases.Lifecycle`, which refuses any other).

A run goes ``CREATED -> STARTING -> RUNNING`` (or ``START_FAILED`` when its worker cannot start),
then ``CLOSING -> CLOSED`` when :meth:`aclose` is called (straight to ``CLOSED`` before any start,
or when its task ends without :meth:`aclose`: a failed start, a bug of ours, the event loop's end).
"""

from __future__ import annotations

from .._core.phases import PhaseEnum, checked_table
from .config import EvaluatorState


class EvalPhase(PhaseEnum):
    """Where an evaluator's run is in its life; :attr:`public` is what ``evaluator.state``
    reports for it."""

    CREATED = EvaluatorState.CREATED, "constructed; no task and no worker yet"
    STARTING = EvaluatorState.STARTING, "its task is starting the worker"
    START_FAILED = EvaluatorState.STARTING, "the worker failed to start: the task ends (start() raises why)"
    RUNNING = EvaluatorState.RUNNING, "the worker started: evaluations run (a dead worker is replaced on demand)"
    CLOSING = EvaluatorState.CLOSED, "aclose() was called: the task abandons what is pending and stops the worker"
    CLOSED = EvaluatorState.CLOSED, "the task has ended (or never started): no worker is left"

    @property
    def closing(self) -> bool:
        """aclose() was called, or the run's task has ended: the evaluator is closed for its user."""
        return self.public is EvaluatorState.CLOSED


#: the moves an evaluator's run may make; anything else is a bug of the library
TRANSITIONS: dict[EvalPhase, frozenset[EvalPhase]] = checked_table(EvalPhase, {
    # aclose() before any start: nothing to stop
    EvalPhase.CREATED: frozenset({EvalPhase.STARTING, EvalPhase.CLOSED}),
    # (to CLOSED: the event loop ended the task while the worker was starting)
    EvalPhase.STARTING: frozenset({EvalPhase.RUNNING, EvalPhase.START_FAILED, EvalPhase.CLOSING, EvalPhase.CLOSED}),
    EvalPhase.START_FAILED: frozenset({EvalPhase.CLOSING, EvalPhase.CLOSED}),
    # (to CLOSED: a bug of ours ended the task, reported as a background error, or the loop ended)
    EvalPhase.RUNNING: frozenset({EvalPhase.CLOSING, EvalPhase.CLOSED}),
    EvalPhase.CLOSING: frozenset({EvalPhase.CLOSED}),
    EvalPhase.CLOSED: frozenset(),  # a closed evaluator cannot be reopened
})


__all__ = ["EvalPhase", "TRANSITIONS"]
