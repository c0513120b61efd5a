"""The Ray backend (``backend="ray"``): each worker seat is a Ray actor that runs the same rollout
engine as a worker process (:mod:`aiocollect._backends.ray_actor`).

What crosses Ray, per batch: one ``run_batch`` call, and its return value (the seat's rows of
the batch as one byte array, put in Ray's object store by the actor, plus a small
:class:`~aiocollect._core.wire.BatchInfo`), awaited here without blocking the event loop (the object
reference's future wakes the loop from Ray's thread) and copied into the collector's slot, from
where the producer delivers it as with any backend. Per weight update: one ``ray.put`` of the
store's newest version, shared by every actor that reads the store, and one ``set_weights`` call per
actor naming it. Per env call (``Collector.call``, ``set_attr`` ...): one ``env_call`` per actor
it reaches, in a concurrency group of its own, answered once the actor applied it between two env
steps. The actors never see the collector's shared memory, so they may run on other machines of
the Ray cluster.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from typing import Any, Callable

import anyio
import numpy as np

from .._core.errors import ConfigError, WorkerTimeoutError
from .._core.heartbeat import STOPPED, UNRESPONSIVE, process_state
from .._core.layout import SlotLayout
from .._worker.rollout import RolloutConfig
from .failures import REPLACE_DEAD, REPLACE_HUNG, changed_spec, hung_error, ray_error, stop_on_failure, unpacked_error
from .seat import SlotViews
from .workers import LoopSeat, OnApplied, OnReady, CallWaiter, allocate_segment

log = logging.getLogger("aiocollect")

INSTALL = "pip install 'aiocollect[ray]'"
_THREAD_COPY_BYTES = 8 << 20  # larger batches are copied out of Ray's object store in a thread


def import_ray() -> Any:
    """Ray, or a :class:`ConfigError` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"backend='ray' needs Ray, which is not installed here ({exc}); {INSTALL}") from None
    return ray


def check_actor_options(options: Any, workers: int) -> list[dict]:
    """``ray_actor_options`` as one dict per worker (a dict for all, or a list of one per worker),
    checked against the options Ray's actors take."""
    if options is None:
        per_worker: list[Any] = [{}] * workers
    elif isinstance(options, dict):
        per_worker = [options] * workers
    elif isinstance(options, (list, tuple)):
        if len(options) != workers:
            raise ConfigError(
                f"ray_actor_options has {len(options)} dicts but the collector has {workers} workers "
                f"(num_workers={workers}); pass one dict for every actor, or a list of one per worker"
            )
        per_worker = list(options)
    else:
        raise ConfigError(
            f"ray_actor_options={options!r:.100} must be a dict of Ray actor options (num_cpus, num_gpus, resources, "
            f"scheduling_strategy ...), or a list of one per worker"
        )
    ray = import_ray()
    known, validate = _ray_option_checks()
    ours = {  # options aiocollect sets itself, and why
        "max_concurrency": "one thread collects, one takes weights",
        "concurrency_groups": "one thread collects, one takes weights, one applies env calls",
        "max_restarts": "aiocollect replaces dead actors itself: pass on_worker_failure='restart' (and max_restarts)",
        "max_task_retries": "a batch is never retried: its actor is replaced under on_worker_failure='restart'",
    }
    out = []
    for i, opts in enumerate(per_worker):
        if not isinstance(opts, dict):
            raise ConfigError(f"ray_actor_options[{i}]={opts!r:.100} must be a dict of Ray actor options")
        taken = sorted(set(ours) & set(opts))
        if taken:
            raise ConfigError(
                f"ray_actor_options sets {taken[0]!r}: aiocollect sets it itself ({ours[taken[0]]}); leave it out"
            )
        if known is not None:
            bad = sorted(set(opts) - set(known))
            if bad:
                raise ConfigError(
                    f"ray_actor_options has {bad}, which Ray {ray.__version__}'s actors do not take; known options: "
                    f"{', '.join(sorted(k for k in known if k not in ours))}"
                )
        if validate is not None:
            try:
                validate(opts, in_options=True)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"ray_actor_options{'' if len(set(map(id, per_worker))) == 1 else f'[{i}]'}: {exc}") from None
        out.append({"num_cpus": 1, "max_restarts": 0, **opts})
    return out


