"""The evaluator: runs a policy for whole episodes in its own worker process and reports return
and episode-length metrics, on demand (``await evaluate()``) or in the background
(``trigger()``), without ever holding the training loop's event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import itertools
import math
import os
import socket
import sys
import time
import warnings
from collections import deque
from typing import Any, Callable, Literal, Mapping, TypeVar

import anyio
import numpy as np

from ._bus import EventBus, Overflow, Subscription
from . import _heartbeat, _shm
from ._checks import ActionBounds
from ._config import _exploration_name, _positive_seconds, check_data_options, check_env_id, check_platform
from ._errors import AiocollectError, BrokenWorkerError, ConfigError, WorkerError
from ._eval_worker import EvalWorkerConfig
from ._registry import snapshot as snapshot_registry
from ._launcher import get_launcher
from ._policy import PolicySpec, classify
from ._supervisor import RestartBudget
from ._systask import spawn_system_task
from ._resource import AsyncResource, unwrap_group as _unwrap, wait_shielded
from ._child import ChildProcess, add_note
from .events import Event, EvaluationCompleted, EvaluationFailed, WorkerFailed, WorkerRestarted

__all__ = [
    "Evaluator",
    "EvaluatorBusyError",
    "EvaluatorClosedError",
    "EvaluatorConfig",
    "EvaluatorState",
]

E = TypeVar("E", bound=Event)
_ENTRY = "aiocollect._eval_worker:serve"


class EvaluatorClosedError(AiocollectError, RuntimeError):
    """Raised when a closed :class:`Evaluator` is used again (started, evaluated with, triggered),
    and by an ``evaluate()`` call still waiting when the evaluator is closed. A closed evaluator
    cannot be reopened: build a new one."""


class EvaluatorBusyError(AiocollectError, RuntimeError):
    """Raised by :meth:`Evaluator.trigger` when an evaluation is pending and
    ``busy_policy="error"``, or when ``busy_policy="queue"`` and ``max_queued`` evaluations
    already wait. Nothing is scheduled then."""


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


def _int_at_least(name: str, value: Any, low: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name}={value!r} must be an int >= {low}; {fix}")


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
    busy machine."""
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

    def __post_init__(self) -> None:
        check_platform("Evaluator")
        env = self.env
        if isinstance(env, str):
            check_env_id(env, "env")
        elif not callable(env):
            raise ConfigError(
                f"env={env!r} is neither a gymnasium env id nor a callable returning a gymnasium.Env; "
                f"pass e.g. 'CartPole-v1' or lambda: gymnasium.make('CartPole-v1')"
            )
        if self.policy is not None and self.policy_factory is not None:
            raise ConfigError(
                f"policy={self.policy!r:.80} and policy_factory={self.policy_factory!r:.80}: pass either policy or "
                f"policy_factory, not both"
            )
        if self.policy is not None and not callable(self.policy):
            raise ConfigError(f"policy={self.policy!r} is not callable; pass an nn.Module, a TensorDictModule or None")
        if self.policy_factory is not None and not callable(self.policy_factory):
            raise ConfigError(f"policy_factory={self.policy_factory!r} is not callable; pass a function that builds the policy")
        _int_at_least("num_trajectories", self.num_trajectories, 1, "pass the number of episodes per evaluation")
        if self.max_steps is not None:
            _int_at_least("max_steps", self.max_steps, 1, "pass None to let episodes run to their end")
        object.__setattr__(self, "exploration_type", _exploration_name(self.exploration_type))
        for name in ("metrics_fn", "on_result"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigError(f"{name}={value!r} is not callable; pass a function or None")
        if not isinstance(self.busy_policy, str) or self.busy_policy not in ("skip", "error", "queue"):
            raise ConfigError(f"busy_policy={self.busy_policy!r} must be 'skip', 'error' or 'queue'")
        _int_at_least("max_queued", self.max_queued, 1, "it bounds the evaluations waiting with busy_policy='queue'")
        _int_at_least("num_envs", self.num_envs, 1, "pass 1 to step a single env")
        if self.num_envs > self.num_trajectories:
            raise ConfigError(
                f"num_envs={self.num_envs} is more than num_trajectories={self.num_trajectories}: the extra envs "
                f"would never run an episode; use num_envs<={self.num_trajectories}"
            )
        if self.env_kwargs is not None and not isinstance(self.env_kwargs, dict):
            raise ConfigError(f"env_kwargs={self.env_kwargs!r} must be a dict or None")
        from ._config import check_kwargs
        from ._limits import check_seed

        check_kwargs("env_kwargs", self.env_kwargs)
        check_seed(self.seed)  # episode j starts with reset(seed=seed + j); torch's generator gets seed
        if isinstance(self.nice, bool) or not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            raise ConfigError(f"nice={self.nice!r} must be an int from 0 (same priority as the trainer) to 19 (lowest)")
        timeout = self.shutdown_timeout
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout >= 0 and math.isfinite(timeout)):
            raise ConfigError(f"shutdown_timeout={timeout!r} must be a finite number of seconds >= 0")
        check_data_options(self.check_finite, self.action_bounds)
        if self.on_worker_failure not in ("raise", "restart"):
            raise ConfigError(
                f"on_worker_failure={self.on_worker_failure!r} must be 'raise' (fail the evaluation) or 'restart' "
                f"(run it again on a new worker)"
            )
        _int_at_least("max_restarts", self.max_restarts, 0, "it bounds the new workers within restart_window")
        if self.restart_window is not None:
            _positive_seconds("restart_window", self.restart_window, "or None to count over the evaluator's whole life")
        if self.step_timeout is not None:
            _positive_seconds("step_timeout", self.step_timeout, "or None to wait for ever")


