"""What a collector's run shares between its parts: :class:`RunState`.

The run's lifecycle (:class:`~aiocollect._collector.run.Run`: start, its tasks, stop, close)
owns one; the modules that work on it (the producer, the start-up, the supervisor, the seeds
and counters of ``state_dict``, the profiling) receive it, never the ``Run``. Its phase
(:class:`Phase`) is the run's one lifecycle variable: each phase reports one public
:class:`CollectorState`, and :meth:`RunState.move_to` is the one place that changes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import anyio

from .. import events as ev
from .._core.layout import SlotLayout
from .._core.profiling import RunProfiling
from .._core.public import public
from .._service.bus import EventBus
from .._service.supervisor import RestartBudget
from .config import CollectorConfig
from .env_calls import EnvCallLog
from .stats import Stats
from .weightsync import WeightSync

if TYPE_CHECKING:  # pragma: no cover
    from .._backends.seat import Backend
    from .._backends.workers import WorkerHandle
    from .._worker.rollout import RolloutConfig
    from .offloop import CollectorLoop
    from .producer import Producer


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


class Phase(enum.Enum):
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

    def __init__(self, public_state: CollectorState, meaning: str) -> None:
        self.public = public_state
        self.meaning = meaning

    @property
    def closing(self) -> bool:
        """aclose() (or the collector's finalizer) asked the run to stop, or it is closed."""
        return self in _CLOSING


_CLOSING = frozenset({Phase.CANCELLING_START, Phase.CLOSING, Phase.STOPPED_CLOSING, Phase.CLOSED})

#: the moves a run may make; anything else is a bug of the library
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
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
}


class _PhaseError(AssertionError):
    """A run was asked to make a move between phases that its lifecycle does not allow: a bug
    of aiocollect, never of its user."""


@dataclasses.dataclass
class Counters:
    """What the consumers received and the workers collected (``state_dict``, progress)."""

    frames: int = 0  # delivered
    batches: int = 0  # delivered
    collected: int = 0  # frames collected by the workers (total_frames counts these)
    requested: int = 0  # batches the consumers asked for
    traj_counters: list[int] | None = None  # each env row's trajectory id, as last delivered
    start_counters: list[int] | None = None  # those restored by load_state_dict


@dataclasses.dataclass
class Seeding:
    seed: int | None = None
    static_seed: bool = False  # every env reset with ``seed`` itself, not ``seed + k``


@dataclasses.dataclass
class SlotMemory:
    """The batch slots in shared memory, and how they are laid out."""

    layout: SlotLayout | None = None
    segment: tuple[int, Any] | None = None  # the slots' memfd and the collector's mapping of it
    views: list[dict] = dataclasses.field(default_factory=list)  # per slot: every worker's rows (numpy views)
    sub_envs: int = 1  # of each env: a vector env's num_envs (learned from the workers' specs)


@dataclasses.dataclass
class RunErrors:
    error: BaseException | None = None  # what ends the run: raised to the consumer
    seen: bool = False  # raised once already
    pending: BaseException | None = None  # a worker failed: raised after its completed batches


class PauseGate:
    """``collector.pause()``: while a pause is held, no batch is delivered or written. Its
    events live on the loop of the run's data plane: in background collection, the collector's
    own loop (a pause taken on the caller's loop is taken there)."""

    def __init__(self, wake: Callable[[], None], home: Callable[[], "CollectorLoop | None"]) -> None:
        self.paused = 0  # pauses held (they nest)
        self.resume = anyio.Event()
        self.resume.set()
        self.writing: anyio.Event | None = None  # set when a write into the sink ends
        self._wake = wake
        self._home = home

    async def wait_open(self) -> None:
        while self.paused:
            await self.resume.wait()

    async def _there(self, fn: Callable[[], Any]) -> None:
        home = self._home()
        if home is not None and not home.on_thread():
            await home.to_thread(fn)
        else:
            await fn()

    async def _enter(self) -> None:
        self.paused += 1
        if self.paused == 1:
            self.resume = anyio.Event()
        try:
            if self.writing is not None:
                await self.writing.wait()  # a write in progress finishes first
        except BaseException:
            await self._exit()
            raise

    async def _exit(self) -> None:
        self.paused -= 1
        if self.paused == 0:
            self.resume.set()
            self._wake()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        entered = False
        try:
            await self._there(self._enter)
            entered = True
            yield
        finally:
            if entered:
                with anyio.CancelScope(shield=True):
                    await self._there(self._exit)


