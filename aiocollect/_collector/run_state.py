"""What a collector's run shares between its parts: :class:`RunState`.

The run's lifecycle (:class:`~aiocollect._collector.run.Run`: start, its tasks, stop, close)
owns one. Its parts are owners of their own, each built with what it needs: the worker pool
(:class:`~aiocollect._collector.pool.WorkerPool`: seats, rollout configs, slots, the inference
server, restarts, kept env calls), the delivery (:class:`Delivery`: the batch stream, the sink,
the pause gate, the counters; filled by the :class:`~aiocollect._collector.producer.Producer`),
the weights (:class:`~aiocollect._collector.weightsync.WeightSync`) and the profiling. Those
parts never receive the run itself: what they tell it goes through hooks it gives them. Its
phase (:class:`Phase`) is the run's one lifecycle variable: each phase reports one public
:class:`CollectorState`, and :meth:`RunState.move_to` is the one place that changes it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Callable

import anyio

from .. import events as ev
from .._core.phases import Lifecycle, PhaseEnum, _PhaseError, checked_table
from .._core.profiling import RunProfiling
from .._core.public import public
from .._service.bus import EventBus
from .config import CollectorConfig
from .delivery import Counters, Delivery, PauseGate
from .pool import PoolHooks, Resume, Seeding, WorkerPool
from .producer import Producer, ProducerHooks
from .stats import Stats
from .weightsync import WeightSync

if TYPE_CHECKING:  # pragma: no cover
    from .._backends.seat import Backend, RolloutSeat
    from .offloop import CollectorLoop


@public
class CollectorState(enum.Enum):
    """Lifecycle of a :class:`~aiocollect.Collector`."""

    CREATED = "created"
    """Constructed; no worker yet."""
    STARTING = "starting"
    """Workers are being started."""
    RUNNING = "running"
    """Collecting."""
    STOPPED = "stopped"
    """Workers are gone (``total_frames`` reached, or a failure); batches already collected can
    still be received."""
    CLOSED = "closed"
    """Closed: every process and shared-memory segment is released. Cannot be reopened."""


State = CollectorState  # the name it had first, still exported


class Phase(PhaseEnum):
    """Where a run is in its life; :attr:`public` is what ``collector.state`` reports for it."""

    CREATED = CollectorState.CREATED, "constructed; no worker yet"
    STARTING = CollectorState.STARTING, "the workers are being started"
    CANCELLING_START = CollectorState.STARTING, "closed while starting: the start-up is being ended"
    RUNNING = CollectorState.RUNNING, "collecting"
    FINISHED = CollectorState.RUNNING, "every batch is collected: the workers are being released"
    CLOSING = CollectorState.RUNNING, "closed while running: the workers are being stopped"
    COMPLETED = CollectorState.STOPPED, "every batch was collected; the workers are gone"
    STOPPED = CollectorState.STOPPED, "the workers are gone (a failure, or the event loop ended)"
    LAUNCH_FAILED = CollectorState.STOPPED, "the start-up failed: nothing usable was started"
    STOPPED_CLOSING = CollectorState.STOPPED, "being closed: the workers are gone, the close ends"
    ENDED = CollectorState.STOPPED, "the consumer saw the end of the stream"
    CLOSED = CollectorState.CLOSED, "every process and shared-memory segment is released"

    @property
    def closing(self) -> bool:
        """aclose() (or the collector's finalizer) asked the run to stop, or it is closed."""
        return self in _CLOSING


_CLOSING = frozenset({Phase.CANCELLING_START, Phase.CLOSING, Phase.STOPPED_CLOSING, Phase.CLOSED})

#: the moves a run may make; anything else is a bug of the library
TRANSITIONS: dict[Phase, frozenset[Phase]] = checked_table(Phase, {
    Phase.CREATED: frozenset({Phase.STARTING, Phase.CLOSED}),
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.CANCELLING_START, Phase.LAUNCH_FAILED, Phase.STOPPED}),
    Phase.CANCELLING_START: frozenset({Phase.STOPPED_CLOSING, Phase.LAUNCH_FAILED}),
    Phase.RUNNING: frozenset({Phase.FINISHED, Phase.CLOSING, Phase.STOPPED}),
    Phase.FINISHED: frozenset({Phase.CLOSING, Phase.COMPLETED}),
    Phase.CLOSING: frozenset({Phase.STOPPED_CLOSING}),
    Phase.COMPLETED: frozenset({Phase.ENDED, Phase.STOPPED_CLOSING, Phase.CLOSED}),
    Phase.STOPPED: frozenset({Phase.ENDED, Phase.STOPPED_CLOSING, Phase.CLOSED}),
    Phase.LAUNCH_FAILED: frozenset({Phase.CLOSED}),
    Phase.STOPPED_CLOSING: frozenset({Phase.CLOSED}),
    Phase.ENDED: frozenset({Phase.STOPPED_CLOSING, Phase.CLOSED}),
    Phase.CLOSED: frozenset(),
})


@dataclasses.dataclass
class RunErrors:
    error: BaseException | None = None  # what ends the run: raised to the consumer
    seen: bool = False  # raised once already
    pending: BaseException | None = None  # a worker failed: raised after its completed batches