def _ray_option_checks() -> tuple[Any, Any]:
    """Ray's own table of actor options and its check of their values (a private module that
    moved between Ray versions: ``(None, None)`` where it is not found; Ray checks them later)."""
    import importlib

    for name in ("ray._common.ray_option_utils", "ray._private.ray_option_utils"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return getattr(module, "actor_options", None), getattr(module, "validate_actor_options", None)
    return None, None


def ensure_ray(ray: Any) -> None:
    """Connect to Ray: the user's ``ray.init``, or else a local instance started here (as Ray
    itself does on first use; it stays up until the process exits). ``ray.init`` takes seconds
    and blocks the calling thread; the caller's loop then, once."""
    if not ray.is_initialized():
        log.info("aiocollect: Ray is not initialised: starting a local Ray instance (call ray.init() first to choose; "
                 "it blocks the event loop for a few seconds)")
        # Ray starts its workers at niceness 15: on the machine that trains, the training loop would
        # starve the actors; a local instance started here runs them at the trainer's priority
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(include_dashboard=False)


class _Snapshots:
    """One ``ray.put`` per weight store and version, shared by every actor that reads the store."""

    def __init__(self) -> None:
        self._refs: dict[int, tuple[int, Any, Any]] = {}  # id(store) -> (version, ref, store)

    def ref(self, store: Any) -> tuple[int, Any]:
        version = store.latest_version
        have = self._refs.get(id(store))
        if have is not None and have[0] == version and have[2] is store:
            return version, have[1]
        import ray

        layout = store.layout
        half = int(store.header[2])
        buf = np.frombuffer(store.buffer, np.uint8)
        start = layout.meta_nbytes + half * layout.buffer_nbytes
        snapshot = (buf[: layout.meta_nbytes].copy(), half, buf[start : start + layout.buffer_nbytes].copy())
        ref = ray.put(snapshot)
        self._refs[id(store)] = (version, ref, store)
        self.puts += 1
        return version, ref

    def clear(self) -> None:
        self._refs.clear()

    puts = 0  # (tests count them)


class _Caller:
    """Runs a function on the event loop from another thread (Ray's callback thread)."""

    def __init__(self) -> None:
        from .._service.resource import loop_token

        token = loop_token()
        self._soon: Callable[[Callable[[], None]], Any] = (
            token.call_soon_threadsafe if hasattr(token, "call_soon_threadsafe") else token.run_sync_soon
        )

    def soon(self, fn: Callable[[], None]) -> None:
        try:
            self._soon(fn)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass


async def await_ref(ref: Any) -> Any:
    """The value of the object reference ``ref``, awaited without blocking the event loop (Ray's
    thread completes its future; a callback wakes the loop); raises what the call raised."""
    fut = ref.future()
    if not fut.done():
        done = anyio.Event()
        caller = _Caller()
        fut.add_done_callback(lambda _: caller.soon(done.set))
        await done.wait()
    return fut.result()


async def kill_actor(actor: Any, pid: int | None, node: str) -> None:
    """``ray.kill`` the actor and, when it ran on this node, wait (2 s at most) until its process
    is gone."""
    import_ray().kill(actor, no_restart=True)
    if pid is not None and node and node == _this_node():
        with anyio.move_on_after(2.0):
            while os.path.exists(f"/proc/{pid}"):
                await anyio.sleep(0.01)


def local_state(pid: int | None, node: str) -> str | None:
    """The state letter of an actor's process when it runs on this node (``None``: unknown)."""
    if pid is None or not node or node != _this_node():
        return None
    state = process_state(pid)
    return None if state is None else state[0]


def kill_stopped(pid: int | None, state: str | None) -> None:
    """SIGKILL a stopped actor process of this node at once (``ray.kill`` asks it to exit
    first, which a stopped process cannot do)."""
    if pid is not None and state in STOPPED:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


async def kill_hung(
    actor: Any, who: str, worker: int | None, pid: int | None, node: str, stuck: tuple[int, int, float],
    timeout: float, fix: str, died: Callable[[], bool] = lambda: False,
) -> WorkerTimeoutError | None:
    """The error for an actor found hung (``stuck``: ``(what, env, seconds)``), with its Python
    stack where it can still answer (1 s at most); the actor is killed. ``None`` (nothing killed)
    if ``died()`` says it died of something else meanwhile."""
    state = local_state(pid, node)
    stack = ""
    if stuck[0] != UNRESPONSIVE and state not in STOPPED:
        with anyio.move_on_after(1.0):
            try:
                stack = await await_ref(actor.stack.options(concurrency_group="control").remote())
            except Exception:  # noqa: BLE001 - died meanwhile
                pass
    if died():
        return None
    error = hung_error(who, worker, stuck, timeout, stack, state, fix)
    import_ray().kill(actor, no_restart=True)
    kill_stopped(pid, state)
    return error


_classes: dict[type, Any] = {}


def actor_class(cls: type) -> Any:
    """``cls`` as a Ray actor class with the concurrency groups it names in ``GROUPS`` (made
    once: Ray exports each actor class it is given)."""
    remote = _classes.get(cls)
    if remote is None:
        remote = _classes[cls] = import_ray().remote(concurrency_groups=dict(cls.GROUPS))(cls)  # type: ignore[attr-defined]
    return remote


class RayWorker(LoopSeat):
    """A worker seat whose rollout runs in a Ray actor (replaced by a new actor after a failure)."""

    reaches_envs = True

    def __init__(self, index: int, options: dict, snapshots: _Snapshots) -> None:
        super().__init__(index)
        self.options = options
        self.snapshots = snapshots
        self.actor: Any = None
        self.actor_pid: int | None = None
        self.node: str = ""
        self.spec: dict | None = None
        self.actor_layout: SlotLayout | None = None  # one slot of this seat's rows, as the actor fills it
        self.watch = False
        self.inflight: deque[tuple[int, Any]] = deque()  # (slot, future of run_batch), in order
        self.controls: deque[Any] = deque()  # futures of set_weights calls
        self.stores: list[Any] = []
        self.sent: list[int] = []  # per store: the newest version sent to the current actor
        self.caller: _Caller | None = None
        self.hung: BaseException | None = None
        self._beat: Any = None  # future of the watchdog's last question
        self._asked = 0.0  # when it was asked
        self._stuck: tuple[int, int, float] | None = None
        self.call_lost: BaseException | None = None  # an env call found the actor dead

    @property
    def pid(self) -> int | None:
        """The actor's process id (on its node, which may be another machine)."""
        return self.actor_pid if self.actor is not None else None

    # -- start-up -------------------------------------------------------------------------------
    def spawn(self, cfg: RolloutConfig) -> Any:
        from .._core import pickling as _pickling
        from .ray_actor import RolloutActor

        return actor_class(RolloutActor).options(max_concurrency=1, **self.options).remote(_pickling.dumps(cfg))

    async def configure(self, actor: Any) -> tuple[int, str, dict]:
        """Wait for a new actor's envs and policy; return ``(pid, node, spec)``."""
        try:
            answer = await await_ref(actor.spec.remote())
        except Exception as exc:
            raise self._error(exc, "while starting") from None
        if answer[0] == "error":
            raise self._task_error(answer[1], answer[2])
        return answer

    def attach(self, layout: SlotLayout, mm: Any) -> None:
        """This seat's rows of the collector's slots, and the layout of the actor's own batch."""
        self.slots = SlotViews(layout, mm, self.index)
        self.actor_layout = SlotLayout.build(list(layout.leaves), layout.rows, layout.frames_per_row, 1, 1)
        self.free = deque(range(layout.num_slots))

    def _setup_actor(self) -> None:
        """Send the actor its batch layout and the weight stores (their newest versions follow)."""
        fut = self.actor.setup.remote(self.actor_layout, [s.layout for s in self.stores], self.watch).future()
        self._watch(fut)
        self.controls.append(fut)  # (its answer: the version of weights sent meanwhile, if applied)
        self.sent = [0] * len(self.stores)
        self._send_weights()

    # -- producer interface ---------------------------------------------------------------------
    async def nudge(self) -> None:
        self._send_weights()
        self._wake()

    async def give_store(self, store: Any) -> None:
        """A weight store this seat reads (the shared one, or its own for per-worker updates)."""
        self.stores.append(store)
        self.sent.append(0)
        if self.actor is not None:
            self.actor.add_store.options(concurrency_group="control").remote(len(self.stores) - 1, store.layout)

    def _send_weights(self) -> None:
        if self.actor is None:
            return
        for k, store in enumerate(self.stores):
            if store.latest_version > self.sent[k]:
                version, ref = self.snapshots.ref(store)
                fut = self.actor.set_weights.options(concurrency_group="control").remote(k, ref).future()
                self._watch(fut)
                self.controls.append(fut)
                self.sent[k] = version

    def _watch(self, fut: Any) -> None:
        caller = self.caller
        if caller is not None:
            fut.add_done_callback(lambda _: caller.soon(self._wake))

    def _submit(self) -> None:
        while self.actor is not None and self.hung is None and self.credits > 0 and self.free:
            slot = self.free.popleft()
            self.credits -= 1
            fut = self.actor.run_batch.remote().future()
            self._watch(fut)
            self.inflight.append((slot, fut))

    async def serve(self, on_ready: OnReady, on_applied: OnApplied) -> BaseException:
        self.caller = _Caller()
        for fut in [f for _, f in self.inflight] + list(self.controls):  # (submitted before serve)
            self._watch(fut)
        while True:
            self.wakeup = anyio.Event()
            if self.call_lost is not None:  # (an idle actor's death, seen by an env call)
                return self._failure(self.call_lost)
            self._submit()
            while self.controls and self.controls[0].done():
                try:
                    version = self.controls.popleft().result()
                except Exception as exc:  # noqa: BLE001 - the actor died
                    return self._failure(exc)
                if version is not None:
                    await on_applied(self, version)
            if self.inflight and self.inflight[0][1].done():
                slot, fut = self.inflight.popleft()
                try:
                    result = fut.result()
                except Exception as exc:  # noqa: BLE001 - the actor died (or was killed as hung)
                    self.free.appendleft(slot)
                    return self._failure(exc)
                if result[0] != "batch":
                    self.free.appendleft(slot)
                    if result[0] == "error":
                        return self._task_error(result[1], result[2])
                    continue  # ("halted",): being stopped
                _, data, info, applied = result
                del result
                await self._copy(slot, data)
                del data  # (Ray frees the object once nothing refers to it)
                self._completed(slot, info)
                for version in applied:
                    await on_applied(self, version)
                on_ready(self)
                continue
            await self.wakeup.wait()

    async def _copy(self, slot: int, data: np.ndarray) -> None:
        assert self.actor_layout is not None
        src = self.actor_layout.views(data, 0, 0)
        dst = self.slots.np_views[slot]

        def copy() -> None:
            for key, array in dst.items():
                np.copyto(array, src[key])

        if data.nbytes > _THREAD_COPY_BYTES:
            await anyio.to_thread.run_sync(copy)
        else:
            copy()

    # -- env calls ------------------------------------------------------------------------------
    async def env_call(self, call: Any) -> list:
        """Hand ``call`` (an :class:`~aiocollect._core.wire.EnvCall`) to the actor; its results
        once the actor applied it between two env steps (:meth:`RolloutActor.env_call
        <aiocollect._backends.ray_actor.RolloutActor.env_call>`). An actor that dies first is
        replaced (``on_worker_failure="restart"``) and its replacement gets the call; else this
        raises the actor's error. What the env raised is raised as the worker's error."""
        waiter = self.calls[call.id] = CallWaiter(call)
        try:
            self._send_call(waiter)
            await waiter.done.wait()
        finally:
            self.calls.pop(call.id, None)
        return waiter.results(self._task_error)

    def _send_call(self, waiter: CallWaiter) -> None:
        actor = self.actor
        if actor is None or self.hung is not None:
            return  # (being replaced: the replacement gets it once it is up)
        fut = actor.env_call.options(concurrency_group="calls").remote(waiter.call).future()
        caller = self.caller or _Caller()
        fut.add_done_callback(lambda f: caller.soon(lambda: self._call_answered(waiter, f, actor)))

    def _call_answered(self, waiter: CallWaiter, fut: Any, actor: Any) -> None:
        try:
            answer = fut.result()
        except Exception as exc:  # noqa: BLE001 - the actor died: serve() reports it
            if actor is self.actor and self.call_lost is None:
                self.call_lost = exc
                self._wake()
            return
        if answer is not None:  # (None: the actor was being stopped)
            waiter.finish(answer)

    def fail_calls(self, error: BaseException) -> None:
        for waiter in list(self.calls.values()):
            waiter.finish(error=error)

    # -- failures -------------------------------------------------------------------------------
    def _who(self) -> str:
        return f"worker {self.index} (Ray actor, pid {self.actor_pid})"

    def _error(self, exc: BaseException, when: str = "") -> BaseException:
        return ray_error(exc, self._who(), self.index, self.actor_pid, REPLACE_DEAD, when)

    def _failure(self, exc: BaseException) -> BaseException:
        return self.hung or self._error(exc)

    def _task_error(self, packed: bytes, text: str) -> BaseException:
        return unpacked_error(self.index, self.actor_pid, packed, text, self._who())

    # -- hangs ----------------------------------------------------------------------------------
    def stuck(self, timeout: float) -> tuple[int, int, float] | None:
        """What the actor answered last time (asked again now: its control thread answers while
        a batch runs). An actor that has not answered for longer than ``timeout`` (1 s at least)
        is hung whatever it was doing (:data:`~aiocollect._core.heartbeat.UNRESPONSIVE`): its process
        is stopped or frozen (or stuck in native code that holds the GIL)."""
        if self.actor is None or self.hung is not None:
            return None
        beat = self._beat
        if beat is not None and not beat.done():
            waited = time.monotonic() - self._asked
            return (UNRESPONSIVE, 0, waited) if waited > max(timeout, 1.0) else None  # (1 s: Ray's own latency)
        if beat is not None:
            try:
                self._stuck = beat.result()
            except Exception:  # noqa: BLE001 - the actor died: serve() reports it
                self._stuck = None
        self._beat = self.actor.stuck.options(concurrency_group="control").remote(timeout).future()
        self._asked = time.monotonic()
        found, self._stuck = self._stuck, None
        return found

    async def declare_hung(self, what: int, env: int, seconds: float, timeout: float) -> None:
        """The actor has been in one call for ``seconds``: take its stack, kill it; :meth:`serve`
        then returns a :class:`WorkerTimeoutError`."""
        self.hung = await kill_hung(
            self.actor, self._who(), self.index, self.actor_pid, self.node, (what, env, seconds), timeout, REPLACE_HUNG
        )

    # -- replacement and shutdown ---------------------------------------------------------------
    async def replace(self, cfg: RolloutConfig) -> None:
        old, self.actor = self.actor, None
        if old is not None:
            with anyio.CancelScope(shield=True):
                await kill_actor(old, self.actor_pid, self.node)
        self._forget()
        self.hung = None
        self.restarts += 1
        actor = self.spawn(cfg)
        try:
            pid, node, spec = await self.configure(actor)
            if spec != self.spec:
                raise changed_spec(self.index, spec, self.spec)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await kill_actor(actor, None, "")
            raise
        self.actor, self.actor_pid, self.node = actor, pid, node
        self.credits = 0
        self.credits_sent = self.completed
        self.free = deque(self.free_slots())
        self._setup_actor()
        for waiter in list(self.calls.values()):  # calls the failed actor did not answer
            if not waiter.done.is_set():
                self._send_call(waiter)

    def _forget(self) -> None:
        """Drop what was asked of the actor that is gone (its slots are free again)."""
        for slot, _ in self.inflight:
            if slot not in self.free:
                self.free.append(slot)
        self.inflight.clear()
        self.controls.clear()
        self._beat = None
        self._stuck = None
        self.call_lost = None

    async def stop(self, timeout: float) -> None:
        """Halt the actor, let it close its envs (at most ``timeout`` seconds), then kill it."""
        actor, self.actor = self.actor, None
        if actor is None:
            self._free()
            return
        try:
            actor.halt.options(concurrency_group="control").remote()
            with anyio.move_on_after(timeout):
                try:
                    await await_ref(actor.close.remote())
                except Exception:  # noqa: BLE001 - dead already, or its envs' close() raised
                    pass
        finally:
            try:
                await kill_actor(actor, self.actor_pid, self.node)
            finally:
                self._forget()
                self._free()

    def _free(self) -> None:
        from .._core.errors import CollectorClosedError

        self.fail_calls(CollectorClosedError(f"worker {self.index} was stopped before it applied the env call"))
        self.slots = SlotViews.unset()  # (the segment is unmapped once no view is left)
        self.stores = []

    def stop_nowait(self) -> None:
        actor, self.actor = self.actor, None
        if actor is not None:
            try:
                import_ray().kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - Ray is shutting down too
                pass
        self._forget()
        self._free()


def _this_node() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        return ""


async def start_ray_workers(configs: list[RolloutConfig], options: list[dict]) -> tuple[list[RayWorker], list[dict]]:
    """An actor per config (Ray started if it is not yet); returns the workers and their specs."""
    ray = import_ray()
    # (on the loop's thread, blocking it for the seconds ray.init takes, once: Ray's own processes
    # die with the thread that started them, so a thread of ours would take them down as it ends)
    ensure_ray(ray)
    snapshots = _Snapshots()
    workers = [RayWorker(i, options[i], snapshots) for i in range(len(configs))]
    async with stop_on_failure(workers):
        for w, cfg in zip(workers, configs):
            w.actor = w.spawn(cfg)

        async def handshake(w: RayWorker) -> None:
            w.actor_pid, w.node, w.spec = await w.configure(w.actor)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_warn_if_slow, workers, ray)
            async with anyio.create_task_group() as starting:
                for w in workers:
                    starting.start_soon(handshake, w)
            tg.cancel_scope.cancel()
        log.debug("aiocollect: %d Ray actors ready in %.1f s", len(workers), time.perf_counter() - t0)
        _warn_if_niced(workers)
        return workers, [w.spec for w in workers]  # type: ignore[misc]


