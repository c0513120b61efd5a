"""The seam between the collector (or the evaluator) and the kinds of worker: what every worker
seat does (:class:`Seat`, :class:`RolloutSeat`, :class:`WatchedSeat`, :class:`EvalSeat`), and what a backend does
(:class:`Backend`): start a run's rollout seats, share the slots with them, open the evaluator's
worker. The backends aiocollect ships are picked by name from one table
(:mod:`aiocollect._backends.table`); a backend object of one's own (a fake for tests, as
httpx's ``MockTransport`` is one for its clients) is passed to ``Collector(backend=...)``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, runtime_checkable

from .._core.layout import SlotLayout

if TYPE_CHECKING:  # pragma: no cover
    from .._core.wire import BatchInfo
    from .._worker.rollout import RolloutConfig


class SlotViews:
    """numpy views of each slot over one worker's rows of the slots' segment."""

    def __init__(self, layout: SlotLayout, buffer: Any, worker: int) -> None:
        self.layout = layout
        self.np_views = [layout.views(buffer, s, worker) for s in range(layout.num_slots)]

    @classmethod
    def unset(cls) -> "SlotViews":
        """What a seat holds before the slots are shared: no view (its ``layout`` is not set)."""
        views = cls.__new__(cls)
        views.np_views = []
        return views


@runtime_checkable
class Seat(Protocol):
    """A worker seat of any kind (a process, a Ray actor, the local rollout, a fake)."""

    @property
    def pid(self) -> int | None:
        """The worker's process id (on its node, for a Ray actor); ``None`` if it has none."""

    hung: BaseException | None
    """The error of a worker the watchdog declared hung (set before it is killed)."""

    async def stop(self, timeout: float) -> None:
        """Let the worker close its envs for ``timeout`` seconds, then kill it. Idempotent."""

    def stop_nowait(self) -> None:
        """Kill the worker now (the event loop is going away: nothing may be awaited)."""


@runtime_checkable
class RolloutSeat(Seat, Protocol):
    """A collector's worker seat, as the collector's run (its pool, producer, supervisor,
    watchdog, profiling, background collection) drives it. aiocollect's seats, and the tests'
    fakes, get the bookkeeping (``ready``, ``held``, ``completed`` ...) from
    :class:`~aiocollect._backends.workers.WorkerHandle`."""

    index: int
    slots: SlotViews
    """Its rows of each slot (once the slots are shared)."""
    ready: deque[tuple[int, BatchInfo]]
    """``(slot, info)`` of the batches it completed and nobody took yet, oldest first."""
    credits_sent: int
    """Batches it was allowed to fill so far."""
    completed: int
    """Batches its processes reported (a replacement's credits start from it)."""
    counters: list[int] | None
    """Its envs' trajectory numbers at the end of its last batch."""
    restarts: int
    traces: list[str]
    """Profiler trace files it wrote that nobody announced yet (taken from the front)."""
    home: Any
    """Background collection: the collector's own loop, which serves it (``None``: the caller's)."""
    can_serve_off_loop: bool
    """Its reports can be read in background collection's own loop."""
    parked: bool
    """:meth:`serve` waits for its next report with nothing half-done (safe to cancel)."""
    reaches_envs: bool
    """:meth:`env_call` works (``Collector.call``, ``get_attr``, ``set_attr`` ...)."""
    server_link: Any
    """``inference="server"``: its link to the inference server (set before its slots are shared)."""

    @property
    def calls_pending(self) -> bool:
        """Env calls were sent to it and not answered yet."""

    def take(self) -> tuple[int, BatchInfo]:
        """The oldest completed batch, ``(slot, info)``; the slot is held until released."""

    async def grant(self, credits: int) -> None:
        """Let the worker fill ``credits`` more batches."""

    async def release(self, slot: int) -> None:
        """The consumer is done with ``slot``: the worker may fill it again."""

    async def serve(self, on_ready: Callable[[Any], None], on_applied: Callable[[Any, int], Awaitable[None]]
                    ) -> BaseException:
        """Handle the worker's reports until it fails; return its error."""

    async def nudge(self) -> None:
        """New weights are published: an idle worker applies them now."""

    async def give_store(self, store: Any) -> None:
        """Read weights from ``store`` (its own weight store: ``update_weights(worker_ids=...)``)."""

    def profile(self, settings: dict[str, Any], path: str) -> None:
        """Profile its next rollouts into ``path``."""

    def profile_off(self) -> None:
        """Drop a profiler recording in progress (no trace is written)."""

    async def replace(self, cfg: RolloutConfig) -> None:
        """Replace the failed worker by a new one built from ``cfg`` (same spaces, same slots)."""

    async def env_call(self, call: Any) -> list:
        """Apply an :class:`~aiocollect._core.wire.EnvCall` to the worker's envs between two env
        steps; its results, one per row (what the env raised, as the worker's error)."""

    def fail_calls(self, error: BaseException) -> None:
        """The worker failed for good: the env calls waiting on it raise ``error``."""

    def stuck(self, timeout: float) -> tuple[int, int, float] | None:
        """``(what, env, seconds)`` if the worker is hung; ``None``: it is not, or it is not watched
        (a seat that never reports a hang, such as the local rollout, is not a :class:`WatchedSeat`:
        the watchdog calls :meth:`WatchedSeat.declare_hung` only after this reported a hang)."""


