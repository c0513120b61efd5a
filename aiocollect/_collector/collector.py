"""The collector: the public front of a run of worker processes (lifecycle, consuming, weights,
profiling, seeding). The run itself, its tasks and its state live in
:class:`aiocollect._collector.run.Run`, which never refers back to the front: a forgotten collector can be
garbage-collected, and its finalizer stops the run.

Events (``on``, ``subscribe``, ``wait_for``) come from the base it shares with the evaluator,
:class:`aiocollect._service.front.Service`; the blocking wrapper (``with``, ``for``, ``close()``) from
:class:`aiocollect._collector.blocking.BlockingMixin`; the work behind ``set_seed`` / ``state_dict`` /
``load_state_dict`` is :mod:`aiocollect._collector.resume`."""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Literal, Mapping, Sequence

import anyio

from .._service.env_calls import not_torchrl_map_fn
from .._service.portal import Portal
from .blocking import BlockingMixin
from .config import CollectorConfig
from .queue_sink import sink_for
from .._core.errors import AiocollectError, CollectorClosedError, ConfigError, EndOfCollection
from .._backends.seat import Backend
from .._worker.policy import PolicySpec, classify
from .._core.profiling import ProfileConfig
from .run import CollectorState, Run, State  # noqa: F401 - State re-exported
from .._service.front import Service, warn_unclosed
from .._service.options import takes_options
from .stats import CollectorStats
from .torchrl_names import TORCHRL_ATTRIBUTES, TORCHRL_NAMES
from .._core.public import public

if TYPE_CHECKING:  # tensordict is imported while the first collector starts (see _run)
    from tensordict import TensorDict


OTHER_NAMES = {
    "env": "pass the env id or factory first, or as create_env_fn=",
    "env_fn": "pass the env id or factory first, or as create_env_fn=",
    "env_kwargs": "use create_env_kwargs=",
    "num_envs": "envs_per_worker= sets the envs of each worker (num_workers * envs_per_worker in all)",
    "batch_size": "use frames_per_batch= (frames in each batch)",
    "total_steps": "use total_frames=",
    "max_episode_steps": "use max_frames_per_traj=",
    "sync": "use delivery='sync' (each batch from every worker) or delivery='async' (the first one ready)",
    "return_same_td": "zero_copy=True delivers views on the workers' shared memory, valid until the next batch",
    "out_keys": "use policy_out_keys= (the names of the tensors a plain nn.Module policy returns, in order)",
    **TORCHRL_NAMES,
}
"""Keywords a stranger may give the collector (other libraries' names) -> what to pass instead."""


