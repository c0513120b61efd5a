"""The library's errors: a small, flat hierarchy rooted in :class:`AiocollectError`.

Every exception aiocollect raises for its own reasons is defined here and derives from
:class:`AiocollectError` (modules that raise one may re-export it: ``aiocollect._service.bus``'s
``SubscriptionOverflowError`` is this module's). What is not an :class:`AiocollectError`:

- exceptions of the user's code (an env, the policy, a handler), which propagate as they are or,
  from a worker, as the ``__cause__`` of a :class:`WorkerError` (one that is also of the original
  type: :func:`worker_error_class`);
- cancellation, and the end-of-stream signals of anyio's protocols (``anyio.EndOfStream``,
  ``anyio.WouldBlock``), which keep their meaning;
- ``aiocollect.testing``'s ``InjectedFailure``, which stands for an exception of the user's code.

Where a standard exception type was raised first, the class also derives from it, so that
``except ValueError`` / ``except TypeError`` / ``except KeyError`` keep working:
:class:`ConfigError` (a bad argument) is a ``ValueError``, :class:`ConfigTypeError` (an argument
of the wrong type) a ``ConfigError`` and a ``TypeError``, :class:`WeightsMismatchError` a
``ConfigError`` and a ``KeyError``. Catch :class:`ConfigError` for any bad argument.

Messages start with a lowercase letter (or the name of what raised them, as
``ReplayBuffer.extend: ...``), end without a full stop, and name the argument, the value it got
and the fix, after a semicolon.

Imported by worker processes: standard library only.
"""

from __future__ import annotations
from .public import public

__all__ = [
    "AiocollectError",
    "ConfigError",
    "ConfigTypeError",
    "WeightsMismatchError",
    "SpecError",
    "WorkerError",
    "BrokenWorkerError",
    "WorkerTimeoutError",
    "CollectorClosedError",
    "EndOfCollection",
    "SubscriptionOverflowError",
    "SamplingError",
]


@public
class AiocollectError(Exception):
    """Base class of every error aiocollect raises on purpose."""


@public
class ConfigError(AiocollectError, ValueError):
    """Raised when an argument, or a combination of arguments, is invalid: by a constructor
    (before any process is started), or by a method called with a bad argument
    (``update_weights``, ``load_state_dict``, ``split_trajectories`` ...). Also when a run
    starts, for what only the env's spaces tell: a ``frames_per_batch`` whose batch slots cannot
    fit in the memory the machine can give, refused before any slot is filled.

    The message names the argument, the value it got and how to fix it.
    """


class ConfigTypeError(ConfigError, TypeError):
    """A :class:`ConfigError` for an argument of the wrong type (a handler that is not callable,
    a batch that is not a TensorDict, an env factory that returns no ``gymnasium.Env`` ...).

    Also a ``TypeError``, which these errors were before they were config errors.
    """


