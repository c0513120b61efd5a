"""A collector's run: its lifecycle (start, its tasks, stop, close) and what the public methods ask.

:class:`Run` starts the run's own task (:class:`~aiocollect._collector.run_task.RunTask`), which
launches the workers and starts the data plane (:class:`~aiocollect._collector.plane.DataPlane`:
one task per worker seat, reading its reports and replacing it after a failure, the producer
(:mod:`aiocollect._collector.producer`), the watchdog for hung workers and the drain into a
replay buffer), then stops and closes it all; the consumers take their batches from the
stream's other side (:class:`~aiocollect._collector.consumer.BatchStream`). What the parts
share (the worker pool, the delivery, the pending error, weights, profiling, the phase) is a
:class:`~aiocollect._collector.run_state.RunState`; the parts are built with what they need of
it, never the ``Run``. Those tasks reference the run, never the user's
:class:`~aiocollect.Collector`: a collector that its user forgets can be garbage-collected, and
its finalizer then stops the run.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any, AsyncContextManager, Callable

import anyio
import anyio.lowlevel

from .._backends.seat import Backend
from .._backends.table import backend_named
from .._core.errors import AiocollectError, CollectorClosedError, ConfigError
from .._core.profiling import ProfileConfig
from .._service.bus import EventBus
from .._service.resource import loop_token, wait_shielded
from .._service.systask import spawn_system_task
from .config import CollectorConfig
from . import env_calls as _env_calls
from . import resume as _resume
from .consumer import BatchStream
from .plane import DataPlane, PlaneHooks
from .run_state import CollectorState, Phase, RunState, State
from .run_task import RunTask
from .stats import CollectorStats
from .weightsync import watch_for


if TYPE_CHECKING:  # tensordict is imported while the first collector starts (see RunTask.run)
    from tensordict import TensorDict


class Run:
    """The lifecycle of one collector's run (see the module docstring); what its parts share is
    :attr:`shared` (a :class:`~aiocollect._collector.run_state.RunState`)."""

    def __init__(self, config: CollectorConfig, backend: Backend | None = None) -> None:
        # where the workers run: the backend named by the config, or the object passed in
        self.shared = RunState(config, backend if backend is not None else backend_named(config.backend_name))
        self.shared.sync.watch = watch_for(config)  # a policy trained in place but never published: said once
        self.task: object | None = None  # the run's own task (a handle kept alive: spawn_system_task)
        self.loop: Any = None  # the event loop that started it (loop_token(): an asyncio loop or trio's token)
        self.stream = BatchStream(self.shared, self)  # the consumer's side of the batch stream
        self.plane: DataPlane | None = None  # the tasks that take the batches to the consumers or the sink
        self.own: RunTask | None = None  # the run's own task, once started
        self.closed_by: str | None = None  # what closed it, in the user's words ("aclose()", ...)

    @property
    def config(self) -> CollectorConfig:
        return self.shared.config

    @property
    def bus(self) -> EventBus:
        return self.shared.bus

    @property
    def loop_gone(self) -> bool:
        """The event loop that ran it ended under it."""
        return self.own is not None and self.own.loop_gone

    @property
    def state(self) -> CollectorState:
        """What ``collector.state`` reports."""
        return self.shared.phase.public

    # -- lifecycle ------------------------------------------------------------------------------
    def note_closer(self, closer: str) -> None:
        """Record what is closing the collector (``"the end of its `async with` block"``), unless
        something closed it already: the first closer is the one a later error names."""
        if self.closed_by is None and self.shared.phase is not Phase.CLOSED:
            self.closed_by = closer

    def why_closed(self) -> str:
        """What closed or stopped this collector, as a sentence about it: by whom it was closed
        (``aclose()``, the end of its ``async with`` block, its failed start ...), or why it
        stopped (a worker's failure, ``total_frames`` reached)."""
        s = self.shared
        if s.phase.closing:
            if self.loop_gone:
                return "this collector was closed when the event loop that started it ended"
            return f"this collector was closed by {self.closed_by or 'aclose()'}"
        error = s.errors.error
        if error is not None:
            first = str(error).partition("\n")[0][:200]
            return f"this collector stopped on an error ({type(error).__name__}" + (f": {first})" if first else ")")
        if s.phase in (Phase.COMPLETED, Phase.ENDED, Phase.FINISHED):
            return f"this collector delivered its total_frames={self.config.total_frames} and stopped"
        return f"this collector is {self.state.value}"

    def closed_error(self, what: str) -> CollectorClosedError:
        """The :class:`CollectorClosedError` for ``what`` (``"update_weights()"``, ``"collect()"``)
        called on a collector that is closed or stopped: it names what closed it (and chains a
        worker's error where one stopped it, when raised ``from`` it)."""
        return CollectorClosedError(f"{what}: {self.why_closed()}; create a new Collector")

    def check_loop(self) -> None:
        """A collector belongs to the event loop that started it (and to its own loop, which
        runs background collection's data plane)."""
        if self.loop is None or self.loop is loop_token() or self.shared.off_loop() is not None:
            return
        if self.loop_gone:
            raise CollectorClosedError(
                "this collector was started in another event loop, which has ended (each asyncio.run() "
                "makes a new loop and cancels what ran in the old one): its workers are gone. A collector "
                "belongs to the loop that started it; create a new Collector in this loop"
            )
        raise AiocollectError(
            "this collector was started in another event loop: a collector belongs to the loop that "
            "started it (its workers report to that loop's tasks). Use it from that loop, or create one "
            "Collector per loop"
        )

    async def start(self, sink: Any = None) -> None:
        s = self.shared
        if s.phase is Phase.CLOSED:
            raise CollectorClosedError(f"start(): {self.why_closed()}, and a closed collector cannot be reopened; "
                                       f"create a new Collector")
        self.check_loop()
        if sink is not None:
            self._attach(sink)
        if s.phase is Phase.CREATED:
            self._begin()
        await self.started.wait()
        moved = self.plane.moved if self.plane is not None else None
        if sink is not None and moved is not None:
            await moved.wait()  # (a caller that trains right after without awaiting gets batches)
        if s.phase is Phase.LAUNCH_FAILED:
            # nothing was started that could be used: the collector is closed, its error raised once
            if self.closed_by is None:
                error = s.errors.error
                self.closed_by = f"its failed start ({type(error).__name__})" if error is not None else "its failed start"
            try:
                await wait_shielded(self.done)
            finally:
                self.stream.close()
                s.move_to(Phase.CLOSED)
            if not s.errors.seen and s.errors.error is not None:
                s.errors.seen = True
                raise s.errors.error

    def _attach(self, sink: Any) -> None:
        """Background collection: every batch goes to ``sink`` from now on. Before the start, or
        on a started collector (``async with`` entered) whose consumers took no batch yet: the
        batches collected ahead meanwhile (``prefetch``) go to the sink too, none is lost."""
        s = self.shared
        if not callable(getattr(sink, "extend", None)):
            raise ConfigError(f"replay_buffer={sink!r} has no extend(batch) method; pass a ReplayBuffer or a TorchRL buffer")
        if s.delivery.sink is not None:
            raise AiocollectError(
                "this collector already writes its batches into a replay buffer or a queue (an earlier "
                "start(replay_buffer=...) or start(queue=...)): one per collector; extend several buffers from one "
                "object's extend(), or create a Collector per buffer"
            )
        asked = s.delivery.counts.requested or self.stream.waiting
        if s.phase is not Phase.CREATED and (s.phase not in (Phase.STARTING, Phase.RUNNING) or asked):
            if asked:
                taken = "its consumers already asked it for batches"
            elif s.phase.public is CollectorState.RUNNING:
                taken = "every batch of total_frames is collected already"
            else:
                taken = f"it is {self.state.value}"
            raise AiocollectError(
                f"start(replay_buffer=...) or start(queue=...) on a collector whose batches cannot all go there any "
                f"more ({taken}): attach the buffer or queue before taking a batch (collect(), `async for`), e.g. "
                f"`async with Collector(...) as c: await c.start(replay_buffer=rb)`, or create a new Collector"
            )
        s.delivery.sink = sink
        if s.phase is Phase.RUNNING and self.plane is not None:  # (else the run's task starts the drain)
            self.plane.sink_attached()

    def _begin(self) -> None:
        """The first start: the stream, the producer, the data plane and the run's own task."""
        s = self.shared
        s.move_to(Phase.STARTING)
        self.loop = loop_token()
        if s.config.zero_copy == "debug":
            import faulthandler

            if not faulthandler.is_enabled():  # a read of a handed-back batch prints its traceback
                faulthandler.enable()
        s.delivery.send = self.stream.open()
        s.stop = anyio.Event()
        hooks = PlaneHooks(take=functools.partial(self.stream.collect, drain=True), request_stop=s.request_stop,
                           at_home=s.run_at)
        self.plane = DataPlane(s.config, s.pool, s.delivery, s.new_producer(), self.loop, hooks)
        own = self.own = RunTask(s, self.plane, self.stream)
        self.started, self.done = own.started, own.done
        self.task = spawn_system_task(own.run)

    def close_unstarted(self) -> bool:
        """Close a collector that never started (nothing to stop); False if it did start."""
        if self.shared.phase is Phase.CREATED:
            self.note_closer("aclose()")
            self.shared.move_to(Phase.CLOSED)
        return self.shared.phase is Phase.CLOSED

    def request_close(self) -> None:
        """Ask the run to stop because its user closes it (or forgot it): enter the closing phase."""
        s = self.shared
        if s.phase is Phase.STARTING:
            s.move_to(Phase.CANCELLING_START)
        elif s.phase in (Phase.RUNNING, Phase.FINISHED):
            s.move_to(Phase.CLOSING)
        elif s.phase in (Phase.COMPLETED, Phase.STOPPED, Phase.ENDED):
            s.move_to(Phase.STOPPED_CLOSING)

    async def aclose(self) -> None:
        s = self.shared
        self.note_closer("aclose()")  # (unless a caller said more: the end of an `async with` ...)
        if self.close_unstarted():
            return
        if self.loop_gone and self.done.is_set():  # its loop ended (and stopped the workers)
            self.stream.close()
            s.move_to(Phase.CLOSED)
            return
        self.check_loop()
        self.request_close()
        s.stop.set()
        if self.own is not None and self.own.launching is not None:
            # a start-up in progress may never end (an env factory waiting for a licence server,
            # Ray actors for resources the cluster lacks): end it. Workers still in their env
            # factories get STARTING_GRACE, those with envs shutdown_timeout, then are killed
            # (every process forked, its hello read or not); the local backend's factories are
            # left to finish in their thread
            self.own.launching.cancel()
        try:
            await wait_shielded(self.done)  # even under task.cancel(): the workers are gone first
        finally:
            self.stream.drop_lease()  # (the workers are gone: nothing to hand back)
            self.stream.close()
            if s.phase is not Phase.CLOSED:
                s.move_to(Phase.CLOSED)
        if s.errors.error is not None and not s.errors.seen:
            s.errors.seen = True
            raise s.errors.error

    def abandon(self) -> None:
        """The collector was garbage-collected while running: stop the run from wherever we are
        (a finalizer, in any thread). Its own task stops the workers; if its loop is gone, they
        are killed now."""
        own = self.own
        if own is None:
            return
        own.abandoned = True
        if own.done.is_set():
            self.stream.close()
            return
        loop, stop = self.loop, self.shared.stop
        try:
            self.request_close()
            if isinstance(loop, asyncio.AbstractEventLoop):
                if loop.is_closed() or not loop.is_running():
                    raise RuntimeError("the loop is gone")
                if loop_token() is loop:
                    stop.set()
                else:
                    loop.call_soon_threadsafe(stop.set)
            else:  # trio
                loop.run_sync_soon(stop.set)
        except Exception:  # noqa: BLE001 - no loop to stop it in: kill the workers now
            self.kill_now()

    def kill_now(self) -> None:
        self.shared.pool.kill_now()

    # -- consuming ------------------------------------------------------------------------------
    async def consume(self) -> "TensorDict":
        """The user's ``collect()`` (:meth:`BatchStream.consume`)."""
        return await self.stream.consume()

    def pause(self) -> AsyncContextManager[None]:
        return self.shared.delivery.gate.hold()

    # -- weights --------------------------------------------------------------------------------
    async def update_weights(self, policy_or_weights: Any, model_id: Any, weights_dict: Any, worker_ids: Any,
                             wait: Any) -> int:
        """``Collector.update_weights``: the weight sync checks the arguments (once) and
        publishes; the lifecycle starts a collector not started yet, refuses a closed one, counts
        on after the last batch, and waits for the targets' acknowledgements if asked."""
        s = self.shared
        sync = s.sync
        updates, targets = sync.request(policy_or_weights, model_id, weights_dict, worker_ids, wait,
                                        started=self.state is not CollectorState.CREATED)
        if self.state in (State.CREATED, State.STARTING):
            await self.start()  # (a start cancelled earlier may still be under way: wait for it)
        self.check_loop()
        if s.phase.closing:
            raise CollectorClosedError(f"update_weights() on a collector that is {self.state.value}; create a new Collector")
        if self.state is State.STOPPED:
            if s.errors.error is not None:
                raise CollectorClosedError(
                    f"update_weights(): the collector stopped because a worker failed ({type(s.errors.error).__name__}); "
                    f"no worker is left to update"
                ) from s.errors.error
            return sync.bump()  # total_frames reached: nothing will collect again, so nothing is waited for
        version = await sync.publish(updates, targets)
        if not wait:
            await anyio.lowlevel.checkpoint()  # (a coroutine yields once: background work runs)
        elif not await sync.wait_applied(version, targets, self.collecting):
            if s.errors.error is not None:
                raise s.errors.error
            if s.phase in (Phase.RUNNING, Phase.FINISHED, Phase.COMPLETED, Phase.ENDED):
                return version  # total_frames reached meanwhile: the rest will not collect again
            raise CollectorClosedError(f"the collector was closed before the workers applied version {version}")
        return version

    def collecting(self) -> bool:
        """The workers may still collect frames (so an update is worth waiting for)."""
        return self.shared.collecting

    @property
    def policy_version(self) -> int:
        return self.shared.sync.version

    @property
    def worker_versions(self) -> tuple[int, ...]:
        return tuple(self.shared.sync.acked)

    # -- what the collector reports ---------------------------------------------------------------
    @property
    def frames(self) -> int:
        return self.shared.delivery.counts.frames

    @property
    def batches(self) -> int:
        return self.shared.delivery.counts.batches

    @property
    def worker_pids(self) -> tuple[int, ...]:
        return self.shared.pool.pids

    @property
    def env_epoch(self) -> int:
        return self.shared.pool.env_calls.epoch

    @property
    def writes_to_sink(self) -> bool:
        """Background collection: the batches go to a replay buffer or a queue."""
        return self.shared.delivery.sink is not None

    @property
    def paused(self) -> bool:
        return self.shared.delivery.gate.paused > 0

    def stats(self) -> CollectorStats:
        s = self.shared
        return s.stats.snapshot(s.delivery.counts.frames, s.delivery.counts.batches, s.pool.server)

    def when_closed(self, fn: Callable[[], Any]) -> None:
        """Call ``fn()`` once, when the run is closed (whatever closed it)."""
        self.shared.on_closed = fn

    def warm_up(self, needs: Any) -> None:
        """Let the backend prepare what starting the workers will need (without waiting)."""
        self.shared.pool.backend.warm_up(needs)

    # -- reaching into the workers' envs and policies ------------------------------------------
    async def reach(self, what: str, kind: str, name: str, args: tuple = (), kwargs: dict | None = None,
                    **options: Any) -> tuple[list, int]:
        """``Collector.call``, ``get_attr``, ``set_attr``, ``map_fn``, ``getattr_env``,
        ``getattr_policy``: start a collector not started yet, refuse one whose workers are gone,
        then apply it (:func:`~aiocollect._collector.env_calls.reach`)."""
        s = self.shared
        if not s.pool.ready and not s.phase.closing:
            await self.start()  # (as update_weights: a call before the start starts the collector)
        self.check_loop()
        if not s.collecting:
            if not (kind == "policy" and s.pool.server is not None):
                _env_calls.check_reachable(s.pool, what)
                if s.errors.error is None and not s.phase.closing:
                    raise CollectorClosedError(
                        f"{what}: every batch of total_frames is collected, and the workers are gone")
            raise self.closed_error(what)
        return await _env_calls.reach(s.pool, what, kind, name, args, kwargs, **options)

    # -- seeds and counters ---------------------------------------------------------------------
    def set_seed(self, seed: int, static_seed: bool) -> int:
        self._require_created("set_seed()")
        s = self.shared
        return _resume.set_seed(s.seeding, s.config, s.pool.total_rows, seed, static_seed)

    def state_dict(self) -> dict[str, Any]:
        s = self.shared
        return _resume.state_dict(s.delivery.counts, s.seeding, s.pool.total_rows)

    def load_state_dict(self, state: Any) -> None:
        self._require_created("load_state_dict()")
        s = self.shared
        _resume.load_state_dict(s.delivery.counts, s.seeding, s.config, state)

    def _require_created(self, what: str) -> None:
        if self.shared.phase is not Phase.CREATED:
            raise AiocollectError(
                f"{what} must be called before the collector starts (it is {self.state.value}); call it "
                f"right after constructing the collector, before `async with` / start()"
            )

    # -- profiling ------------------------------------------------------------------------------
    def enable_profile(self, config: ProfileConfig) -> None:
        s = self.shared
        if self.state in (State.STOPPED, State.CLOSED):
            s.profiling.check(config)
            raise self.closed_error("enable_profile()")
        s.profiling.enable(config, s.pool.ready)

    def disable_profile(self) -> None:
        self.shared.profiling.disable()

__all__ = ["CollectorState", "Run", "State"]