@public
class Collector(Service, BlockingMixin):
    """Collects experience from gymnasium envs stepped in worker processes.

    Examples:
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

    **What is copied.** Workers write frames in place into preallocated shared-memory slots
    (every worker's rows of a slot side by side). A batch you receive is yours: it stays valid
    after the next one arrives, for as long as you keep it, and may be modified in place. It is
    lent without a copy while a slot can be spared (views on its slot, which goes back to the
    workers once nothing refers to the batch any more), else copied out of the slots (one
    contiguous copy per key); ``stats().batches_copied`` counts the copies. With
    ``zero_copy=True`` the batch is a view on the slots, valid until you ask for the next batch,
    kept or not (see :class:`CollectorConfig`).

    **Lifecycle.** ``async with Collector(...)`` starts on entry and closes on exit; or ``await
    start()`` / ``await aclose()`` (for notebooks: the collector's own tasks do not belong to the
    cell that started it). ``async for`` and :meth:`collect` start it if needed. :meth:`aclose`
    is idempotent, never leaves a process or shared-memory segment behind, and finishes (within
    ``shutdown_timeout`` plus a moment) even when the caller is being cancelled. A closed
    collector cannot be reopened. A plain ``with Collector(...) as c: for batch in c:`` runs the
    same code through an anyio blocking portal (an event loop in a helper thread).

    A collector belongs to the event loop that started it. One that is garbage-collected while
    running (a notebook cell re-run, ``break`` out of ``async for batch in Collector(...)``) is
    stopped by its finalizer, with a ``ResourceWarning``.

    **Errors.** Bad arguments raise :class:`ConfigError` here. An exception in a worker reaches
    the consumer as :class:`WorkerError` (original as ``__cause__``, worker traceback in the
    message); a worker killed from outside as :class:`BrokenWorkerError`, as soon as its pipe
    closes; a worker stuck in one call for longer than ``step_timeout`` as
    :class:`WorkerTimeoutError` (with its stack); data that does not match the env's spaces as
    :class:`SpecError`. Every failure first emits :class:`~aiocollect.events.WorkerFailed`.

    **Failures you survive.** With ``on_worker_failure="restart"`` a worker that raises, dies or
    hangs is replaced by a new process (a fork of the launcher, in well under a second) and the
    collection goes on: its unfinished batch is discarded (no delivered batch holds a frame of
    it), batches it completed before are delivered, its envs are made anew (reset with seeds
    derived from ``seed``, the worker index and the restart count: a run with restarts is
    reproducible only if the failures happen at the same points) and their new trajectories get
    fresh ids. :class:`~aiocollect.events.WorkerRestarted` follows ``WorkerFailed``; restarts
    are counted in :meth:`stats`. More than ``max_restarts`` within ``restart_window`` seconds
    raise the last error.

    **Vector envs.** ``create_env_fn`` may return a ``gymnasium.vector.VectorEnv`` (gymnasium's
    ``gym.make_vec(..., vectorization_mode="vector_entry_point")``, ``SyncVectorEnv``,
    ``AsyncVectorEnv``, EnvPool's ``envpool.make_gymnasium``): each worker steps its
    ``envs_per_worker`` copies as batched envs, and each sub-env is one row of the batch, so a
    batch has ``num_workers * envs_per_worker * num_envs`` rows, with the same data as that many
    single envs (true final observations, one trajectory id and episode event per sub-env, no
    frame of a "reset step"). ``num_envs`` is learned when the workers start; ``frames_per_batch``
    must then be a multiple of the number of rows (else :class:`ConfigError` at start). Vector
    envs that cannot give such data (next-step autoreset without a way to reset some sub-envs,
    an unknown autoreset mode) are refused with a :class:`SpecError`. See ``docs/vector-envs.md``.

    **Backends.** ``backend`` names where the workers run: ``"process"`` (the default with
    ``num_workers>=1``), ``"local"`` (``num_workers=0``) or ``"ray"`` (see
    :attr:`CollectorConfig.backend`). It also takes a backend object instead of a name, to plug
    in a fake pool of workers for tests or a backend of your own: any object with the members of
    ``aiocollect._backends.seat.Backend`` (``name``, ``weights_in_parent``, ``profiles``,
    ``serves_inference``, ``check_options``, ``warm_up``, ``start``, ``share_slots``); the config
    holds it, it checks its own options, and options of aiocollect's backends are refused for it.

    See :class:`CollectorConfig` for every option.
    """

    _closed_error = CollectorClosedError
    _ended = "the collector stopped"

    def __getattr__(self, name: str) -> Any:
        """Only for a name the collector lacks: TorchRL's methods and attributes say what to use
        instead (a ported script's ``collector.next()``, ``collector.is_running()`` ...)."""
        if name in TORCHRL_ATTRIBUTES:
            raise AttributeError(
                f"'Collector' object has no attribute {name!r} (TorchRL's collectors have): "
                f"{TORCHRL_ATTRIBUTES[name]} (docs/migrating-from-torchrl.md maps every method)",
                name=name, obj=self,
            )
        raise AttributeError(f"'Collector' object has no attribute {name!r}", name=name, obj=self)

    @takes_options(CollectorConfig, OTHER_NAMES)
    def __init__(self, *args: Any, **options: Any) -> None:
        # (every option is written once, in CollectorConfig: its type, default and docs)
        self.config = CollectorConfig(*args, **options)
        self._run = run = Run(self.config, self.config.chosen_backend)
        self._portal = portal = Portal(run)
        self._in_with = False
        # the run's tasks never refer to this object: when it is forgotten, this stops the run.
        # Once the run is closed (on every path: aclose(), a refused start ...) there is nothing to
        # stop, and the finalizer registry, a global, must not keep the run alive: its error's
        # traceback refers to the frames that started it, and through them to the caller's
        # batches (whose memory, lent slots, would stay mapped)
        self._finalizer = weakref.finalize(self, _finalize, run, portal)
        run.when_closed(self._finalizer.detach)
        _register_iterable_dataset(type(self))
        # let the backend prepare (the launcher import what the workers need) while the caller does other things
        run.warm_up(_needs(self.config))

    # -- public state -----------------------------------------------------------------------------
    @property
    def state(self) -> CollectorState:
        return self._run.state

    @property
    def frames(self) -> int:
        """Frames delivered so far (including those restored by :meth:`load_state_dict`)."""
        return self._run.frames

    @property
    def batches(self) -> int:
        """Batches delivered so far."""
        return self._run.batches

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Process ids of the running workers (empty for the local backend; with
        ``backend="ray"``, the actors' process ids on their nodes)."""
        return self._run.worker_pids

    @property
    def policy_version(self) -> int:
        """Latest weight version published (0: the weights the policy had at start). Each
        :meth:`update_weights` adds one."""
        return self._run.policy_version

    @property
    def worker_versions(self) -> tuple[int, ...]:
        """Per worker, the weight version it acknowledged applying (at a batch boundary)."""
        return self._run.worker_versions

    def __repr__(self) -> str:
        return _describe(self._run)

    def __len__(self) -> int:
        """The number of batches the collector delivers, ``total_frames // frames_per_batch``
        (TorchRL's ``len(collector)``). Raises ``TypeError`` for an endless collector
        (``total_frames=-1``) and under ``trajs_per_batch`` (how many batches hold the frames
        depends on the episodes' lengths)."""
        config = self.config
        if config.total_frames == -1:
            raise TypeError("len() of a Collector with total_frames=-1: it collects until you stop it, so it has no length")
        if config.trajs_per_batch is not None:
            raise TypeError(
                f"len() of a Collector with trajs_per_batch={config.trajs_per_batch}: how many batches hold "
                f"total_frames={config.total_frames} depends on the episodes' lengths"
            )
        return config.total_batches  # type: ignore[return-value]

    def __bool__(self) -> bool:
        return True  # (with __len__, an endless collector would otherwise raise in `if collector:`)

    # -- weights ----------------------------------------------------------------------------------
    async def update_weights(
        self,
        policy_or_weights: Any = None,
        *,
        worker_ids: Any = None,
        model_id: str = "policy",
        weights_dict: Mapping[str, Any] | None = None,
        wait: bool = True,
    ) -> int:
        """Publish new policy weights to the workers (or the inference server); returns the new
        version.

        ``policy_or_weights``: an ``nn.Module`` / ``TensorDictModule`` (its current weights, on
        whatever device it is now), a ``TensorDict`` of parameters
        (``TensorDict.from_module(policy)``), a state dict, or ``None`` for the weights of the
        ``policy`` given to the constructor. With worker inference they are copied once into
        shared memory; each worker applies the newest complete version at its next batch
        boundary (never within a batch, never half-written; an idle worker at once) and every
        frame it collects after that carries the version in ``("collector", "policy_version")``.
        With ``inference="server"`` they are copied into the server's own weights at once,
        between two forward passes, and every action chosen after that carries the new version.

        ``model_id`` names what the weights are for: ``"policy"`` (all of the workers' policy)
        or one of its submodules, ``"policy.<path>"`` with the path ``get_submodule`` takes
        (``"policy.actor"``, ``"policy.heads.0"``); the rest of the policy keeps its weights.
        ``weights_dict={model_id: weights, ...}`` updates several models as one version: a
        worker applies all of them at the same batch boundary or none.

        ``worker_ids`` limits the update to some workers (the others keep their weights); with
        one ``policy_factory`` per worker (distinct policies), it is how each gets its own.

        ``wait=True`` returns once every targeted worker that still collects applied it: once
        ``total_frames`` have been collected (the workers are done, though batches may still
        wait to be delivered) nothing is waited for, so the loop ``async for batch in c: ...;
        await c.update_weights(policy)`` ends cleanly. A worker being replaced after a failure
        is waited for (its replacement applies the newest version before its first batch).
        ``wait=False`` returns once published, after yielding to the event loop once. Called
        before the collector starts, it starts it.

        **On-policy training (PPO)**: with ``delivery="sync"`` and no ``prefetch``, call
        ``await collector.update_weights(policy)`` after each training step: every frame of the
        next batch is collected with the new version. Batches collected ahead (``prefetch=N``)
        still carry the version before the update (see ``("collector", "policy_version")``).

        The workers and the server run a copy of the policy: training the constructor's
        ``policy`` in place changes nothing they run until it is published: by this method, by
        ``update_at_each_batch=True`` or by the blocking ``update_policy_weights_()``. A
        collector whose policy was changed in place and that hands out another batch without an
        update in between says so once on the ``aiocollect`` logger (it reads the tensors'
        version counters and gradients: 1.5 µs per batch for a 4-64-2 MLP, 3 µs for a Nature
        CNN).

        Emits :class:`~aiocollect.events.WeightsUpdated`, then one
        :class:`~aiocollect.events.WeightsApplied` per worker (with its latency). Raises
        :class:`ConfigError` for arguments that do not fit the workers' policy (those that could
        not fit any policy before the collector starts; nothing is published then), and
        :class:`CollectorClosedError` after :meth:`aclose` or once a worker's failure stopped
        the collection.
        """
        return await self._run.update_weights(policy_or_weights, model_id, weights_dict, worker_ids, wait)

    # -- reaching into the workers' envs and policies --------------------------------------------
    # Each returns an awaitable in async code; called where no event loop runs (the blocking
    # wrapper: `with Collector(...)`), it blocks and returns the result. Calls that change the envs
    # (call, set_attr, map_fn) are applied one at a time, each between two env steps of every env it
    # names, and start a new env epoch (`env_epoch`): every frame whose step began after the call
    # returned carries it, or a later one, in ("collector", "env_epoch"). A call before the start
    # starts the collector. What an env raises is raised here as the worker's error (also an
    # instance of the env's exception type, with the worker's traceback); the workers go on.
    @property
    def env_epoch(self) -> int:
        """The env epoch of the latest ``call``, ``set_attr`` or ``map_fn`` (0: none yet): the
        frames an env steps after it applied carry it in ``("collector", "env_epoch")``."""
        return self._run.env_epoch

    def call(self, name: str, *args: Any, indices: Any = None, workers: Any = None, persist: bool = False,
             **kwargs: Any) -> Any:
        """Call the method ``name(*args, **kwargs)`` of every env (gymnasium's ``VectorEnv.call``,
        SB3's ``env_method``; an attribute that is not callable is returned as it is); its results,
        one per env row in row order. ``indices``: only those env rows (a batch's rows: each
        worker's envs in worker order, a vector env's sub-envs each a row); ``workers``: only
        the rows of those workers. ``persist=True``: a worker replaced after a failure calls it
        again on its new envs before its first batch (as ``set_attr`` always does).

        Examples:
            >>> await collector.call("set_level", 3)   # doctest: +SKIP
        """
        return self._awaitable_or_blocking("call()", lambda: self._reach(
            "call()", "call", name, args, kwargs, indices=indices, workers=workers, persist=persist))

    def get_attr(self, name: str, indices: Any = None, *, workers: Any = None) -> Any:
        """The attribute ``name`` of every env (looked up through gymnasium's wrappers, as
        gymnasium's vector envs do), one per env row in row order (``indices``, ``workers``: as
        :meth:`call`). A read: it starts no env epoch."""
        return self._awaitable_or_blocking("get_attr()", lambda: self._reach(
            "get_attr()", "get", name, indices=indices, workers=workers))

    def set_attr(self, name: str, values: Any, indices: Any = None, *, workers: Any = None) -> Any:
        """Set the attribute ``name`` of every env (through gymnasium's wrappers: the wrapper or
        env that has it): to ``values`` itself, or, for a list or tuple, to one value per env
        row (gymnasium's ``VectorEnv.set_attr``). Kept for the run: a worker replaced after a
        failure sets it on its new envs before its first batch. Returns the env epoch it started
        (see :attr:`env_epoch`).

        Examples:
            >>> epoch = await collector.set_attr("max_steps", 200)   # doctest: +SKIP
            >>> # every frame with batch["collector", "env_epoch"] >= epoch stepped with it
        """
        async def set_it() -> int:
            return (await self._run.reach(
                "set_attr()", "set", name, indices=indices, workers=workers, value=values))[1]
        return self._awaitable_or_blocking("set_attr()", set_it)

    def map_fn(self, fn: Callable[..., Any], *args: Any, indices: Any = None, workers: Any = None,
               persist: bool = False, **kwargs: Any) -> Any:
        """Call ``fn(env, *args, **kwargs)`` on every env in its worker (``fn`` travels with
        cloudpickle, as env factories do: a lambda works); its results, one per env row
        (``indices``, ``workers``, ``persist``: as :meth:`call`). A vector env's sub-envs are
        reached where it keeps them in its process (``SyncVectorEnv``). Not TorchRL's
        ``map_fn(method_name, list_of_args)`` (a method of each worker, one call per worker): a
        name raises a :class:`ConfigError` that shows the :meth:`call` to make instead."""
        not_torchrl_map_fn("map_fn()", fn)
        return self._awaitable_or_blocking("map_fn()", lambda: self._reach(
            "map_fn()", "fn", "", (fn, *args), kwargs, indices=indices, workers=workers, persist=persist))

    def getattr_env(self, attr: str) -> Any:
        """TorchRL's name: the attribute ``attr`` of the first env (env row 0); see :meth:`get_attr`
        for every env."""
        async def first() -> Any:
            return (await self._reach("getattr_env()", "get", attr, indices=[0]))[0]
        return self._awaitable_or_blocking("getattr_env()", first)

    def getattr_policy(self, attr: str) -> Any:
        """TorchRL's name: the attribute ``attr`` of the policy that acts, weights as last
        applied: worker 0's replica, or with ``inference="server"`` the inference server's own
        copy (in this process: the object itself, not a copy, read between two forward passes)."""
        async def first() -> Any:
            return (await self._reach("getattr_policy()", "policy", attr))[0]
        return self._awaitable_or_blocking("getattr_policy()", first)

    async def _reach(self, *args: Any, **kwargs: Any) -> list:
        return (await self._run.reach(*args, **kwargs))[0]

    # -- profiling and stats ---------------------------------------------------------------------
    def enable_profile(self, config: ProfileConfig | None = None, **kwargs: Any) -> ProfileConfig:
        """Profile chosen workers (and the collector's process) with ``torch.profiler``: pass a
        :class:`ProfileConfig` or its fields as keywords. Call it at any time (before start,
        right after entering ``async with``, between batches): it profiles the *next*
        ``num_rollouts`` rollouts of the chosen workers (the first ``warmup_rollouts`` of them
        unrecorded); a profile in progress is replaced. The constructor's ``profile=`` does the
        same from the start. Each trace file written emits
        :class:`~aiocollect.events.ProfileTraceReady`.

        Examples:
            >>> collector.enable_profile(workers=[0], num_rollouts=5, warmup_rollouts=2,   # doctest: +SKIP
            ...                          save_path="traces/worker_{worker_idx}.json")
        """
        if config is not None and not isinstance(config, ProfileConfig):
            raise ConfigError(f"config={config!r:.100} must be a ProfileConfig or None (then pass its fields as keywords)")
        if not self.config.chosen_backend.profiles:
            raise ConfigError(
                f"enable_profile(): backend={self.config.backend_name!r} does not support the profiler yet (its traces "
                f"are files on the workers' machines); use backend='process' to profile"
            )
        fields = {f.name for f in dataclasses.fields(ProfileConfig)}
        unknown = [k for k in kwargs if k not in fields]
        if unknown:
            raise ConfigError(
                f"enable_profile() got the keyword {unknown[0]}={kwargs[unknown[0]]!r:.60}, which is not a field of "
                f"ProfileConfig; pass some of {sorted(fields)}"
            )
        if config is None:
            config = ProfileConfig(**kwargs)
        elif kwargs:
            config = dataclasses.replace(config, **kwargs)
        bad = [w for w in config.workers if w >= self.config.workers]
        if bad:
            raise ConfigError(
                f"config=ProfileConfig(workers={list(config.workers)}) names workers {bad}, but this collector has "
                f"{self.config.workers} (indices 0..{self.config.workers - 1})"
            )
        self._run.enable_profile(config)
        return config

    def disable_profile(self) -> None:
        """Stop profiling: before start, nothing will be profiled; while running, recordings in
        progress are dropped without writing a trace."""
        self._run.disable_profile()

    def stats(self) -> CollectorStats:
        """Counters and timing so far: frames, batches, frames per second, episodes and their
        mean return, worker restarts, and seconds spent per stage (see :class:`CollectorStats`)."""
        return self._run.stats()

    # -- seeding and state ------------------------------------------------------------------------
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed the envs: env ``k`` (counted over all workers) is reset with ``seed + k`` (or
        ``seed`` itself with ``static_seed=True``), and a random policy samples each env's action
        space seeded the same way. The same seed, policy and settings give the same data whatever
        the number of workers. Call before the collector starts.

        Returns the next unused seed (``seed + number of envs``), to seed something else with.
        (With vector envs, whose number of sub-envs is known only once the collector started,
        it counts each vector env once: take ``state_dict()["next_seed"]`` after the start.)
        Raises :class:`ConfigError` for a seed below 0, or so large that a derived seed would
        pass torch's limit (``2**64 - 1``).
        """
        return self._run.set_seed(seed, static_seed)

    def state_dict(self) -> dict[str, Any]:
        """Counters to resume from: frames and batches delivered, the next trajectory number of
        each env (so trajectory ids stay unique after a resume), and the seeds."""
        return self._run.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume counters from :meth:`state_dict` (before start). ``total_frames`` counts the
        restored frames; envs are reset, seeded with the saved ``next_seed`` so that a resumed
        run does not replay the same episodes."""
        self._run.load_state_dict(state)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, replay_buffer: Any = None, *, queue: Any = None, close_queue: bool = True) -> None:
        """Start the workers and wait until they are ready (idempotent). Raises what a worker
        raised while starting (an env factory's error, a :class:`SpecError` ...).

        Cancelling a waiting ``start()`` does not stop the start-up: a later ``start()`` takes
        it from there. :meth:`aclose` ends it, as does a cancelled ``async with`` entry (which
        closes the collector), even one stuck in an env factory that never returns: control
        comes back within about a second (nothing was collected yet): workers still in their env
        factories get half a second, then are killed, and workers that built their envs get
        ``shutdown_timeout`` seconds to close them (with the local backend, whose factories run
        in a thread of this process, the factory is left to finish there and what it builds is
        closed). When the start-up fails or is cancelled, none of its worker processes is alive
        any more by the time the error reaches the caller.

        With ``replay_buffer`` (any object with ``extend(batch)``, sync or async: an
        :class:`~aiocollect.ReplayBuffer`, a TorchRL buffer ...) the collector collects in the
        background and writes every batch into it, until ``total_frames`` or :meth:`aclose`;
        :meth:`pause` holds the writes. Errors (of the workers or of ``extend``) are raised by
        :meth:`aclose`. Batches then go to the buffer only: :meth:`collect` refuses. Pass it at
        the first start, or on a started collector whose batches nobody asked for yet (``async
        with Collector(...) as c: await c.start(replay_buffer=rb)``): every batch, those collected
        ahead meanwhile included, goes to the buffer. Once a batch was asked for (:meth:`collect`,
        ``async for``), or with a buffer or queue already attached, it raises
        :class:`AiocollectError`.

        With ``queue`` (instead of ``replay_buffer``: an ``asyncio.Queue``, the send side of
        ``anyio.create_memory_object_stream()`` or of ``trio.open_memory_channel()``) every batch
        is put into your queue (``await put`` / ``await send``), in order, so that several
        consumer tasks share one collector. A full queue holds the collector as a slow buffer
        does: ``collector.batches`` (counting a batch waiting to be put) is at most the queue's
        size plus one ahead of what your consumers took; the workers then stop once ``prefetch``
        batches and their slots are full. When the delivery ends (``total_frames``, a failure, a failed start, :meth:`aclose`,
        which cancels a pending put) the collector closes the queue if ``close_queue`` (the
        default): a stream or channel is closed, so its receivers' ``async for`` ends after the
        batches still in it; an ``asyncio.Queue`` is shut down (``get()`` raises
        ``asyncio.QueueShutDown`` once it is empty) where Python has ``Queue.shutdown`` (3.13+),
        else left open (stop its consumers yourself; ``len(collector)`` says how many batches
        come). Pass ``close_queue=False``, or a ``clone()`` of a stream, to keep it open. Errors
        are raised by :meth:`aclose`, as with a replay buffer. A queue nobody can take from (its
        receivers all closed, or closed or shut down by you) ends the delivery: the collector
        stops as at ``total_frames``, and :meth:`aclose` raises nothing for it.
        """
        await self._run.start(sink_for(replay_buffer, queue, close_queue))

    async def __aenter__(self) -> "Collector":
        try:
            await self._run.start()
        except BaseException:
            # cancelled (or failed) on entry: nobody will call __aexit__, so close here
            with anyio.CancelScope(shield=True):
                try:
                    await self._run.aclose()
                except Exception:  # noqa: BLE001 - the entry's own error (or cancellation) wins
                    pass
            raise
        return self

    def _closing(self, closer: str) -> None:
        self._run.note_closer(closer)  # (named by CollectorClosedError's messages)

    async def aclose(self) -> None:
        """Stop the workers (each gets ``shutdown_timeout`` seconds to close its envs, then is
        killed), free the shared memory and close the stream. Idempotent; shielded from
        cancellation. Raises an error of the workers that no consumer has seen yet."""
        await self._run.aclose()  # (closed, the run lets go of the finalizer: RunState.on_closed)

    # -- consuming --------------------------------------------------------------------------------
    async def collect(self) -> "TensorDict":
        """The next batch (starting the collector if needed).

        Raises :class:`EndOfCollection` once ``total_frames`` have been delivered, a worker's
        error if one failed, :class:`CollectorClosedError` after :meth:`aclose`. Cancelling a
        waiting call loses no frame: the batch goes to the next call.
        """
        run = self._run
        if run.state is CollectorState.CREATED:
            await run.start()
        if run.writes_to_sink:
            raise AiocollectError(
                "this collector writes its batches into a replay buffer or a queue (start(replay_buffer=...) or "
                "start(queue=...)); sample from the buffer, or take from the queue, instead of collecting"
            )
        return await run.consume()

    def pause(self) -> Any:
        """``async with collector.pause():`` no batch is delivered, and nothing is written into
        the replay buffer, until the block exits (a write in progress finishes first). Workers
        stop once their slots are full (backpressure); nothing is lost: held batches follow
        after the pause. Pauses nest."""
        return self._run.pause()

    @property
    def paused(self) -> bool:
        return self._run.paused

    def __aiter__(self) -> AsyncIterator["TensorDict"]:
        return self

    async def __anext__(self) -> "TensorDict":
        try:
            return await self.collect()
        except EndOfCollection:
            raise StopAsyncIteration from None