@runtime_checkable
class WatchedSeat(RolloutSeat, Protocol):
    """A rollout seat whose hangs are found from outside (a worker process, a Ray actor)."""

    async def declare_hung(self, what: int, env: int, seconds: float, timeout: float) -> None:
        """Record the hang found by :meth:`stuck` in :attr:`hung` and kill the worker."""


@runtime_checkable
class EvalSeat(Seat, Protocol):
    """The evaluator's worker, as :class:`~aiocollect._evaluator.run.EvalRun` drives it."""

    dead: BaseException | None
    failed: bool

    async def evaluate(self, req: Any, weights: Any, episodes: int) -> Any:
        """Run evaluation ``req``; its answer (a :mod:`~aiocollect._core.eval_wire` message)."""

    async def env_call(self, call: Any) -> list:
        """Apply an :class:`~aiocollect._core.wire.EnvCall` to the worker's envs (between
        evaluations); its results, one per env row (what the env raised, as the worker's error)."""

    def abort_nowait(self, rid: int) -> None:
        """Ask the worker to stop evaluation ``rid``."""

    def failure(self, msg: Any) -> BaseException:
        """The exception of a failed evaluation's answer."""

    async def check_hung(self, timeout: float) -> None:
        """Declare the worker hung (and kill it) if it is."""


@dataclasses.dataclass
class Launch:
    """What a backend gets to start a run's rollout workers."""

    configs: list[RolloutConfig]
    """One per worker seat (its env, its policy, its seeds)."""
    needs: tuple[str, ...] = ()
    """The heavy modules the workers' policies import (the launcher imports them once)."""
    shutdown_timeout: float = 0.0
    """Seconds a worker that must go (a failed start-up) gets to close its envs."""
    options: Any = None
    """The backend's own options as the user gave them (``ray_actor_options`` for Ray)."""
    policy: Any = None
    """The local backend: the collector's policy (a replica of it is used)."""
    factory: Callable[[], Any] | None = None
    """The local backend: the policy factory, when there is no policy."""


@dataclasses.dataclass
class Sharing:
    """What a backend gets to share the slots with its started seats."""

    layout: SlotLayout
    """The slots' layout (every worker's rows)."""
    store: Any = None
    """The weight store every worker reads, if the policy has weights."""
    store_fds: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Per worker index: the descriptors of the weight stores it maps (the process backend)."""
    watch: bool = False
    """A ``step_timeout`` is set: the workers keep a heartbeat."""


@runtime_checkable
class Backend(Protocol):
    """Where a collector's workers run. aiocollect's own are named in
    :data:`~aiocollect._backends.table.BACKENDS`; any object with these members can be passed
    to ``Collector(backend=...)`` instead of a name (a fake pool of workers in tests)."""

    name: str
    """Its name in messages (``"process"``)."""
    weights_in_parent: bool
    """The weight stores stay in this process's memory (the workers do not map them)."""
    profiles: bool
    """The profiler can record its workers (``Collector.enable_profile``, ``profile=``)."""
    serves_inference: bool
    """Its workers can step envs for the collector's inference server (``inference="server"``)."""
    opens_evaluator: bool
    """It can also run an :class:`~aiocollect.Evaluator`'s worker (``open_evaluator``)."""
    options_name: str | None
    """The constructor option that holds its own options (``"ray_actor_options"``), if any: only
    that option is handed to it (:attr:`Launch.options`)."""

    def check_options(self, options: Any, workers: int) -> Any:
        """Check its own options as the user gave them (``ray_actor_options``) for ``workers``
        workers (``num_workers``: 0 for the collector's own process), or raise a
        :class:`~aiocollect.ConfigError` naming what is wrong."""

    def warm_up(self, needs: tuple[str, ...]) -> None:
        """A collector was built: prepare what starting its workers will need (without waiting)."""

    async def start(self, launch: Launch) -> tuple[list[Any], list[dict]]:
        """Start a seat per config (:class:`RolloutSeat`); return them and the specs they
        report (batch leaves, weights). Nothing is left running if this raises."""

    async def share_slots(self, seats: list[Any], sharing: Sharing) -> tuple[int, Any]:
        """Allocate the slots' shared memory, give each seat its rows (and the weight store);
        return the segment (descriptor, mapping), owned by the caller."""


__all__ = ["Backend", "EvalSeat", "Launch", "RolloutSeat", "Seat", "Sharing", "SlotViews", "WatchedSeat"]
