"""The collector: starts workers, turns their slots into TensorDict batches and delivers them
through a bounded stream to ``async for`` / :meth:`Collector.collect`."""

from __future__ import annotations

import enum

import time
import warnings
from collections import deque
import contextlib
import copy
import dataclasses
import inspect
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Sequence, TypeVar

import anyio
import torch
from tensordict import TensorDict, TensorDictBase

from . import events as ev
from ._bus import EventBus, Overflow, Subscription
from ._config import CollectorConfig
from ._errors import (
    AiocollectError,
    BrokenWorkerError,
    CollectorClosedError,
    ConfigError,
    EndOfCollection,
    SpecError,
)
from ._launcher import get_launcher
from ._layout import Key, SlotLayout, frame_leaves
from ._policy import PolicySpec, classify, describe
from ._profiling import ProfileConfig, Recorder
from ._rollout import RolloutConfig
from ._split import split_trajectories
from ._resource import AsyncResource, unwrap_group as _unwrap
from ._systask import spawn_system_task
from ._weightsync import WeightSync
from ._workers import LocalWorker, WorkerHandle, setup_process_slots, start_process_workers

E = TypeVar("E", bound=ev.Event)

_ENDLESS = 1 << 62
_THREAD_COPY_BYTES = 8 << 20  # larger batches are copied out of shared memory in a thread


class State(enum.Enum):
    """Lifecycle of a :class:`Collector`."""

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


