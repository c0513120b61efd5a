"""Profiling with ``torch.profiler``: in chosen workers (around their rollouts) and in the
collector's process (around what runs there: assembling batches, hooks, post-processing).

Imported by worker processes: torch only when a profile is actually recorded.
"""

from __future__ import annotations

import dataclasses
import os
import string
import inspect
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, Sequence

from .errors import ConfigError
from .public import public

if TYPE_CHECKING:
    from ..events import Event

ACTIVITIES = ("cpu", "cuda")


@public
@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """What to profile, and where the traces go (Chrome trace JSON: open them in
    ``chrome://tracing`` or https://ui.perfetto.dev).

    The profiler skips the first ``warmup_rollouts`` batches of each profiled worker, records
    until ``num_rollouts`` batches have been collected, then writes the trace and emits a
    :class:`~aiocollect.events.ProfileTraceReady` event.
    """

    workers: tuple[int, ...] = (0,)
    """Indices of the workers to profile. The local backend is worker 0, and its envs run in the
    collector's process: with ``profile_collector`` it gets the collector's single trace (torch
    allows one profiler per process)."""
    num_rollouts: int = 5
    """Batches (per profiled worker) after which profiling stops, warm-up included."""
    warmup_rollouts: int = 1
    """Batches skipped before recording starts."""
    save_path: str = "traces/worker_{worker_idx}.json"
    """Trace file; ``{worker_idx}`` becomes the worker index (``collector`` for the collector's own
    process). Relative paths are relative to the collector process's working directory."""
    activities: tuple[str, ...] = ("cpu",)
    """``"cpu"`` and/or ``"cuda"``."""
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    profile_collector: bool = True
    """Also profile the collector's own process over the same batches."""
    on_trace_ready: Callable[[Any], Any] | None = None
    """Called (in the collector's process, sync or async) with each ProfileTraceReady event."""

    def __post_init__(self) -> None:
        given = self.workers
        workers = _sequence(given, int)
        if workers is None or any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in workers):
            raise ConfigError(f"workers={given!r} must be a worker index or a list of them (ints >= 0)")
        object.__setattr__(self, "workers", workers)
        for name in ("num_rollouts", "warmup_rollouts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an int >= 0")
        if self.num_rollouts <= self.warmup_rollouts:
            raise ConfigError(
                f"num_rollouts={self.num_rollouts} must be greater than warmup_rollouts="
                f"{self.warmup_rollouts}: nothing would be recorded"
            )
        activities = _sequence(self.activities, str)
        if not activities or any(not isinstance(a, str) or a not in ACTIVITIES for a in activities):
            raise ConfigError(f"activities={self.activities!r} must be a non-empty subset of {list(ACTIVITIES)}")
        object.__setattr__(self, "activities", activities)
        for name in ("record_shapes", "profile_memory", "with_stack", "with_flops", "profile_collector"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        path = self.save_path
        if isinstance(path, os.PathLike):
            object.__setattr__(self, "save_path", os.fspath(path))
        if not isinstance(self.save_path, str):
            raise ConfigError(f"save_path={path!r} must be a str (or a path), e.g. 'traces/worker_{{worker_idx}}.json'")
        try:
            for worker_idx in (0, "collector"):  # what path_for is given
                self.save_path.format(worker_idx=worker_idx)
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
            raise ConfigError(
                f"save_path={path!r} is not a format string whose only field is '{{worker_idx}}' "
                f"({type(exc).__name__}: {exc}); write a literal brace as '{{{{' or '}}}}'"
            ) from None
        fields = {field for _, field, _, _ in string.Formatter().parse(self.save_path) if field is not None}
        if "worker_idx" not in fields and len(workers) + int(self.profile_collector) > 1:
            raise ConfigError(
                f"save_path={path!r} needs a '{{worker_idx}}' placeholder: several processes are "
                f"profiled and would overwrite each other's trace"
            )
        if self.on_trace_ready is not None and not callable(self.on_trace_ready):
            raise ConfigError(f"on_trace_ready={self.on_trace_ready!r} is not callable")

    def path_for(self, worker: int | str) -> str:
        return os.path.abspath(self.save_path.format(worker_idx=worker))

    def for_worker(self) -> dict[str, Any]:
        """The picklable part a worker needs."""
        return {
            "num_rollouts": self.num_rollouts,
            "warmup_rollouts": self.warmup_rollouts,
            "activities": self.activities,
            "record_shapes": self.record_shapes,
            "profile_memory": self.profile_memory,
            "with_stack": self.with_stack,
            "with_flops": self.with_flops,
        }


def _sequence(value: Any, single: type) -> tuple | None:
    """``value`` as a tuple: one ``single`` alone, or the items of a list, tuple, set or range
    (``None`` for anything else: a dict, a str of the wrong kind, an object)."""
    if isinstance(value, single) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple, set, frozenset, range)):
        return tuple(value)
    return None