class RunState:
    """The state one run's parts share (see the module docstring)."""

    def __init__(self, config: CollectorConfig, backend: "Backend") -> None:
        c = self.config = config
        self.life = Lifecycle(Phase.CREATED, TRANSITIONS, "a collector's run")
        self.bus = EventBus()
        self.stats = Stats()
        self.seeding = Seeding(seed=c.seed)
        self.errors = RunErrors()
        # (stores in process memory for the local backend, and for Ray, which ships each version)
        self.sync = WeightSync(c.policy, backend.weights_in_parent, self.emit, c.workers, serving=c.inference == "server")
        self.pool = WorkerPool(config, backend, self.sync, PoolHooks(
            wake=self.wake, applied=self.applied, emit=self.emit, worker_failed=self.worker_failed,
            collecting=lambda: self.collecting, restarted=self.stats.restarted,
        ))
        self.delivery = Delivery(PauseGate(self.wake, lambda: self.home), Counters())
        self.profiling = RunProfiling(c.profile, self.pool, self.emit_event,
                                      lambda: self.producer.rounds if self.producer is not None else 0)
        self.producer: Producer | None = None
        self.stop = anyio.Event()  # the run's task stops the workers once set (made anew at start)
        # background collection: the collector's own loop (a thread) that runs the data plane
        self.home: CollectorLoop | None = None
        # called once, on entering CLOSED, whatever closed the run (aclose(), a refused or failed
        # start, a finalizer): its owner lets go there of what would keep the run alive (the
        # Collector's finalizer, registered in a global registry)
        self.on_closed: Callable[[], Any] | None = None

    def new_producer(self) -> Producer:
        """The producer of a starting run, built with the parts it works on."""
        self.producer = Producer(self.config, self.pool, self.delivery, self.sync, self.profiling, self.stats,
                                 ProducerHooks(
                                     pending=lambda: self.errors.pending, emit=self.emit, emit_event=self.emit_event,
                                     listens_to=self.bus.listens_to, finish=self.finish,
                                     request_stop=self.request_stop, pull_weights=self.pull_weights,
                                 ))
        return self.producer

    def resume_point(self) -> Resume:
        """Where the start-up resumes from (``load_state_dict``, ``set_seed``)."""
        counts = self.delivery.counts
        return Resume(self.seeding.seed, self.seeding.static_seed, counts.start_counters, counts.frames)

    # -- the phase ------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        """The run's phase (:meth:`move_to` changes it; it moves on the caller's loop and in
        background collection's thread)."""
        return self.life.phase

    @property
    def public_state(self) -> CollectorState:
        return self.phase.public

    def move_to(self, phase: Phase) -> None:
        """Enter ``phase``; :class:`_PhaseError` for a move the lifecycle does not allow."""
        self.life.move_to(phase)
        if phase is Phase.CLOSED and self.on_closed is not None:
            on_closed, self.on_closed = self.on_closed, None
            on_closed()

    @property
    def collecting(self) -> bool:
        """The workers may still collect frames: not every batch is collected and nobody closes
        the run (an update is worth waiting for, a failed worker worth replacing)."""
        return self.phase is Phase.RUNNING

    def finish(self) -> None:
        """Every batch is collected: the workers will collect no more (nobody waits for them)."""
        with self.life.moving:
            if self.phase is Phase.RUNNING:
                self.move_to(Phase.FINISHED)
        self.on_user_loop(self.sync.notify)

    # -- the two loops of background collection ---------------------------------------------------
    def off_loop(self) -> "CollectorLoop | None":
        """The collector's own loop when the current task runs in it (background collection's
        data plane), else ``None``: what the caller's loop owns must be asked of it."""
        home = self.home
        return home if home is not None and home.on_thread() else None

    def run_at(self, home: "CollectorLoop | None") -> None:
        """Background collection's data plane runs in ``home`` from now on (``None``: no more)."""
        self.home = home

    def on_user_loop(self, fn: Callable[[], Any]) -> None:
        """Call ``fn()`` on the caller's loop: now if we are on it, else soon."""
        home = self.off_loop()
        if home is None:
            fn()
        else:
            home.call_user(fn)

    def request_stop(self) -> None:
        """The run is to stop its workers (``total_frames`` delivered, a queue nobody reads)."""
        self.on_user_loop(self.stop.set)

    async def pull_weights(self) -> None:
        """``update_at_each_batch``: publish the constructor's policy as a new version, on the
        caller's loop, where every other publish is made (one writer of the weight store, and of
        the versions, at a time)."""
        home = self.off_loop()
        targets = list(range(self.config.workers))
        if home is None:
            await self.sync.publish({"policy": None}, targets)
        else:
            await home.to_user(self.sync.publish, {"policy": None}, targets)

    async def applied(self, worker: Any, version: int) -> None:
        """A worker applied weights ``version``: recorded on the caller's loop, where
        ``update_weights`` waits for it (from the data plane without waiting: the worker's other
        reports go on being read)."""
        home = self.off_loop()
        if home is None:
            await self.sync.on_applied(worker, version)
        else:
            home.post_user(self.sync.on_applied, worker, version)

    # -- shared helpers -------------------------------------------------------------------------
    async def emit(self, event_type: type[ev.Event], **fields: Any) -> None:
        """Build and emit an event, only if someone listens (events cost nothing otherwise)."""
        if self.bus.listens_to(event_type):
            await self.emit_event(event_type(**fields))

    async def emit_event(self, event: ev.Event) -> None:
        """Emit ``event`` on the caller's loop, where its handlers and subscriptions live: from
        background collection's own loop, it waits until that loop has run the handlers."""
        home = self.off_loop()
        if home is None:
            await self.bus.emit(event)
        else:
            await home.to_user(self.bus.emit, event)

    def wake(self, worker: "RolloutSeat | None" = None) -> None:
        if self.producer is not None:
            self.producer.wake(worker)

    def worker_failed(self, error: BaseException) -> None:
        """A worker raised or died for good: batches it completed before are still delivered
        (the producer drains them), then the error ends the run."""
        if self.errors.pending is None:
            self.errors.pending = error
        self.wake()


__all__ = ["CollectorState", "Counters", "Delivery", "Phase", "_PhaseError", "RunState", "State", "TRANSITIONS"]
