"""A run's worker pool: the seats (started by the run's backend:
:class:`~aiocollect._backends.seat.Backend`), their rollout configs, the slots' shared memory,
the inference server (``inference="server"``), the restart budget and the env calls kept for
replacements; starting it all and taking it down again.

:class:`WorkerPool` is built by the run's lifecycle (:class:`~aiocollect._collector.run.Run`)
with what it needs (the config, the backend, the weight sync and :class:`PoolHooks`, what it
tells the run) and owns what it allocates until :meth:`WorkerPool.stop`. The supervisor and the
watchdog (:mod:`aiocollect._service.supervisor`) drive its seats; the producer takes their
batches.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio

from .. import events as ev
from .._core import heartbeat as _heartbeat
from .._core import shm as _shm
from .._core.affinity import cpu_each, crowded, spare_one_cpu
from .._core.imports import env_needs
from .._core.quick_import import import_module
from .._core.errors import AiocollectError, SpecError
from .._core.layout import SlotLayout, frame_leaves
from .._worker.policy import PolicySpec, describe
from .env_factories import check_same_spaces, env_ids, has_factory_list, worker_factories
from .._service.env_calls import EnvCallLog
from .._service.resource import in_own_thread
from .._service.supervisor import RestartBudget
from .._worker.rollout import RolloutConfig
from .._worker.vector import reported_sub_envs
from .._core.geometry import Geometry
from .._backends.seat import Backend, Launch, RolloutSeat, Sharing
from .config import CollectorConfig
from .weightsync import WeightSync

if TYPE_CHECKING:  # pragma: no cover
    from .inference_server import InferenceServer


async def import_in_thread(module: str, give_up_after: float | None = None) -> None:
    """Import ``module`` in a thread of its own that ends with the import, while the event loop
    keeps running. For tensordict's import while the workers start (without torch._dynamo:
    :mod:`~aiocollect._core.quick_import`); torch's import code still holds the GIL for up to
    ~0.1 s at times. Cancelled, it waits ``give_up_after`` seconds more for the import, then
    leaves it to finish in its thread."""
    await in_own_thread(lambda: import_module(module), f"aiocollect import {module}", give_up_after=give_up_after)


@dataclasses.dataclass
class SlotMemory:
    """The batch slots in shared memory, and how they are laid out."""

    layout: SlotLayout | None = None
    segment: tuple[int, Any] | None = None  # the slots' memfd and the collector's mapping of it
    views: list[dict] = dataclasses.field(default_factory=list)  # per slot: every worker's rows (numpy views)


@dataclasses.dataclass(frozen=True)
class PoolHooks:
    """What the pool (its supervisors and watchdog) tells the run, and asks of it."""

    wake: Callable[..., None]
    """A worker has news (a batch ready, a failure): the producer looks again."""
    applied: Callable[[Any, int], Awaitable[None]]
    """A worker applied weights ``version``."""
    emit: Callable[..., Awaitable[None]]
    """Emit an event of a type built from fields (if someone listens)."""
    worker_failed: Callable[[BaseException], None]
    """A worker failed for good: its error ends the run after the batches it completed."""
    collecting: Callable[[], bool]
    """The workers may still collect frames (a failed worker is worth replacing)."""
    restarted: Callable[[], None]
    """A worker was replaced (counted in the stats)."""


@dataclasses.dataclass
class Seeding:
    seed: int | None = None
    static_seed: bool = False  # every env reset with ``seed`` itself, not ``seed + k``


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a run's start-up resumes from (``load_state_dict``, ``set_seed``)."""

    seed: int | None = None
    static_seed: bool = False
    traj_counters: list[int] | None = None
    frames: int = 0