class Recorder:
    """Drives one profiler over a process's batches: ``before(n)`` / ``after(n)`` around batch
    ``n`` (counted from 0); ``after`` returns the trace path once it is written."""

    def __init__(self, settings: dict[str, Any], path: str) -> None:
        self.settings = settings
        self.path = path
        self.prof: Any = None
        self.done = False

    def before(self, n: int) -> None:
        if self.done or self.prof is not None or n != self.settings["warmup_rollouts"]:
            return
        import torch.profiler as tp

        kinds = {"cpu": tp.ProfilerActivity.CPU, "cuda": tp.ProfilerActivity.CUDA}
        options: dict[str, Any] = {}
        if "acc_events" in inspect.signature(tp.profile).parameters:
            # One cycle per recorder, so keeping events across cycles changes nothing; without it
            # torch 2.11 warns on the first cycle ("Profiler clears events at the end of each
            # cycle"), an error where warnings are errors.
            options["acc_events"] = True
        prof = tp.profile(
            activities=[kinds[a] for a in self.settings["activities"]],
            record_shapes=self.settings["record_shapes"],
            profile_memory=self.settings["profile_memory"],
            with_stack=self.settings["with_stack"],
            with_flops=self.settings["with_flops"],
            **options,
        )
        # Kept only once started: abort() stops it, and stopping one that never started raises
        # "Can't disable Kineto profiler when it's not running".
        prof.__enter__()
        self.prof = prof

    def after(self, n: int) -> str | None:
        if self.prof is None or n + 1 < self.settings["num_rollouts"]:
            return None
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        prof.export_chrome_trace(self.path)
        self.done = True
        return self.path

    def abort(self) -> None:
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.__exit__(None, None, None)


class ProfiledWorker(Protocol):
    """A worker seat, as the profiler drives it (the collector's seats:
    :class:`~aiocollect._backends.seat.RolloutSeat`)."""

    @property
    def index(self) -> int: ...

    @property
    def traces(self) -> list[str]:
        """The trace files it wrote and nobody announced yet (taken from the front)."""
        ...

    def profile(self, settings: dict[str, Any], path: str) -> None:
        """Profile its next rollouts (``settings``: :meth:`ProfileConfig.for_worker`) into ``path``."""

    def profile_off(self) -> None:
        """Drop a recording in progress."""


class _ProfiledConfig(Protocol):
    @property
    def workers(self) -> int:
        """Worker seats (1 for ``num_workers=0``: the collector's process)."""
        ...

    @property
    def num_workers(self) -> int: ...


class ProfiledPool(Protocol):
    """A collector's worker pool, as its profiling reads it (the collector's:
    :class:`~aiocollect._collector.pool.WorkerPool`)."""

    @property
    def config(self) -> _ProfiledConfig: ...

    @property
    def workers(self) -> Sequence[ProfiledWorker]: ...


class RunProfiling:
    """A run's profiling: which workers record their next rollouts, the collector process's own
    recorder, and the traces they announce (:class:`~aiocollect.events.ProfileTraceReady`)."""

    def __init__(self, config: ProfileConfig | None, pool: ProfiledPool, emit_event: Callable[[Event], Awaitable[None]],
                 rounds: Callable[[], int]) -> None:
        self.config = config
        self.pool = pool  # the workers it records
        self._emit_event = emit_event  # ProfileTraceReady, to the run's handlers and subscriptions
        self._rounds = rounds  # worker batches collected so far
        self.recorder: Recorder | None = None  # the collector process's, when profile_collector
        self.recorder_from = 0  # the producer's round the recording started at
        self.local_trace = False  # the local worker's trace is the collector's

    def check(self, config: ProfileConfig) -> None:
        workers = self.pool.config.workers
        bad = [w for w in config.workers if w >= workers]
        if bad:
            raise ConfigError(
                f"ProfileConfig.workers={list(config.workers)} names workers {bad}, but this collector has "
                f"{workers} (indices 0..{workers - 1})"
            )

    def enable(self, config: ProfileConfig, workers_ready: bool) -> None:
        self.check(config)
        self.disable()
        self.config = config
        if workers_ready:
            self.start()

    def start(self) -> None:
        """Profile the next rollouts of the chosen workers (and of the collector's process)."""
        p, pool = self.config, self.pool
        if p is None:
            return
        if pool.config.num_workers == 0 and p.profile_collector:
            # The local backend's rollouts run in this process, which has one profiler: the
            # collector's trace is recorded around the local worker's batches (they hold the env
            # steps and the policy's passes; the rounds' delivery runs between them, recorded too).
            # Around the producer's rounds instead, a rollout filled ahead (prefetch) would be
            # missed: which one is up to the event loop's scheduling.
            self.local_trace = True
            for w in pool.workers:
                w.profile(p.for_worker(), p.path_for("collector"))
            return
        for w in pool.workers:
            if w.index in p.workers:
                w.profile(p.for_worker(), p.path_for(w.index))
        if p.profile_collector:
            self.recorder = Recorder(p.for_worker(), p.path_for("collector"))
            self.recorder_from = self._rounds()

    def abort_collector(self) -> None:
        if self.recorder is not None:
            self.recorder.abort()
            self.recorder = None

    def disable(self) -> None:
        self.config = None
        self.local_trace = False
        self.abort_collector()
        for w in self.pool.workers:
            w.profile_off()

    async def trace_ready(self, worker: int | None, path: str) -> None:
        from ..events import ProfileTraceReady

        event = ProfileTraceReady(worker=worker, path=path)
        p = self.config
        if p is not None and p.on_trace_ready is not None:
            result = p.on_trace_ready(event)
            if inspect.isawaitable(result):
                await result
        await self._emit_event(event)

    async def announce_traces(self) -> None:
        for w in self.pool.workers:
            while w.traces:
                await self.trace_ready(None if self.local_trace else w.index, w.traces.pop(0))


