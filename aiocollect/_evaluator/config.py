"""The evaluator's options and what follows from them: :class:`EvaluatorConfig` (validated at
construction, before any process starts; the one place the options are written, which
:func:`~aiocollect._service.options.takes_options` makes ``Evaluator()``'s signature), :class:`EvaluatorState`, the settings its
worker gets (:func:`worker_setup`) and the checks and CPU snapshots of the weights given to an
evaluation."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import itertools
import os
import sys
from typing import Any, Callable, Literal, Mapping

import numpy as np

from .._core.datachecks import ActionBounds
from .._service.options import (
    POLICY_STATE,
    RAY_PLACES_ACTORS,
    RESTART_OPTIONS,
    Needs,
    known_keywords,
    check_bool,
    check_choice,
    check_int,
    check_needs,
    exploration_name,
    positive_int,
    positive_seconds,
    check_data_options,
    check_env_id,
    check_kwargs,
    check_policy_args,
    check_platform,
    check_recurrent_state,
    env_factory_fix,
)
from .._core.errors import ConfigError
from .._core.imports import env_needs
from .._core.eval_wire import EvalWorkerConfig
from .._core.limits import check_seed
from .._core.video import require_writer
from .._worker.policy import PolicySpec, classify, is_recurrent, loaded_class
from .._core.registry import snapshot as snapshot_registry
from .._core.public import public


EVALUATOR_MODE_OPTIONS: tuple[Needs, ...] = (
    Needs("ray_actor_options", None, "backend", ("ray",), "sets the options of the worker's Ray actor",
          "pass backend='ray' or drop it"),
    Needs("cpus", None, "backend", ("process",), "places the evaluator's worker process on CPUs",
          RAY_PLACES_ACTORS),
    *RESTART_OPTIONS,
    Needs("max_queued", 4, "busy_policy", ("queue",), "bounds the evaluations waiting behind the running one",
          "only busy_policy='queue' keeps them waiting: pass it too, or drop max_queued"),
    Needs("video_dir", None, "record_video", (True,), "is where the evaluation videos are written",
          "pass record_video=True too, or drop video_dir"),
    Needs("video_max_frames", 1000, "record_video", (True,), "bounds the frames of each evaluation video",
          "pass record_video=True too, or drop video_max_frames"),
    Needs("video_fps", 30, "video_dir", None, "is the frame rate of the video files written in video_dir",
          "pass video_dir=<a folder> (with record_video=True) to write files, or drop video_fps (without video_dir "
          "the frames come back in the metrics, with no frame rate)"),
    Needs("video_prefix", "eval", "video_dir", None, "starts the names of the video files written in video_dir",
          "pass video_dir=<a folder> (with record_video=True) to write files, or drop video_prefix"),
    POLICY_STATE,
)
"""The evaluator's options that mean something only under another setting."""



@public
class EvaluatorState(enum.Enum):
    """Lifecycle of an :class:`Evaluator`."""

    CREATED = "created"
    """Constructed; no worker yet."""
    STARTING = "starting"
    """Its worker process is starting."""
    RUNNING = "running"
    """Ready to evaluate (the worker is replaced on the next evaluation if it died)."""
    CLOSED = "closed"
    """Closed: its worker is gone. Cannot be reopened."""