class WeightsMismatchError(ConfigError, KeyError):
    """Raised by ``update_weights`` when the weights given lack tensors of the model they are
    for; the message lists the missing names and what the model has.

    Also a ``KeyError``, as it was first. Printed as its message (a ``KeyError`` would quote it).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@public
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


@public
class WorkerError(AiocollectError):
    """An exception raised inside a worker (by an env, the policy or an env factory).

    The original exception is ``__cause__`` (when it could be pickled back; otherwise a
    ``RuntimeError`` carrying its text), and :attr:`worker_traceback` holds the traceback as
    formatted in the worker: it names the user's file, line and source line, also for an env or
    a policy defined in a script's ``__main__`` or a notebook cell.

    The error is also an instance of the original exception's type: an env's ``ValueError``
    arrives as a ``WorkerValueError``, a subclass of both :class:`WorkerError` and
    ``ValueError`` made (once per type) when it is first needed, so ``except ValueError`` catches
    it as it would without workers, and ``except WorkerError`` catches every worker's error.
    Where that type cannot be subclassed with :class:`WorkerError`'s constructor (a final class,
    a metaclass of its own, an ``__init__`` that needs other arguments, a control-flow exception
    as ``StopIteration``), the error is a plain :class:`WorkerError`. It pickles as itself (a
    plain :class:`WorkerError` where the original type cannot be pickled by reference).

    Attributes:
        worker: index of the worker (``None`` for the in-process local backend).
        worker_traceback: the worker-side traceback, formatted.
    """

    def __init__(self, message: str, *, worker: int | None = None, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.worker = worker
        self.worker_traceback = worker_traceback

    def __str__(self) -> str:  # (a WorkerKeyError would quote its message as a KeyError does)
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


@public
class BrokenWorkerError(WorkerError):
    """A worker process ended without reporting an error: killed from outside (SIGKILL, the
    OOM killer) or crashed in native code. Noticed as soon as its control pipe closes."""


@public
class WorkerTimeoutError(WorkerError):
    """A worker spent longer than ``step_timeout`` seconds in one env ``step``/``reset`` or one
    policy call: it is hung (a deadlocked simulator, a network-backed env that never answers).
    Also raised for a worker stopped for that long (``SIGSTOP``, a debugger, a frozen container)
    or granted work and showing no progress for that long. It is killed; the message holds its
    Python stack at that moment, or says that it was stopped (a stopped process writes none).

    Attributes:
        env: global index of the env it was stepping or resetting (``None``: the policy).
        doing: what it was doing, in words.
    """

    def __init__(self, message: str, *, worker: int | None = None, env: int | None = None, doing: str = "") -> None:
        super().__init__(message, worker=worker)
        self.env = env
        self.doing = doing


#: exception types whose meaning is control flow: never mixed into a WorkerError (an env's
#: StopAsyncIteration must not end the consumer's ``async for``)
_NOT_MIXED: tuple[type[BaseException], ...] = (StopIteration, StopAsyncIteration, GeneratorExit, AiocollectError)
_NOT_MIXED_MODULES = frozenset({"asyncio", "anyio", "trio", "concurrent", "sniffio", "uvloop"})
_MIXED: dict[type, type[WorkerError]] = {}


def worker_error_class(cause: type) -> type[WorkerError]:
    """The :class:`WorkerError` subclass that is also a ``cause`` (``WorkerValueError`` for
    ``ValueError``), made once per type; :class:`WorkerError` itself where ``cause`` cannot or
    must not be mixed in (see :class:`WorkerError`)."""
    made = _MIXED.get(cause)
    if made is not None:
        return made
    made = WorkerError
    if (
        isinstance(cause, type)
        and issubclass(cause, Exception)
        and not issubclass(cause, _NOT_MIXED)
        and str(getattr(cause, "__module__", "")).partition(".")[0] not in _NOT_MIXED_MODULES
    ):
        name = f"Worker{cause.__name__}"
        try:
            mixed: type[WorkerError] = type(cause)(  # type: ignore[misc]  # (its metaclass, if its own)
                name,
                (WorkerError, cause),
                {
                    "__module__": __name__,
                    "__qualname__": name,
                    "__doc__": f"A :class:`WorkerError` whose cause is a ``{cause.__qualname__}``; also a ``{cause.__qualname__}``.",
                    "__reduce__": _reduce_mixed,
                    "_mixed_cause": cause,
                },
            )
            probe = mixed("probe", worker=0, worker_traceback="tb")
            if str(probe) == "probe" and probe.args == ("probe",) and probe.worker_traceback == "tb":
                made = mixed
        except Exception:  # noqa: BLE001 - cannot be subclassed so: a plain WorkerError
            pass
    return _MIXED.setdefault(cause, made)


def _reduce_mixed(self: WorkerError) -> tuple:
    import pickle

    cause = type(self)._mixed_cause  # type: ignore[attr-defined]
    try:
        pickle.dumps(cause)  # (by reference: importable where it is loaded)
    except Exception:  # noqa: BLE001 - a local class: travels as a plain WorkerError
        return (WorkerError, self.args, dict(vars(self)))
    return (_rebuild_mixed, (cause, self.args), dict(vars(self)))


def _rebuild_mixed(cause: type, args: tuple) -> WorkerError:
    return worker_error_class(cause)(*args)


@public
class CollectorClosedError(AiocollectError, RuntimeError):
    """Raised when a closed collector is used again (started, collected from or reopened).

    A closed collector cannot be reopened: build a new one (worker start-up after the first
    collector in a process takes well under a second)."""


class LoopGone(CollectorClosedError):
    """Background collection's own event loop (or the caller's) ended while something was to
    run there: the collection is over. Not exported: it reaches a user only as a
    :class:`CollectorClosedError`."""


@public
class EndOfCollection(AiocollectError):
    """Raised by :meth:`Collector.collect` once ``total_frames`` frames have been delivered.

    ``async for`` ends quietly instead."""


@public
class SubscriptionOverflowError(AiocollectError):
    """Raised by a subscription with ``overflow="error"`` when it fell behind and lost events.

    Raised once, by the receive after the loss; the subscription goes on with the events it
    still holds."""


@public
class SamplingError(AiocollectError, RuntimeError):
    """Raised by :meth:`ReplayBuffer.sample` when no sample of the requested kind exists.

    For example: the buffer is empty, no stored frame passes a
    :class:`StalenessAwareSampler`'s ``max_staleness`` gate, no stored run is long enough for a
    :class:`SliceSampler`, or a sample without replacement asks for more frames than are stored.
    The message says what was asked and what the buffer holds. Nothing is consumed: sampling
    again after more data was written may succeed.
    """


# -- evaluator


@public
class EvaluatorClosedError(AiocollectError, RuntimeError):
    """Raised when a closed :class:`~aiocollect.Evaluator` is used again (started, evaluated
    with, triggered), and by an ``evaluate()`` call still waiting when the evaluator is closed. A
    closed evaluator cannot be reopened: build a new one."""


@public
class EvaluatorBusyError(AiocollectError, RuntimeError):
    """Raised by :meth:`Evaluator.trigger <aiocollect.Evaluator.trigger>` when an evaluation is
    pending and ``busy_policy="error"``, or when ``busy_policy="queue"`` and ``max_queued``
    evaluations already wait. Nothing is scheduled then."""


__all__ += ["EvaluatorClosedError", "EvaluatorBusyError"]


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the caller of this function that points
    at the user's line: the first frame outside this package (and outside the code that
    ``dataclasses`` generates, whose file name is ``"<string>"``)."""
    import os
    import sys
    from types import FrameType

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # aiocollect/
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(package) or frame.f_code.co_filename == "<string>"):
        frame, level = frame.f_back, level + 1
    return level


def add_note(exc: BaseException, note: str) -> None:
    exc.add_note(note)