def _register_iterable_dataset(cls: type) -> None:
    """A collector is a ``torch.utils.data.IterableDataset`` (a virtual subclass, as TorchRL's
    collectors are real ones), so that ``DataLoader(collector, batch_size=None)`` iterates it
    (blocking) instead of indexing it. torch is imported here anyway: batches are TensorDicts."""
    if cls not in _registered:
        from torch.utils.data import IterableDataset

        IterableDataset.register(cls)
        _registered.add(cls)


_registered: set[type] = set()


def _describe(run: Run) -> str:
    c = run.config
    return (
        f"<Collector {c.create_env_fn!r} {run.state.value}: {c.num_workers} workers x "
        f"{c.envs_per_worker} envs, {c.frames_per_batch} frames/batch, {run.frames} frames>"
    )




def _needs(config: CollectorConfig) -> Any:
    """What the workers will import for this config's policy (the backend prepares it early)."""
    if config.inference == "server" or (config.policy is None and config.policy_factory is None):
        kind = "server" if config.inference == "server" else "random"  # (no torch in the workers)
    else:
        kind = "factory" if config.policy is None else classify(config.policy)[0]
    return PolicySpec(kind).needs

def _finalize(run: Run, portal: Portal) -> None:  # (a finalizer: must not refer to the collector)
    """The collector was garbage-collected (or the interpreter exits): stop what it left running."""
    active = run.task is not None and not run.done.is_set()
    name = _describe(run)
    if portal.portal is not None:
        try:
            portal.portal.call(run.aclose)
        except BaseException:  # noqa: BLE001 - nothing to report it to
            pass
        portal.close()
    elif active:
        run.abandon()
    if active:
        warn_unclosed(name, "Collector")


__all__ = ["Collector", "CollectorState", "CollectorStats", "State"]