def _in_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:  # pragma: no cover - trio is optional
        try:
            trio.lowlevel.current_task()
            return True
        except RuntimeError:
            pass
    return False


def _on_cpu(policy: Any) -> Any:
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


def _weights_state(weights: Any) -> tuple[str, Mapping[str, Any]]:
    """``(kind, {name: value})`` of the weights given (not copied); raises :class:`ConfigError`
    for what is not weights."""
    from ._weights import named

    torch = sys.modules.get("torch")
    td = sys.modules.get("tensordict")
    if torch is not None and isinstance(weights, torch.nn.Module):
        kind, state = "state_dict", weights.state_dict()
    elif td is not None and isinstance(weights, td.TensorDictBase):
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


def _weights_payload(weights: Any) -> tuple[str, dict] | None:
    """``(kind, {name: tensor})`` to send: a CPU snapshot taken now (training may change the
    parameters before the evaluation runs)."""
    if weights is None:
        return None
    import torch

    kind, state = _weights_state(weights)
    snapshot = {}
    for name, value in state.items():
        snapshot[name] = value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
    return kind, snapshot


class _EvalProcess(ChildProcess):
    """The evaluator's worker process, whose messages are read by one task (:meth:`read`) so
    that its death is noticed at once, even between evaluations; with a ``step_timeout``, its
    heartbeat (:meth:`watch`)."""

    def __init__(self, sock: socket.socket, *, after_death: str, **_: Any) -> None:
        super().__init__(sock, index=None, who="the evaluator's worker", after_death=after_death)
        self.replies: deque[Any] = deque()
        self.wakeup: anyio.Event | None = None
        self.dead: WorkerError | None = None  # its socket reached end-of-file (the hang, if it was hung)
        self.failed = False  # it reported a fatal error (and exits)
        self.hung: WorkerError | None = None  # set by the watchdog before it kills the process
        self.scope: anyio.CancelScope | None = None
        self.reader_done: anyio.Event | None = None
        self.heartbeat_fd: int | None = None
        self.monitor: _heartbeat.HeartbeatMonitor | None = None

    def watch(self) -> int:
        """Allocate the heartbeat (a small memfd of its own); return the fd to send."""
        fd, mm = _shm.allocate(_heartbeat.NBYTES, f"aiocollect-{os.getpid()}-eval")
        self.heartbeat_fd, self.monitor = fd, _heartbeat.HeartbeatMonitor(mm, 0)
        return fd

    def close_fds(self) -> None:
        super().close_fds()
        if self.heartbeat_fd is not None:
            os.close(self.heartbeat_fd)
            self.heartbeat_fd = None
        # the mapping goes with the monitor (a watchdog reading a stack dump may still hold it)
        self.monitor = None

    async def send(self, msg: Any, fds: tuple[int, ...] = ()) -> None:
        try:
            await super().send(msg, fds)
        except OSError:  # broken pipe: the worker is gone
            raise (self.dead or self.broken()) from None

    async def read(self, on_death: Callable[["_EvalProcess", WorkerError], None], *, task_status: Any) -> None:
        self.reader_done = anyio.Event()
        try:
            with anyio.CancelScope() as scope:
                self.scope = scope
                task_status.started()
                while True:
                    try:
                        msg = await self.recv()
                    except BrokenWorkerError as exc:
                        self.dead = self.hung or exc
                        self._wake()
                        if not self.failed:
                            on_death(self, self.dead)
                        return
                    if msg[0] == "error":
                        self.failed = True
                    self.replies.append(msg)
                    self._wake()
        finally:
            self.reader_done.set()

    def _wake(self) -> None:
        if self.wakeup is not None:
            self.wakeup.set()

    async def reply(self) -> Any:
        while not self.replies:
            if self.dead is not None:
                raise self.dead
            self.wakeup = anyio.Event()
            await self.wakeup.wait()
        return self.replies.popleft()

    async def stop(self, timeout: float) -> None:
        """Close our end for writing (the worker exits at end-of-file, even mid-message); kill it
        after ``timeout`` seconds."""
        if self.scope is not None:
            self.scope.cancel()
            assert self.reader_done is not None
            await self.reader_done.wait()  # no task may wait on the socket when it is closed
        if self.pid is not None:
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            if self.dead is None and not await self.wait_exit(timeout):
                self.kill()
            if not await self.wait_exit(5.0):  # pragma: no cover - unkillable (D state)
                self.kill()
                raise RuntimeError(f"the evaluator's worker (pid {self.pid}) did not exit after SIGKILL")
        self.close_fds()


@dataclasses.dataclass(eq=False)
class _Request:
    id: int
    step: int | None
    weights: Any
    background: bool
    done: anyio.Event
    result: dict | None = None
    error: BaseException | None = None
    abandoned: bool = False  # the evaluate() call waiting for it was cancelled
    sent: bool = False  # the whole request reached the worker's socket


