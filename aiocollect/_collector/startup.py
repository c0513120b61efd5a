"""Starting and stopping one run's worker pool: the policy as the workers get it, their rollout
configs, the workers (started by the run's backend: :class:`~aiocollect._backends.seat.Backend`),
the slots' shared memory and the weight store; and taking it all down again. The run's lifecycle
(:class:`~aiocollect._collector.run.Run`) calls these from its task, on the state the run's parts
share (:class:`~aiocollect._collector.run_state.RunState`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import anyio

from .._core import heartbeat as _heartbeat
from .._core import shm as _shm
from .._core.affinity import crowded, spare_one_cpu
from .._core.quick_import import import_module
from .._core.errors import AiocollectError, SpecError
from .._core.layout import SlotLayout, frame_leaves
from .._worker.policy import PolicySpec, describe
from .env_factories import check_same_spaces, env_ids, has_factory_list, worker_factories
from .producer import whole_slots
from .._service.resource import in_own_thread
from .._worker.rollout import RolloutConfig
from .._worker.vector import learn_sub_envs
from .._backends.seat import Launch, Sharing

if TYPE_CHECKING:
    from .run_state import RunState


async def import_in_thread(module: str, give_up_after: float | None = None) -> None:
    """Import ``module`` in a thread of its own that ends with the import, while the event loop
    keeps running. For tensordict's import while the workers start (without torch._dynamo:
    :mod:`~aiocollect._core.quick_import`); torch's import code still holds the GIL for up to
    ~0.1 s at times. Cancelled, it waits ``give_up_after`` seconds more for the import, then
    leaves it to finish in its thread."""
    await in_own_thread(lambda: import_module(module), f"aiocollect import {module}", give_up_after=give_up_after)


def _free_unlent_slots(run: "RunState") -> None:
    """The workers are gone, and batches lent to the consumer keep the slots' segment mapped for
    as long as it keeps them: free the memory of every other slot, and of the heartbeats, now."""
    layout = run.slots.layout
    lent = {slot for loan in run.producer.loans.out for _, slot in loan.parts}  # type: ignore[union-attr]
    mapping = run.slots.segment[1]  # type: ignore[index]
    for slot in range(layout.num_slots):  # type: ignore[union-attr]
        if slot not in lent:
            _shm.discard(mapping, slot * layout.slot_nbytes, layout.slot_nbytes)  # type: ignore[union-attr]
    _shm.discard(mapping, layout.nbytes, len(mapping) - layout.nbytes)  # type: ignore[union-attr]


async def stop_workers(run: "RunState") -> None:
    """Stop every worker (killed after shutdown_timeout), release the slots' segment and the
    weight stores; also when the event loop is going away (nothing awaited then)."""
    workers = run.workers
    run.workers_ready = False
    try:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for w in workers:
                    tg.start_soon(w.stop, run.config.shutdown_timeout)
    except BaseException:
        for w in workers:  # the event loop is going away: no more awaiting
            w.stop_nowait()
        raise
    finally:
        run.sync.close()
        if run.server is not None:  # (after the workers: none waits for an answer now)
            run.stats.server = run.stats.server_totals(run.server)
            run.server.stop()
            run.server = None
        slots = run.slots
        if slots.segment is not None:  # (the mapping stays while batch views use it)
            if run.producer is not None and run.producer.loans.out:
                _free_unlent_slots(run)
            os.close(slots.segment[0])
            slots.segment = None
        slots.views = []
        if run.producer is not None:
            run.producer.pool.clear()
            run.producer.loans.clear()  # (a lent batch the consumer keeps keeps its mapping itself)


async def launch_workers(run: "RunState") -> None:
    """Start the workers (in-process for ``num_workers=0``), learn their batch leaves, lay out
    and share the slots and the weight store; the run is then ready to grant credits."""
    c = run.config
    run.configs = rollout_configs(run, worker_policy_specs(run))
    needs = tuple(sorted({n for cfg in run.configs for n in cfg.policy.needs}))
    launch = Launch(run.configs, needs, c.shutdown_timeout, c.ray_actor_options, c.policy, c.factory_for(0))
    workers, specs = await run.backend.start(launch)
    run.workers = list(workers)
    slots = run.slots
    slots.sub_envs = learn_sub_envs(specs, c, run.counts.start_counters, run.seeding.seed)
    check_same_spaces(specs, run.configs)
    batch_specs = [{k: v for k, v in s.items() if k not in ("weights", "spaces")} for s in specs]
    for i, s in enumerate(batch_specs[1:], 1):
        if s != batch_specs[0]:
            raise SpecError(
                f"worker {i} reports batch leaves {s} but worker 0 reports {batch_specs[0]}: every env "
                f"must have the same spaces and every worker's policy the same outputs"
            )
    extras = specs[0]["extras"]
    if c.inference == "server":
        extras = await start_server(run, specs[0])
    leaves = frame_leaves(specs[0]["obs"], specs[0]["act"], extras, step_count=c.max_frames_per_traj is not None,
                          env_fn_index=has_factory_list(c))
    slots.layout = SlotLayout.build(leaves, run.rows_per_worker, c.frames_per_row(slots.sub_envs), c.num_slots,
                                    len(run.workers))
    # the real bytes per frame are known now: refuse a run whose slots cannot fit, before any is filled
    c.check_slot_memory(slots.layout, len(run.workers) * _heartbeat.NBYTES)
    store_fds = run.sync.setup([s.get("weights") for s in specs], run.workers)
    sharing = Sharing(slots.layout, run.sync.store, store_fds, c.step_timeout is not None)
    slots.segment = await run.backend.share_slots(run.workers, sharing)
    slots.views = whole_slots(slots.layout, slots.segment[1])
    if run.server is not None:
        run.server.start()
    run.workers_ready = True
    run.profiling.start()
    if c.progress:
        from .._service.progress import make_bar

        run.bar = make_bar(c.total_frames, run.counts.frames)


async def start_server(run: "RunState", spec: dict) -> list:
    """Server inference: the server for the workers' spaces (the policy built here from
    ``policy_factory`` if there is no ``policy``), its shared memory and each worker's link to
    it. Returns the policy's extra outputs (part of the batch layout)."""
    from .inference_server import InferenceServer

    c = run.config
    policy = c.policy if c.policy is not None else c.factory_for(0)()  # type: ignore[misc]
    groups = c.worker_groups
    server = InferenceServer(policy, spec, len(run.workers) * groups, run.rows_per_worker // groups, c.exploration_type,
                             c.devices["policy_device"], c.compile_policy, c.cudagraph_policy, c.env_batch_size,
                             server_priority(c), c.state_leaves, c.server_weights, out_keys=c.policy_out_keys)
    run.server = server
    run.sync.serve(server)
    extras = server.probe()
    if c.compile_policy is not False or c.cudagraph_policy is not False:  # (compiling takes seconds)
        await in_own_thread(server.warm_up, "aiocollect server warm-up")
    server.allocate(extras)
    for w in run.workers:
        w.server_link = server.link(w.index, groups)  # type: ignore[attr-defined]
    return extras


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


