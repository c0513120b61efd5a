"""The library's errors: a small, flat hierarchy rooted in :class:`AiocollectError`.

Imported by worker processes: standard library only.
"""

from __future__ import annotations

__all__ = [
    "AiocollectError",
    "ConfigError",
    "SpecError",
    "WorkerError",
    "BrokenWorkerError",
    "WorkerTimeoutError",
    "CollectorClosedError",
    "EndOfCollection",
]


class AiocollectError(Exception):
    """Base class of every error aiocollect raises on purpose."""


class ConfigError(AiocollectError, ValueError):
    """Raised by a constructor when an argument, or a combination of arguments, is invalid.

    The message names the argument, the value it got and how to fix it. Raised before any
    process is started.
    """


class SpecError(AiocollectError, ValueError):
    """Raised when data does not match what the env's spaces declare.

    For example an observation whose shape is not the observation space's, a value of another
    kind than its space's dtype (a float for an integer space, an integer for a float Box), an
    integer that does not fit its dtype (300 for uint8), a reward that is not a real scalar, a
    policy that writes no ``"action"``, or an action of the wrong shape or dtype; and when asked
    for, NaN/inf (``check_finite=True``) or a Box action out of bounds
    (``action_bounds="error"``). The message names the env, the key, the value and the space.
    Raised on the first step that shows the mismatch, in the worker; it reaches the consumer as
    itself (not wrapped), with the worker-side traceback attached as a note.
    """


class WorkerError(AiocollectError):
    """An exception raised inside a worker (by an env, the policy or an env factory).

    The original exception is ``__cause__`` (when it could be pickled back; otherwise a
    ``RuntimeError`` carrying its text), and :attr:`worker_traceback` holds the traceback as
    formatted in the worker.

    Attributes:
        worker: index of the worker (``None`` for the in-process local backend).
        worker_traceback: the worker-side traceback, formatted.
    """

    def __init__(self, message: str, *, worker: int | None = None, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.worker = worker
        self.worker_traceback = worker_traceback


class BrokenWorkerError(WorkerError):
    """A worker process ended without reporting an error: killed from outside (SIGKILL, the
    OOM killer) or crashed in native code. Noticed as soon as its control pipe closes."""


class WorkerTimeoutError(WorkerError):
    """A worker spent longer than ``step_timeout`` seconds in one env ``step``/``reset`` or one
    policy call: it is hung (a deadlocked simulator, a network-backed env that never answers).
    It is killed; the message holds its Python stack at that moment.

    Attributes:
        env: global index of the env it was stepping or resetting (``None``: the policy).
        doing: what it was doing, in words.
    """

    def __init__(self, message: str, *, worker: int | None = None, env: int | None = None, doing: str = "") -> None:
        super().__init__(message, worker=worker)
        self.env = env
        self.doing = doing


class CollectorClosedError(AiocollectError, RuntimeError):
    """Raised when a closed collector is used again (started, collected from or reopened).

    A closed collector cannot be reopened: build a new one (worker start-up after the first
    collector in a process takes well under a second)."""


class EndOfCollection(AiocollectError):
    """Raised by :meth:`Collector.collect` once ``total_frames`` frames have been delivered.

    ``async for`` ends quietly instead."""


# -- evaluator


class EvaluatorClosedError(AiocollectError, RuntimeError):
    """Raised when a closed :class:`~aiocollect.Evaluator` is used again (started, evaluated
    with, triggered), and by an ``evaluate()`` call still waiting when the evaluator is closed. A
    closed evaluator cannot be reopened: build a new one."""


class EvaluatorBusyError(AiocollectError, RuntimeError):
    """Raised by :meth:`Evaluator.trigger <aiocollect.Evaluator.trigger>` when an evaluation is
    pending and ``busy_policy="error"``, or when ``busy_policy="queue"`` and ``max_queued``
    evaluations already wait. Nothing is scheduled then."""


__all__ += ["EvaluatorClosedError", "EvaluatorBusyError"]