class RunState:
    """The state one run's parts share (see the module docstring)."""

    def __init__(self, config: CollectorConfig, backend: "Backend") -> None:
        c = self.config = config
        self.backend = backend  # where the workers run
        self.phase = Phase.CREATED
        self.bus = EventBus()
        self.stats = Stats()
        self.counts = Counters()
        self.seeding = Seeding(seed=c.seed)
        self.slots = SlotMemory()
        self.errors = RunErrors()
        self.gate = PauseGate(self.wake, lambda: self.home)
        self.profiling = RunProfiling(self, c.profile)
        # (stores in process memory for the local backend, and for Ray, which ships each version)
        self.sync = WeightSync(c.policy, backend.weights_in_parent, self.emit, c.workers, serving=c.inference == "server")
        self.budget = RestartBudget(c.max_restarts, c.restart_window)
        self.env_calls = EnvCallLog()  # env epochs, and the env calls a replacement worker applies again
        self.workers: list[WorkerHandle] = []
        self.configs: list[RolloutConfig] = []
        self.workers_ready = False  # started, and their slots shared
        self.server: Any = None  # inference="server": the run's InferenceServer
        self.producer: Producer | None = None
        self.send: Any = None  # the producer's side of the batch stream
        self.stop = anyio.Event()  # the run's task stops the workers once set (made anew at start)
        self.sink: Any = None  # start(replay_buffer=...)
        # background collection: the collector's own loop (a thread) that runs the data plane
        self.home: CollectorLoop | None = None
        self._moving = threading.RLock()  # (the phase moves on the caller's loop and in that thread)
        # called once, on entering CLOSED, whatever closed the run (aclose(), a refused or failed
        # start, a finalizer): its owner lets go there of what would keep the run alive (the
        # Collector's finalizer, registered in a global registry)
        self.on_closed: Callable[[], Any] | None = None
        self.bar: Any = None  # progress bar

    # -- the phase ------------------------------------------------------------------------------
    @property
    def public_state(self) -> CollectorState:
        return self.phase.public

    def move_to(self, phase: Phase) -> None:
        """Enter ``phase``; :class:`_PhaseError` for a move the lifecycle does not allow."""
        with self._moving:
            if phase not in TRANSITIONS[self.phase]:
                raise _PhaseError(f"a collector's run cannot go from {self.phase.name} to {phase.name}")
            self.phase = phase
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
        with self._moving:
            if self.phase is Phase.RUNNING:
                self.move_to(Phase.FINISHED)
        self.on_user_loop(self.sync.notify)

    # -- the two loops of background collection ---------------------------------------------------
    def off_loop(self) -> "CollectorLoop | None":
        """The collector's own loop when the current task runs in it (background collection's
        data plane), else ``None``: what the caller's loop owns must be asked of it."""
        home = self.home
        return home if home is not None and home.on_thread() else None

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
    @property
    def rows_per_worker(self) -> int:
        """Env rows of each worker's batch (its sub-envs, for vector envs)."""
        return self.config.envs_per_worker * self.slots.sub_envs

    @property
    def total_rows(self) -> int:
        """Env rows of all workers (the number of envs, counting each sub-env of a vector env)."""
        return self.config.total_envs * self.slots.sub_envs

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

    def wake(self, worker: "WorkerHandle | None" = None) -> None:
        if self.producer is not None:
            self.producer.wake(worker)

    def worker_failed(self, error: BaseException) -> None:
        """A worker raised or died for good: batches it completed before are still delivered
        (the producer drains them), then the error ends the run."""
        if self.errors.pending is None:
            self.errors.pending = error
        self.wake()


if TYPE_CHECKING:  # pragma: no cover
    from .._service.supervisor import SupervisedRun, SupervisedWorker

    def _supervised(run: RunState, worker: WorkerHandle) -> tuple[SupervisedRun, SupervisedWorker]:
        """(For mypy: the run's state and its seats are what the supervisor and the watchdog
        drive, whose tasks are started untyped.)"""
        return run, worker


__all__ = ["CollectorState", "Counters", "Phase", "_PhaseError", "RunState", "State", "TRANSITIONS"]
