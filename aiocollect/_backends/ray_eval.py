"""The Evaluator's worker as a Ray actor (``Evaluator(..., backend="ray")``): the parent's side,
with the interface of :class:`~aiocollect._backends.eval_process.EvalProcess` that
:class:`~aiocollect._evaluator.run.EvalRun` drives. The actor is
:class:`~aiocollect._backends.ray_actor.EvalActor`: the same episodes loop as the worker process.

An evaluation is one ``evaluate`` call (its weights travel as its argument), awaited without
blocking the loop; its answer becomes the message the process worker would have sent
(:class:`~aiocollect._core.eval_wire.Result`, :class:`~aiocollect._core.eval_wire.Failed` or
:class:`~aiocollect._core.eval_wire.Aborted`), so that failures, aborts and restarts are handled by the
same code. A dead actor is noticed by the call in progress, or between evaluations by a ping
every second.
"""

from __future__ import annotations

from typing import Any, Callable

import anyio

from .._core.errors import WorkerError
from .._core.eval_wire import Aborted, Answer, Failed, Result
from .._core.heartbeat import UNRESPONSIVE
from .failures import actor_died, stop_on_failure, unpacked_error
from .ray import actor_class, await_ref, import_ray, kill_actor, kill_hung

_PING = 1.0  # seconds between checks that an idle actor is alive


class RayEvalWorker:
    """The evaluator's worker, a Ray actor (replaced by a new one after a failure)."""

    def __init__(self, actor: Any, options: dict, *, after_death: str) -> None:
        self.actor = actor
        self.options = options
        self.after_death = after_death
        self.pid: int | None = None
        self.node = ""
        self.dead: WorkerError | None = None  # the actor died (or was killed as hung)
        self.failed = False  # (a process worker's fatal error: an actor has none, it dies)
        self.hung: WorkerError | None = None
        self.scope: anyio.CancelScope | None = None
        self.busy = False  # an evaluation is in progress (the ping is not needed then)

    @property
    def name(self) -> str:
        return f"the evaluator's worker (Ray actor, pid {self.pid})"

    @classmethod
    async def open(
        cls,
        tg: Any,
        *,
        worker_config: bytes,
        watch: bool,
        after_death: str,
        on_death: Callable[["RayEvalWorker", WorkerError], None],
        options: dict,
        **_: Any,
    ) -> "RayEvalWorker":
        """A new actor, its envs made and its policy checked; its liveness watched in ``tg``
        (``on_death`` when it dies between evaluations). Raises what it raised while starting."""
        from .ray import ensure_ray
        from .ray_actor import EvalActor

        ensure_ray(import_ray())
        actor = actor_class(EvalActor).options(max_concurrency=1, **options).remote()
        worker = cls(actor, options, after_death=after_death)
        async with stop_on_failure([worker]):
            try:
                answer = await await_ref(worker.actor.setup.remote(worker_config, watch))
            except Exception as exc:  # noqa: BLE001 - it died while starting
                raise worker._died(exc) from None
            if answer[0] == "error":
                raise worker._error(answer[1], answer[2])
            _, worker.pid, worker.node = answer
            await tg.start(worker.read, on_death)
        return worker

    def _died(self, exc: BaseException) -> WorkerError:
        return self.hung or actor_died(self.name, None, exc, self.after_death)

    def _error(self, packed: bytes, text: str) -> BaseException:
        return unpacked_error(None, self.pid, packed, text, self.name)

    # -- liveness -----------------------------------------------------------------------------------
    async def read(self, on_death: Callable[["RayEvalWorker", WorkerError], None], *, task_status: Any) -> None:
        """Between evaluations, ask the actor every second whether it is alive."""
        with anyio.CancelScope() as scope:
            self.scope = scope
            task_status.started()
            while self.dead is None:
                await anyio.sleep(_PING)
                if self.busy:
                    continue
                try:
                    await await_ref(self.actor.ping.options(concurrency_group="control").remote())
                except Exception as exc:  # noqa: BLE001 - it died
                    if self.dead is None:
                        self.dead = self._died(exc)
                        on_death(self, self.dead)

    # -- evaluations ----------------------------------------------------------------------------------
    async def evaluate(self, req: Any, weights: Any, episodes: int) -> Answer:
        """Run evaluation ``req``; its answer as the process worker's message. Raises the
        actor's death (or hang)."""
        if self.dead is not None:
            raise self.dead
        self.busy = True
        try:
            ref = self.actor.evaluate.remote(req.id, weights, episodes, req.step)
            req.sent = True
            if req.abandoned:
                self.abort_nowait(req.id)
            try:
                answer = await await_ref(ref)
            except Exception as exc:  # noqa: BLE001 - it died or was killed as hung
                self.dead = self._died(exc)
                raise self.dead from None
        finally:
            self.busy = False
        kind = answer[0]
        if kind == "result":
            return Result(answer[1], answer[2], answer[3], answer[4])
        if kind == "aborted":
            return Aborted(answer[1])
        return Failed(answer[1], answer[2], answer[3])

    async def env_call(self, call: Any) -> list:
        """Apply the env call ``call`` (an :class:`~aiocollect._core.wire.EnvCall`) in the actor,
        between evaluations; its results, one per env row. Raises what the env raised as the
        worker's error (the actor goes on), and the actor's death if it comes first."""
        if self.dead is not None:
            raise self.dead
        self.busy = True
        try:
            answer = await await_ref(self.actor.env_call.remote(call))
        except Exception as exc:  # noqa: BLE001 - it died
            self.dead = self._died(exc)
            raise self.dead from None
        finally:
            self.busy = False
        if answer.error is not None:
            raise self._error(answer.result, answer.error)
        import cloudpickle

        return cloudpickle.loads(answer.result)

    def abort_nowait(self, rid: int) -> None:
        self.actor.abort.options(concurrency_group="control").remote(rid)

    def failure(self, msg: Any) -> BaseException:
        return self._error(msg.exception, msg.traceback)

    # -- hangs and stopping ---------------------------------------------------------------------------
    async def check_hung(self, timeout: float) -> None:
        """If the actor has spent longer than ``timeout`` in one call, or has not answered the
        question for that long (its process is stopped or frozen), take its stack, record the
        :class:`WorkerTimeoutError` in :attr:`hung` and kill it."""
        patience = max(timeout, 1.0)
        try:
            with anyio.fail_after(patience):
                stuck = await await_ref(self.actor.stuck.options(concurrency_group="control").remote(timeout))
        except TimeoutError:
            stuck = (UNRESPONSIVE, 0, patience)
        except Exception:  # noqa: BLE001 - dead (the evaluation's call says so)
            return
        if stuck is None:
            return
        fix = "pass on_worker_failure='restart' to run the evaluation again on a new worker"
        self.hung = await kill_hung(
            self.actor, self.name, None, self.pid, self.node, stuck, timeout, fix, died=lambda: self.dead is not None
        )

    def stop_nowait(self) -> None:
        """Kill the actor now (the event loop is going away)."""
        try:
            import_ray().kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - Ray is shutting down too
            pass

    async def stop(self, timeout: float) -> None:
        """Let the actor close its envs (at most ``timeout`` seconds), then kill it and, on this
        node, wait until its process is gone."""
        if self.scope is not None:
            self.scope.cancel()
        if self.dead is None:
            with anyio.move_on_after(timeout):
                try:
                    await await_ref(self.actor.close.remote())
                except Exception:  # noqa: BLE001 - dead already, or its envs' close() raised
                    pass
        await kill_actor(self.actor, self.pid, self.node)


__all__ = ["RayEvalWorker"]