class WorkerPool:
    """A run's worker seats and what they share (see the module docstring)."""

    def __init__(self, config: CollectorConfig, backend: Backend, sync: WeightSync, hooks: PoolHooks) -> None:
        self.config = config
        self.backend = backend  # where the workers run
        self.sync = sync
        self.hooks = hooks
        self.workers: list[RolloutSeat] = []
        self.configs: list[RolloutConfig] = []
        self.ready = False  # started, and their slots shared
        self.slots = SlotMemory()
        self.geometry: Geometry = config.geometry  # (a vector env's sub-envs, once the workers report them)
        self.server: InferenceServer | None = None  # inference="server"
        self.budget = RestartBudget(config.max_restarts, config.restart_window)
        self.env_calls = EnvCallLog()  # env epochs, and the env calls a replacement worker applies again

    # -- what the supervisor and the watchdog read (:class:`~aiocollect._service.supervisor.SupervisedRun`)
    @property
    def rows_per_worker(self) -> int:
        """Env rows of each worker's batch (its sub-envs, for vector envs)."""
        return self.geometry.rows_per_worker

    @property
    def total_rows(self) -> int:
        """Env rows of all workers (the number of envs, counting each sub-env of a vector env)."""
        return self.geometry.total_rows

    @property
    def collecting(self) -> bool:
        return self.hooks.collecting()

    def wake(self, worker: Any = None) -> None:
        self.hooks.wake(worker)

    async def applied(self, worker: Any, version: int) -> None:
        await self.hooks.applied(worker, version)

    async def emit(self, event_type: type[ev.Event], **fields: Any) -> None:
        await self.hooks.emit(event_type, **fields)

    def worker_failed(self, error: BaseException) -> None:
        self.hooks.worker_failed(error)

    def restarted(self) -> None:
        self.hooks.restarted()

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(pid for pid in (w.pid for w in self.workers) if pid is not None)

    # -- start and stop -------------------------------------------------------------------------
    async def launch(self, resume: Resume) -> None:
        """Start the workers (in-process for ``num_workers=0``), learn their batch leaves, lay out
        and share the slots and the weight store; the pool is then ready to grant credits."""
        c = self.config
        self.configs = self.rollout_configs(self.worker_policy_specs(), resume)
        # (an env factory whose module imports torch: the workers import it too, so fork them from
        # the launcher's torch template, where it is imported already)
        policy_needs = {n for cfg in self.configs for n in cfg.policy.needs}
        needs = tuple(sorted(policy_needs | set(env_needs(c.create_env_fn, c.create_env_kwargs))))
        # (a backend gets its own options alone: Ray its ray_actor_options)
        options = c.ray_actor_options if self.backend.options_name == "ray_actor_options" else None
        launch = Launch(self.configs, needs, c.shutdown_timeout, options, c.policy, c.factory_for(0))
        workers, specs = await self.backend.start(launch)
        self.workers = list(workers)
        slots = self.slots
        n = reported_sub_envs(specs)
        if n is not None:  # vector envs: each sub-env is a row
            self.geometry = c.geometry.with_sub_envs(n)
            self.geometry.check_counters(resume.traj_counters)
            self.geometry.check_seed(resume.seed)
        self.env_calls.rows_per_worker = self.rows_per_worker
        check_same_spaces(specs, self.configs)
        batch_specs = [{k: v for k, v in s.items() if k not in ("weights", "spaces")} for s in specs]
        for i, s in enumerate(batch_specs[1:], 1):
            if s != batch_specs[0]:
                raise SpecError(
                    f"worker {i} reports batch leaves {s} but worker 0 reports {batch_specs[0]}: every env "
                    f"must have the same spaces and every worker's policy the same outputs"
                )
        extras = specs[0]["extras"]
        if c.inference == "server":
            extras = await self.start_server(specs[0])
        leaves = frame_leaves(specs[0]["obs"], specs[0]["act"], extras, step_count=c.max_frames_per_traj is not None,
                              env_fn_index=has_factory_list(c))
        slots.layout = SlotLayout.of(self.geometry, leaves, c.num_slots)
        # the real bytes per frame are known now: refuse a run whose slots cannot fit, before any is filled
        c.check_slot_memory(slots.layout, len(self.workers) * _heartbeat.NBYTES)
        store_fds = self.sync.setup([s.get("weights") for s in specs], self.workers)
        sharing = Sharing(slots.layout, self.sync.store, store_fds, c.step_timeout is not None)
        slots.segment = await self.backend.share_slots(self.workers, sharing)
        slots.views = [slots.layout.views(slots.segment[1], k) for k in range(slots.layout.num_slots)]
        if self.server is not None:
            self.server.start()
        self.ready = True

    async def stop(self, lent: set[int], on_server_stopped: Callable[["InferenceServer"], None]) -> None:
        """Stop every worker (killed after shutdown_timeout), release the weight stores, the
        server (``on_server_stopped(server)`` first: its totals) and the slots' segment, whose
        mapping stays while batches lent to the consumer (slots ``lent``) use it; also when the
        event loop is going away (nothing awaited then)."""
        workers = self.workers
        self.ready = False
        try:
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for w in workers:
                        tg.start_soon(w.stop, self.config.shutdown_timeout)
        except BaseException:
            self.kill_now()  # the event loop is going away: no more awaiting
            raise
        finally:
            self.sync.close()
            if self.server is not None:  # (after the workers: none waits for an answer now)
                on_server_stopped(self.server)
                self.server.stop()
                self.server = None
            slots = self.slots
            if slots.segment is not None:  # (the mapping stays while batch views use it)
                if lent:
                    self._free_unlent_slots(lent)
                os.close(slots.segment[0])
                slots.segment = None
            slots.views = []

    def kill_now(self) -> None:
        """Kill every worker now (the event loop is going away, or its collector was forgotten)."""
        for w in self.workers:
            try:
                w.stop_nowait()
            except Exception:  # noqa: BLE001 - best effort: the process is going away
                pass

    def _free_unlent_slots(self, lent: set[int]) -> None:
        """The workers are gone, and batches lent to the consumer keep the slots' segment mapped
        for as long as it keeps them: free the memory of every other slot, and of the
        heartbeats, now."""
        layout, segment = self.slots.layout, self.slots.segment
        assert layout is not None and segment is not None
        mapping = segment[1]
        for slot in range(layout.num_slots):
            if slot not in lent:
                _shm.discard(mapping, slot * layout.slot_nbytes, layout.slot_nbytes)
        _shm.discard(mapping, layout.nbytes, len(mapping) - layout.nbytes)

    async def start_server(self, spec: dict) -> list:
        """Server inference: the server for the workers' spaces (the policy built here from
        ``policy_factory`` if there is no ``policy``), its shared memory and each worker's link
        to it. Returns the policy's extra outputs (part of the batch layout)."""
        from .inference_server import InferenceServer
        from .server_parts import ServerOptions

        c = self.config
        policy = c.policy if c.policy is not None else c.factory_for(0)()  # type: ignore[misc]
        groups = c.worker_groups
        options = ServerOptions(
            exploration_type=c.exploration_type, device=c.devices["policy_device"], compile_policy=c.compile_policy,
            cudagraph_policy=c.cudagraph_policy, env_batch_size=c.env_batch_size, priority=server_priority(c),
            state=c.state_leaves, weights=c.server_weights, out_keys=c.policy_out_keys,
        )
        server = InferenceServer(policy, spec, len(self.workers) * groups, self.rows_per_worker // groups, options)
        self.server = server
        self.sync.serve(server)
        extras = server.probe()
        if options.wraps:  # (compiling takes seconds)
            await in_own_thread(server.warm_up, "aiocollect server warm-up")
        server.allocate(extras)
        for w in self.workers:
            w.server_link = server.link(w.index, groups)  # type: ignore[attr-defined]
        return extras

    # -- what each worker gets ------------------------------------------------------------------
    def worker_policy_specs(self) -> list[PolicySpec]:
        """The policy as each worker gets it: the local rollout's own (``num_workers=0``: the
        collector's policy itself, or random), else one spec pickled once for every worker, or
        one per worker with a factory of its own."""
        c = self.config
        if c.num_workers == 0:
            local_policy = c.policy is not None or c.factory_for(0) is not None
            named: dict[str, Any] = {} if c.policy_out_keys is None else {"out_keys": c.policy_out_keys}
            return [PolicySpec("local" if local_policy else "random", exploration_type=c.exploration_type,
                               state=c.state_leaves, **named)]
        if isinstance(c.policy_factory, tuple):
            return [policy_spec(c, i) for i in range(c.workers)]
        return [policy_spec(c, None)] * c.workers  # one spec for every worker: pickled once

    def rollout_configs(self, policy_specs: list[PolicySpec], resume: Resume) -> list[RolloutConfig]:
        from .._core.registry import snapshot

        c = self.config
        counters = tuple(resume.traj_counters) if resume.traj_counters else None
        # ids registered in this process, for the workers: packed once, sent to each as bytes
        ids = env_ids(c)
        registry = snapshot(ids[0] if ids else None) if c.num_workers else ()
        spin = credit_spin(c)  # (the same for every worker)
        return [
            RolloutConfig(
                **worker_factories(c, i),
                policy=policy_specs[i],
                worker=i,
                envs_per_worker=c.envs_per_worker,
                total_envs=c.geometry.total_envs,
                seed=resume.seed,
                static_seed=resume.static_seed,
                max_frames_per_traj=c.max_frames_per_traj,
                random_frames=max(c.random_frames - resume.frames // c.geometry.total_envs, 0),
                reset_at_each_iter=c.reset_at_each_iter,
                traj_counters=counters,
                registry=registry,
                check_finite=c.check_finite,
                action_bounds=c.action_bounds,
                worker_groups=c.worker_groups,
                cpus=worker_cpus(c, i),
                credit_spin=spin,
                one_hot_actions=not c.categorical_action_encoding,
                decorrelation_steps=c.max_decorrelation_steps,
            )
            for i in range(c.workers)
        ]


def server_priority(c: Any) -> str:
    """The server thread's priority: ``server_priority="auto"`` is ``"auto"`` (``SCHED_IDLE``,
    back to normal if it starves: :class:`~aiocollect._collector.inference_server.StarvationWatch`)
    where this process has fewer CPUs than busy threads (:func:`~aiocollect._core.affinity.crowded`)
    and Linux's ``SCHED_IDLE`` exists, ``"normal"`` elsewhere."""
    if c.server_priority != "auto":
        return str(c.server_priority)
    return "auto" if hasattr(os, "SCHED_IDLE") and crowded(c.workers) else "normal"


def worker_cpus(c: Any, worker: int) -> tuple[int, ...] | None:
    """``worker``'s CPUs: ``worker_cpus``'s; or, not given, under ``inference="server"`` with
    ``server_priority="auto"`` on a crowded machine, every CPU of this process but its first
    (:func:`~aiocollect._core.affinity.spare_one_cpu`; a worker process applies them, the local
    backend's rollout in this process does not)."""
    cpus = c.cpus_for(worker)
    if cpus is None and c.inference == "server" and server_priority(c) == "auto":
        return spare_one_cpu(c.workers)
    return cpus


#: seconds a worker process with a CPU of its own looks for its next credit before it sleeps
CREDIT_SPIN = 0.001


def credit_spin(c: Any) -> float:
    """How long a worker process looks for its next credit without sleeping once its batch is
    sent (:data:`CREDIT_SPIN`): under ``delivery="sync"``, where it has a CPU of its own and the
    collector's process one more (:func:`~aiocollect._core.affinity.cpu_each`); else 0: it sleeps
    at once, leaving its CPU to the others.

    A sync round starts when every worker has its credit: one read as it comes costs the worker
    no wake-up and the collector's process no write that wakes a sleeping process, which counts
    where rounds are short (the design page's "Short rounds"), for at most a millisecond of
    polling per batch. An async worker waiting for a credit is ahead of the consumer: nothing
    waits on it. Not under ``inference="server"``: the server's thread needs a CPU too."""
    if c.delivery != "sync" or c.inference == "server" or not cpu_each(c.workers, c.worker_cpus):
        return 0.0
    return CREDIT_SPIN


def policy_spec(c: CollectorConfig, worker: int | None) -> PolicySpec:
    """The policy as sent to a worker (``worker``: the index of its own factory, if any)."""
    if c.inference == "server":  # the workers only step envs: the policy stays here
        return PolicySpec("server", exploration_type=c.exploration_type)
    factory = c.factory_for(worker or 0)
    try:
        return describe(c.policy, factory, c.exploration_type, c.state_leaves, c.policy_out_keys)
    except Exception as exc:
        what = "the policy" if factory is None else ("policy_factory" if worker is None else f"policy_factory[{worker}]")
        raise AiocollectError(
            f"{what} could not be pickled for the workers ({type(exc).__name__}: {exc}); "
            f"pass policy_factory=<a picklable function that builds it> instead"
        ) from exc


__all__ = ["CREDIT_SPIN", "PoolHooks", "Resume", "Seeding", "SlotMemory", "WorkerPool", "credit_spin",
           "import_in_thread", "policy_spec", "server_priority", "worker_cpus"]


if TYPE_CHECKING:  # pragma: no cover
    from .._core.profiling import ProfiledPool
    from .._service.supervisor import SupervisedRun, SupervisedWorker

    def _typed(pool: WorkerPool, seat: RolloutSeat) -> tuple[SupervisedRun, SupervisedWorker, ProfiledPool]:
        """(For mypy: the pool and its seats are what the supervisor, the watchdog and the
        profiling drive; the supervisor's tasks are started untyped.)"""
        return pool, seat, pool