def _nest(flat: dict[Key, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return out


class Collector(AsyncResource):
    """Collects experience from gymnasium envs stepped in worker processes.

    >>> async with Collector("CartPole-v1", frames_per_batch=256, total_frames=1024,
    ...                      num_workers=2, envs_per_worker=4) as collector:   # doctest: +SKIP
    ...     async for batch in collector:
    ...         batch.batch_size                               # torch.Size([8, 32])

    Each batch is a :class:`tensordict.TensorDict` of shape ``[E, T]`` (dim names ``[None,
    "time"]``) in TorchRL's layout: ``observation``, ``action``, ``done`` / ``terminated`` /
    ``truncated``, ``("next", "observation")``, ``("next", "reward")``, ``("next", "done")`` ...,
    ``("collector", "traj_ids")``, ``("collector", "policy_version")`` and whatever else the
    policy writes. With ``split_trajs=True`` it is ``[n_traj, max_len]`` with
    ``("collector", "mask")``.

    **What is copied.** Workers write frames in place into preallocated shared-memory slots (two
    or more per worker). When a batch is delivered its tensors are copied out of the slots once
    (a ``torch.cat`` over workers), and the slots go back to the workers: a batch you receive is
    yours, stays valid after the next one arrives, and may be modified in place.

    **Lifecycle.** ``async with Collector(...)`` starts on entry and closes on exit; or ``await
    start()`` / ``await aclose()`` (for notebooks: the collector's own tasks do not belong to the
    cell that started it). ``async for`` and :meth:`collect` start it if needed. :meth:`aclose`
    is idempotent, never leaves a process or shared-memory segment behind, and finishes (within
    ``shutdown_timeout`` plus a moment) even when the caller is being cancelled. A closed
    collector cannot be reopened. A plain ``with Collector(...) as c: for batch in c:`` runs the
    same code through an anyio blocking portal (an event loop in a helper thread).

    **Errors.** Bad arguments raise :class:`ConfigError` here. An exception in a worker reaches
    the consumer as :class:`WorkerError` (original as ``__cause__``, worker traceback in the
    message); a worker killed from outside as :class:`BrokenWorkerError`, as soon as its pipe
    closes; data that does not match the env's spaces as :class:`SpecError`.

    See :class:`CollectorConfig` for every option.
    """

    def __init__(
        self,
        create_env_fn: Any,
        policy: Any = None,
        *,
        frames_per_batch: int,
        total_frames: int = -1,
        num_workers: int = 1,
        envs_per_worker: int = 1,
        delivery: str = "sync",
        inference: str = "worker",
        create_env_kwargs: dict | None = None,
        policy_factory: Callable[[], Any] | Sequence[Callable[[], Any]] | None = None,
        max_frames_per_traj: int | None = None,
        init_random_frames: int | None = None,
        reset_at_each_iter: bool = False,
        split_trajs: bool = False,
        exploration_type: Any = "random",
        progress: bool = False,
        seed: int | None = None,
        prefetch: int = 2,
        shutdown_timeout: float = 5.0,
        postproc: Callable[[TensorDict], Any] | None = None,
        update_at_each_batch: bool = False,
        trajs_per_batch: int | None = None,
        traj_format: str = "pad",
        check_finite: bool = False,
        action_bounds: str = "pass",
    ) -> None:
        self.config = CollectorConfig(
            create_env_fn=create_env_fn,
            policy=policy,
            frames_per_batch=frames_per_batch,
            total_frames=total_frames,
            num_workers=num_workers,
            envs_per_worker=envs_per_worker,
            delivery=delivery,  # type: ignore[arg-type]
            inference=inference,  # type: ignore[arg-type]
            create_env_kwargs=create_env_kwargs,
            policy_factory=policy_factory,
            max_frames_per_traj=max_frames_per_traj,
            init_random_frames=init_random_frames,
            reset_at_each_iter=reset_at_each_iter,
            split_trajs=split_trajs,
            exploration_type=exploration_type,
            progress=progress,
            seed=seed,
            prefetch=prefetch,
            shutdown_timeout=shutdown_timeout,
            postproc=postproc,
            update_at_each_batch=update_at_each_batch,
            trajs_per_batch=trajs_per_batch,
            traj_format=traj_format,  # type: ignore[arg-type]
            check_finite=check_finite,
            action_bounds=action_bounds,  # type: ignore[arg-type]
        )
        self._state = State.CREATED
        self._launch_failed = False
        self._closing = False
        self._ended = False
        self._produced = 0
        self._collected = 0  # frames collected by the workers (total_frames counts these)
        self._pending_error: BaseException | None = None
        self._seed: int | None = seed
        self._static_seed = False
        self._frames = 0
        self._batches = 0
        self._episodes = 0
        self._start_counters: list[int] | None = None
        self._counters: list[int] | None = None
        self._workers: list[WorkerHandle] = []
        self._error: BaseException | None = None
        self._error_seen = False
        self._requested = 0
        self._arrivals: deque[WorkerHandle] = deque()
        self._bar: Any = None
        self._task: Any = None
        self._bus = EventBus()
        self._stats = _Stats()
        self._sink: Any = None
        self._paused = 0
        self._resume = anyio.Event()
        self._resume.set()
        self._writing = False
        self._drained = anyio.Event()
        self._profile: ProfileConfig | None = None
        self._recorder: Recorder | None = None
        self._sync = WeightSync(policy, num_workers == 0, self._emit)
        if num_workers > 0:
            # Let the launcher import what the workers need while the caller does other things.
            needs = PolicySpec("random" if policy is None and policy_factory is None else
                               ("factory" if policy is None else classify(policy)[0])).needs
            get_launcher().ensure_started(needs)

    # -- public state -----------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def frames(self) -> int:
        """Frames delivered so far (including those restored by :meth:`load_state_dict`)."""
        return self._frames

    @property
    def batches(self) -> int:
        """Batches delivered so far."""
        return self._batches

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the running workers (empty for the local backend)."""
        return tuple(w.pid for w in self._workers if w.pid is not None)

    @property
    def policy_version(self) -> int:
        """Latest weight version published (0: the weights the policy had at start). Each
        :meth:`update_weights` adds one."""
        return self._sync.version

    @property
    def worker_versions(self) -> tuple[int, ...]:
        """Per worker, the weight version it acknowledged applying (at a batch boundary)."""
        return tuple(self._sync.acked)

    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Any = None,
        model_id: str = "policy",
        weights_dict: Mapping[str, Any] | None = None,
        wait: bool = True,
    ) -> int:
        """Publish new policy weights to the workers; returns the new version.

        ``policy_or_weights``: an ``nn.Module`` / ``TensorDictModule`` (its current weights, on
        whatever device it is now), a ``TensorDict`` of parameters
        (``TensorDict.from_module(policy)``), a state dict, or ``None`` for the weights of the
        ``policy`` given to the constructor. They are copied once into shared memory; each
        worker applies the newest complete version at its next batch boundary (never within a
        batch, never half-written; an idle worker at once) and every frame it collects after
        that carries the version in ``("collector", "policy_version")``.

        ``model_id`` names what the weights are for: ``"policy"`` (all of the workers' policy)
        or one of its submodules, ``"policy.<path>"`` with the path ``get_submodule`` takes
        (``"policy.actor"``, ``"policy.heads.0"``); the rest of the policy keeps its weights.
        ``weights_dict={model_id: weights, ...}`` updates several models as one version: a
        worker applies all of them at the same batch boundary or none.

        ``worker_ids`` limits the update to some workers (the others keep their weights); with
        one ``policy_factory`` per worker (distinct policies), it is how each gets its own.
        ``wait=True`` returns once every targeted worker applied it; ``wait=False`` at once.
        Emits :class:`~aiocollect.events.WeightsUpdated`, then one
        :class:`~aiocollect.events.WeightsApplied` per worker (with its latency).
        """
        if weights_dict is not None:
            if policy_or_weights is not None or model_id != "policy":
                raise ValueError(
                    "pass either weights_dict={model_id: weights, ...} or policy_or_weights (with model_id), not both"
                )
            if not isinstance(weights_dict, Mapping) or not weights_dict:
                raise ValueError(f"weights_dict={weights_dict!r} must be a non-empty {{model_id: weights}} mapping")
            updates = dict(weights_dict)
        else:
            updates = {model_id: policy_or_weights}
        sync = self._sync
        sync.check_model_ids(updates)
        if self._state is State.CREATED:
            await self.start()
        if self._state is not State.RUNNING:
            raise CollectorClosedError(f"update_weights() on a collector that is {self._state.value}")
        targets = sync.targets(worker_ids, self.config.workers)
        version = await sync.publish(updates, targets)
        if wait and not await sync.wait_applied(version, targets, lambda: self._state is State.RUNNING):
            if self._error is not None:
                raise self._error
            raise CollectorClosedError(f"the collector stopped before workers applied version {version}")
        return version

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<Collector {c.create_env_fn!r} {self._state.value}: {c.num_workers} workers x "
            f"{c.envs_per_worker} envs, {c.frames_per_batch} frames/batch, {self._frames} frames>"
        )

    # -- events ---------------------------------------------------------------------------------
    def on(self, event_type: type[E], handler: Callable[[E], Any] | None = None) -> Any:
        """Call ``handler(event)`` (sync or async, awaited in registration order) for each event
        of ``event_type`` or a subclass (see :mod:`aiocollect.events`). Returns a handle whose
        ``remove()`` unsubscribes; without ``handler`` it is a decorator.

        Handlers run in the collector's own task, before the batch they concern is delivered: a
        slow handler slows collection (that is what hooks are for; use :meth:`subscribe` to
        watch without ever slowing anything). An exception in a handler stops the collector and
        is raised to the consumer.

        >>> @collector.on(EpisodeEnded)                     # doctest: +SKIP
        ... def log(event): print(event.ret)
        """
        return self._bus.on(event_type, handler)

    def subscribe(
        self, event_type: type[E], *, max_buffer: int = 1024, overflow: Overflow = "drop_oldest"
    ) -> Subscription[E]:
        """A bounded stream of events of ``event_type``: ``async for event in subscription``
        (ends when the collector stops). A subscriber that falls behind loses events by its
        ``overflow`` policy (``"drop_oldest"``, ``"drop_newest"`` or ``"error"``, counted in
        ``subscription.dropped``); it never slows the collector or the other subscribers."""
        return self._bus.subscribe(event_type, max_buffer=max_buffer, overflow=overflow)

    async def wait_for(self, event_type: type[E], predicate: Callable[[E], bool] | None = None) -> E:
        """The next event of ``event_type`` that ``predicate`` accepts. Raises
        :class:`CollectorClosedError` if the collector stops first."""
        try:
            return await self._bus.wait_for(event_type, predicate)
        except anyio.EndOfStream:
            raise CollectorClosedError(
                f"the collector stopped before a matching {event_type.__name__} event"
            ) from None

    def enable_profile(self, config: ProfileConfig | None = None, **kwargs: Any) -> ProfileConfig:
        """Profile chosen workers (and the collector's process) with ``torch.profiler``: pass a
        :class:`ProfileConfig` or its fields as keywords. Must be called before iteration starts.
        Each trace file written emits :class:`~aiocollect.events.ProfileTraceReady`.

        >>> collector.enable_profile(workers=[0], num_rollouts=5, warmup_rollouts=2,   # doctest: +SKIP
        ...                          save_path="traces/worker_{worker_idx}.json")
        """
        if self._state is not State.CREATED:
            raise AiocollectError(
                "enable_profile() must be called before iteration starts (the collector is "
                f"{self._state.value}); call it right after constructing the collector"
            )
        if config is None:
            config = ProfileConfig(**kwargs)
        elif kwargs:
            config = dataclasses.replace(config, **kwargs)
        bad = [w for w in config.workers if w >= self.config.workers]
        if bad:
            raise ConfigError(
                f"ProfileConfig.workers={list(config.workers)} names workers {bad}, but this collector has "
                f"{self.config.workers} (indices 0..{self.config.workers - 1})"
            )
        self._profile = config
        return config

    def disable_profile(self) -> None:
        """Stop profiling: before start, nothing will be profiled; while running, recordings in
        progress are dropped without writing a trace."""
        self._profile = None
        if self._recorder is not None:
            self._recorder.abort()
            self._recorder = None
        for w in self._workers:
            w.profile_off()

    def stats(self) -> "CollectorStats":
        """Counters and timing so far: frames, batches, frames per second, episodes and their
        mean return, and seconds spent per stage (see :class:`CollectorStats`)."""
        return self._stats.snapshot(self._frames, self._batches)

    # -- seeding and state ------------------------------------------------------------------------
    def _require_created(self, what: str) -> None:
        if self._state is not State.CREATED:
            raise AiocollectError(f"{what} must be called before the collector starts (it is {self._state.value})")

    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the envs: env ``k`` (counted over all workers) is reset with ``seed + k`` (or
        ``seed`` itself with ``static_seed=True``), and a random policy samples each env's action
        space seeded the same way. The same seed, policy and settings give the same data whatever
        the number of workers. Call before the collector starts.

        Returns the next unused seed (``seed + number of envs``), to seed something else with.
        """
        self._require_created("set_seed()")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed={seed!r} must be an int")
        self._seed, self._static_seed = seed, bool(static_seed)
        return seed if static_seed else seed + self.config.total_envs

    def state_dict(self) -> dict[str, Any]:
        """Counters to resume from: frames and batches delivered, the next trajectory number of
        each env (so trajectory ids stay unique after a resume), and the seeds."""
        counters = self._counters or self._start_counters or [0] * self.config.total_envs
        seed = self._seed
        return {
            "frames": self._frames,
            "batches": self._batches,
            "collected_frames": self._collected,
            "traj_counters": [k + 1 for k in counters] if self._counters else list(counters),
            "seed": seed,
            "static_seed": self._static_seed,
            "next_seed": None if seed is None else (seed if self._static_seed else seed + self.config.total_envs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume counters from :meth:`state_dict` (before start). ``total_frames`` counts the
        restored frames; envs are reset, seeded with the saved ``next_seed`` so that a resumed
        run does not replay the same episodes."""
        self._require_created("load_state_dict()")
        counters = list(state["traj_counters"])
        if len(counters) != self.config.total_envs:
            raise ValueError(
                f"state has trajectory counters for {len(counters)} envs, this collector has "
                f"{self.config.total_envs}; resume with the same num_workers * envs_per_worker"
            )
        total = self.config.total_frames
        if total != -1 and state["frames"] > total:
            raise ValueError(f"state has {state['frames']} frames, more than total_frames={total}")
        self._frames, self._batches = int(state["frames"]), int(state["batches"])
        self._collected = int(state.get("collected_frames", self._frames))
        self._start_counters = counters
        self._seed, self._static_seed = state.get("next_seed"), bool(state.get("static_seed", False))

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, replay_buffer: Any = None) -> None:
        """Start the workers and wait until they are ready (idempotent). Raises what a worker
        raised while starting (an env factory's error, a :class:`SpecError` ...).

        With ``replay_buffer`` (any object with ``extend(batch)``, sync or async: an
        :class:`~aiocollect.ReplayBuffer`, a TorchRL buffer ...) the collector collects in the
        background and writes every batch into it, until ``total_frames`` or :meth:`aclose`;
        :meth:`pause` holds the writes. Errors (of the workers or of ``extend``) are raised by
        :meth:`aclose`. Batches then go to the buffer only: :meth:`collect` refuses.
        """
        if self._state is State.CLOSED:
            raise CollectorClosedError("this collector is closed and cannot be reopened; create a new Collector")
        if replay_buffer is not None:
            if self._state is not State.CREATED:
                raise AiocollectError("start(replay_buffer=...) must be the first start of the collector")
            if not callable(getattr(replay_buffer, "extend", None)):
                raise TypeError(f"replay_buffer={replay_buffer!r} has no extend(batch) method")
            self._sink = replay_buffer
        if self._state is State.CREATED:
            self._state = State.STARTING
            size = max(self.config.prefetch, 1)
            self._send, self._recv = anyio.create_memory_object_stream[tuple[TensorDict, list, int]](size)
            self._started = anyio.Event()
            self._done = anyio.Event()
            self._stop = anyio.Event()
            self._wakeup = anyio.Event()
            self._task = spawn_system_task(self._run)
        await self._started.wait()
        if self._state is State.STOPPED and self._launch_failed:
            # nothing was started that could be used: the collector is closed, its error raised once
            with anyio.CancelScope(shield=True):
                await self._done.wait()
            self._recv.close()
            self._state = State.CLOSED
            if not self._error_seen and self._error is not None:
                self._error_seen = True
                raise self._error

    async def aclose(self) -> None:
        """Stop the workers (each gets ``shutdown_timeout`` seconds to close its envs, then is
        killed), free the shared memory and close the stream. Idempotent; shielded from
        cancellation. Raises an error of the workers that no consumer has seen yet."""
        if self._state is State.CLOSED:
            return
        if self._state is State.CREATED:
            self._state = State.CLOSED
            return
        self._closing = True
        with anyio.CancelScope(shield=True):
            self._stop.set()
            await self._done.wait()
        self._recv.close()
        self._state = State.CLOSED
        if self._error is not None and not self._error_seen:
            self._error_seen = True
            raise self._error

    def __del__(self) -> None:
        if getattr(self, "_state", State.CLOSED) not in (State.STARTING, State.RUNNING):
            return  # nothing of ours is running (a stopped collector's workers are gone)
        warnings.warn(
            f"{self!r} was not closed: use `async with Collector(...)` or `await collector.aclose()`",
            ResourceWarning,
            stacklevel=2,
        )
        for w in self._workers:
            try:
                w.stop_nowait()
            except Exception:
                pass

    # -- consuming --------------------------------------------------------------------------------
    async def collect(self) -> TensorDict:
        """The next batch (starting the collector if needed).

        Raises :class:`EndOfCollection` once ``total_frames`` have been delivered, a worker's
        error if one failed, :class:`CollectorClosedError` after :meth:`aclose`. Cancelling a
        waiting call loses no frame: the batch goes to the next call.
        """
        if self._state is State.CREATED:
            await self.start()
        if self._sink is not None:
            raise AiocollectError(
                "this collector writes its batches into a replay buffer (start(replay_buffer=...)); "
                "sample from the buffer instead of collecting"
            )
        return await self._collect()

    async def _collect(self, *, drain: bool = False) -> TensorDict:
        if self._state is State.CLOSED:
            raise CollectorClosedError("this collector is closed; create a new Collector")
        if self._ended:
            self._raise_end()
        self._requested += 1
        self._wake()
        try:
            batch, parts, frames = await self._recv.receive()
        except anyio.EndOfStream:
            if not drain:  # (the drain into a replay buffer is what the runner itself waits for)
                await self._done.wait()  # the workers are gone before the end is reported
            if self._closing or self._state is State.CLOSED:
                if self._error is None:
                    raise CollectorClosedError("this collector was closed while waiting for a batch") from None
            elif not drain:
                # the end was seen: nothing is left to release (a consumer that never calls
                # aclose(), as in `async for b in Collector(...)`, leaves nothing open)
                self._ended = True
                self._recv.close()
            self._raise_end()
        except anyio.ClosedResourceError:
            raise CollectorClosedError("this collector was closed while waiting for a batch") from None
        self._delivered(parts, frames)
        return batch

    @contextlib.asynccontextmanager
    async def pause(self) -> AsyncIterator[None]:
        """``async with collector.pause():`` no batch is delivered, and nothing is written into
        the replay buffer, until the block exits (a write in progress finishes first). Workers
        stop once their slots are full (backpressure); nothing is lost: held batches follow
        after the pause. Pauses nest."""
        self._paused += 1
        if self._paused == 1:
            self._resume = anyio.Event()
        try:
            while self._writing:
                await anyio.sleep(0.001)
            yield
        finally:
            self._paused -= 1
            if self._paused == 0:
                self._resume.set()
                self._wake()

    @property
    def paused(self) -> bool:
        return self._paused > 0

    async def _drain_into_sink(self) -> None:
        """Background collection: every batch goes into the replay buffer."""
        sink = self._sink
        while True:
            try:
                batch = await self._collect(drain=True)
            except Exception:  # noqa: BLE001 - the end, or the collector's stored error (aclose raises it)
                self._drained.set()
                return
            while self._paused:
                await self._resume.wait()
            self._writing = True
            try:
                result = sink.extend(batch)
                if inspect.isawaitable(result):
                    await result
            finally:
                self._writing = False

    def __aiter__(self) -> AsyncIterator[TensorDict]:
        return self

    async def __anext__(self) -> TensorDict:
        try:
            return await self.collect()
        except EndOfCollection:
            raise StopAsyncIteration from None

    # -- blocking wrapper -------------------------------------------------------------------------
    def _portal(self) -> Any:
        portal = getattr(self, "_blocking_portal", None)
        if portal is None:
            from anyio.from_thread import start_blocking_portal

            options = {}
            try:
                import uvloop  # noqa: F401

                options = {"use_uvloop": True}
            except ImportError:  # pragma: no cover
                pass
            self._portal_cm = start_blocking_portal("asyncio", options)
            portal = self._blocking_portal = self._portal_cm.__enter__()
        return portal

    def __enter__(self) -> "Collector":
        portal = self._portal()
        try:
            portal.call(self.start)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except Exception:
            if exc is None:
                raise

    def __iter__(self) -> Iterator[TensorDict]:
        """Plain ``for batch in collector`` (blocking). Runs the collector in an event loop in a
        helper thread (an anyio blocking portal); :meth:`close` ends both."""
        portal = self._portal()
        while True:
            try:
                yield portal.call(self.collect)
            except EndOfCollection:
                return

    def close(self) -> None:
        """Blocking :meth:`aclose`, for code that used the blocking wrapper."""
        portal = getattr(self, "_blocking_portal", None)
        if portal is None:
            if self._state in (State.CREATED, State.CLOSED):
                self._state = State.CLOSED
                return
            raise RuntimeError("this collector runs in an event loop: use `await collector.aclose()`")
        try:
            portal.call(self.aclose)
        finally:
            self._blocking_portal = None
            self._portal_cm.__exit__(None, None, None)

    # -- the collector's own task -----------------------------------------------------------------
    def _wake(self, worker: WorkerHandle | None = None) -> None:
        if worker is not None:
            self._arrivals.append(worker)
        wakeup = getattr(self, "_wakeup", None)
        if wakeup is not None:
            wakeup.set()

    async def _run(self) -> None:
        try:
            try:
                async with anyio.create_task_group() as tg:
                    t_launch = time.perf_counter()
                    await self._launch()
                    self._stats.start()
                    for w in self._workers:
                        await self._emit(ev.WorkerStarted, worker=w.index, pid=w.pid)
                    await self._emit(
                        ev.CollectorStarted,
                        num_workers=self.config.num_workers,
                        envs_per_worker=self.config.envs_per_worker,
                        pids=self.worker_pids,
                        startup_seconds=time.perf_counter() - t_launch,
                    )
                    self._state = State.RUNNING
                    self._started.set()
                    for w in self._workers:
                        tg.start_soon(w.serve, self._wake, self._worker_failed, self._sync.on_applied)
                    tg.start_soon(self._produce)
                    if self._sink is not None:
                        tg.start_soon(self._drain_into_sink)
                    await self._stop.wait()
                    tg.cancel_scope.cancel()
            except Exception as exc:  # noqa: BLE001 - reported to the consumer
                self._error = _unwrap(exc)
                self._launch_failed = not self._started.is_set()
            finally:
                await self._stop_workers()
            reason = "error" if self._error is not None else ("closed" if self._closing else "total_frames")
            with anyio.CancelScope(shield=True):
                try:
                    await self._emit(ev.CollectorStopped, reason=reason, frames=self._frames,
                                     batches=self._batches, error=self._error)
                except Exception as exc:  # noqa: BLE001 - a handler's error still surfaces
                    if self._error is None:
                        self._error = exc
        finally:
            if self._recorder is not None:
                self._recorder.abort()
                self._recorder = None
            self._bus.close()
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self._send.close()
            if self._state is not State.CLOSED:
                self._state = State.STOPPED
            self._started.set()
            self._done.set()

    async def _stop_workers(self) -> None:
        self._sync.close()
        workers, self._workers = self._workers, []
        self._keep_pids = tuple(w.pid for w in workers if w.pid is not None)
        try:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for w in workers:
                        tg.start_soon(w.stop, self.config.shutdown_timeout)
        except BaseException:
            for w in workers:  # the event loop is going away: no more awaiting
                w.stop_nowait()
            raise

    def _describe(self, worker: int | None) -> PolicySpec:
        """The policy as sent to a worker (``worker``: the index of its own factory, if any)."""
        c = self.config
        factory = c.factory_for(worker or 0)
        try:
            return describe(c.policy, factory, c.exploration_type)
        except Exception as exc:
            what = "the policy" if factory is None else ("policy_factory" if worker is None else f"policy_factory[{worker}]")
            raise AiocollectError(
                f"{what} could not be pickled for the workers ({type(exc).__name__}: {exc}); "
                f"pass policy_factory=<a picklable function that builds it> instead"
            ) from exc

    def _rollout_configs(self, policy_specs: list[PolicySpec]) -> list[RolloutConfig]:
        c = self.config
        counters = tuple(self._start_counters) if self._start_counters else None
        return [
            RolloutConfig(
                env_fn=c.create_env_fn,
                env_kwargs=dict(c.create_env_kwargs or {}),
                policy=policy_specs[i],
                worker=i,
                envs_per_worker=c.envs_per_worker,
                total_envs=c.total_envs,
                frames_per_env=c.frames_per_env,
                seed=self._seed,
                static_seed=self._static_seed,
                max_frames_per_traj=c.max_frames_per_traj,
                random_steps=max(c.random_steps - self._frames // c.total_envs, 0),
                reset_at_each_iter=c.reset_at_each_iter,
                traj_counters=counters,
                start_batch=self._batches if c.delivery == "sync" else 0,
                profile=self._worker_profile(i),
                check_finite=c.check_finite,
                action_bounds=c.action_bounds,
            )
            for i in range(c.workers)
        ]

    def _worker_profile(self, worker: int) -> tuple[dict, str] | None:
        p = self._profile
        if p is None or worker not in p.workers:
            return None
        if self.config.num_workers == 0 and p.profile_collector:
            return None  # one profiler per process: the collector's trace covers the local envs
        return (p.for_worker(), p.path_for(worker))

    async def _announce_traces(self) -> None:
        for w in self._workers:
            while w.traces:
                await self._trace_ready(w.index, w.traces.pop(0))

    async def _trace_ready(self, worker: int | None, path: str) -> None:
        event = ev.ProfileTraceReady(worker=worker, path=path)
        p = self._profile
        if p is not None and p.on_trace_ready is not None:
            result = p.on_trace_ready(event)
            if inspect.isawaitable(result):
                await result
        await self._bus.emit(event)

    async def _launch(self) -> None:
        c = self.config
        if c.num_workers == 0:
            factory = c.factory_for(0)
            if c.policy is None and factory is None:
                spec, policy = PolicySpec("random", exploration_type=c.exploration_type), None
            else:
                # a replica, as in a worker: the caller's module may change under training (the
                # local rollout yields to the loop mid-batch), weights change only by update_weights
                policy = copy.deepcopy(c.policy) if c.policy is not None else factory()  # type: ignore[misc]
                spec = PolicySpec("local", exploration_type=c.exploration_type)
            local = LocalWorker(self._rollout_configs([spec])[0], policy)
            self._workers = [local]
            specs = [local.rollout.spec()]
        else:
            per_worker = isinstance(c.policy_factory, tuple)
            policy_specs = [self._describe(i if per_worker else None) for i in range(c.workers if per_worker else 1)]
            if not per_worker:
                policy_specs *= c.workers  # one spec for every worker: pickled once
            needs = tuple(sorted({n for p in policy_specs for n in p.needs}))
            workers, specs = await start_process_workers(self._rollout_configs(policy_specs), needs, get_launcher())
            self._workers = list(workers)
        batch_specs = [{k: v for k, v in s.items() if k != "weights"} for s in specs]
        for i, s in enumerate(batch_specs[1:], 1):
            if s != batch_specs[0]:
                raise SpecError(
                    f"worker {i} reports batch leaves {s} but worker 0 reports {batch_specs[0]}: every env "
                    f"must have the same spaces and every worker's policy the same outputs"
                )
        leaves = frame_leaves(specs[0]["obs"], specs[0]["act"], specs[0]["extras"])
        self._layout = SlotLayout.build(leaves, c.envs_per_worker, c.frames_per_env, max(2, c.prefetch + 1))
        try:
            store = self._sync.setup([s.get("weights") for s in specs], self._workers)
            if c.num_workers == 0:
                self._workers[0].setup(self._layout)  # type: ignore[attr-defined]
                if store is not None:
                    await self._workers[0].give_store(store)
            else:
                await setup_process_slots(self._workers, self._layout, store)  # type: ignore[arg-type]
        finally:
            self._sync.close_fds()
        if self._profile is not None and self._profile.profile_collector:
            self._recorder = Recorder(self._profile.for_worker(), self._profile.path_for("collector"))
        if c.progress:
            from ._progress import make_bar

            self._bar = make_bar(c.total_frames, self._frames)
        self._t0 = time.perf_counter()

    async def _pump(self, produced: int, remaining: int) -> None:
        """Grant workers the credits they may collect with now."""
        if self.config.delivery == "sync":
            target = min(remaining, self._run_requested() + self.config.prefetch)
            if (
                self.config.update_at_each_batch
                and self._sync.can_pull
                and any(w.credits_sent < target for w in self._workers)
            ):
                # pulled right before the workers may start the next batch(es)
                await self._sync.publish({"policy": None}, list(range(self.config.workers)))
        else:
            target = remaining
        for w in self._workers:
            if w.credits_sent < target:
                try:
                    await w.grant(target - w.credits_sent)
                except BrokenWorkerError as exc:  # died under us: reported like any failure
                    self._worker_failed(exc)

    def _run_requested(self) -> int:
        return self._requested

    async def _emit(self, event_type: type[ev.Event], **fields: Any) -> None:
        """Build and emit an event, only if someone listens (events cost nothing otherwise)."""
        if self._bus.listens_to(event_type):
            await self._bus.emit(event_type(**fields))

    async def _raise_failure(self) -> None:
        error = self._pending_error
        assert error is not None
        worker = getattr(error, "worker", None)
        pid = next((w.pid for w in self._workers if w.index == worker), None)
        await self._emit(ev.WorkerFailed, worker=-1 if worker is None else worker, pid=pid, error=error)
        raise error

    def _raise_end(self) -> None:
        if self._error is not None:
            self._error_seen = True
            raise self._error from self._error.__cause__
        raise EndOfCollection(f"all {self.config.total_frames} frames (total_frames) have been collected")

    def _deliverable(self) -> bool:
        if self.config.delivery == "sync":
            return all(w.ready for w in self._workers)
        return bool(self._arrivals)

    def _worker_failed(self, error: BaseException) -> None:
        """A worker raised or died: batches it completed before are still delivered (the
        producer drains them), then the error ends the run."""
        if self._pending_error is None:
            self._pending_error = error
        self._wake()

    async def _wait(self, cond: Callable[[], bool], produced: int, remaining: int) -> None:
        while True:
            if self._pending_error is None:
                await self._pump(produced, remaining)
            await self._announce_traces()
            self._wakeup = anyio.Event()
            if cond():
                return
            if self._pending_error is not None and not self._deliverable():
                await self._raise_failure()
            await self._wakeup.wait()

    async def _produce(self) -> None:
        c = self.config
        total = c.total_batches
        remaining = _ENDLESS if total is None else total - self._batches
        workers = self._workers
        sync = c.delivery == "sync"
        produced = 0  # batches delivered into the stream (what demand counts)
        rounds = 0  # worker batches collected (what total_frames counts)
        if c.trajs_per_batch is not None:
            from ._trajs import TrajectoryAccumulator

            remaining = _ENDLESS if total is None else total - self._collected // c.frames_per_batch
            trajs = TrajectoryAccumulator(c.trajs_per_batch, c.traj_format)
        self._batches_at_start = self._batches
        while rounds < remaining:
            if self._pending_error is not None and not self._deliverable():
                await self._raise_failure()
            index = self._batches_at_start + produced
            if c.update_at_each_batch and self._sync.can_pull and not sync:
                await self._sync.publish({"policy": None}, list(range(c.workers)))
            if self._recorder is not None:
                self._recorder.before(rounds)
            await self._emit(ev.BeforeRollout, index=index)
            t_wait = time.perf_counter()
            await self._wait(lambda: self._requested + c.prefetch > produced, produced, remaining)
            if sync:
                await self._wait(lambda: all(w.ready for w in workers), produced, remaining)
                parts = [(w, w.ready.popleft()) for w in workers]
            else:
                await self._wait(lambda: bool(self._arrivals), produced, remaining)
                w = self._arrivals.popleft()
                parts = [(w, w.ready.popleft())]
            t_assemble = time.perf_counter()
            batch = await self._assemble([(w, item[0]) for w, item in parts])
            for w, (slot, _, _) in parts:
                if self._pending_error is None:
                    try:
                        await w.release(slot)
                    except BrokenWorkerError as exc:
                        self._worker_failed(exc)
            if sync:
                self._arrivals.clear()
            rounds += 1
            self._collected += c.frames_per_batch
            infos = [(w.index, info) for w, (_, _, info) in parts]
            if c.trajs_per_batch is not None:
                envs = [w.index * c.envs_per_worker + e for w, _ in parts for e in range(c.envs_per_worker)]
                outputs = trajs.add(batch, envs)
            else:
                outputs = [split_trajectories(batch) if c.split_trajs else batch]
            t_done = time.perf_counter()
            timing = self._stats.batch(infos, wait=t_assemble - t_wait, delivery=t_done - t_assemble)
            if self._bus.listens_to(ev.EpisodeEnded):
                for worker, info in infos:
                    for env, traj_id, ret, length, terminated in info["episodes"]:
                        await self._bus.emit(ev.EpisodeEnded(
                            worker=worker, env=env, traj_id=traj_id, ret=ret, length=length,
                            terminated=terminated, policy_version=info.get("version", 0),
                        ))
            for n, batch in enumerate(outputs):
                index = self._batches_at_start + produced
                produced += 1
                self._produced += 1
                await self._emit(ev.AfterRollout, index=index, batch=batch)
                if c.postproc is not None:
                    batch = c.postproc(batch)
                    if inspect.isawaitable(batch):
                        batch = await batch
                while self._paused:  # collector.pause(): hold the batch (workers stop by backpressure)
                    await self._resume.wait()
                frames = c.frames_per_batch if c.trajs_per_batch is None else _frames_in(batch)
                await self._emit(
                    ev.BatchReady, index=index, frames=frames, workers=tuple(w for w, _ in infos),
                    policy_versions=tuple(info.get("version", 0) for _, info in infos), timing=timing,
                )
                # the round's counters go with its first delivery
                await self._send.send((batch, infos if n == 0 else [], frames))
            if self._recorder is not None and (path := self._recorder.after(rounds - 1)) is not None:
                self._recorder = None
                await self._trace_ready(None, path)
            await self._announce_traces()
        self._send.close()  # consumers drain what is buffered, then get EndOfCollection
        if self._sink is not None:
            await self._drained.wait()  # every batch is in the replay buffer
        self._stop.set()  # total_frames reached: release the workers now

    def _delivered(self, parts: list[tuple[int, dict]], frames: int) -> None:
        """Account for a batch the consumer received (counters, state_dict, progress)."""
        c = self.config
        if self._counters is None:
            self._counters = list(self._start_counters or [0] * c.total_envs)
        for index, info in parts:
            base = index * c.envs_per_worker
            self._counters[base : base + c.envs_per_worker] = info["traj_counters"]
            self._episodes += len(info["episodes"])
        self._frames += frames
        self._batches += 1
        if self._bar is not None:
            self._bar.update_to(self._frames, self._stats.mean_return)

    async def _assemble(self, parts: list[tuple[WorkerHandle, int]]) -> TensorDict:
        layout: SlotLayout = self._layout
        views = [w.slots.views[slot] for w, slot in parts]

        def copy() -> TensorDict:
            flat: dict[Key, torch.Tensor] = {}
            for leaf in layout.leaves:
                tensors = [v[leaf.key] for v in views]
                flat[leaf.key] = torch.cat(tensors) if len(tensors) > 1 else tensors[0].clone()
            E = layout.num_envs * len(views)
            T = layout.frames_per_env
            flat[("next", "done")] = flat[("next", "terminated")] | flat[("next", "truncated")]
            for name in ("done", "terminated", "truncated"):  # flags of obs at t: envs reset at once
                flat[(name,)] = torch.zeros(E, T, 1, dtype=torch.bool)
            return TensorDict(_nest(flat), batch_size=[E, T], names=[None, "time"])

        if layout.slot_nbytes * len(views) > _THREAD_COPY_BYTES:
            return await anyio.to_thread.run_sync(copy)
        return copy()





def _frames_in(batch: TensorDictBase) -> int:
    mask = batch.get(("collector", "mask"), None)
    return int(mask.sum()) if mask is not None else batch.numel()


@dataclasses.dataclass(frozen=True)
class CollectorStats:
    """A snapshot of :meth:`Collector.stats`."""

    frames: int
    """Frames delivered to consumers."""
    batches: int
    """Batches delivered."""
    seconds: float
    """Seconds since the workers were ready."""
    fps: float
    """Frames collected per second since the workers were ready."""
    episodes: int
    """Episodes that ended in collected batches."""
    mean_return: float | None
    """Mean return of the last (up to) 100 episodes; ``None`` before the first one ends."""
    timing: Mapping[str, float]
    """Seconds per stage since start: ``"env"`` and ``"policy"`` (summed over workers: CPU time
    in the workers), ``"wait"`` (the collector waiting for workers) and ``"delivery"`` (copying
    out of shared memory, assembling and post-processing)."""


class _Stats:
    """Running totals for :meth:`Collector.stats` and the progress bar (cheap per batch)."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.episodes = 0
        self.returns: deque[float] = deque(maxlen=100)
        self.timing = {"env": 0.0, "policy": 0.0, "wait": 0.0, "delivery": 0.0}

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def batch(self, infos: list[tuple[int, dict]], *, wait: float, delivery: float) -> dict[str, float]:
        timing = {"env": 0.0, "policy": 0.0, "wait": wait, "delivery": delivery}
        for _, info in infos:
            for key, value in info.get("timing", {}).items():
                timing[key] += value
            self.episodes += len(info["episodes"])
            self.returns.extend(e[2] for e in info["episodes"])
        for key, value in timing.items():
            self.timing[key] += value
        return timing

    @property
    def mean_return(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None

    def snapshot(self, frames: int, batches: int) -> CollectorStats:
        seconds = 0.0 if self.t0 is None else time.perf_counter() - self.t0
        return CollectorStats(
            frames=frames,
            batches=batches,
            seconds=seconds,
            fps=frames / seconds if seconds > 0 else 0.0,
            episodes=self.episodes,
            mean_return=self.mean_return,
            timing=dict(self.timing),
        )
