"""The evaluator's own task and its state: the queue of evaluations, running them one at a time
in the worker (:class:`~aiocollect._backends.eval_process.EvalProcess`), replacing a worker that died,
crashed or hung (``on_worker_failure="restart"``, within the restart budget), computing the
metrics and reporting them (events, ``on_result``, the waiting caller: :mod:`.results`). The public front is
:class:`aiocollect.Evaluator`, which holds one :class:`EvalRun`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sys
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio

from .._core.phases import Lifecycle
from .._service.bus import EventBus
from .._service.env_calls import EnvCallLog, message
from .._core.errors import EvaluatorClosedError, WorkerError, add_note
from .config import EvaluatorConfig, EvaluatorState
from .lifecycle import TRANSITIONS, EvalPhase
from .._backends.eval_process import EvalProcess
from .._backends.table import backend_named
from .._core.eval_wire import Aborted, Failed, Result
from .results import Request, report_failure, report_success, result_metrics
from .._service.resource import unwrap_group as _unwrap, wait_shielded
from .._service.supervisor import RestartBudget
from .._service.systask import spawn_system_task

if TYPE_CHECKING:
    from .._backends.ray_eval import RayEvalWorker
from ..events import WorkerFailed, WorkerRestarted


def in_event_loop() -> bool:
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


@dataclasses.dataclass(eq=False)
class EnvJob:
    """An env call (``Evaluator.call``, ``set_attr`` ...) waiting its turn among the evaluations:
    ``rows`` (env rows), ``values`` (``set_attr``'s, one per row); ``result``: the results, one
    per row."""

    kind: str
    name: str
    args: tuple
    kwargs: dict
    rows: list[int]
    values: list | None
    persist: bool
    done: anyio.Event
    result: list | None = None
    error: BaseException | None = None


class EvalRun:
    """An evaluator's state and its own task (:meth:`launch`): never refers to the front."""

    def __init__(self, config: EvaluatorConfig, worker_config: bytes, needs: tuple[str, ...]) -> None:
        self.config = config
        self.worker_config = worker_config  # cloudpickle(EvalWorkerConfig)
        self.needs = needs
        self.life = Lifecycle(EvalPhase.CREATED, TRANSITIONS, "an evaluator's run")
        self.bus = EventBus()
        self.queue: deque[Request | EnvJob] = deque()  # evaluations and env calls, in the order they were made
        self.current: Request | None = None  # running in the worker
        self.reporting: Request | None = None  # done; its events and on_result are running
        self.proc: EvalProcess | RayEvalWorker | None = None
        self.errors: list[BaseException] = []  # background failures nobody has seen yet
        self.start_error: BaseException | None = None
        self.unconsumed: dict | None = None
        self.last: dict | None = None
        self.ids = itertools.count(1)
        self.task: Any = None
        self.completed = self.failed = self.skipped = self.restarts = 0
        self.budget = RestartBudget(config.max_restarts, config.restart_window)
        self.restart = config.on_worker_failure == "restart"
        self.env_calls = EnvCallLog()  # the env calls a new worker applies again (set_attr, persisted calls)
        self.env_calls.rows_per_worker = config.num_envs

    @property
    def pending(self) -> int:
        return sum(isinstance(r, Request) for r in self.queue) + (self.current is not None)

    # -- lifecycle --------------------------------------------------------------------------------
    @property
    def phase(self) -> EvalPhase:
        return self.life.phase

    @property
    def state(self) -> EvaluatorState:
        """The public state (``evaluator.state``) of the current phase."""
        return self.life.phase.public

    def move_to(self, phase: EvalPhase) -> None:
        """Enter ``phase``: the one place the run's phase changes. A move that
        :data:`~aiocollect._evaluator.lifecycle.TRANSITIONS` does not allow raises
        :class:`~aiocollect._core.phases._PhaseError` (a bug of ours)."""
        self.life.move_to(phase)

    def launch(self, main: Callable[[], Awaitable[None]]) -> None:
        """Start the evaluator's own task, ``main()`` (which awaits :meth:`run`), if not yet."""
        if self.phase is not EvalPhase.CREATED:
            return
        if not in_event_loop():
            raise RuntimeError(
                "the Evaluator needs a running event loop: call it from async code (a task of the loop "
                "it should run in)"
            )
        self.started = anyio.Event()
        self.done = anyio.Event()
        self.stop = anyio.Event()
        self.wakeup = anyio.Event()
        self.changed = anyio.Event()
        self.move_to(EvalPhase.STARTING)
        try:
            self.task = spawn_system_task(main)
        except BaseException:
            self.move_to(EvalPhase.CLOSED)  # (no task: nothing would ever close it)
            raise

    async def start(self) -> None:
        """See :meth:`Evaluator.start <aiocollect.Evaluator.start>` (launched already)."""
        await self.started.wait()
        error = self.start_error
        if error is not None:
            await wait_shielded(self.done)
            if error in self.errors:  # nobody has seen it yet: raised here, not again by poll() ...
                self.errors.remove(error)
                raise error
            raise EvaluatorClosedError(
                f"this evaluator is closed: its worker failed to start ({type(error).__name__}: {error}); "
                f"create a new Evaluator"
            ) from error
        if self.phase.closing:
            raise EvaluatorClosedError("this evaluator is closed and cannot be reopened; create a new Evaluator")

    async def aclose(self) -> None:
        """See :meth:`Evaluator.aclose <aiocollect.Evaluator.aclose>`."""
        if self.task is None:
            if self.phase is EvalPhase.CREATED:  # never started: nothing to stop
                self.move_to(EvalPhase.CLOSED)
            self.bus.close()
        else:
            if not self.phase.closing:  # (its task moves on to CLOSED as it ends)
                self.move_to(EvalPhase.CLOSING)
            self.stop.set()
            try:
                await wait_shielded(self.done)  # even under task.cancel(): the worker is gone first
            finally:
                self.bus.close()
        self.raise_background_error()

    async def run(self) -> None:
        """The evaluator's own task: until :meth:`aclose`, a failed start or a bug of ours."""
        try:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._main, tg)
                    await self.stop.wait()
                    tg.cancel_scope.cancel()
            except Exception as exc:  # noqa: BLE001 - a bug of ours: reported, never lost
                self.add_error(_unwrap(exc))
            finally:
                proc, self.proc = self.proc, None
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
            try:
                self.move_to(EvalPhase.CLOSED)
            finally:  # (a refused move is a bug of ours: it must not leave aclose() waiting)
                self.bus.close()
                self.started.set()
                self.done.set()

    async def _main(self, tg: Any) -> None:
        try:
            self.proc = await self._spawn(tg)
        except Exception as exc:  # noqa: BLE001 - raised by start(), or surfaced like a background error
            self.start_error = exc
            self.add_error(exc)
            self.stop.set()
            if self.phase is EvalPhase.STARTING:  # (not if aclose() came first)
                self.move_to(EvalPhase.START_FAILED)
            return
        else:
            if self.phase is EvalPhase.STARTING:
                self.move_to(EvalPhase.RUNNING)
        finally:
            self.started.set()
        if self.config.step_timeout is not None:
            tg.start_soon(self._watchdog, self.config.step_timeout)
        await self._schedule(tg)

    def _abandon_all(self) -> None:
        closed = EvaluatorClosedError("the evaluator was closed before this evaluation completed")
        requests = list(self.queue) + [r for r in (self.current, self.reporting) if r is not None]
        self.queue.clear()
        self.current = self.reporting = None
        for req in requests:
            if not req.done.is_set():
                req.error = closed
                req.done.set()
        self.notify()

    # -- the caller's side of requests ----------------------------------------------------------
    def submit_env_call(
        self, kind: str, name: str, args: tuple, kwargs: dict, rows: list[int], values: list | None, persist: bool,
    ) -> EnvJob:
        """Queue an env call behind the evaluations (and env calls) made before it; launched already."""
        job = EnvJob(kind, name, args, kwargs, rows, values, persist, anyio.Event())
        self.queue.append(job)
        self.wakeup.set()
        return job

    def withdraw(self, job: EnvJob) -> None:
        """Its caller is gone: an env call still queued is not made (one being applied is)."""
        try:
            self.queue.remove(job)
        except ValueError:
            pass

    def submit(self, weights: tuple[str, dict] | None, step: int | None, *, background: bool) -> Request:
        """Queue an evaluation of ``weights`` (a CPU snapshot: :func:`~aiocollect._evaluator.config.weights_payload`); launched already."""
        req = Request(next(self.ids), step, weights, background, anyio.Event())
        self.queue.append(req)
        self.wakeup.set()
        self.notify()
        return req

    def abandon(self, req: Request) -> None:
        req.abandoned = True
        try:
            self.queue.remove(req)
        except ValueError:
            pass
        else:
            self.notify()
            return
        proc = self.proc
        if req is self.current and req.sent and proc is not None:
            proc.abort_nowait(req.id)  # the socket is idle: the request was sent whole

    def notify(self) -> None:
        changed, self.changed = self.changed, anyio.Event()
        changed.set()

    def add_error(self, exc: BaseException) -> None:
        self.errors.append(exc)
        self.notify()

    def raise_background_error(self) -> None:
        if not self.errors:
            return
        first, *rest = self.errors
        self.errors.clear()
        if rest:
            add_note(
                first,
                f"{len(rest)} more background evaluation(s) failed after this one "
                f"({', '.join(type(e).__name__ for e in rest)}); each was an EvaluationFailed event",
            )
        raise first

    # -- the worker -------------------------------------------------------------------------------
    async def _spawn(self, tg: Any) -> EvalProcess | RayEvalWorker:
        after = "; a new worker replaces it (on_worker_failure='restart')" if self.restart else "; the next evaluation starts a new worker"
        backend = backend_named(self.config.backend, choices=("process", "ray"))
        proc = await backend.open_evaluator(
            tg,
            needs=self.needs,
            worker_config=self.worker_config,
            watch=self.config.step_timeout is not None,
            after_death=after,
            on_death=self._worker_died,
            options=self.config.ray_actor_options,  # (each backend checks its own)
        )
        kept = self.env_calls.kept_for(0)
        if kept:  # a new worker: the set_attr calls (and persisted calls) made so far, in order
            try:
                for call in kept:
                    await proc.env_call(call)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await proc.stop(self.config.shutdown_timeout)
                raise
        return proc

    def _worker_died(self, proc: "EvalProcess | RayEvalWorker", exc: WorkerError) -> None:
        """Between evaluations nobody waits on the worker: report its death now (under
        ``"restart"``: replace it now). One killed as hung had its evaluation end meanwhile:
        the next evaluation starts a new worker."""
        if proc is not self.proc or self.current is not None or self.stop.is_set() or proc.hung is not None:
            return
        if self.restart:
            self.wakeup.set()
        else:
            self.add_error(exc)

    async def _live_worker(self, tg: Any) -> EvalProcess | RayEvalWorker:
        """The worker, or a new one if there is none or it is gone (its failure was reported)."""
        proc = self.proc
        if proc is None or proc.dead is not None or proc.failed:
            self.proc = None
            if proc is not None:
                with anyio.CancelScope(shield=True):
                    await proc.stop(self.config.shutdown_timeout)
            proc = self.proc = await self._spawn(tg)
        return proc

    async def _replace(self, tg: Any, proc: EvalProcess | RayEvalWorker | None, error: BaseException) -> None:
        """``proc`` died, crashed or hung (``error``): emit :class:`WorkerFailed`, stop it and,
        within the restart budget, start a new worker (:class:`WorkerRestarted`). Past the
        budget, raises ``error`` with a note saying so (the next evaluation starts a new worker)."""
        old_pid = pid = None if proc is None else proc.pid
        if proc is not None:
            self.proc = None
            with anyio.CancelScope(shield=True):
                await proc.stop(0)  # dead or hung already: killed now if it is not gone
        while True:
            await self.bus.emit(WorkerFailed(worker=-1, pid=pid, error=error))
            if not (self.restart and not self.stop.is_set() and self.budget.allow(error)):
                raise error
            try:
                self.proc = await self._spawn(tg)
            except Exception as exc:  # noqa: BLE001 - the new worker failed to start: counted the same
                error, pid = exc, None
                continue
            break
        self.restarts += 1
        await self.bus.emit(WorkerRestarted(worker=-1, pid=self.proc.pid, old_pid=old_pid))

    async def _watchdog(self, timeout: float) -> None:
        """Declare the worker hung when it spends longer than ``timeout`` in one call of an
        evaluation, or is stopped or has not started the evaluation it was sent for that long
        (checked during an evaluation only: between them an idle worker is never hung)."""
        period = min(max(timeout / 4, 0.01), 1.0)
        while True:
            await anyio.sleep(period)
            proc = self.proc
            if proc is not None and self.current is not None and proc.dead is None and proc.hung is None:
                await proc.check_hung(timeout)

    # -- evaluations ------------------------------------------------------------------------------
    async def _schedule(self, tg: Any) -> None:
        while True:
            while not self.queue:
                proc = self.proc
                if self.restart and proc is not None and proc.dead is not None and proc.hung is None:
                    try:  # it died between evaluations: a new worker now, ready for the next one
                        await self._replace(tg, proc, proc.dead)
                    except Exception as exc:  # noqa: BLE001 - past the budget (or a handler's error)
                        self.add_error(exc)
                    continue
                self.wakeup = anyio.Event()
                await self.wakeup.wait()
            item = self.queue.popleft()
            if isinstance(item, EnvJob):
                await self._env_job(item, tg)
                continue
            req = self.current = item
            try:
                try:
                    metrics = await self._run_one(req, tg)
                except Exception as exc:  # noqa: BLE001 - the evaluation's failure, reported
                    failure: BaseException | None = exc
                else:
                    failure = None
                # no longer pending (a handler may trigger the next one), but wait() waits for it
                self.current, self.reporting = None, req
                self.notify()
                if failure is not None:
                    self.failed += 1
                    await report_failure(req, failure, self.bus, self.add_error)
                elif metrics is not None:  # (None: aborted, its caller is gone)
                    self.completed += 1
                    self.last = metrics
                    if req.background:
                        self.unconsumed = metrics
                    await report_success(req, metrics, self.bus, self.config.on_result, self.add_error)
            finally:
                self.current = self.reporting = None
                if not req.done.is_set():  # cancelled (closing), or aborted by its caller
                    req.error = EvaluatorClosedError("the evaluator was closed before this evaluation completed")
                    req.done.set()
                self.notify()

    async def _env_job(self, job: EnvJob, tg: Any) -> None:
        """Make the env call ``job`` on the worker (started if there is none), between two
        evaluations; its results, or its error, go to its caller. A change starts an env epoch
        and, for ``set_attr`` or ``persist=True``, is kept for the workers that replace this one."""
        log = self.env_calls
        mine = [(r, i) for i, r in enumerate(job.rows)]  # (one worker: its rows are the env rows)

        async def send(epoch: int) -> list:
            call = message(log.next_id(), job.kind, job.name, job.args, job.kwargs, job.values, mine, epoch)
            return await proc.env_call(call)

        try:
            dead = self.proc
            if self.restart and dead is not None and dead.dead is not None and dead.hung is None:
                await self._replace(tg, dead, dead.dead)  # (it died between evaluations: replaced, events)
            # (a new worker applies the calls kept so far as it starts: before this one is kept)
            proc = await self._live_worker(tg)
            job.result = (await log.make(
                job.kind, job.name, job.args, job.kwargs, job.rows, job.values, job.persist, send))[0]
        except Exception as exc:  # noqa: BLE001 - its caller's to raise
            job.error = exc
        finally:
            if job.result is None and job.error is None:  # cancelled: the evaluator closes
                job.error = EvaluatorClosedError("the evaluator was closed before this env call completed")
            job.done.set()

    async def _run_one(self, req: Request, tg: Any) -> dict | None:
        """Run ``req`` to its metrics (``None``: aborted). Under ``"restart"`` a worker that dies,
        crashes or hangs meanwhile is replaced and the evaluation runs again from its start,
        within the restart budget; an env's or policy's exception (the worker reports it and
        stays usable) fails the evaluation either way."""
        weights, req.weights = req.weights, None  # kept until the evaluation ends, for a rerun
        while True:
            proc = self.proc
            if self.restart and proc is not None and proc.dead is not None and proc.hung is None:
                lost: BaseException = proc.dead  # it died between evaluations, not replaced yet
            else:
                try:
                    proc = await self._live_worker(tg)
                except Exception as exc:
                    if not self.restart:
                        raise
                    lost, proc = exc, None  # a new worker that failed to start: counted the same
                else:
                    t0 = time.perf_counter()
                    try:
                        msg = await proc.evaluate(req, weights, self.config.num_trajectories)
                    except WorkerError as exc:  # its death or hang, seen by send() or reply()
                        if not self.restart:
                            raise
                        lost = exc
                    else:
                        if isinstance(msg, Result):
                            return await result_metrics(msg, self.config, req.step, time.perf_counter() - t0)
                        if isinstance(msg, Aborted):
                            return None
                        error = proc.failure(msg)
                        if isinstance(msg, Failed) or not self.restart:  # else fatal: the worker exits
                            raise error
                        lost = error
            await self._replace(tg, proc, lost)
            if req.abandoned:  # its caller is gone: not run again
                return None


__all__ = ["EnvJob", "EvalRun", "Request", "in_event_loop"]