@public
@dataclasses.dataclass(frozen=True)
class EvaluatorConfig:
    """Every option of :class:`Evaluator` (see its docstring for the whole story)."""

    env: Any
    """A gymnasium env id (``"CartPole-v1"``) or a callable returning a ``gymnasium.Env`` (it
    travels with cloudpickle: lambdas and classes from ``__main__`` or a notebook work). Ids
    registered in this process before the evaluator is constructed can be made in its worker."""
    policy: Any = None
    """``None`` (random actions), an ``nn.Module`` on the observation tensor, a
    ``TensorDictModule`` or any callable taking and returning a TensorDict. Copied (pickled) at
    construction; later changes reach evaluations only through ``weights=``."""
    _: dataclasses.KW_ONLY  # the rest by keyword only, as Evaluator() takes them
    policy_factory: Callable[[], Any] | None = None
    """Builds the policy in the worker instead of copying ``policy``."""
    num_trajectories: int = 10
    """Episodes per evaluation."""
    max_steps: int | None = None
    """Truncate each episode after this many steps (``None``: the env's own limit only)."""
    exploration_type: str = "deterministic"
    """tensordict interaction type the policy runs under: deterministic, mode, mean, median, random."""
    metrics_fn: Callable[[np.ndarray, np.ndarray], Any] | None = None
    """``metrics_fn(returns, lengths) -> Mapping[str, Any]`` (sync or async), run in this process
    after each evaluation: ``returns`` (float64) and ``lengths`` (int64) have one entry per episode,
    in episode order. Its items are added to the metrics (and may replace built-in ones)."""
    on_result: Callable[[dict], Any] | None = None
    """``on_result(metrics)`` (sync or async), called after each successful evaluation, after the
    :class:`~aiocollect.events.EvaluationCompleted` handlers."""
    busy_policy: Literal["skip", "error", "queue"] = "skip"
    """What :meth:`Evaluator.trigger` does while an evaluation is pending: ``"skip"`` it (returns
    False), raise :class:`EvaluatorBusyError` (``"error"``), or ``"queue"`` it (up to
    ``max_queued``)."""
    max_queued: int = 4
    """With ``busy_policy="queue"``: triggered evaluations that may wait behind the running one."""
    num_envs: int = 1
    """Envs stepped together in the worker (the policy runs batched over them); at most
    ``num_trajectories``. The metrics do not depend on it when ``seed`` is set."""
    env_kwargs: dict | None = None
    """Keyword arguments for ``env`` (or ``gymnasium.make``)."""
    seed: int | None = None
    """Episode ``j`` of every evaluation starts with ``env.reset(seed=seed + j)`` (and a random
    policy's action space is seeded the same way; torch's RNG with ``seed`` at the start of each
    evaluation): every evaluation sees the same start states. ``None``: unseeded."""
    shutdown_timeout: float = 5.0
    """Seconds the worker gets to close its envs and exit at :meth:`Evaluator.aclose` before it
    is killed."""
    nice: int = 0
    """Added to the worker process's niceness (0 to 19): a positive value lets the collector's
    workers and the training loop have the CPU first, at the price of slower evaluations on a
    busy machine. (With the process backend the worker also becomes a session of its own at that
    niceness, since Linux's autogroups apply ``nice`` only within a session; a Ray actor gets the
    plain niceness.)"""
    cpus: Any = None
    """The CPUs the worker process may run on (Linux's CPU affinity, as the collector's
    ``worker_cpus`` for one worker): ``None`` leaves it to the kernel, a set of CPU numbers (e.g.
    ``{3}``) places it; each must be one this process may run on. ``backend="process"`` only."""
    check_finite: bool = False
    """Raise :class:`SpecError` on NaN or +-inf in an observation, a reward or the policy's action
    (as :class:`~aiocollect.Collector`'s option of the same name)."""
    action_bounds: ActionBounds = "pass"
    """The policy's action outside its Box space's bounds: ``"pass"`` (as it is), ``"clip"`` (the
    env gets it clipped) or ``"error"`` (:class:`SpecError`); give it the collector's setting, so
    that evaluation acts as training did."""
    on_worker_failure: Literal["raise", "restart"] = "raise"
    """What the worker's death, crash or hang during an evaluation does: ``"raise"`` fails that
    evaluation; ``"restart"`` runs it again from its start on a new worker (at most
    ``max_restarts`` times within ``restart_window`` seconds). An env's or policy's exception is
    not a worker failure: it fails its evaluation either way."""
    max_restarts: int = 3
    """With ``on_worker_failure="restart"``: new workers allowed within ``restart_window``; the
    next failure is raised."""
    restart_window: float | None = 60.0
    """Seconds over which ``max_restarts`` counts (``None``: the evaluator's whole life)."""
    step_timeout: float | None = None
    """Seconds the worker may spend in one env ``step``/``reset`` or one policy call of an
    evaluation before it is declared hung and killed (:class:`WorkerTimeoutError`, or a restart).
    ``None``: never."""
    backend: Literal["process", "ray"] = "process"
    """Where the worker runs: ``"process"`` (a process forked on this machine) or ``"ray"`` (a Ray
    actor, anywhere in the Ray cluster; ``pip install 'aiocollect[ray]'``, see ``docs/ray.md``)."""
    ray_actor_options: dict | None = None
    """``backend="ray"``: options for the worker's actor, as Ray's ``.options()`` takes them
    (``num_cpus`` (default 1), ``resources``, ``scheduling_strategy``, ``runtime_env`` ...)."""
    categorical_action_encoding: bool = True
    """A Discrete action as the policy writes it: its index (``True``), or one-hot (``False``,
    TorchRL ``GymEnv``'s default), as the collector's option of the same name."""
    recurrent_state: dict | None = None
    """A recurrent TensorDict policy's state, key -> per-env shape, as the collector's option of the
    same name (TorchRL's ``LSTMModule``/``GRUModule`` need none): zeros at each episode's start."""
    log_prefix: str | None = None
    """``None``: aiocollect's metric names (``return_mean`` ...). A str (TorchRL's default is
    ``"eval"``): TorchRL's ``Evaluator``'s names instead, ``<log_prefix>/reward``,
    ``/reward_std`` (``ddof=1``), ``/num_episodes``, ``/episode_length``, ``/fps``, ``/step``
    (an evaluation counter where no ``step`` is given) and ``/<name>`` for ``metrics_fn``'s items."""
    record_video: bool = False
    """Record the first episode of each evaluation (TorchRL's ``dump_video``): the env's
    ``render()`` after its reset and after each step, so the env must be made with
    ``render_mode="rgb_array"`` (``gymnasium.make(id, render_mode="rgb_array")``, or
    ``env_kwargs={"render_mode": "rgb_array"}``). The metrics then hold ``"video"`` (or
    ``<log_prefix>/video``): the path of the file written in ``video_dir``, or without one the
    frames, a ``uint8`` numpy array ``[T, H, W, 3]`` (``T``: the episode's length plus one, at most
    ``video_max_frames``; about 0.7 MB per frame for CartPole's 600x400, sent from the worker)."""
    video_dir: str | None = None
    """With ``record_video``: write each video as ``<video_dir>/<video_prefix>_<step>.mp4`` (the
    evaluation's ``step``, or its number from 1 when none is given), made by the evaluator's
    worker (``pip install 'aiocollect[video]'``: imageio with ffmpeg). ``None``: frames in the metrics."""
    video_fps: int = 30
    """With ``video_dir``: frames per second of the video files."""
    video_max_frames: int | None = 1000
    """With ``record_video``: frames recorded at most (the episode runs on unrecorded past them);
    ``None``: the whole episode, however long."""
    video_prefix: str = "eval"
    """With ``video_dir``: the start of the video files' names."""

    def __post_init__(self) -> None:
        check_platform("Evaluator")
        self._check_env_and_policy()
        positive_int("num_trajectories", self.num_trajectories, fix="pass the number of episodes per evaluation")
        if self.max_steps is not None:
            positive_int("max_steps", self.max_steps, fix="pass None to let episodes run to their end")
        object.__setattr__(self, "exploration_type", exploration_name(self.exploration_type))
        for name in ("metrics_fn", "on_result"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"{name}={value!r} is not callable; pass a function or None")
        check_choice("busy_policy", self.busy_policy, ("skip", "error", "queue"))
        positive_int("max_queued", self.max_queued, fix="it bounds the evaluations waiting with busy_policy='queue'")
        positive_int("num_envs", self.num_envs, fix="pass 1 to step a single env")
        if self.num_envs > self.num_trajectories:
            raise ConfigError(
                f"num_envs={self.num_envs} is more than num_trajectories={self.num_trajectories}: the extra envs "
                f"would never run an episode; use num_envs<={self.num_trajectories}"
            )
        check_kwargs("env_kwargs", self.env_kwargs)
        check_seed(self.seed)  # episode j starts with reset(seed=seed + j); torch's generator gets seed
        check_int("nice", self.nice, 0, 19, fix="0 is the trainer's own priority, 19 the lowest")
        positive_seconds("shutdown_timeout", self.shutdown_timeout, allow_zero=True)
        check_data_options(self.check_finite, self.action_bounds)
        self._check_restarts()
        self._check_backend()
        check_bool("record_video", self.record_video)
        check_needs(self, EVALUATOR_MODE_OPTIONS)
        if self.cpus is not None:
            from .._core.affinity import normalize_cpu_set

            object.__setattr__(self, "cpus", normalize_cpu_set(self.cpus, "cpus"))
        check_bool("categorical_action_encoding", self.categorical_action_encoding)
        object.__setattr__(self, "recurrent_state", check_recurrent_state(self.recurrent_state))
        if self.recurrent_state is not None:
            from .._worker.policy import check_recurrent_policy
            from .._worker.recurrent import declared_leaves

            check_recurrent_policy(self.policy, declared_leaves(self.recurrent_state))
        if self.log_prefix is not None and (not isinstance(self.log_prefix, str) or not self.log_prefix):
            raise ConfigError(
                f"log_prefix={self.log_prefix!r} must be a non-empty str (TorchRL's metric names, e.g. 'eval' gives "
                f"'eval/reward'), or None for aiocollect's names"
            )
        self.chosen_backend.check_options(self.ray_actor_options, 1)  # (its own options: Ray's actor's)
        self._check_video()

    def _check_env_and_policy(self) -> None:
        """``env`` (an env id or a callable) and the policy (or its factory)."""
        env = self.env
        if isinstance(env, str):
            check_env_id(env, "env")
        elif not callable(env):
            raise ConfigError(
                f"env={env!r:.200} is neither a gymnasium env id nor a callable returning a gymnasium.Env; "
                f"{env_factory_fix(env)}"
            )
        check_policy_args(self.policy, self.policy_factory)
        if self.policy_factory is not None and not callable(self.policy_factory):
            raise ConfigError(f"policy_factory={self.policy_factory!r} is not callable; pass a function that builds the policy")

    def _check_restarts(self) -> None:
        """What a worker's failure does, and the budget and watchdog of ``"restart"``."""
        check_choice(
            "on_worker_failure", self.on_worker_failure, ("raise", "restart"),
            "'raise' (fail the evaluation) or 'restart' (run it again on a new worker)",
        )
        positive_int("max_restarts", self.max_restarts, allow_zero=True, fix="it bounds the new workers within restart_window")
        if self.restart_window is not None:
            positive_seconds("restart_window", self.restart_window, "or None to count over the evaluator's whole life")
        if self.step_timeout is not None:
            positive_seconds("step_timeout", self.step_timeout, "or None to wait for ever")

    def _check_video(self) -> None:
        if self.video_dir is not None:  # (with record_video: the table of options says so)
            if not isinstance(self.video_dir, (str, os.PathLike)):
                raise ConfigError(f"video_dir={self.video_dir!r} must be a directory path (a str) or None")
            object.__setattr__(self, "video_dir", os.fspath(self.video_dir))
            require_writer()  # (the extra is missing: said now, not at the first evaluation)
        positive_int("video_fps", self.video_fps, fix="the video files' frames per second, e.g. 30")
        if self.video_max_frames is not None:
            positive_int("video_max_frames", self.video_max_frames, fix="or None to record whole episodes")
        if not isinstance(self.video_prefix, str) or not self.video_prefix or "/" in self.video_prefix:
            raise ConfigError(f"video_prefix={self.video_prefix!r} must be a non-empty file name prefix (no '/')")

    def _check_backend(self) -> None:
        """One of the table's backends that open an evaluator (TorchRL's ``"thread"`` is explained)."""
        from .._backends.table import EVALUATOR_BACKENDS

        if self.backend == "thread":  # (TorchRL's name, not one of ours)
            raise ConfigError(
                "backend='thread' (TorchRL's default) is not an aiocollect backend: its evaluator runs in a worker "
                "process of its own, which never holds your event loop or your GIL; use backend='process' (the "
                "default), or 'ray'"
            )
        check_choice("backend", self.backend, EVALUATOR_BACKENDS)

    @property
    def policy_or_factory(self) -> Any:
        """``policy``, or ``policy_factory`` where that builds it (``None``: random actions)."""
        return self.policy if self.policy is not None else self.policy_factory

    @property
    def chosen_backend(self) -> Any:
        """The backend object of that name (:data:`~aiocollect._backends.table.BACKENDS`), which
        opens the evaluator's worker."""
        from .._backends.table import EVALUATOR_BACKENDS, backend_named

        return backend_named(self.backend, EVALUATOR_BACKENDS)

    @property
    def actor_options(self) -> dict:
        """``backend="ray"``: the worker's actor options, with aiocollect's defaults filled in."""
        from .._backends.ray import check_actor_options

        return check_actor_options(self.ray_actor_options, 1)[0]


