"""The collector's options: one frozen dataclass, each field typed, defaulted and documented, and
every invalid value or combination rejected at construction."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from .._core.datachecks import ActionBounds
from .._core.errors import ConfigError, user_stacklevel
from .._core.profiling import ProfileConfig
from .._core.geometry import Geometry
from .._core.limits import MIN_FRAME_NBYTES, check_fits_in_memory
from .._service.options import (
    POLICY_STATE,
    RAY_PLACES_ACTORS,
    RESTART_OPTIONS,
    Needs,
    as_whole_number,
    check_bool,
    check_choice,
    check_data_options,
    check_env_id,
    check_int,
    check_needs,
    check_platform,
    env_factory_fix,
    check_policy_args,
    check_recurrent_state,
    check_sendable_to_workers,
    check_worker_count,
    exploration_name,
    format_size,
    multiples_around,
    positive_int,
    positive_seconds,
)
from .._core.public import public
from .env_factories import check_env_factories, env_ids, listed

if TYPE_CHECKING:  # pragma: no cover
    from .._backends.seat import Backend

_SERVER = "inference", ("server",)

MODE_OPTIONS: tuple[Needs, ...] = (
    Needs("worker_groups", 1, *_SERVER, "alternates groups of envs around the inference server's forward passes",
          "use inference='server' (with worker inference each worker acts for all its envs)"),
    Needs("env_batch_size", None, *_SERVER, "sizes the inference server's forward passes",
          "use inference='server' (worker inference runs one pass per worker over its own envs)"),
    Needs("server_priority", "auto", *_SERVER, "is the priority of the inference server's thread",
          "use inference='server' (with worker inference there is no server)"),
    Needs("server_weights", "copy", *_SERVER, "chooses what the inference server's forward passes run",
          "use inference='server' (worker inference runs a copy of the policy in each worker)"),
    Needs("compile_policy", False, *_SERVER, "wraps the policy the inference server runs",
          "use inference='server' (worker inference runs a plain copy of the policy in each worker)"),
    Needs("cudagraph_policy", False, *_SERVER, "wraps the policy the inference server runs",
          "use inference='server' (worker inference runs a plain copy of the policy in each worker)"),
    Needs("ray_actor_options", None, "backend_name", ("ray",), "sets the options of the workers' Ray actors",
          "pass backend='ray' or drop it", label="backend"),
    Needs("worker_cpus", None, "backend_name", ("process",), "places the worker processes on CPUs", {
        "local": "with num_workers=0 the envs run in this process; use num_workers>=1, or set this process's CPUs "
                 "yourself (os.sched_setaffinity(0, cpus))",
        "ray": RAY_PLACES_ACTORS,
        None: "pass backend='process' or drop it",
    }, label="backend"),
    Needs("step_timeout", None, "backend_name", ("process", "ray"), "declares a worker hung after that long", {
        "local": "with num_workers=0 the envs step in the event loop's own thread, where a hung env cannot be watched "
                 "or killed; use num_workers>=1",
        None: "its workers are not watched for hangs; use backend='process' or 'ray', or drop it",
    }, label="backend"),
    *RESTART_OPTIONS,
    Needs("traj_format", "pad", "trajs_per_batch", None, "lays out the complete episodes of trajs_per_batch",
          "pass trajs_per_batch=<episodes per batch> too, or drop traj_format (split_trajs always pads)"),
    POLICY_STATE,
    Needs("policy_out_keys", None, "policy_or_factory", None, "names the tensors a plain nn.Module policy returns",
          "pass the policy (policy= or policy_factory=), or drop policy_out_keys (random actions have no outputs to "
          "name)", label="policy"),
    Needs("max_decorrelation_steps", 0, "reset_at_each_iter", (False,), "staggers the envs' episodes before the first "
          "batch", "reset_at_each_iter=True resets every env at each batch, all in step again: drop one of them"),
)
"""The collector's options that mean something only under another setting: each set without it
is refused, naming both (checked in this order, once the settings themselves are valid)."""


@public
@dataclasses.dataclass(frozen=True)
class CollectorConfig:
    """Every option of :class:`~aiocollect.Collector`, checked and frozen.

    ``Collector(env, policy, **options)`` builds one and keeps it as ``collector.config``; each
    keyword of the constructor is a field here, with the same name, type and default. Invalid
    values and combinations raise :class:`ConfigError` at construction, before any process
    starts; an option that needs another setting (``worker_groups`` needs
    ``inference="server"``) names both.

    The options by what they decide:

    - what to collect: ``create_env_fn``, ``policy``, ``policy_factory``, ``frames_per_batch``,
      ``total_frames``, ``max_frames_per_traj``, ``init_random_frames``, ``seed``;
    - where it runs: ``num_workers``, ``envs_per_worker``, ``backend``, ``inference``,
      ``policy_device``, ``storing_device``, ``worker_cpus``;
    - how batches arrive: ``delivery``, ``prefetch``, ``zero_copy``, ``split_trajs``,
      ``trajs_per_batch``, ``postproc``;
    - what happens on failure: ``on_worker_failure``, ``max_restarts``, ``step_timeout``.

    Every option with its default and meaning: ``docs/options.md`` (generated from these
    fields' docs), or ``help(aiocollect.CollectorConfig)``.

    Examples:
        >>> config = CollectorConfig("CartPole-v1", frames_per_batch=256, num_workers=2)
        >>> config.delivery, config.inference
        ('sync', 'worker')
    """

    create_env_fn: Any
    """A gymnasium env id (``"CartPole-v1"``) or a callable returning a ``gymnasium.Env``, or a
    ``gymnasium.vector.VectorEnv`` whose sub-envs are then rows of the batch (see
    ``docs/vector-envs.md``); lambdas and classes defined in ``__main__`` or a notebook work: it
    travels with cloudpickle. A list (TorchRL's ``create_env_fn=[f1, f2, ...]``) gives each worker
    its own (``num_workers`` entries) or each env its own (``num_workers * envs_per_worker``; with
    ``num_workers=0``, ``envs_per_worker``); each row of a batch then says which one made its env in
    ``("collector", "env_fn_index")``. Every env must have the same spaces.
    Ids registered in this process (``gymnasium.register``, or by importing a plugin such as
    ``ale_py``) can be made in the workers, by id or by a callable that calls ``gymnasium.make``:
    the registry is sent to them at each start."""
    policy: Any = None
    """``None`` (random actions from the action space), a ``TensorDictModule``, a plain ``nn.Module``
    on the observation tensor, or any callable taking and returning a TensorDict."""
    _: dataclasses.KW_ONLY  # the rest by keyword only, as Collector() and TorchRL's collectors take them
    frames_per_batch: int
    """Frames in each delivered batch; a multiple of the number of envs that fill it."""
    total_frames: int | None = -1  # (None, as TorchRL, is taken as -1 when checked)
    """Frames to collect in all; ``-1`` (or ``None``, as TorchRL) collects forever. Not a multiple of ``frames_per_batch``:
    rounded up to the next whole batch, with a warning (as TorchRL's collectors do)."""
    num_workers: int = 1
    """Worker processes (Ray actors with ``backend="ray"``); ``0`` runs the envs in the
    collector's process (local backend)."""
    envs_per_worker: int = 1
    """Envs stepped by each worker (batched through the policy together)."""
    delivery: Literal["sync", "async"] = "sync"
    """``"sync"``: each batch holds frames from every worker, ordered by worker. ``"async"``: each
    batch is the first worker batch ready."""
    inference: Literal["worker", "server"] = "worker"
    """Where the policy runs: ``"worker"``, a replica in each worker (on CPU, one torch thread
    each); ``"server"``, the policy object itself in this process, one batched forward pass over
    the envs of every worker that waits for actions (workers step envs only and never import
    torch). See ``docs/inference.md``."""
    create_env_kwargs: dict | Sequence[dict] | None = None
    """Keyword arguments for ``create_env_fn`` (or ``gymnasium.make``): one dict for every env, or a
    list of one per worker or per env (as a list of ``create_env_fn``)."""
    policy_factory: Callable[[], Any] | Sequence[Callable[[], Any]] | None = None
    """Builds the policy inside each worker instead of copying ``policy``: one callable for every
    worker, or a list of one per worker (distinct policies, e.g. one per agent or league member;
    they must produce the same outputs, and :meth:`Collector.update_weights` with ``worker_ids``
    updates each one's weights)."""
    policy_out_keys: Sequence[str | tuple[str, ...]] | None = None
    """Names of the tensors a plain ``nn.Module`` policy returns as a tuple, in order, ``"action"``
    among them (what a ``TensorDictModule``'s ``out_keys`` would say): with
    ``policy_out_keys=["action", "sample_log_prob", "state_value"]`` a module returning
    ``(action, log_prob, value)`` steps the envs with ``action`` and the batch holds all three
    under those names. ``None``: a module returns the action alone, or a dict of tensors that
    names its outputs itself (``{"action": a, "sample_log_prob": lp, "state_value": v}``; it must
    hold ``"action"``). Worker and server inference alike; refused for a TensorDict policy, which
    names its outputs itself."""
    max_frames_per_traj: int | None = None
    """Truncate episodes after this many frames (``("next", "truncated")`` is set); ``None`` (or
    TorchRL's ``-1``): no limit."""
    init_random_frames: int | None = None
    """Frames (in all) collected with random actions before the policy is used; ``None`` (or
    TorchRL's ``-1``): none."""
    reset_at_each_iter: bool = False
    """Reset every env at the start of each batch."""
    split_trajs: bool = False
    """Deliver ``[n_traj, max_len]`` padded trajectories with a ``("collector", "mask")``."""
    exploration_type: str = "random"
    """tensordict interaction type the policy runs under: random, deterministic, mode, mean, median."""
    progress: bool = False
    """Show a progress bar (needs tqdm: ``pip install 'aiocollect[progress]'``). In Jupyter it stays
    in the cell that starts the collector: a widget with ipywidgets (``aiocollect[notebook]``), a
    text line updated in place without."""
    seed: int | None = None
    """Seed of env 0; env ``k`` gets ``seed + k``. Same as calling :meth:`Collector.set_seed`."""
    prefetch: int = 0
    """Batches the workers may collect ahead of the consumer's requests. ``0`` (the default):
    with ``delivery="sync"`` no env steps between handing out a batch and the next request, as
    TorchRL's ``MultiSyncCollector``, so the loop "train on the batch, ``update_weights``, next batch"
    is on-policy: every frame of the next batch carries the version published before it was asked
    for. ``N > 0`` collects ``N`` batches ahead while you train: more frames per second when training
    takes a while (the envs need not wait for it), at a cost in staleness: a batch handed out after an
    update may have been collected up to ``N`` versions before it (see ``("collector",
    "policy_version")``), and more shared memory: each worker has 4 batch slots with
    ``prefetch=0``, ``2 * prefetch + 3`` above (without ``zero_copy``).
    ``delivery="async"`` (TorchRL's ``MultiAsyncCollector``, off-policy by nature) lets each worker
    run ``max(2, prefetch + 1)`` batches ahead of those taken and assembles ``prefetch`` more: after
    an update at most that many carry older weights."""
    zero_copy: bool | Literal["debug"] = False
    """Deliver each batch as views on the workers' shared memory that are handed back at the next
    request, kept or not (TorchRL's ``return_same_td``, without the reuse of one TensorDict).
    The default (``False``) also lends batches without a copy, while slots can be spared, but
    hands a slot back only once nothing refers to the batch, and copies when the consumer keeps
    too many; ``True`` guarantees no copy with one extra slot per worker. A batch stays valid until the
    consumer asks for the next one (the next ``async for`` step or ``collect()``) or the collector
    closes; then its memory goes back to the workers, which write new frames into it. Keep data
    longer by copying it (``batch.clone()``, ``replay_buffer.extend(batch)``). Never write into it.
    ``"debug"``: reading a batch after it was handed back crashes the process with a traceback
    (the memory is protected) instead of silently reading newer frames."""
    shutdown_timeout: float = 5.0
    """Seconds a worker gets to close its envs and exit before it is killed. A start-up that is
    cancelled (Ctrl-C, a cancel scope, :meth:`Collector.aclose`) or fails gives control back
    within about a second, even one stuck in an env factory: a worker still in its env factories
    has nothing to close yet and gets half a second (at most this), then is killed; one that built
    its envs gets these seconds to close them. With the local backend a factory runs in a thread,
    which cannot be killed: it is left to finish there, and what it builds is closed."""
    postproc: Callable[[Any], Any] | None = None
    """Transforms each batch before delivery (sync or async; returns the batch to deliver)."""
    update_at_each_batch: bool = False
    """Publish the weights of ``policy`` (the collector's reference) before each batch."""
    frames_per_update: int | None = None
    """Background collection (``start(replay_buffer=...)``, ``start(queue=...)``) only: collect at
    most this many frames per ``update_weights()`` call, the replay ratio off-policy methods tune
    (SB3's ``train_freq`` with ``gradient_steps``; with ``G`` gradient steps per update and
    ``B`` frames per sample, ``G * B / frames_per_update`` is how often each frame is replayed).
    The workers get this many frames before the first call and this many more after each, so the
    frames written are ``frames_per_update * (updates + 1)``, rounded down to whole batches
    (``frames_per_batch``); collection waits for the next update meanwhile. ``None`` (the
    default): as fast as the workers go."""
    trajs_per_batch: int | None = None
    """Deliver batches of this many complete episodes (instead of ``frames_per_batch`` frames)."""
    traj_format: Literal["pad", "padded", "cat"] = "pad"
    """With ``trajs_per_batch``: ``"pad"`` gives ``[N, max_len]`` with ``("collector", "mask")``,
    ``"cat"`` the trajectories one after another, ``[sum of lengths]``. ``"padded"`` (TorchRL's
    spelling) is taken as ``"pad"``."""
    on_worker_failure: Literal["raise", "restart"] = "raise"
    """What a worker's failure (an exception, its death, a hang past ``step_timeout``) does:
    ``"raise"`` ends the collection with the error; ``"restart"`` replaces the worker and goes on
    (at most ``max_restarts`` times within ``restart_window`` seconds)."""
    max_restarts: int = 3
    """With ``on_worker_failure="restart"``: replacements allowed within ``restart_window``; one
    more failure raises."""
    restart_window: float | None = 60.0
    """Seconds over which ``max_restarts`` counts (``None``: the whole run)."""
    step_timeout: float | None = None
    """Seconds a worker may spend in one env ``step``/``reset`` or one policy call before it is
    declared hung (:class:`WorkerTimeoutError`, or a restart). ``None``: never."""
    profile: ProfileConfig | None = None
    """A :class:`ProfileConfig`: profile from the start (same as :meth:`Collector.enable_profile`)."""
    check_finite: bool = False
    """Raise :class:`SpecError` on NaN or +-inf in an observation, a reward or a policy's action
    (a vectorized check per step and key; off by default)."""
    action_bounds: ActionBounds = "pass"
    """A policy's action outside its Box space's bounds: ``"pass"`` gives it to the env as it is,
    ``"clip"`` gives the env ``np.clip(action, low, high)`` (the batch keeps the policy's action),
    ``"error"`` raises :class:`SpecError`. Random actions are never touched."""
    device: Any = None
    """Fills ``policy_device`` and ``storing_device`` where they are not given (TorchRL's
    meaning; the envs always step on the CPU)."""
    policy_device: Any = None
    """Where the policy runs: ``"cpu"``, or a CUDA device with ``inference="server"`` (the
    server's copy of the weights lives there; your module stays where it is). ``None``: worker
    inference on the CPU; the server where the policy's parameters are."""
    env_device: Any = None
    """Gymnasium envs step on the CPU: ``None`` or ``"cpu"``."""
    worker_groups: int = 1
    """``inference="server"``: ``2`` splits each worker's envs into two groups that alternate, so
    that the server computes one group's actions while the worker steps the other (rlpyt's
    ``AlternatingSampler``); ``envs_per_worker`` must be even. Single envs only."""
    env_batch_size: int | None = None
    """``inference="server"``: a forward pass waits until at least this many envs wait for actions
    (whole workers' envs; or until every other worker is between batches), instead of serving
    whoever waits at once (``None``). Larger passes for a GPU, without a slow worker stalling the
    others for longer than it takes ``env_batch_size`` envs to be ready."""
    server_priority: Literal["auto", "normal", "idle"] = "auto"
    """``inference="server"``: the scheduling priority of the server's thread. ``"auto"`` (the
    default) decides from the CPUs this process may use: with fewer than the busy threads (the
    workers, your event loop and the server's thread: 2 workers on 2 cores), the server's thread
    runs as with ``"idle"`` and the workers are kept off one CPU (unless ``worker_cpus`` places
    them): your loop's wake-ups then wait neither for forward passes nor for env steps, and on a
    machine with nothing else to do collection is as fast (see the benchmarks page); should that
    thread wait for a CPU more than 60% of the time (training on the CPU beside it, other
    programs), it goes back to normal priority by itself, so collection never stalls as it can
    under ``"idle"``; with enough CPUs, ``"normal"``. ``"normal"``: the kernel's usual
    share. ``"idle"`` runs it under Linux's ``SCHED_IDLE``: it gives way at once to any other
    thread that wants its core (see ``docs/inference.md``); on a machine busy with other work it
    only gets the CPU left over, and collection all but stops (a warning on the ``aiocollect``
    logger says so)."""
    server_weights: Literal["copy", "shared"] = "copy"
    """``inference="server"``: what the server's forward passes run. ``"copy"`` (the default): a
    copy of the policy's weights of its own, on ``policy_device``; your module stays where and what
    you made it, and :meth:`Collector.update_weights` is the only way new weights reach a forward
    pass, so train the module in place as you like and every frame's ``policy_version`` names the
    weights that chose it. It costs one more copy of the weights on ``policy_device`` (see the
    benchmarks page for an update's latency). ``"shared"`` runs your module object itself (moved to
    ``policy_device`` in place), for a policy too large for a second copy: then an in-place change
    (an optimizer's ``step()``) reaches the next forward pass before ``update_weights`` makes its
    version, and a pass that runs during the step can read half-updated weights; train a copy and
    pass its weights (``update_weights(trained.state_dict())``) to keep versions exact."""
    compile_policy: bool | dict = False
    """``inference="server"``: run the policy through ``torch.compile`` (``True``, or a dict of
    its keyword arguments); compiled during start-up, for every number of rows a forward pass can
    have (not counted as collection)."""
    cudagraph_policy: bool | dict = False
    """``inference="server"`` on a CUDA ``policy_device``: replay the policy's forward passes as
    CUDA graphs (tensordict's ``CudaGraphModule``; ``True`` or a dict of its keyword arguments)."""
    storing_device: Any = None
    """Where delivered batches live: ``None``/``"cpu"`` (shared memory, lent or copied), or a CUDA
    device (each batch copied to it once, in a thread, and its slots handed back at once)."""
    backend: Literal["process", "local", "ray"] | Backend | None = None
    """Where the workers run: ``"process"`` (worker processes forked on this machine; the default
    with ``num_workers>=1``), ``"local"`` (the collector's own process and event loop; the default,
    and the only choice, with ``num_workers=0``), or ``"ray"`` (each worker a Ray actor, on any
    node of a Ray cluster; needs ``pip install 'aiocollect[ray]'``; see ``docs/ray.md``). A backend
    object (a fake pool of workers in tests) is used as it is."""
    ray_actor_options: dict | Sequence[dict] | None = None
    """``backend="ray"``: options for each worker's actor (``num_cpus`` (default 1), ``num_gpus``,
    ``resources``, ``memory``, ``scheduling_strategy`` for a placement group or node affinity,
    ``runtime_env`` ...), as Ray's ``.options()`` takes them; one dict for every actor or a list of
    one per worker."""
    worker_cpus: Any = None
    """The CPUs the worker processes may run on (Linux's CPU affinity, set by each worker before
    it makes its envs and kept by a replacement): ``None`` leaves them to the kernel; a set of CPU
    numbers is for every worker (``range(1, 4)``: the kernel spreads them over CPUs 1 to 3); a
    list of one set per worker places each (``[[1], [2]]``). Each CPU must be one this process may
    run on (``os.sched_getaffinity(0)``). ``None`` under ``inference="server"`` with
    ``server_priority="auto"`` on a machine with fewer cores than busy threads keeps the workers
    off this process's first CPU (``sorted(os.sched_getaffinity(0))[1:]``), left to the event loop
    and the server's thread (see ``docs/inference.md``); pass ``os.sched_getaffinity(0)`` to let
    them run anywhere. ``backend="process"`` only."""

    categorical_action_encoding: bool = True
    """How a Discrete action is stored: ``True``, its index (``[]`` int64); ``False``, one-hot
    (``[n]`` int64), as TorchRL's ``GymEnv`` does by default (its ``categorical_action_encoding``
    option): the policy writes a one-hot action (a single 1), the env gets its index, and random
    actions are stored one-hot too. Single envs only (not vector envs)."""

    max_decorrelation_steps: int = 0
    """Before collecting, each env takes a random number (uniform in ``[0, max_decorrelation_steps]``,
    from ``seed``) of random-action steps, resetting at episode ends, so that the envs do not start
    in lockstep (rlpyt's option). Those steps are not frames: not delivered, not counted, their
    ended episodes not reported (the episode in progress keeps its length and return). A replaced
    worker's envs are decorrelated again. See ``docs/concepts.md``."""

    recurrent_state: dict | None = None
    """The state a recurrent TensorDict policy carries from step to step: state key -> per-env
    shape (or ``(shape, dtype)``; float32 by default), e.g. ``{"recurrent_state": (1, 64)}``.
    Each step the policy reads ``"is_init"`` and each key (zeros at an episode's start) and writes
    ``("next", key)``; the batch stores all three. TorchRL's ``LSTMModule``/``GRUModule`` declare
    theirs already (no need to repeat it). See ``docs/inference.md``."""

    @property
    def state_leaves(self) -> tuple:
        """``recurrent_state`` as the leaves of the state (``()``: none declared)."""
        from .._worker.recurrent import declared_leaves

        return declared_leaves(self.recurrent_state)

    def cpus_for(self, worker: int) -> tuple[int, ...] | None:
        """The CPUs of ``worker`` (``None``: wherever the kernel puts it)."""
        return None if self.worker_cpus is None else self.worker_cpus[worker]

    @property
    def policy_or_factory(self) -> Any:
        """``policy``, or ``policy_factory`` where that builds it (``None``: random actions)."""
        return self.policy if self.policy is not None else self.policy_factory

    @property
    def backend_name(self) -> str:
        """``backend``'s name, with its default filled in."""
        return self.chosen_backend.name

    @property
    def chosen_backend(self) -> Backend:
        """The backend object: the one passed as ``backend``, or aiocollect's of that name (by
        default ``"local"`` with ``num_workers=0``, else ``"process"``)."""
        from .._backends.table import backend_named

        backend = self.backend
        if backend is None:
            backend = "local" if self.num_workers == 0 else "process"
        return backend_named(backend) if isinstance(backend, str) else backend

    @property
    def stores_on_cuda(self) -> bool:
        """Batches are copied to a CUDA ``storing_device`` (none is lent)."""
        if self.storing_device is None and self.device is None:
            return False
        storing = self.devices["storing_device"]
        return storing is not None and storing.type == "cuda"

    @functools.cached_property
    def devices(self) -> dict[str, Any]:
        """``policy_device``, ``env_device`` and ``storing_device`` as ``torch.device`` (or None),
        with ``device`` filled in (checked at construction; worked out once)."""
        from .devices import resolve_devices

        return resolve_devices(self)

    def __post_init__(self) -> None:
        self._check_env_fn()
        self._check_sizes()
        self._check_choices()
        self._check_backend_name()
        for name in ("max_frames_per_traj", "init_random_frames"):  # TorchRL's -1: none (as None)
            if type(getattr(self, name)) is int and getattr(self, name) == -1:
                object.__setattr__(self, name, None)
        check_needs(self, MODE_OPTIONS)  # options that mean something only under another setting
        if self.traj_format == "padded":  # TorchRL's spelling of the same layout (after the table: given, it is set)
            object.__setattr__(self, "traj_format", "pad")
        self._check_backend()  # (after the table: its messages do not need the backend's package)
        self._check_placement()
        self._check_policy()
        self._check_batch_shape()
        self._check_flags()
        self._check_delivery()
        self._check_lifecycle()

    def _check_env_fn(self) -> None:
        if isinstance(self.num_workers, int) and self.num_workers > 0:
            check_platform("Collector(num_workers>=1)")
        fn = self.create_env_fn
        if isinstance(fn, str):
            check_env_id(fn)
        elif not callable(fn) and not listed(fn):  # (a list: checked with the numbers of workers and envs)
            raise ConfigError(
                f"create_env_fn={fn!r:.200} is neither a gymnasium env id nor a callable returning a gymnasium.Env "
                f"(nor a list of them, one per worker or per env); {env_factory_fix(fn)}"
            )

    def _check_sizes(self) -> None:
        """``frames_per_batch``, ``total_frames`` (rounded up to whole batches, as TorchRL does) and
        the numbers of workers and envs."""
        positive_int("frames_per_batch", self.frames_per_batch)
        if self.total_frames is None:  # TorchRL's other spelling of "forever"
            object.__setattr__(self, "total_frames", -1)
        if isinstance(self.total_frames, bool) or not isinstance(self.total_frames, int):
            whole = as_whole_number(self.total_frames)
            raise ConfigError(f"total_frames={self.total_frames!r} must be an int (-1 or None for endless)"
                              + (f"; pass total_frames={whole}" if whole is not None else ""))
        if self.total_frames != -1:
            if self.total_frames <= 0:
                raise ConfigError(f"total_frames={self.total_frames} must be positive, or -1 (or None) to collect forever")
            lower, upper = multiples_around(self.total_frames, self.frames_per_batch)
            if upper != self.total_frames:
                # TorchRL's collectors warn and collect up to the next whole batch: so do we (a
                # ported script keeps its numbers)
                warnings.warn(
                    f"total_frames={self.total_frames} is not a multiple of frames_per_batch={self.frames_per_batch}: "
                    f"collecting {upper} frames ({upper // self.frames_per_batch} whole "
                    f"batch{'es' * (upper > self.frames_per_batch)}), "
                    f"{upper - self.total_frames} more, as TorchRL does. Pass total_frames={upper}"
                    + (f" (or {lower})" if lower else "") + " to silence this warning.",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
                object.__setattr__(self, "total_frames", upper)
        positive_int("num_workers", self.num_workers, allow_zero=True)
        check_worker_count(self.num_workers)
        positive_int("envs_per_worker", self.envs_per_worker)

    def _check_choices(self) -> None:
        """Options that are one of a few words."""
        check_choice("delivery", self.delivery, ("sync", "async"))
        check_choice("inference", self.inference, ("worker", "server"))
        check_choice("traj_format", self.traj_format, ("pad", "padded", "cat"), "'pad' (or TorchRL's 'padded') or 'cat'")
        check_choice("on_worker_failure", self.on_worker_failure, ("raise", "restart"))
        check_choice("server_priority", self.server_priority, ("auto", "normal", "idle"))
        check_choice("server_weights", self.server_weights, ("copy", "shared"))

    def _check_backend_name(self) -> None:
        """A backend of aiocollect's by name (or None), or a backend object."""
        from .._backends.table import BACKENDS, backend_choices, backend_object

        if self.backend is None or isinstance(self.backend, str):
            check_choice("backend", self.backend, (*BACKENDS, None),
                         f"{backend_choices()} (or None: chosen by num_workers)")
        else:
            backend_object(self.backend)

    def _check_backend(self) -> None:
        """The backend's own options (a backend ignores another's, which the table of options
        refuses naming both), the number of workers and what it supports."""
        backend = self.chosen_backend
        backend.check_options(self.ray_actor_options, self.num_workers)
        unsupported = (  # (inference is a checked str by now; profile anything, even an array)
            ("inference", self.inference != "worker", backend.serves_inference,
             "server inference (the workers share memory with the collector's server)"),
            ("profile", self.profile is not None, backend.profiles,
             "the profiler (its traces are files on the workers' machine)"),
        )
        for option, used, supported, what in unsupported:
            if used and not supported:
                value = getattr(self, option)
                raise ConfigError(
                    f"backend={backend.name!r} does not support {what} yet: {option}={value!r}; "
                    f"use backend='process' for it"
                )

    def _check_placement(self) -> None:
        """Where the workers run: the worker processes' CPUs."""
        if self.worker_cpus is not None:
            from .._core.affinity import normalize_cpus

            object.__setattr__(self, "worker_cpus", normalize_cpus(self.worker_cpus, self.workers))

    def _check_policy(self) -> None:
        """``policy`` and ``policy_factory``, and where the policy runs (the server's options, devices)."""
        check_policy_args(self.policy, self.policy_factory)
        from .._worker.policy import check_out_keys

        object.__setattr__(self, "policy_out_keys", check_out_keys(self.policy_out_keys, self.policy))
        object.__setattr__(self, "recurrent_state", check_recurrent_state(self.recurrent_state))
        if self.recurrent_state is not None:
            from .._worker.policy import check_recurrent_policy

            check_recurrent_policy(self.policy, self.state_leaves)
        if self.inference == "server":
            from .inference_server import check_server_config

            check_server_config(self)
        if self.server_priority == "idle" and not hasattr(os, "SCHED_IDLE"):  # pragma: no cover - Linux has it
            raise ConfigError("server_priority='idle' needs Linux's SCHED_IDLE scheduling policy")
        from .inference_server import check_wrapping

        check_wrapping(self)
        if any(getattr(self, name) is not None for name in ("device", "policy_device", "env_device", "storing_device")):
            self.devices  # noqa: B018 - checked now (and kept)
        factory = self.policy_factory
        if isinstance(factory, (list, tuple)):
            if len(factory) != self.workers:
                raise ConfigError(
                    f"policy_factory={factory!r:.200} is a list of {len(factory)} factories but there are {self.workers} "
                    f"workers (num_workers={self.num_workers}); pass one factory per worker, or a single callable for all"
                )
            bad = [i for i, f in enumerate(factory) if not callable(f)]
            if bad:
                raise ConfigError(
                    f"policy_factory[{bad[0]}]={factory[bad[0]]!r} is not callable (policy_factory={factory!r:.200}); "
                    f"pass functions that build the policy"
                )
            object.__setattr__(self, "policy_factory", tuple(factory))
        elif factory is not None and not callable(factory):
            raise ConfigError(
                f"policy_factory={factory!r} is not callable; pass a function that builds the policy, "
                f"or a list of one per worker"
            )

    def _check_batch_shape(self) -> None:
        """``frames_per_batch`` splits evenly over the envs that fill a batch."""
        check_env_factories(self)  # (create_env_fn, create_env_kwargs: one, or a list per worker or per env)
        self.geometry  # noqa: B018 - worked out and checked now (and kept)
        for name, low in (("max_frames_per_traj", 1), ("init_random_frames", 0)):
            value = getattr(self, name)
            if value is not None:
                below = type(value) is int and value < low
                check_int(name, value, low, fix=f"pass {name}=None (or TorchRL's -1) for none" if below else "")
        positive_int("max_decorrelation_steps", self.max_decorrelation_steps, allow_zero=True)

    def _check_flags(self) -> None:
        for name in ("reset_at_each_iter", "split_trajs", "progress", "categorical_action_encoding"):
            check_bool(name, getattr(self, name))
        if self.progress:
            from .._service.progress import check_available

            check_available()
        object.__setattr__(self, "exploration_type", exploration_name(self.exploration_type))
        self.geometry.check_seed(self.seed)
        check_data_options(self.check_finite, self.action_bounds)

    def _check_delivery(self) -> None:
        """How batches are delivered: ``prefetch``, ``zero_copy``, ``trajs_per_batch``, the slots'
        memory, ``update_at_each_batch`` and ``postproc``."""
        positive_int("prefetch", self.prefetch, allow_zero=True)
        if self.zero_copy not in (False, True, "debug") or type(self.zero_copy) not in (bool, str):
            raise ConfigError(f"zero_copy={self.zero_copy!r} must be False, True or 'debug'")
        if self.zero_copy and self.trajs_per_batch is not None:
            raise ConfigError(
                f"zero_copy={self.zero_copy!r} and trajs_per_batch={self.trajs_per_batch} cannot be combined: "
                "trajs_per_batch keeps frames across batches, so it copies them anyway; drop zero_copy"
            )
        self.check_slot_memory()
        if self.trajs_per_batch is not None:
            positive_int("trajs_per_batch", self.trajs_per_batch)
            if self.split_trajs:
                raise ConfigError(
                    f"trajs_per_batch={self.trajs_per_batch} and split_trajs=True both reshape batches into trajectories; "
                    "trajs_per_batch already gives padded complete trajectories: drop split_trajs"
                )
        check_bool("update_at_each_batch", self.update_at_each_batch)
        if self.update_at_each_batch and self.policy is None:
            raise ConfigError(
                "update_at_each_batch=True pulls the weights of `policy` before each batch, but no policy "
                "was given; pass the policy module (policy_factory builds replicas in the workers only)"
            )
        if self.postproc is not None and not callable(self.postproc):
            raise ConfigError(f"postproc={self.postproc!r} must be a callable taking and returning a batch")
        if self.frames_per_update is not None:
            positive_int("frames_per_update", self.frames_per_update)
            if self.update_at_each_batch:
                raise ConfigError(
                    f"frames_per_update={self.frames_per_update} counts your update_weights() calls, but "
                    f"update_at_each_batch=True publishes the weights before each batch itself; drop one of them"
                )

    def _check_lifecycle(self) -> None:
        """Start, failures and shutdown: what travels to the workers, restarts, timeouts, the profiler."""
        positive_seconds("shutdown_timeout", self.shutdown_timeout, allow_zero=True)
        fn = self.create_env_fn
        if self.num_workers > 0:
            from .._core.registry import check_sendable

            for env_id in env_ids(self):
                check_sendable(env_id)  # the id's spec must reach the worker processes
        if self.num_workers > 0:
            check_sendable_to_workers(fn, self.create_env_kwargs)
        positive_int("max_restarts", self.max_restarts, allow_zero=True)
        if self.restart_window is not None:
            positive_seconds("restart_window", self.restart_window, "or None to count over the whole run")
        if self.step_timeout is not None:
            positive_seconds("step_timeout", self.step_timeout, "or None to wait for ever")
        if self.profile is not None:
            if not isinstance(self.profile, ProfileConfig):
                raise ConfigError(f"profile={self.profile!r} must be a ProfileConfig or None")
            bad = [w for w in self.profile.workers if w >= self.workers]
            if bad:
                raise ConfigError(
                    f"profile=ProfileConfig(workers={list(self.profile.workers)}) names workers {bad}, but this "
                    f"collector has {self.workers} (indices 0..{self.workers - 1})"
                )

    @property
    def lend_slots(self) -> int:
        """Slots per worker that may be lent to the consumer as batches (``_pool.Loans``): without
        ``zero_copy``, the batches ahead, the one being delivered and the one the consumer still
        holds while it asks for the next (a loop's variable); none with ``zero_copy``
        (its batches hold their slots until the next one is asked for) or ``trajs_per_batch``
        (which copies frames anyway)."""
        if self.zero_copy or self.trajs_per_batch is not None or self.stores_on_cuda:
            return 0
        return self.prefetch + 2

    @property
    def fill_slots(self) -> int:
        """Batch slots per worker to fill ahead of the consumer: ``prefetch`` ahead and one being
        filled, at least two (in async delivery, how far each worker runs ahead)."""
        return max(2, self.prefetch + 1)

    @property
    def num_slots(self) -> int:
        """Batch slots per worker: ``prefetch`` ahead, one being filled, and with ``zero_copy``
        one more held by the consumer, or the slots that may be lent (:attr:`lend_slots`)."""
        return self.fill_slots + (1 if self.zero_copy else self.lend_slots)

    def check_slot_memory(self, layout: Any = None, extra_nbytes: int = 0) -> None:
        """The batch slots of every worker must fit in this machine's memory.

        At construction (no ``layout``) a lower bound, so that nothing that could work is refused:
        ``MIN_FRAME_NBYTES`` per frame against RAM and swap. When a run starts, once the workers
        reported their spaces, ``layout`` (the run's ``SlotLayout``) gives the real figure: every
        slot of every worker (``prefetch`` ahead, the one being filled, those lent to the consumer
        or held by ``zero_copy``), ``extra_nbytes`` on top (the workers' heartbeats) and one batch
        copied out of the slots (made when a batch cannot be lent), against the shared memory that
        can be filled now (``_shm.available``) less a headroom for the rest of the program
        (``_shm.headroom``: 10%, at least 256 MiB). This runs before the slots are allocated: a
        memfd's pages are taken only when written, so an oversized segment would be accepted and
        then filled towards the OOM killer."""
        slots = self.num_slots
        per_worker = "" if self.delivery == "sync" else f" x {self.workers} workers (delivery='async')"
        what = f"frames_per_batch={self.frames_per_batch} with prefetch={self.prefetch} ({slots} batch slots{per_worker}"
        if layout is None:
            frames = slots * self.frames_per_batch * (1 if self.delivery == "sync" else self.workers)
            check_fits_in_memory(
                frames * MIN_FRAME_NBYTES, f"{what} in shared memory, {MIN_FRAME_NBYTES} bytes per frame or more)",
                "use a smaller frames_per_batch or prefetch",
            )
            return
        from .._core import shm as _shm

        probe = _shm.available()
        if probe is None:
            return  # (not known here: the lower bound above was checked at construction)
        have, source = probe
        keep = _shm.headroom(have)
        frame = sum(leaf.np_dtype.itemsize * math.prod(leaf.shape) for leaf in layout.leaves)
        rows = layout.rows * (layout.workers if self.delivery == "sync" else 1)  # env rows of a batch
        batch = rows * layout.frames_per_row

        def needs(frames: int) -> int:
            built = type(layout).build(list(layout.leaves), layout.rows, frames // rows, layout.num_slots, layout.workers)
            return built.nbytes + extra_nbytes + frames * frame

        need = needs(batch)
        if need <= have - keep:
            return
        # a batch of f frames takes about f * per_frame bytes, plus what does not grow with it
        # (alignment): an estimate, then the exact figure a row of frames at a time around it
        per_frame = frame * (layout.num_slots * layout.workers * layout.rows // rows + 1)
        largest = max((have - keep - max(need - batch * per_frame, 0)) // per_frame // rows * rows, 0)
        while needs(largest + rows) <= have - keep:
            largest += rows
        while largest > 0 and needs(largest) > have - keep:
            largest -= rows
        counts = f"prefetch={self.prefetch}, num_workers={self.num_workers} and envs_per_worker={self.envs_per_worker}"
        raise ConfigError(
            f"{what} of {batch:,} frames of {frame:,} bytes, and one copy of a batch) needs {format_size(need)} of shared "
            f"memory, more than this machine can give now: {format_size(have)} ({source}), less {format_size(keep)} kept for "
            f"the rest of the program; "
            + (f"the largest frames_per_batch that fits with {counts} is {largest}" if largest else
               f"no frames_per_batch fits with {counts}")
            + "; " + ("a smaller prefetch, " if self.prefetch else "") + "fewer envs (num_workers, envs_per_worker)"
            + ("" if self.zero_copy or not self.lend_slots else
               f" or zero_copy=True (1 slot per worker held by the consumer instead of {self.lend_slots} lent)")
            + " also help"
        )

    def factory_for(self, worker: int) -> Callable[[], Any] | None:
        """The policy factory of ``worker`` (``None``: the workers copy ``policy``)."""
        f = self.policy_factory
        return f[worker] if isinstance(f, (list, tuple)) else f  # type: ignore[return-value]

    @property
    def workers(self) -> int:
        """Number of rollout workers (1 for the local backend)."""
        return max(self.num_workers, 1)

    @functools.cached_property
    def geometry(self) -> Geometry:
        """Workers, env copies, rows and how ``frames_per_batch`` splits over them, with the seeds
        derived from ``seed`` (single envs: one row per env; the run's own, once the workers
        reported vector envs' sub-envs, is ``geometry.with_sub_envs(n)``). Worked out and checked
        at construction: ``frames_per_batch`` must be a multiple of the envs that fill a batch."""
        return Geometry(self.workers, self.envs_per_worker, self.frames_per_batch, sync=self.delivery == "sync")

    @property
    def total_batches(self) -> int | None:
        total = self.total_frames  # (None was made -1 at construction)
        return None if total is None or total == -1 else total // self.frames_per_batch

    @property
    def random_frames(self) -> int:
        """Frames of each env copy taken with random actions (``init_random_frames`` spread evenly
        over the copies: :meth:`Geometry.per_copy`)."""
        return self.geometry.per_copy(self.init_random_frames or 0)