_niced_warned = False


def _warn_if_niced(workers: list[RayWorker]) -> None:
    """Once a process: actors on this node that run at a lower priority than this process (Ray
    starts its workers at niceness 15 unless ``RAY_worker_niceness`` says otherwise) are said on
    the ``aiocollect`` logger, with the fix: beside a busy training loop they get what it leaves."""
    global _niced_warned
    if _niced_warned:
        return
    node, ours = _this_node(), os.getpriority(os.PRIO_PROCESS, 0)
    niced = []  # the niceness of each actor here that runs below this process
    for w in workers:
        if w.node != node or not w.actor_pid:
            continue
        try:
            nice = os.getpriority(os.PRIO_PROCESS, w.actor_pid)
        except OSError:  # (gone already, or not ours to look at)
            continue
        if nice > ours:
            niced.append(nice)
    if niced:
        _niced_warned = True
        log.warning(
            "aiocollect: %d of %d Ray actors on this machine run at niceness %d (this process: %d): a busy "
            "training loop here takes the CPUs before them. Set RAY_worker_niceness=0 in the environment before "
            "ray.init() (or let the collector start Ray, which does)", len(niced), len(workers), max(niced), ours,
        )


_SLOW_START = 20.0  # seconds after which actors not yet up are logged (Ray may lack their resources)