def worker_policy_specs(run: "RunState") -> list[PolicySpec]:
    """The policy as each worker gets it: the local rollout's own (``num_workers=0``: the
    collector's policy itself, or random), else one spec pickled once for every worker, or one
    per worker with a factory of its own."""
    c = run.config
    if c.num_workers == 0:
        local_policy = c.policy is not None or c.factory_for(0) is not None
        named: dict[str, Any] = {} if c.policy_out_keys is None else {"out_keys": c.policy_out_keys}
        return [PolicySpec("local" if local_policy else "random", exploration_type=c.exploration_type, state=c.state_leaves,
                           **named)]
    if isinstance(c.policy_factory, tuple):
        return [policy_spec(run, i) for i in range(c.workers)]
    return [policy_spec(run, None)] * c.workers  # one spec for every worker: pickled once


def policy_spec(run: "RunState", worker: int | None) -> PolicySpec:
    """The policy as sent to a worker (``worker``: the index of its own factory, if any)."""
    c = run.config
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


def rollout_configs(run: "RunState", policy_specs: list[PolicySpec]) -> list[RolloutConfig]:
    from .._core.registry import snapshot

    c = run.config
    counters = tuple(run.counts.start_counters) if run.counts.start_counters else None
    # ids registered in this process, for the workers: packed once, sent to each as bytes
    ids = env_ids(c)
    registry = snapshot(ids[0] if ids else None) if c.num_workers else ()
    return [
        RolloutConfig(
            **worker_factories(c, i),
            policy=policy_specs[i],
            worker=i,
            envs_per_worker=c.envs_per_worker,
            total_envs=c.total_envs,
            frames_per_env=c.frames_per_env,
            seed=run.seeding.seed,
            static_seed=run.seeding.static_seed,
            max_frames_per_traj=c.max_frames_per_traj,
            random_steps=max(c.random_steps - run.counts.frames // c.total_envs, 0),
            reset_at_each_iter=c.reset_at_each_iter,
            traj_counters=counters,
            registry=registry,
            check_finite=c.check_finite,
            action_bounds=c.action_bounds,
            worker_groups=c.worker_groups,
            cpus=worker_cpus(c, i),
            one_hot_actions=not c.categorical_action_encoding,
            decorrelation_steps=c.max_decorrelation_steps,
        )
        for i in range(c.workers)
    ]


__all__ = ["import_in_thread", "launch_workers", "policy_spec", "rollout_configs", "stop_workers", "worker_policy_specs"]
