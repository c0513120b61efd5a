"""Typed events: what happens during collection, as frozen dataclasses.

Dispatch follows the class hierarchy: a handler registered for :class:`Event` sees every event,
one for :class:`WorkerEvent` sees :class:`WorkerStarted`, :class:`WorkerFailed` ... Register with
``collector.on(EventType, handler)`` (or ``@collector.on(EventType)``), stream with
``collector.subscribe(EventType)``, wait with ``await collector.wait_for(EventType)``.

All fields are keyword-only; every event has ``time`` (``time.monotonic()`` when it was made).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, TypeVar, dataclass_transform

_T = TypeVar("_T")

__all__ = [
    "AfterRollout",
    "BatchReady",
    "BeforeRollout",
    "CollectorStarted",
    "CollectorStopped",
    "EpisodeEnded",
    "EvaluationCompleted",
    "EvaluationFailed",
    "Event",
    "ProfileTraceReady",
    "WeightsApplied",
    "WeightsUpdated",
    "WorkerEvent",
    "WorkerFailed",
    "WorkerRestarted",
    "WorkerStarted",
]

@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(dataclasses.field,))
def _event(cls: type[_T]) -> type[_T]:
    """An event type: a frozen dataclass with keyword-only fields (declared so that type checkers
    see its fields)."""
    return dataclasses.dataclass(frozen=True, kw_only=True)(cls)


@_event
class Event:
    """Base class of every event."""

    time: float = dataclasses.field(default_factory=time.monotonic, compare=False)


@_event
class CollectorStarted(Event):
    """Every worker is up and the batch layout is known."""

    num_workers: int
    envs_per_worker: int
    pids: tuple[int, ...]
    startup_seconds: float


@_event
class CollectorStopped(Event):
    """The workers are gone: ``reason`` is ``"closed"``, ``"total_frames"``, ``"error"`` or
    ``"queue_closed"`` (the queue of ``start(queue=...)`` had no receiver left, or was closed)."""

    reason: str
    frames: int
    batches: int
    error: BaseException | None = None


@_event
class BatchReady(Event):
    """A batch is about to be delivered (after the post-processing, before the consumer gets it).

    ``timing`` holds seconds per stage, summed over the workers that filled it: ``"env"`` (env
    steps and resets), ``"policy"`` (policy forward passes), ``"wait"`` (the collector waiting
    for workers) and ``"delivery"`` (copying out of shared memory and assembling the batch).
    """

    index: int
    frames: int
    workers: tuple[int, ...]
    policy_versions: tuple[int, ...]
    timing: Mapping[str, float]


@_event
class EpisodeEnded(Event):
    """An episode ended in a worker (computed there, as rlpyt's TrajInfo)."""

    worker: int
    env: int
    traj_id: int
    ret: float
    length: int
    terminated: bool
    policy_version: int


@_event
class WeightsUpdated(Event):
    """New weights were published (``update_weights``): ``model_ids`` are the models updated
    together as ``version`` (``model_id`` is the first of them), ``workers`` those targeted."""

    version: int
    model_id: str
    workers: tuple[int, ...]
    model_ids: tuple[str, ...] = ()


@_event
class WeightsApplied(Event):
    """A worker applied a weight version at a batch boundary; ``latency`` since publication."""

    version: int
    worker: int
    latency: float


@_event
class EvaluationCompleted(Event):
    """An evaluation finished; ``metrics`` has return mean/std/min/max, episode length and what
    ``metrics_fn`` added."""

    step: int | None
    metrics: Mapping[str, Any]


@_event
class EvaluationFailed(Event):
    """An evaluation raised (the error also surfaces where the result is awaited)."""

    step: int | None
    error: BaseException


@_event
class ProfileTraceReady(Event):
    """A profiler trace file was written (open it in Chrome's trace viewer / Perfetto)."""

    worker: int | None  # None: the collector's own process
    path: str


@_event
class WorkerEvent(Event):
    """Base class of the events about one worker process; ``worker`` is its index, ``-1`` for a
    worker without one (the local backend's, an :class:`~aiocollect.Evaluator`'s)."""

    worker: int
    pid: int | None


@_event
class WorkerStarted(WorkerEvent):
    """A worker process is up."""


@_event
class WorkerFailed(WorkerEvent):
    """A worker raised or died; ``error`` is what the consumer will get."""

    error: BaseException


@_event
class WorkerRestarted(WorkerEvent):
    """A failed worker was replaced by a new process (``pid`` is the new one)."""

    old_pid: int | None


@_event
class BeforeRollout(Event):
    """Hook: the collector is about to assemble batch ``index``; handlers are awaited in order."""

    index: int


@_event
class AfterRollout(Event):
    """Hook: batch ``index`` was assembled (``batch`` may be changed in place by a handler);
    handlers are awaited in order, before the batch is delivered."""

    index: int
    batch: Any = dataclasses.field(repr=False, compare=False)
