"""The evaluator: runs a policy for whole episodes in its own worker process and reports return
and episode-length metrics, on demand (``await evaluate()``) or in the background
(``trigger()``), without ever holding the training loop's event loop.

This module is the public front; its options are :mod:`aiocollect._evaluator.config`, its own task and
state :mod:`aiocollect._evaluator.run`, the parent's side of its worker :mod:`aiocollect._backends.eval_process`,
their messages :mod:`aiocollect._core.eval_wire` and the worker itself :mod:`aiocollect._worker.eval_main`.
"""

from __future__ import annotations

from typing import Any, Callable

import anyio

from .._core.errors import ConfigError, EvaluatorBusyError, EvaluatorClosedError
from .._service.options import takes_options
from .config import EvaluatorConfig, EvaluatorState, check_request, weights_payload, worker_setup
from .lifecycle import EvalPhase
from .run import EvalRun, in_event_loop
from .._service.env_calls import not_torchrl_map_fn, rows_named, values_for
from .._service.front import Service, warn_unclosed
from .._core.public import public

__all__ = [
    "Evaluator",
    "EvaluatorBusyError",
    "EvaluatorClosedError",
    "EvaluatorConfig",
    "EvaluatorState",
]


@public
class Evaluator(Service):
    """Evaluates a policy on whole episodes in a worker process of its own.

    Examples:
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
    from sending the request to the result, weight transfer included). With ``record_video=True``
    also ``video``: the first episode's frames (``uint8 [T, H, W, 3]``) or, with ``video_dir``,
    the path of the mp4 file written from them (see :class:`EvaluatorConfig`).

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

    **Reaching into the envs.** :meth:`call`, :meth:`get_attr`, :meth:`set_attr`, :meth:`map_fn`
    and :meth:`getattr_env` reach the worker's envs as the collector's methods of the same names
    do (one result per env, in env order; ``indices=`` for some of them), between evaluations:
    they wait their turn behind the evaluations made before them, and the evaluations made after
    them see their effect (an evaluation runs with the settings it started with). ``set_attr``
    calls, and calls made with ``persist=True``, are kept: a new worker (after a failure, or for
    the next evaluation after a death) applies them before its first evaluation. What the env
    raises is raised as the worker's error (an instance of the env's exception type too); the
    worker goes on.

    **Lifecycle.** ``async with Evaluator(...)``, or ``await start()`` (optional: the first
    evaluation starts it) and ``await aclose()``. The evaluator's work runs in a task of its own,
    not the caller's: it may be started in one notebook cell, triggered in others, closed in
    another. :meth:`aclose` is idempotent, shielded from cancellation, and leaves no process
    behind: it abandons the evaluations still pending (``await wait()`` first to keep them),
    stops the worker (killed after ``shutdown_timeout``) and ends subscriptions. A closed
    evaluator cannot be reopened (:class:`EvaluatorClosedError`).

    See :class:`EvaluatorConfig` for every option.
    """

    _closed_error = EvaluatorClosedError
    _ended = "the evaluator closed"

    @takes_options(EvaluatorConfig, {
        "create_env_fn": "pass the env id or factory first, or as env=",
        "create_env_kwargs": "use env_kwargs=",
        "num_episodes": "use num_trajectories= (episodes per evaluation)",
        "max_frames_per_traj": "use max_steps= (steps per episode at most)",
        "num_workers": "the evaluator has one worker process; num_envs= sets the envs it steps",
        "dump_video": "use record_video=True",
    })
    def __init__(self, *args: Any, **options: Any) -> None:
        # (its signature, for users, IDEs and mypy, is EvaluatorConfig's: every option is written there once)
        self.config: EvaluatorConfig = EvaluatorConfig(*args, **options)
        """The options, checked (:class:`EvaluatorConfig`)."""
        c = self.config
        worker_config, needs = worker_setup(c)
        self._run = EvalRun(c, worker_config, needs)
        self._portal: Any = None  # synchronous code (TorchRL's blocking calls): a _blocking.Portal, made on first use
        self._steps = 0  # with log_prefix: TorchRL's evaluation counter, the step of an untagged evaluation
        # let the backend prepare (the launcher import what the worker needs) while the caller does other things
        c.chosen_backend.warm_up(needs)

    # -- public state -----------------------------------------------------------------------------
    @property
    def state(self) -> EvaluatorState:
        """Where the evaluator is in its life (:class:`EvaluatorState`)."""
        return self._run.state

    @property
    def pending(self) -> int:
        """Evaluations running or queued (triggered and :meth:`evaluate` calls alike). An
        evaluation whose events and ``on_result`` are being delivered no longer counts: its
        handlers may trigger the next one."""
        return self._run.pending

    @property
    def worker_pid(self) -> int | None:
        """Process id of the worker process (``None`` before it started, after it died or closed;
        with ``backend="ray"``, the actor's process id on its node)."""
        proc = self._run.proc
        return proc.pid if proc is not None and proc.dead is None else None

    @property
    def completed(self) -> int:
        """Evaluations that completed (metrics computed)."""
        return self._run.completed

    @property
    def failed(self) -> int:
        """Evaluations that raised."""
        return self._run.failed

    @property
    def skipped(self) -> int:
        """Triggers skipped because an evaluation was pending (``busy_policy="skip"``)."""
        return self._run.skipped

    @property
    def restarts(self) -> int:
        """Workers started to replace one that died, crashed or hung (``on_worker_failure="restart"``)."""
        return self._run.restarts

    def __repr__(self) -> str:
        c = self.config
        return (
            f"<Evaluator {c.env!r} {self.state.value}: {c.num_trajectories} episodes per evaluation, "
            f"{self.completed} completed, {self.pending} pending>"
        )

    # -- lifecycle --------------------------------------------------------------------------------
    def _launch(self) -> None:
        """Start the evaluator's own task (not the caller's: a notebook cell may end)."""
        self._run.launch(self._own_task)

    async def _own_task(self) -> None:
        # the task holds the front (a forgotten evaluator is collected with its task, and its
        # __del__ stops the worker), the run never does
        await self._run.run()

    async def start(self) -> None:
        """Start the worker process and wait until it is ready (idempotent). Raises what the
        worker raised while starting (the env factory's error, a :class:`SpecError` for a policy
        that does not fit the env ...); the evaluator is then closed. A cancelled ``async with``
        entry closes the evaluator, and :meth:`aclose` ends a start-up in progress: a worker
        still starting (even one stuck in an env factory that never returns) is killed. Either
        way the worker process is gone by the time the error reaches the caller."""
        if self._run.state is EvaluatorState.CLOSED and self._run.task is None:
            raise EvaluatorClosedError("this evaluator is closed and cannot be reopened; create a new Evaluator")
        self._launch()
        await self._run.start()

    async def aclose(self) -> None:
        """Stop the worker (``shutdown_timeout`` seconds to close its envs, then killed), abandon
        pending evaluations (a waiting :meth:`evaluate` raises :class:`EvaluatorClosedError`) and
        end subscriptions. Idempotent; shielded from cancellation. Raises a background error that
        nobody has seen yet."""
        await self._run.aclose()

    def __del__(self) -> None:
        run = getattr(self, "_run", None)
        proc = None if run is None else run.proc
        if run is None or proc is None or run.phase is EvalPhase.CLOSED:  # (its task has ended)
            return
        warn_unclosed(repr(self), "Evaluator")
        try:
            proc.stop_nowait()
        except Exception:
            pass

    # -- evaluating -------------------------------------------------------------------------------
    def evaluate(self, weights: Any = None, step: int | None = None, *, weights_dict: dict | None = None) -> Any:
        """Evaluate ``weights`` (see the class docstring) and return the metrics, tagged ``step``:
        ``await evaluator.evaluate(...)`` in async code. In synchronous code (no running event loop)
        it blocks and returns the metrics, as TorchRL's ``Evaluator.evaluate``: the evaluator then
        runs in an event loop in a helper thread, until :meth:`shutdown`. ``weights_dict``
        (TorchRL's) may hold ``"policy"`` only: the same as ``weights``.
        """
        weights, step = self._torchrl_args(weights, step, weights_dict, "evaluate")
        if in_event_loop():
            return self._evaluate(weights, step)
        return self._blocking().call(self._evaluate, weights, step)

    async def _evaluate(self, weights: Any = None, step: int | None = None) -> dict:
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
        check_request(self.config, weights, step)
        await self.start()
        req = self._submit(weights, step, background=False)
        try:
            await req.done.wait()
        except BaseException:
            if not req.done.is_set():
                self._run.abandon(req)
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
        check_request(self.config, weights, step)
        self._run.raise_background_error()
        if self._run.state is EvaluatorState.CLOSED:
            raise EvaluatorClosedError("this evaluator is closed; create a new Evaluator")
        if self.pending:
            busy = self.config.busy_policy
            if busy == "skip":
                self._run.skipped += 1
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

    def trigger_eval(self, weights: Any = None, step: int | None = None, *, weights_dict: dict | None = None) -> bool:
        """TorchRL's name for :meth:`trigger` (the same arguments, and TorchRL's ``weights_dict``
        with ``"policy"`` only). In synchronous code (no running event loop) it schedules the
        evaluation in the helper thread's event loop that a blocking :meth:`evaluate` uses."""
        weights, step = self._torchrl_args(weights, step, weights_dict, "trigger_eval")
        if in_event_loop():
            return self.trigger(weights, step)
        return self._blocking().call(self.trigger, weights, step)

    def shutdown(self, timeout: float | None = None) -> Any:
        """TorchRL's name for :meth:`aclose`: ``await evaluator.shutdown()`` in async code; in
        synchronous code it blocks until the worker is gone and ends the helper thread.
        ``timeout`` is accepted for TorchRL's signature; the worker gets the constructor's
        ``shutdown_timeout``."""
        if in_event_loop():
            return self.aclose()
        if self._portal is None and self._run.state is EvaluatorState.CLOSED:
            return None  # closed already (by aclose() in its event loop, or a failed start)
        portal = self._blocking()
        try:
            portal.call(self.aclose)
        finally:
            self._portal.close()
        return None

    def _blocking(self) -> Any:
        """The helper thread's portal (synchronous code), started on first use."""
        if self._portal is None:
            if self._run.state is not EvaluatorState.CREATED:
                raise ConfigError(
                    "this evaluator runs in an event loop already; call it from that loop's async code "
                    "(`await evaluator.evaluate(...)`), not from synchronous code"
                )
            from .._service.portal import Portal

            self._portal = Portal(self._run)
        return self._portal.get()

    def _torchrl_args(self, weights: Any, step: Any, weights_dict: Any, method: str) -> tuple[Any, Any]:
        """TorchRL's ``weights_dict`` (``{"policy": weights}`` only) and, with ``log_prefix``,
        TorchRL's counter for an untagged evaluation's step."""
        if weights_dict is not None:
            if not isinstance(weights_dict, dict) or set(weights_dict) - {"policy"}:
                names = sorted(weights_dict) if isinstance(weights_dict, dict) else weights_dict
                raise ConfigError(
                    f"{method}(weights_dict={names!r:.200}): the evaluator's worker holds one model, the policy; "
                    f"pass {method}(weights) (or weights_dict={{'policy': weights}})"
                )
            if weights is None:
                weights = weights_dict.get("policy")
        if step is None and self.config.log_prefix is not None:
            step, self._steps = self._steps, self._steps + 1
        return weights, step

    def poll(self, timeout: float = 0) -> dict | None:
        """The metrics of the latest background evaluation completed since the last
        :meth:`poll` or :meth:`wait` (older ones are superseded: see the events), or ``None``.
        Never blocks (TorchRL's ``timeout`` must be 0: use ``wait(timeout)`` to wait). Raises a
        background evaluation's error nobody has seen yet (once)."""
        if timeout:
            raise ConfigError(
                f"poll(timeout={timeout!r}) never waits here; use evaluator.wait(timeout={timeout!r}) to wait for "
                f"the pending evaluations"
            )
        self._run.raise_background_error()
        result, self._run.unconsumed = self._run.unconsumed, None
        return result

    def wait(self, timeout: float | None = None) -> Any:
        """Wait until no evaluation is pending; return the metrics of the last one that completed
        (``None`` if none has; also ``None`` after ``timeout`` seconds, where one is given).
        Raises a background evaluation's error nobody has seen yet. ``await evaluator.wait()`` in
        async code; in synchronous code it blocks (TorchRL's ``wait``)."""
        if in_event_loop():
            return self._wait(timeout)
        return self._blocking().call(self._wait, timeout)

    async def _wait(self, timeout: float | None = None) -> dict | None:
        if timeout is not None:
            with anyio.move_on_after(timeout):
                return await self._wait()
            return None
        run = self._run
        while run.pending or run.reporting is not None:
            await run.changed.wait()
        self._run.raise_background_error()
        run.unconsumed = None
        return run.last

    # -- reaching into the envs ----------------------------------------------------------------------
    def call(self, name: str, *args: Any, indices: Any = None, persist: bool = False, **kwargs: Any) -> Any:
        """Call the method ``name(*args, **kwargs)`` of every env of the worker (an attribute that
        is not callable is returned as it is); its results, one per env (``indices``: only those
        envs). ``persist=True``: a new worker calls it again before its first evaluation. Awaited
        in async code; blocks in synchronous code. See the class docstring for when it applies."""
        return self._env("call()", "call", name, args, kwargs, indices=indices, persist=persist)

    def get_attr(self, name: str, indices: Any = None) -> Any:
        """The attribute ``name`` of every env (through gymnasium's wrappers), one per env."""
        return self._env("get_attr()", "get", name, indices=indices)

    def set_attr(self, name: str, values: Any, indices: Any = None) -> Any:
        """Set the attribute ``name`` of every env (through gymnasium's wrappers) to ``values``,
        or, for a list or tuple, to one value per env; the evaluations made after it run with it,
        and a new worker sets it again. Returns ``None`` once it is set.

        Examples:
            >>> await evaluator.set_attr("level", 3)   # doctest: +SKIP
            >>> metrics = await evaluator.evaluate(policy)   # on level 3
        """
        return self._env("set_attr()", "set", name, indices=indices, value=values, discard=True)

    def map_fn(self, fn: Callable[..., Any], *args: Any, indices: Any = None, persist: bool = False,
               **kwargs: Any) -> Any:
        """Call ``fn(env, *args, **kwargs)`` on every env in the worker (``fn`` travels with
        cloudpickle: a lambda works); its results, one per env (``indices``, ``persist``: as
        :meth:`call`)."""
        not_torchrl_map_fn("map_fn()", fn)
        return self._env("map_fn()", "fn", "", (fn, *args), kwargs, indices=indices, persist=persist)

    def getattr_env(self, attr: str) -> Any:
        """TorchRL's name: the attribute ``attr`` of the first env."""
        return self._env("getattr_env()", "get", attr, indices=[0], first=True)

    def _env(self, what: str, kind: str, name: str, args: tuple = (), kwargs: dict | None = None, *,
             indices: Any = None, value: Any = None, persist: bool = False, first: bool = False,
             discard: bool = False) -> Any:
        n = self.config.num_envs
        rows = rows_named(what, n, n, 1, indices, None)
        values = values_for(what, value, rows) if kind == "set" else None

        async def make() -> Any:
            await self.start()
            if self._run.state is EvaluatorState.CLOSED:
                raise EvaluatorClosedError(f"{what}: this evaluator is closed; create a new Evaluator")
            job = self._run.submit_env_call(kind, name, args, kwargs or {}, rows, values, persist)
            try:
                await job.done.wait()
            finally:
                if not job.done.is_set():
                    self._run.withdraw(job)
            if job.error is not None:
                raise job.error
            assert job.result is not None
            return None if discard else job.result[0] if first else job.result

        if in_event_loop():
            return make()
        return self._blocking().call(make)

    def _submit(self, weights: Any, step: int | None, *, background: bool) -> Any:
        payload = weights_payload(weights)  # a CPU snapshot, taken now
        self._launch()
        return self._run.submit(payload, step, background=background)