async def _warn_if_slow(workers: list[RayWorker], ray: Any) -> None:
    """Actors that wait for resources wait for ever, silently: say so on the ``aiocollect``
    logger (once), with what they asked for and what the cluster has free."""
    await anyio.sleep(_SLOW_START)
    waiting = [w for w in workers if w.spec is None]
    if waiting:
        try:
            free = ray.available_resources()
        except Exception:  # noqa: BLE001 - informative only
            free = "?"
        log.warning(
            "aiocollect: %d of %d Ray actors are not running after %.0f s; each asks for %s and the cluster has %s "
            "free: lower num_cpus in ray_actor_options, use fewer workers, or add nodes (an actor waits until "
            "its resources are free)", len(waiting), len(workers), _SLOW_START, waiting[0].options, free,
        )


def setup_ray_slots(workers: list[RayWorker], layout: SlotLayout, shared_store: Any, watch: bool) -> tuple[int, Any]:
    """The collector's slots (a memfd, as the other backends have, so that batches are lent and
    delivered alike) and each actor's set-up. Returns the segment, owned by the caller."""
    fd, mm = allocate_segment(layout, f"aiocollect-{os.getpid()}-ray")
    for w in workers:
        w.attach(layout, mm)
        w.watch = watch
        if shared_store is not None:
            w.stores.append(shared_store)
            w.sent.append(0)
        w._setup_actor()
    return fd, mm


__all__ = [
    "RayWorker", "actor_class", "await_ref", "check_actor_options", "import_ray", "kill_actor", "kill_hung",
    "setup_ray_slots",
    "start_ray_workers",
]