def on_cpu(policy: Any) -> Any:
    """``policy``, or a CPU copy of it if it has tensors elsewhere (the worker runs on CPU and
    must not initialise CUDA to unpickle it)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(policy, torch.nn.Module):
        return policy
    tensors = itertools.chain(policy.parameters(), policy.buffers())
    if all(t.device.type == "cpu" for t in tensors):
        return policy
    import copy

    return copy.deepcopy(policy).cpu()


def weights_state(weights: Any) -> tuple[str, Mapping[str, Any]]:
    """``(kind, {name: value})`` of the weights given (not copied); raises :class:`ConfigError`
    for what is not weights."""
    from .._worker.weights import named

    module, td_base = loaded_class("torch.nn", "Module"), loaded_class("tensordict", "TensorDictBase")
    if module is not None and isinstance(weights, module):
        kind, state = "state_dict", weights.state_dict()
    elif td_base is not None and isinstance(weights, td_base):
        kind, state = "params", dict(weights.flatten_keys(".").items())
    elif isinstance(weights, Mapping):
        kind, state = "state_dict", weights
    else:
        raise ConfigError(
            f"{named('weights', weights)} is a {type(weights).__name__}: pass an nn.Module, its state_dict(), "
            f"TensorDict.from_module(module), or None for the weights the policy was built with"
        )
    for name in state:
        if not isinstance(name, str):
            raise ConfigError(
                f"{named('weights', weights)} has a key {name!r}; a state dict's keys are parameter names (str): pass "
                f"module.state_dict()"
            )
    return kind, state


def weights_payload(weights: Any) -> tuple[str, dict] | None:
    """``(kind, {name: tensor})`` to send: a CPU snapshot taken now (training may change the
    parameters before the evaluation runs)."""
    if weights is None:
        return None
    import torch

    kind, state = weights_state(weights)
    snapshot = {}
    for name, value in state.items():
        snapshot[name] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return kind, snapshot


def worker_setup(c: EvaluatorConfig) -> tuple[bytes, tuple[str, ...]]:
    """The pickled :class:`~aiocollect._core.eval_wire.EvalWorkerConfig` for ``c``'s worker, and the
    modules the worker needs (for the launcher to import once). Raises :class:`ConfigError` for
    a policy or an env that cannot be pickled."""
    from .._core import pickling as _pickling
    from .._worker.recurrent import declared_leaves

    if c.policy_factory is not None:
        mode, obj, kind = "factory", c.policy_factory, "factory"
    elif c.policy is not None:
        mode, obj, kind = "object", c.policy, classify(c.policy, is_recurrent(c.policy, declared_leaves(c.recurrent_state)))[0]
    else:
        mode, obj, kind = "random", None, "random"
    if mode == "object":
        obj = on_cpu(obj)
    try:
        payload = _pickling.dumps(obj) if obj is not None else b""
    except Exception as exc:
        name = "policy_factory" if mode == "factory" else "policy"
        raise ConfigError(
            f"{name}={obj!r:.100} could not be pickled for the evaluator's worker ({type(exc).__name__}: "
            f"{exc}); pass policy_factory=<a picklable function that builds it> instead"
        ) from exc
    # ids registered in this process, for the worker (taken now: the config is sent as is)
    registry = snapshot_registry(c.env if isinstance(c.env, str) else None, "env")
    try:
        worker_config = _pickling.dumps(EvalWorkerConfig(
            env_fn=c.env,
            env_kwargs=dict(c.env_kwargs or {}),
            policy_mode=mode,
            policy_payload=payload,
            exploration_type=c.exploration_type,
            num_envs=c.num_envs,
            max_steps=c.max_steps,
            seed=c.seed,
            nice=c.nice,
            cpus=c.cpus,
            registry=registry,
            check_finite=c.check_finite,
            action_bounds=c.action_bounds,
            one_hot_actions=not c.categorical_action_encoding,
            recurrent_state=declared_leaves(c.recurrent_state),
            record_video=c.record_video,
            video_dir=c.video_dir,
            video_fps=c.video_fps,
            video_max_frames=c.video_max_frames,
            video_prefix=c.video_prefix,
        ))
    except Exception as exc:
        raise ConfigError(
            f"env={c.env!r:.100} (or env_kwargs) could not be pickled for the evaluator's worker "
            f"({type(exc).__name__}: {exc}); pass a gymnasium id or a function that builds the env"
        ) from exc
    needs = PolicySpec(kind).needs
    td_base = loaded_class("tensordict.nn", "TensorDictModuleBase")
    if td_base is not None and isinstance(c.policy, td_base):
        needs = ("torch", "tensordict")
    # (an env factory whose module imports torch: the worker imports it too; see _core/imports.py)
    return worker_config, tuple(sorted(set(needs) | set(env_needs(c.env, c.env_kwargs))))


def check_request(c: EvaluatorConfig, weights: Any, step: Any) -> None:
    """The arguments of :meth:`Evaluator.evaluate <aiocollect.Evaluator.evaluate>` /
    :meth:`~aiocollect.Evaluator.trigger` (before anything starts)."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ConfigError(f"step={step!r} must be an int or None (it tags the metrics: the training step)")
    if weights is None:
        return
    if c.policy is None and c.policy_factory is None:
        from .._worker.weights import named

        raise ConfigError(
            f"{named('weights', weights)} were given, but the evaluator has no policy (random actions): build it "
            f"with Evaluator(env, policy) to evaluate weights"
        )
    weights_state(weights)


__all__ = [
    "EvaluatorConfig",
    "EvaluatorState",
    "check_request",
    "on_cpu",
    "weights_payload",
    "weights_state",
    "worker_setup",
]
