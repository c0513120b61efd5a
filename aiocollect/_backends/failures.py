"""How every kind of worker seat fails, in one place: the start-and-stop-on-failure block, the
errors for a worker that raised, died or hung (their texts), and the translation of Ray's errors.
The process seats (:mod:`~aiocollect._backends.workers`, :mod:`~aiocollect._backends.eval_process`)
and the Ray seats (:mod:`~aiocollect._backends.ray`, :mod:`~aiocollect._backends.ray_eval`) all use
these, so that a user reads the same words whichever backend runs the worker.
"""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable, Iterable

import anyio

from .._core import heartbeat as _heartbeat
from .._core.errors import (
    AiocollectError, BrokenWorkerError, SpecError, WorkerError, WorkerTimeoutError, add_note, worker_error_class,
)

#: Seconds a worker still starting (in its env factory: nothing collected, no env of it to close)
#: gets to finish when its start-up is cancelled or fails, before it is killed; a start-up that is
#: given up returns within about this (``shutdown_timeout`` is for workers with envs to close).
STARTING_GRACE = 0.5

#: The last sentence of a rollout worker's hang or death: what to pass to go on.
REPLACE_HUNG = "pass on_worker_failure='restart' to replace hung workers and go on"
REPLACE_DEAD = "; pass on_worker_failure='restart' to replace dead workers and go on"


@contextlib.asynccontextmanager
async def stop_on_failure(
    seats: Iterable[Any], timeout: float = 0.0, forget: Callable[[], None] | None = None,
    started: Callable[[Any], bool] | None = None,
) -> AsyncIterator[None]:
    """Start-up (or a replacement) that must leave nothing behind: when the block raises (or is
    cancelled), ``forget()`` is called, then every seat in ``seats`` (read at that moment: a list
    the block appends to) is stopped, shielded, concurrently, with ``timeout`` seconds each to
    close its envs; then the error goes on. With ``started``, a seat for which it is false (still
    in its env factories: nothing to close yet) gets ``STARTING_GRACE`` seconds at most instead,
    so that a cancelled start-up gives control back within about a second whatever
    ``timeout`` is."""
    try:
        yield
    except BaseException:
        if forget is not None:
            forget()
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for seat in list(seats):
                    grace = timeout if started is None or started(seat) else min(timeout, STARTING_GRACE)
                    tg.start_soon(seat.stop, grace)
        raise


def worker_error(
    worker: int | None, pid: int | None, exc: BaseException | None, tb: str, who: str | None = None
) -> BaseException:
    """The exception the consumer sees for ``exc`` raised in a worker: our own errors (a
    :class:`SpecError` ...) as themselves with the worker traceback as a note, anything else
    wrapped in :class:`WorkerError` with the original as ``__cause__``: in the subclass that is also
    the original's type (``WorkerValueError``), so ``except ValueError`` catches it too."""
    if who is None:
        who = "the local worker" if worker is None else f"worker {worker} (pid {pid})"
    if isinstance(exc, AiocollectError):
        add_note(exc, f"raised in {who}; worker traceback:\n{tb}")
        return exc
    what = f"{type(exc).__name__}: {exc}" if exc is not None else "an error"
    frames = tb.rstrip()
    header = "Traceback (most recent call last):\n"
    if frames.startswith(header):  # (the message has its own header)
        frames = frames[len(header) :]
    message = f"{who} raised {what}\n\nWorker traceback (most recent call last):\n{frames}"
    cls = worker_error_class(type(exc)) if exc is not None else WorkerError
    try:
        err = cls(message, worker=worker, worker_traceback=tb)
    except Exception:  # noqa: BLE001 - the original type's constructor refused: a plain one
        err = WorkerError(message, worker=worker, worker_traceback=tb)
    err.__cause__ = exc
    return err


def unpacked_error(worker: int | None, pid: int | None, packed: bytes, tb: str, who: str) -> BaseException:
    """:func:`worker_error` for an exception that a worker sent pickled (with its traceback's
    text); one whose class cannot be loaded here is named by the traceback alone."""
    import cloudpickle

    try:
        exc = cloudpickle.loads(packed)
    except Exception:  # noqa: BLE001 - its class cannot be loaded here
        exc = None
    return worker_error(worker, pid, exc, tb, who=who)


def exited_unexpectedly(who: str, worker: int | None, after_death: str) -> BrokenWorkerError:
    """A worker process whose control socket closed without an error report."""
    return BrokenWorkerError(
        f"{who} exited unexpectedly: its control socket closed without an error report. "
        f"It was killed from outside (SIGKILL, the OOM killer) or crashed in native code; look "
        f"at the process's stderr and `dmesg` for the cause{after_death}",
        worker=worker,
    )


def actor_died(who: str, worker: int | None, exc: BaseException, after_death: str, when: str = "") -> BrokenWorkerError:
    """A Ray actor that died (``when``: ``"while starting"`` ...)."""
    return BrokenWorkerError(
        f"{who} died{' ' + when if when else ''}: {exc}\nIt was killed from outside (ray.kill, a node failure, "
        f"the OOM killer) or crashed{after_death}",
        worker=worker,
    )


def ray_error(exc: BaseException, who: str, worker: int | None, pid: int | None, after_death: str, when: str = "") -> BaseException:
    """What a failed Ray call means: the worker's own exception (a call or the actor's
    constructor raised), the actor's death, or else ``exc`` itself."""
    import ray

    if isinstance(exc, ray.exceptions.RayTaskError):  # the actor's constructor or a call raised
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return worker_error(worker, pid, cause, str(exc), who=who)
    if isinstance(exc, ray.exceptions.RayActorError):
        return actor_died(who, worker, exc, after_death, when)
    return exc


def changed_spec(worker: int, spec: dict, before: dict | None) -> SpecError:
    """A replacement worker whose batch leaves differ from those of the worker it replaces."""
    return SpecError(
        f"the replacement of worker {worker} reports batch leaves {spec}, but the worker "
        f"it replaces reported {before}: its env or policy changed"
    )


def hung_error(
    who: str, worker: int | None, stuck: tuple[int, int, float], timeout: float, stack: str, state: str | None,
    fix: str = REPLACE_HUNG,
) -> WorkerTimeoutError:
    """A worker found hung (``stuck``: ``(what, env, seconds)``, as
    :meth:`HeartbeatMonitor.stuck <aiocollect._core.heartbeat.HeartbeatMonitor.stuck>` says), with
    its Python stack if it could write one and its process state (``None``: unknown)."""
    what, env, seconds = stuck
    return WorkerTimeoutError(
        _heartbeat.hang_message(who, what, env, seconds, timeout, stack, state, fix),
        worker=worker,
        env=_heartbeat.env_of(what, env),
        doing=_heartbeat.describe(what, env),
    )


__all__ = [
    "REPLACE_DEAD", "REPLACE_HUNG", "actor_died", "changed_spec", "exited_unexpectedly", "hung_error", "ray_error", "stop_on_failure",
    "unpacked_error", "worker_error",
]
