"""The Ray backend's actor: one worker seat's rollout, the same engine a worker process runs
(:func:`~aiocollect._worker.vector.open_rollout`), in a Ray actor.

Imported in Ray's worker processes; it does not import Ray (the collector's side,
:mod:`aiocollect._backends.ray`, makes it an actor class). Three concurrency groups: the default one
(one thread) runs :meth:`RolloutActor.run_batch` calls one after another, in the order the collector
submits them; ``"control"`` (one thread of its own) takes new weights and answers the watchdog while
a batch is being collected; ``"calls"`` (one thread) waits for the env calls it hands over
(``Collector.call``, ``set_attr`` ...). Weights change only between batches: :attr:`RolloutActor.batch`
is held for the length of a batch, and weights that arrive meanwhile wait for its end. Env calls
are applied between two env steps: by the batch's own thread between its steps, or, between
batches, by the ``"calls"`` thread holding :attr:`RolloutActor.batch`; never during a step.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

import numpy as np

from .._core import heartbeat as _heartbeat

CONTROL = "control"  # the concurrency group of the methods that run beside a batch
CALLS = "calls"  # the concurrency group of env calls (which wait for a step boundary)
_CALL_POLL = 0.05  # seconds between an env call's tries to apply itself while no batch applies it


class _Waiting:
    """An env call handed over to the thread that steps the envs, and its answer."""

    __slots__ = ("call", "done", "answer")

    def __init__(self, call: Any) -> None:
        self.call = call
        self.done = threading.Event()
        self.answer: Any = None


class RolloutActor:
    """One seat's envs and policy. Built from a cloudpickled
    :class:`~aiocollect._worker.rollout.RolloutConfig` (as a worker process is)."""

    GROUPS = {CONTROL: 1, CALLS: 1}  # its concurrency groups (besides the default one)

    def __init__(self, config: bytes) -> None:
        import cloudpickle

        from .._worker.vector import open_rollout

        self.rollout: Any = None
        self.failed: tuple | None = None  # ("error", packed exception, traceback): told by spec()
        try:
            self.cfg = cloudpickle.loads(config)
            self.rollout = open_rollout(self.cfg)  # a Rollout, or a VectorRollout for vector envs
        except Exception as exc:  # noqa: BLE001 - (raised here, Ray would keep only its text)
            self.failed = _packed(exc)
        self.batch = threading.Lock()  # held while a batch is collected
        self.mutex = threading.Lock()  # guards what the control thread hands over
        self.pending: dict[int, tuple[np.ndarray, int, np.ndarray]] = {}  # store -> newest snapshot
        self.layouts: dict[int, Any] = {}  # stores not yet added: index -> layout
        self.stores: list[Any] = []
        self.buffer: Any = None
        self.array: np.ndarray | None = None
        self.views: dict | None = None
        self.halted = False
        self.thread: int | None = None  # the thread that runs batches (for its stack when hung)
        self.calls: list[_Waiting] = []  # env calls handed over, not applied yet (guarded by mutex)
        beat = bytearray(_heartbeat.NBYTES)
        self.beat = beat
        self.monitor = _heartbeat.HeartbeatMonitor(beat, 0)

    def spec(self) -> tuple:
        """``(pid, node id, batch leaves)``: what the collector needs to lay out the batch; or
        ``("error", packed exception, traceback)`` if the envs or the policy could not be made."""
        if self.failed is not None:
            return self.failed
        return os.getpid(), _node_id(), self.rollout.spec()

    def setup(self, layout: Any, store_layouts: list[Any], watch: bool) -> int | None:
        """The layout of one batch of this seat (one slot, one worker's rows), the weight stores
        the collector publishes to, and whether to keep a heartbeat (a ``step_timeout``). Returns
        the weights' version if weights sent meanwhile were applied."""
        self.buffer = bytearray(layout.slot_nbytes)
        self.array = np.frombuffer(self.buffer, np.uint8)
        self.views = layout.views(self.buffer, 0, 0)
        with self.mutex:
            self.layouts.update(enumerate(store_layouts))
        if watch:
            self.rollout.heartbeat = _heartbeat.Heartbeat(self.beat, 0)
        with self.batch:
            return self._apply()

    # -- the control group ------------------------------------------------------------------------
    def add_store(self, index: int, layout: Any) -> None:
        """Weight store ``index``, this seat's own (per-worker updates); added at the next batch
        boundary."""
        with self.mutex:
            self.layouts[index] = layout

    def set_weights(self, store: int, snapshot: tuple[np.ndarray, int, np.ndarray]) -> int | None:
        """A new version in store ``store`` (its header and its newest buffer). Applied now if no
        batch is being collected (returns the version applied), else at the batch's end."""
        with self.mutex:
            self.pending[store] = snapshot
        if not self.batch.acquire(blocking=False):
            return None  # run_batch applies it when its batch ends, and reports it
        try:
            return self._apply()
        finally:
            self.batch.release()

    def stuck(self, timeout: float) -> tuple[int, int, float] | None:
        """As :meth:`HeartbeatMonitor.stuck <aiocollect._core.heartbeat.HeartbeatMonitor.stuck>`."""
        return self.monitor.stuck(timeout)

    def stack(self) -> str:
        """The Python stack of the thread that collects batches (for a hang's error)."""
        frame = sys._current_frames().get(self.thread) if self.thread is not None else None
        return "" if frame is None else "".join(traceback.format_stack(frame))

    def halt(self) -> None:
        """Collect no more batches: ``run_batch`` calls still queued return at once."""
        self.halted = True

    # -- the calls group ----------------------------------------------------------------------------
    def env_call(self, call: Any) -> Any:
        """Apply the :class:`~aiocollect._core.wire.EnvCall` ``call`` between two env steps;
        returns its :class:`~aiocollect._core.wire.EnvCallDone` once applied (what the env raised
        travels in it: the actor goes on). Handed to the batch in progress, which applies it
        after its current step; between batches applied here, holding :attr:`batch`."""
        waiting = _Waiting(call)
        with self.mutex:
            self.calls.append(waiting)
        wait = 0.0
        while not waiting.done.wait(wait):
            if self.halted:  # (the collector stops the actor: nobody waits for the answer)
                return None
            if self.batch.acquire(blocking=False):
                try:
                    self._apply_calls()
                finally:
                    self.batch.release()
            wait = _CALL_POLL
        return waiting.answer

    def _apply_calls(self) -> None:
        """Apply the env calls handed over (``self.batch`` held: between two env steps)."""
        from .._worker.env_calls import answer

        with self.mutex:
            calls, self.calls = self.calls, []
        for waiting in calls:
            waiting.answer = answer(self.rollout, waiting.call)
            waiting.done.set()

    def _between_steps(self) -> None:
        if self.calls:  # (read without the lock: a call handed over meanwhile waits for the next step)
            self._apply_calls()

    # -- the default group --------------------------------------------------------------------------
    def _apply(self) -> int | None:
        """Between batches (``self.batch`` held): take the stores and weights handed over."""
        from .._worker.weights import WeightStore

        with self.mutex:  # (stores in their index order; weights for stores not added yet wait)
            while len(self.stores) in self.layouts:
                layout = self.layouts.pop(len(self.stores))
                store = WeightStore.create(layout, bytearray(layout.nbytes))
                self.stores.append(store)
                self.rollout.add_store(store)
            ready = {k: v for k, v in self.pending.items() if k < len(self.stores)}
            self.pending = {k: v for k, v in self.pending.items() if k not in ready}
        for index, (meta, half_index, half) in ready.items():
            store = self.stores[index]
            buf = np.frombuffer(store.buffer, np.uint8)
            layout = store.layout
            start = layout.meta_nbytes + half_index * layout.buffer_nbytes
            buf[start : start + half.nbytes] = half
            buf[: meta.nbytes] = meta  # (the header last: it names the buffer now complete)
        return self.rollout.apply_weights() if self.stores else None

    def run_batch(self) -> tuple:
        """Collect one batch. Returns ``("batch", bytes of the batch, BatchInfo, versions
        applied)``: the weights applied before it (its frames carry them) and after it; ``("error",
        packed exception, traceback)`` if the env or the policy raised; ``None`` once halted."""
        if self.halted:
            return ("halted",)
        applied = []
        with self.batch:
            self.thread = threading.get_ident()
            if (v := self._apply()) is not None:
                applied.append(v)
            try:
                self._between_steps()  # (env calls handed over since the last batch: before its first step)
                self.rollout.run_batch(self.views, self.rollout.version, self._between_steps)
                info = self.rollout.batch_info()
            except Exception as exc:  # noqa: BLE001 - reported to the collector
                return _packed(exc)
        # Weights handed over during the batch: set_weights found the batch running and left them
        # (it stores them, then tries the lock; the lock is free now, so a set_weights that failed
        # to take it stored them before this check). One that takes the lock first applies them itself.
        while True:
            with self.mutex:
                more = bool(self.pending or self.layouts)
            if not more or not self.batch.acquire(blocking=False):
                break
            try:
                if (v := self._apply()) is not None:
                    applied.append(v)
                else:
                    break  # (weights for a store that is not added yet: they wait)
            finally:
                self.batch.release()
        # (returned by value: Ray copies the array into its object store before the next batch)
        return ("batch", self.array, info, applied)

    def close(self) -> None:
        """Close the envs (the actor is killed next)."""
        self.halted = True
        with self.batch:
            if self.rollout is not None:
                self.rollout.close()


class EvalActor:
    """The Evaluator's worker as a Ray actor: the same episodes loop as its worker process
    (:class:`~aiocollect._worker.eval_main.EvalWorker`), called instead of messaged. ``abort``,
    ``stuck`` and ``stack`` run in the ``"control"`` group, beside an evaluation; env calls
    (:meth:`env_call`) in the default group, between evaluations."""

    GROUPS = {CONTROL: 1}

    def __init__(self) -> None:
        self.worker: Any = None
        self.current: int | None = None  # the evaluation in progress
        self.aborted: int | None = None  # the evaluation its caller gave up on
        self.thread: int | None = None
        beat = bytearray(_heartbeat.NBYTES)
        self.beat = beat
        self.monitor = _heartbeat.HeartbeatMonitor(beat, 0)

    def setup(self, config: bytes, watch: bool) -> tuple:
        """Make the envs and the policy: ``("ready", pid, node id)``, or ``("error", packed
        exception, traceback)``."""
        import cloudpickle

        from .._worker.eval_main import EvalWorker, _Abort

        actor = self

        class Worker(EvalWorker):
            own_session = False

            def tick(self) -> None:  # (no socket: an abort is a flag set by the control thread)
                if actor.aborted is not None and actor.aborted == actor.current:
                    raise _Abort

        try:
            worker = Worker(None)  # type: ignore[arg-type]
            worker.setup(cloudpickle.loads(config))
        except Exception as exc:  # noqa: BLE001 - reported to the evaluator
            return _packed(exc)
        if watch:
            worker.hb = _heartbeat.Heartbeat(self.beat, 0)
        self.worker = worker
        return ("ready", os.getpid(), _node_id())

    def evaluate(self, rid: int, weights: Any, episodes: int, step: int | None = None) -> tuple:
        """Evaluation ``rid``: ``("result", rid, returns, lengths, video)``, ``("aborted", rid)`` or
        ``("failed", rid, packed exception, traceback)`` (the actor stays usable)."""
        from .._worker.eval_main import _Abort
        from .._worker.peer import pack_exception

        self.current, self.thread = rid, threading.get_ident()
        try:
            if self.aborted == rid:
                return ("aborted", rid)
            self.worker.load_weights(weights)
            returns, lengths = self.worker.evaluate(episodes)
            video = self.worker.take_video(rid if step is None else step)  # (a file: on the actor's node)
        except _Abort:
            return ("aborted", rid)
        except Exception as exc:  # noqa: BLE001 - the evaluation fails, the actor goes on
            return ("failed", rid, pack_exception(exc), traceback.format_exc())
        finally:
            self.current = None
        return ("result", rid, returns, lengths, video)

    def env_call(self, call: Any) -> Any:
        """Apply the :class:`~aiocollect._core.wire.EnvCall` ``call`` to the envs (between two
        evaluations); its :class:`~aiocollect._core.wire.EnvCallDone`."""
        from .._worker.env_calls import answer

        return answer(self.worker.loop, call)

    def abort(self, rid: int) -> None:
        """Stop evaluation ``rid`` at its next step (or before it starts)."""
        self.aborted = rid

    def ping(self) -> None:
        """(The evaluator asks now and then between evaluations: a dead actor raises.)"""

    def stuck(self, timeout: float) -> tuple[int, int, float] | None:
        return self.monitor.stuck(timeout)

    def stack(self) -> str:
        frame = sys._current_frames().get(self.thread) if self.thread is not None else None
        return "" if frame is None else "".join(traceback.format_stack(frame))

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _packed(exc: BaseException) -> tuple[str, bytes, str]:
    from .._worker.peer import pack_exception

    text = "".join(traceback.format_exception(exc))
    traceback.clear_frames(exc.__traceback__)
    return ("error", pack_exception(exc), text)


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not in a Ray worker (tests of the class itself)
        return ""


__all__ = ["CALLS", "CONTROL", "EvalActor", "RolloutActor"]