class Evaluator(AsyncResource):
    """Evaluates a policy on whole episodes in a worker process of its own.

    >>> async with Evaluator("CartPole-v1", policy, num_trajectories=10, seed=0) as ev:  # doctest: +SKIP
    ...     metrics = await ev.evaluate(policy, step=0)      # the module's current weights
    ...     metrics["return_mean"], metrics["episode_length_mean"]
    ...     ev.trigger(policy, step=1)                        # in the background
    ...     await ev.wait()                                   # {... 'step': 1 ...}

    The env (an id or a factory, ``num_envs`` of them) and a replica of the policy live in one
    process forked from aiocollect's launcher: evaluation never competes with the training
    loop's event loop for the GIL, and needs nothing from it but a few small messages. The
    policy runs on CPU under ``exploration_type`` (tensordict's interaction type; deterministic
    by default), with autograd off and, for an ``nn.Module``, in eval mode (dropout off).

    **Metrics** (a dict, Python numbers): ``return_mean``, ``return_std`` (population, ``ddof=0``),
    ``return_min``, ``return_max``, ``episode_length_mean``, whatever ``metrics_fn(returns,
    lengths)`` adds, then ``step`` (as given), ``num_trajectories`` and ``seconds`` (wall time
    from sending the request to the result, weight transfer included).

    **Weights.** ``weights`` may be an ``nn.Module`` (its ``state_dict()`` is used), a state dict,
    ``TensorDict.from_module(module)``, or ``None``: the weights the policy was built with. They
    are copied to the CPU when the call is made (a triggered evaluation evaluates the weights of
    the moment it was triggered), pickled to the worker and loaded into its replica; names must
    match the policy's (for a ``TensorDictModule`` policy, its inner module's also fit). The copy
    and the pickling run in the event loop: for a model of hundreds of megabytes that holds it
    for tens of milliseconds.

    **Background evaluations.** :meth:`trigger` schedules one and returns at once (from any task
    of the loop; it needs no ``await``); while one is pending it follows ``busy_policy``. Results
    arrive as :class:`~aiocollect.events.EvaluationCompleted` events (:meth:`on`,
    :meth:`subscribe`, :meth:`wait_for`), through ``on_result``, :meth:`poll` and :meth:`wait`.
    Evaluations run one at a time, in order; :meth:`evaluate` waits its turn behind them.

    **Errors** are never dropped. An evaluation that raises (the env, the policy, ``metrics_fn``)
    emits :class:`~aiocollect.events.EvaluationFailed`; :meth:`evaluate` raises the error, and a
    background one's error is raised by the next :meth:`trigger`, :meth:`poll`, :meth:`wait` or
    :meth:`aclose` (once; where several failed, the first, with a note counting the others). An
    exception of the worker is a :class:`WorkerError` (the original as ``__cause__``, the worker
    traceback in the message); a worker killed from outside is a :class:`BrokenWorkerError`, as
    soon as its socket closes (between evaluations too), and the next evaluation starts a new
    worker. An exception in an event handler or ``on_result`` surfaces the same way. Bad
    arguments raise :class:`ConfigError` here, before any process starts.

    **Worker failures.** With ``step_timeout=seconds`` the worker writes, before each env reset,
    env step and policy call of an evaluation, the time into a heartbeat in shared memory, which
    the evaluator reads a few times per timeout; a call that outlasts ``step_timeout`` makes the
    worker hung: its Python stack is taken (``faulthandler``, through ``SIGUSR1``), it is killed,
    and the evaluation fails with :class:`WorkerTimeoutError` (naming the env, what it was doing
    and that stack). An idle worker (between evaluations, loading weights) is never hung. With
    ``on_worker_failure="restart"`` an evaluation whose worker died, crashed or hung runs again,
    from its start, on a new worker: :meth:`evaluate` returns its metrics, and the failure is a
    :class:`~aiocollect.events.WorkerFailed` then a :class:`~aiocollect.events.WorkerRestarted`
    event (``worker=-1``: the evaluator's worker has no index); a worker that dies between
    evaluations is replaced at once, and no error is raised for it. At most ``max_restarts`` new
    workers within ``restart_window`` seconds (:attr:`restarts` counts them all): the next
    failure fails its evaluation with a note naming ``max_restarts`` (between evaluations: is
    raised like a background evaluation's error), and the next evaluation starts a new worker. An exception of the env or
    the policy is *not* a worker failure (the worker reports it and stays usable): it fails its
    evaluation under either setting, as a rerun would raise it again.

    **Lifecycle.** ``async with Evaluator(...)``, or ``await start()`` (optional: the first
    evaluation starts it) and ``await aclose()``. The evaluator's work runs in a task of its own,
    not the caller's: it may be started in one notebook cell, triggered in others, closed in
    another. :meth:`aclose` is idempotent, shielded from cancellation, and leaves no process
    behind: it abandons the evaluations still pending (``await wait()`` first to keep them),
    stops the worker (killed after ``shutdown_timeout``) and ends subscriptions. A closed
    evaluator cannot be reopened (:class:`EvaluatorClosedError`).

    See :class:`EvaluatorConfig` for every option.
    """

    def __init__(
        self,
        env: Any,
        policy: Any = None,
        *,
        policy_factory: Callable[[], Any] | None = None,
        num_trajectories: int = 10,
        max_steps: int | None = None,
        exploration_type: Any = "deterministic",
        metrics_fn: Callable[[np.ndarray, np.ndarray], Any] | None = None,
        on_result: Callable[[dict], Any] | None = None,
        busy_policy: Literal["skip", "error", "queue"] = "skip",
        max_queued: int = 4,
        num_envs: int = 1,
        env_kwargs: dict | None = None,
        seed: int | None = None,
        shutdown_timeout: float = 5.0,
        nice: int = 0,
        check_finite: bool = False,
        action_bounds: str = "pass",
        on_worker_failure: Literal["raise", "restart"] = "raise",
        max_restarts: int = 3,
        restart_window: float | None = 60.0,
        step_timeout: float | None = None,
    ) -> None:
        import cloudpickle

        self.config = c = EvaluatorConfig(
            env=env,
            policy=policy,
            policy_factory=policy_factory,
            num_trajectories=num_trajectories,
            max_steps=max_steps,
            exploration_type=exploration_type,
            metrics_fn=metrics_fn,
            on_result=on_result,
            busy_policy=busy_policy,
            max_queued=max_queued,
            num_envs=num_envs,
            env_kwargs=env_kwargs,
            seed=seed,
            shutdown_timeout=shutdown_timeout,
            nice=nice,
            check_finite=check_finite,
            action_bounds=action_bounds,  # type: ignore[arg-type]
            on_worker_failure=on_worker_failure,
            max_restarts=max_restarts,
            restart_window=restart_window,
            step_timeout=step_timeout,
        )
        if c.policy_factory is not None:
            mode, obj, kind = "factory", c.policy_factory, "factory"
        elif c.policy is not None:
            mode, obj, kind = "object", c.policy, classify(c.policy)[0]
        else:
            mode, obj, kind = "random", None, "random"
        if mode == "object":
            obj = _on_cpu(obj)
        try:
            payload = cloudpickle.dumps(obj) if obj is not None else b""
        except Exception as exc:
            name = "policy_factory" if mode == "factory" else "policy"
            raise ConfigError(
                f"{name}={obj!r:.100} could not be pickled for the evaluator's worker ({type(exc).__name__}: "
                f"{exc}); pass policy_factory=<a picklable function that builds it> instead"
            ) from exc
        # ids registered in this process, for the worker (taken now: the config is sent as is)
        registry = snapshot_registry(c.env if isinstance(c.env, str) else None, "env")
        try:
            self._worker_config = cloudpickle.dumps(EvalWorkerConfig(
                env_fn=c.env,
                env_kwargs=dict(c.env_kwargs or {}),
                policy_mode=mode,
                policy_payload=payload,
                exploration_type=c.exploration_type,
                num_envs=c.num_envs,
                max_steps=c.max_steps,
                seed=c.seed,
                nice=c.nice,
                registry=registry,
                check_finite=c.check_finite,
                action_bounds=c.action_bounds,
            ))
        except Exception as exc:
            raise ConfigError(
                f"env={c.env!r:.100} (or env_kwargs) could not be pickled for the evaluator's worker "
                f"({type(exc).__name__}: {exc}); pass a gymnasium id or a function that builds the env"
            ) from exc
        needs = PolicySpec(kind).needs
        td_nn = sys.modules.get("tensordict.nn")
        if td_nn is not None and isinstance(c.policy, td_nn.TensorDictModuleBase):
            needs = ("torch", "tensordict")
        self._needs = needs
        self._state = EvaluatorState.CREATED
        self._bus = EventBus()
        self._queue: deque[_Request] = deque()
        self._current: _Request | None = None  # running in the worker
        self._reporting: _Request | None = None  # done; its events and on_result are running
        self._proc: _EvalProcess | None = None
        self._errors: list[BaseException] = []  # background failures nobody has seen yet
        self._start_error: BaseException | None = None
        self._unconsumed: dict | None = None
        self._last: dict | None = None
        self._ids = itertools.count(1)
        self._task: Any = None
        self.completed = 0
        """Evaluations that completed (metrics computed)."""
        self.failed = 0
        """Evaluations that raised."""
        self.skipped = 0
        """Triggers skipped because an evaluation was pending (``busy_policy="skip"``)."""
        self.restarts = 0
        """Workers started to replace one that died, crashed or hung (``on_worker_failure="restart"``)."""
        self._budget = RestartBudget(self.config.max_restarts, self.config.restart_window)
        # let the launcher import what the worker needs while the caller does other things
        get_launcher().ensure_started(needs)

    # -- public state -----------------------------------------------------------------------------
    @property
    def state(self) -> EvaluatorState:
        return self._state

    @property
    def pending(self) -> int:
        """Evaluations running or queued (triggered and :meth:`evaluate` calls alike). An
        evaluation whose events and ``on_result`` are being delivered no longer counts: its
        handlers may trigger the next one."""
        return len(self._queue) + (self._current is not None)

    @property
    def worker_pid(self) -> int | None:
        """Process id of the worker process (``None`` before it started, after it died or closed)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.dead is None else None

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<Evaluator {c.env!r} {self._state.value}: {c.num_trajectories} episodes per evaluation, "
            f"{self.completed} completed, {self.pending} pending>"
        )

    # -- events -----------------------------------------------------------------------------------
    def on(self, event_type: type[E], handler: Callable[[E], Any] | None = None) -> Any:
        """Call ``handler(event)`` (sync or async, awaited in registration order) for each
        :class:`~aiocollect.events.EvaluationCompleted` / :class:`~aiocollect.events.EvaluationFailed`,
        and :class:`~aiocollect.events.WorkerFailed` / :class:`~aiocollect.events.WorkerRestarted`
        about its worker (or any superclass registered). Returns a handle whose ``remove()`` unsubscribes; without
        ``handler`` it is a decorator. Handlers run in the evaluator's own task, before the next
        evaluation starts (so a handler may call :meth:`trigger`, but must not await
        :meth:`evaluate` or :meth:`wait`: they would wait for the handler itself). An exception
        in one surfaces like a background evaluation's error (from :meth:`evaluate` for its own
        evaluation)."""
        return self._bus.on(event_type, handler)

    def subscribe(
        self, event_type: type[E], *, max_buffer: int = 1024, overflow: Overflow = "drop_oldest"
    ) -> Subscription[E]:
        """A bounded stream of events of ``event_type`` (ends when the evaluator closes); a slow
        subscriber loses events by its ``overflow`` policy and never slows the evaluator."""
        return self._bus.subscribe(event_type, max_buffer=max_buffer, overflow=overflow)

    async def wait_for(self, event_type: type[E], predicate: Callable[[E], bool] | None = None) -> E:
        """The next event of ``event_type`` that ``predicate`` accepts. Raises
        :class:`EvaluatorClosedError` if the evaluator closes first."""
        try:
            return await self._bus.wait_for(event_type, predicate)
        except anyio.EndOfStream:
            raise EvaluatorClosedError(
                f"the evaluator closed before a matching {event_type.__name__} event"
            ) from None

    # -- lifecycle --------------------------------------------------------------------------------
    def _launch(self) -> None:
        """Start the evaluator's own task (not the caller's: a notebook cell may end)."""
        if self._state is not EvaluatorState.CREATED:
            return
        if not _in_event_loop():
            raise RuntimeError(
                "the Evaluator needs a running event loop: call it from async code (a task of the loop "
                "it should run in)"
            )
        self._started = anyio.Event()
        self._done = anyio.Event()
        self._stop = anyio.Event()
        self._wakeup = anyio.Event()
        self._changed = anyio.Event()
        self._state = EvaluatorState.STARTING
        self._task = spawn_system_task(self._run)

    async def start(self) -> None:
        """Start the worker process and wait until it is ready (idempotent). Raises what the
        worker raised while starting (the env factory's error, a :class:`SpecError` for a policy
        that does not fit the env ...); the evaluator is then closed."""
        if self._state is EvaluatorState.CLOSED and self._task is None:
            raise EvaluatorClosedError("this evaluator is closed and cannot be reopened; create a new Evaluator")
        self._launch()
        await self._started.wait()
        error = self._start_error
        if error is not None:
            await wait_shielded(self._done)
            if error in self._errors:  # nobody has seen it yet: raised here, not again by poll() ...
                self._errors.remove(error)
                raise error
            raise EvaluatorClosedError(
                f"this evaluator is closed: its worker failed to start ({type(error).__name__}: {error}); "
                f"create a new Evaluator"
            ) from error
        if self._state is EvaluatorState.CLOSED:
            raise EvaluatorClosedError("this evaluator is closed and cannot be reopened; create a new Evaluator")

    async def aclose(self) -> None:
        """Stop the worker (``shutdown_timeout`` seconds to close its envs, then killed), abandon
        pending evaluations (a waiting :meth:`evaluate` raises :class:`EvaluatorClosedError`) and
        end subscriptions. Idempotent; shielded from cancellation. Raises a background error that
        nobody has seen yet."""
        self._state = EvaluatorState.CLOSED
        if self._task is not None:
            self._stop.set()
            try:
                await wait_shielded(self._done)  # even under task.cancel(): the worker is gone first
            finally:
                self._bus.close()
        else:
            self._bus.close()
        self._raise_background_error()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is None or getattr(self, "_state", None) is EvaluatorState.CLOSED and self._done.is_set():
            return
        warnings.warn(
            f"{self!r} was not closed: use `async with Evaluator(...)` or `await evaluator.aclose()`",
            ResourceWarning,
            stacklevel=2,
        )
        try:
            proc.stop_nowait()
        except Exception:
            pass

    # -- evaluating -------------------------------------------------------------------------------
    async def evaluate(self, weights: Any = None, step: int | None = None) -> dict:
        """Evaluate ``weights`` (see the class docstring) and return the metrics, tagged ``step``.

        Starts the evaluator if needed; waits behind evaluations already pending. Raises the
        evaluation's error (a :class:`WorkerError` for the env's or policy's exception, a
        :class:`BrokenWorkerError` if the worker died, a :class:`WorkerTimeoutError` if it hung
        past ``step_timeout``, ``metrics_fn``'s or an event handler's exception) and
        :class:`EvaluatorClosedError` if the evaluator is closed meanwhile. Under
        ``on_worker_failure="restart"`` a worker's death or hang is not raised (the evaluation runs
        again on a new worker) unless the restart budget is spent.
        Cancelling the call abandons the evaluation: the worker stops it between two steps and
        no event is emitted for it (unless it had finished already).

        Raises :class:`ConfigError` for a ``step`` that is not an int or ``None``, and for
        ``weights`` that are no weights (or given to an evaluator without a policy), before
        anything starts.
        """
        self._check_request(weights, step)
        await self.start()
        req = self._submit(weights, step, background=False)
        try:
            await req.done.wait()
        except BaseException:
            if not req.done.is_set():
                self._abandon(req)
            raise
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def trigger(self, weights: Any = None, step: int | None = None) -> bool:
        """Schedule an evaluation of ``weights`` (copied now) in the background and return at
        once; True if it was scheduled.

        Starts the evaluator if needed (its start-up error then surfaces like a background
        one). While an evaluation is pending, ``busy_policy`` decides: ``"skip"`` returns False,
        ``"error"`` raises :class:`EvaluatorBusyError`, ``"queue"`` queues it behind the others,
        raising :class:`EvaluatorBusyError` when ``max_queued`` already wait. First raises the
        error of an earlier background evaluation nobody has seen yet (nothing is scheduled
        then), and :class:`EvaluatorClosedError` after :meth:`aclose`. Call it from a task of
        the event loop the evaluator runs in.
        """
        self._check_request(weights, step)
        self._raise_background_error()
        if self._state is EvaluatorState.CLOSED:
            raise EvaluatorClosedError("this evaluator is closed; create a new Evaluator")
        if self.pending:
            busy = self.config.busy_policy
            if busy == "skip":
                self.skipped += 1
                return False
            if busy == "error":
                raise EvaluatorBusyError(
                    f"an evaluation is already pending (pending={self.pending}) and busy_policy='error'; "
                    f"`await evaluator.wait()` before triggering, or use busy_policy='skip' or 'queue'"
                )
            queued = self.pending - 1  # one runs (or is about to), the others wait
            if queued >= self.config.max_queued:
                raise EvaluatorBusyError(
                    f"{queued} evaluations already wait behind the running one (max_queued="
                    f"{self.config.max_queued}); trigger less often, `await evaluator.wait()`, raise "
                    f"max_queued, or use busy_policy='skip'"
                )
        self._submit(weights, step, background=True)
        return True

    def poll(self) -> dict | None:
        """The metrics of the latest background evaluation completed since the last
        :meth:`poll` or :meth:`wait` (older ones are superseded: see the events), or ``None``.
        Never blocks. Raises a background evaluation's error nobody has seen yet (once)."""
        self._raise_background_error()
        result, self._unconsumed = self._unconsumed, None
        return result

    async def wait(self) -> dict | None:
        """Wait until no evaluation is pending; return the metrics of the last one that completed
        (``None`` if none has). Raises a background evaluation's error nobody has seen yet."""
        while self.pending or self._reporting is not None:
            await self._changed.wait()
        self._raise_background_error()
        self._unconsumed = None
        return self._last

    # -- the caller's side of requests ----------------------------------------------------------
    def _check_request(self, weights: Any, step: Any) -> None:
        """The arguments of :meth:`evaluate` / :meth:`trigger` (before anything starts)."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ConfigError(f"step={step!r} must be an int or None (it tags the metrics: the training step)")
        if weights is None:
            return
        c = self.config
        if c.policy is None and c.policy_factory is None:
            from ._weights import named

            raise ConfigError(
                f"{named('weights', weights)} were given, but the evaluator has no policy (random actions): build it "
                f"with Evaluator(env, policy) to evaluate weights"
            )
        _weights_state(weights)

    def _submit(self, weights: Any, step: int | None, *, background: bool) -> _Request:
        payload = _weights_payload(weights)
        self._launch()
        req = _Request(next(self._ids), step, payload, background, anyio.Event())
        self._queue.append(req)
        self._wakeup.set()
        self._notify()
        return req

    def _abandon(self, req: _Request) -> None:
        req.abandoned = True
        try:
            self._queue.remove(req)
        except ValueError:
            pass
        else:
            self._notify()
            return
        proc = self._proc
        if req is self._current and req.sent and proc is not None:
            proc.send_nowait(("abort", req.id))  # the socket is idle: the request was sent whole

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def _add_error(self, exc: BaseException) -> None:
        self._errors.append(exc)
        self._notify()

    def _raise_background_error(self) -> None:
        if not self._errors:
            return
        first, *rest = self._errors
        self._errors.clear()
        if rest:
            add_note(
                first,
                f"{len(rest)} more background evaluation(s) failed after this one "
                f"({', '.join(type(e).__name__ for e in rest)}); each was an EvaluationFailed event",
            )
        raise first

    # -- the evaluator's own task ---------------------------------------------------------------
    async def _run(self) -> None:
        try:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._main, tg)
                    await self._stop.wait()
                    tg.cancel_scope.cancel()
            except Exception as exc:  # noqa: BLE001 - a bug of ours: reported, never lost
                self._add_error(_unwrap(exc))
            finally:
                proc, self._proc = self._proc, None
                if proc is not None:
                    try:
                        with anyio.CancelScope(shield=True):
                            await proc.stop(self.config.shutdown_timeout)
                    except BaseException:
                        proc.stop_nowait()  # the event loop is going away: no more awaiting
                        raise
        finally:
            self._abandon_all()
            # aclose(), a failed start (or a bug of ours, reported above) ends this task: closed
            self._state = EvaluatorState.CLOSED
            self._bus.close()
            self._started.set()
            self._done.set()

    async def _main(self, tg: Any) -> None:
        try:
            self._proc = await self._spawn(tg)
        except Exception as exc:  # noqa: BLE001 - raised by start(), or surfaced like a background error
            self._start_error = exc
            self._add_error(exc)
            self._stop.set()
            return
        finally:
            if self._state is EvaluatorState.STARTING and self._start_error is None:
                self._state = EvaluatorState.RUNNING
            self._started.set()
        if self.config.step_timeout is not None:
            tg.start_soon(self._watchdog, self.config.step_timeout)
        await self._schedule(tg)

    def _abandon_all(self) -> None:
        closed = EvaluatorClosedError("the evaluator was closed before this evaluation completed")
        requests = list(self._queue) + [r for r in (self._current, self._reporting) if r is not None]
        self._queue.clear()
        self._current = self._reporting = None
        for req in requests:
            if not req.done.is_set():
                req.error = closed
                req.done.set()
        self._notify()

    async def _spawn(self, tg: Any) -> _EvalProcess:
        restart = self.config.on_worker_failure == "restart"
        after = "; a new worker replaces it (on_worker_failure='restart')" if restart else "; the next evaluation starts a new worker"
        proc = _EvalProcess.spawn(get_launcher(), self._needs, _ENTRY, after_death=after)
        try:
            fds = (proc.watch(),) if self.config.step_timeout is not None else ()
            await proc.handshake()
            await proc.send(("config", self._worker_config), fds)
            await proc.expect("ready")
            await tg.start(proc.read, self._worker_died)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await proc.stop(0)
            raise
        return proc

    def _worker_died(self, proc: _EvalProcess, exc: WorkerError) -> None:
        """Between evaluations nobody waits on the worker: report its death now (under
        ``"restart"``: replace it now). One killed as hung had its evaluation end meanwhile:
        the next evaluation starts a new worker."""
        if proc is not self._proc or self._current is not None or self._stop.is_set() or proc.hung is not None:
            return
        if self.config.on_worker_failure == "restart":
            self._wakeup.set()
        else:
            self._add_error(exc)

    async def _schedule(self, tg: Any) -> None:
        restart = self.config.on_worker_failure == "restart"
        while True:
            while not self._queue:
                proc = self._proc
                if restart and proc is not None and proc.dead is not None and proc.hung is None:
                    try:  # it died between evaluations: a new worker now, ready for the next one
                        await self._replace(tg, proc, proc.dead)
                    except Exception as exc:  # noqa: BLE001 - past the budget (or a handler's error)
                        self._add_error(exc)
                    continue
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
            req = self._current = self._queue.popleft()
            try:
                try:
                    metrics = await self._run_one(req, tg)
                except Exception as exc:  # noqa: BLE001 - the evaluation's failure, reported
                    failure: BaseException | None = exc
                else:
                    failure = None
                # no longer pending (a handler may trigger the next one), but wait() waits for it
                self._current, self._reporting = None, req
                self._notify()
                if failure is not None:
                    await self._report_failure(req, failure)
                else:
                    await self._report_success(req, metrics)
            finally:
                self._current = self._reporting = None
                if not req.done.is_set():  # cancelled (closing), or aborted by its caller
                    req.error = EvaluatorClosedError("the evaluator was closed before this evaluation completed")
                    req.done.set()
                self._notify()

    async def _run_one(self, req: _Request, tg: Any) -> dict | None:
        """Run ``req`` to its metrics (``None``: aborted). Under ``"restart"`` a worker that dies,
        crashes or hangs meanwhile is replaced and the evaluation runs again from its start,
        within the restart budget; an env's or policy's exception (the worker reports it and
        stays usable) fails the evaluation either way."""
        restart = self.config.on_worker_failure == "restart"
        weights, req.weights = req.weights, None  # kept until the evaluation ends, for a rerun
        while True:
            proc = self._proc
            if restart and proc is not None and proc.dead is not None and proc.hung is None:
                lost: BaseException = proc.dead  # it died between evaluations, not replaced yet
            else:
                try:
                    proc = await self._live_worker(tg)
                except Exception as exc:
                    if not restart:
                        raise
                    lost, proc = exc, None  # a new worker that failed to start: counted the same
                else:
                    t0 = time.perf_counter()
                    try:
                        msg = await self._attempt(proc, req, weights)
                    except WorkerError as exc:  # its death or hang, seen by send() or reply()
                        if not restart:
                            raise
                        lost = exc
                    else:
                        if msg[0] == "result":
                            return await self._metrics(req, msg[2], msg[3], time.perf_counter() - t0)
                        if msg[0] == "aborted":
                            return None
                        error = proc.error_from(msg)
                        if msg[0] == "failed" or not restart:  # "error": fatal, the worker exits
                            raise error
                        lost = error
            await self._replace(tg, proc, lost)
            if req.abandoned:  # its caller is gone: not run again
                return None

    async def _live_worker(self, tg: Any) -> _EvalProcess:
        """The worker, or a new one if there is none or it is gone (its failure was reported)."""
        proc = self._proc
        if proc is None or proc.dead is not None or proc.failed:
            self._proc = None
            if proc is not None:
                with anyio.CancelScope(shield=True):
                    await proc.stop(self.config.shutdown_timeout)
            proc = self._proc = await self._spawn(tg)
        return proc

    async def _attempt(self, proc: _EvalProcess, req: _Request, weights: Any) -> Any:
        """Send ``req`` to ``proc``; return its answer (``result``, ``failed``, ``aborted`` or a
        fatal ``error``). Raises the worker's death (or hang) if it comes first."""
        req.sent = False
        await proc.send(("evaluate", req.id, weights, self.config.num_trajectories))
        req.sent = True
        if req.abandoned:
            await proc.send(("abort", req.id))
        while True:
            msg = await proc.reply()
            if msg[0] == "error" or msg[1] == req.id:
                return msg
            # else the answer to an abort that arrived after its evaluation finished

    async def _replace(self, tg: Any, proc: _EvalProcess | None, error: BaseException) -> None:
        """``proc`` died, crashed or hung (``error``): emit :class:`WorkerFailed`, stop it and,
        within the restart budget, start a new worker (:class:`WorkerRestarted`). Past the
        budget, raises ``error`` with a note saying so (the next evaluation starts a new worker)."""
        old_pid = pid = None if proc is None else proc.pid
        if proc is not None:
            self._proc = None
            with anyio.CancelScope(shield=True):
                await proc.stop(0)  # dead or hung already: killed now if it is not gone
        while True:
            await self._bus.emit(WorkerFailed(worker=-1, pid=pid, error=error))
            if not self._may_restart(error):
                raise error
            try:
                self._proc = await self._spawn(tg)
            except Exception as exc:  # noqa: BLE001 - the new worker failed to start: counted the same
                error, pid = exc, None
                continue
            break
        self.restarts += 1
        await self._bus.emit(WorkerRestarted(worker=-1, pid=self._proc.pid, old_pid=old_pid))

    def _may_restart(self, error: BaseException) -> bool:
        if self.config.on_worker_failure != "restart" or self._stop.is_set():
            return False
        return self._budget.allow(error)

    async def _watchdog(self, timeout: float) -> None:
        """Declare the worker hung when it spends longer than ``timeout`` in one call of an
        evaluation (never while idle: its heartbeat says so, and it is only read during one)."""
        period = min(max(timeout / 4, 0.01), 1.0)
        while True:
            await anyio.sleep(period)
            proc = self._proc
            if proc is None or self._current is None or proc.dead is not None or proc.hung is not None:
                continue
            monitor = proc.monitor
            stuck = None if monitor is None else monitor.stuck(timeout)
            if stuck is None:
                continue
            error = await proc.hung_error(monitor, *stuck, timeout)  # type: ignore[arg-type]
            if proc.dead is None:  # (else it died meanwhile, of something else)
                proc.hung = error
                proc.kill()

    async def _metrics(self, req: _Request, returns: list[float], lengths: list[int], seconds: float) -> dict:
        r = np.asarray(returns, dtype=np.float64)
        n = np.asarray(lengths, dtype=np.int64)
        metrics: dict[str, Any] = {
            "return_mean": float(r.mean()),
            "return_std": float(r.std()),
            "return_min": float(r.min()),
            "return_max": float(r.max()),
            "episode_length_mean": float(n.mean()),
        }
        fn = self.config.metrics_fn
        if fn is not None:
            extra = fn(r.copy(), n.copy())
            if inspect.isawaitable(extra):
                extra = await extra
            if not isinstance(extra, Mapping):
                raise TypeError(
                    f"metrics_fn returned {type(extra).__name__}; it must return a mapping of metric names to values"
                )
            metrics.update(extra)
        metrics.update(step=req.step, num_trajectories=len(r), seconds=seconds)
        return metrics

    async def _report_success(self, req: _Request, metrics: dict | None) -> None:
        if metrics is None:  # aborted: its caller is gone
            return
        self.completed += 1
        self._last = metrics
        if req.background:
            self._unconsumed = metrics
        req.result = metrics
        try:
            await self._bus.emit(EvaluationCompleted(step=req.step, metrics=dict(metrics)))
            on_result = self.config.on_result
            if on_result is not None:
                result = on_result(dict(metrics))
                if inspect.isawaitable(result):
                    await result
        except Exception as exc:  # noqa: BLE001 - a handler's error: surfaced, never dropped
            if req.background or req.abandoned:
                self._add_error(exc)
            else:
                req.error = exc
        req.done.set()

    async def _report_failure(self, req: _Request, exc: BaseException) -> None:
        self.failed += 1
        handler_error = None
        try:
            await self._bus.emit(EvaluationFailed(step=req.step, error=exc))
        except Exception as handler_exc:  # noqa: BLE001 - surfaced, with the evaluation's error as context
            handler_exc.__context__ = exc
            handler_error = handler_exc
        error = handler_error or exc
        if req.background:
            self._add_error(error)
        elif not req.abandoned:
            req.error = error
        elif handler_error is not None:  # its caller gave up on the evaluation, not on the handler
            self._add_error(handler_error)
        req.done.set()
