"""The producer: turns the workers' completed slots into delivered batches.

Each round it grants the workers the credits they may collect with (rounds: ``prefetch``
deliveries ahead of the consumers' requests, and more while a delivery still needs rounds), waits
for the parts of a batch (every worker's next slot in ``sync`` delivery, the first one ready in
``async``), assembles them (one copy out of shared memory), gives the slots back, runs the hooks
and post-processing, and sends the batch into the bounded stream that ``collect()`` /
``async for`` read.
"""

from __future__ import annotations

import inspect
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import anyio
import numpy as np
import torch

from .. import events as ev
from .._core.errors import BrokenWorkerError
from .._core.layout import Key, SlotLayout
from .batch_memory import ChunkPool, Loans
from .._service.resource import in_own_thread

if TYPE_CHECKING:  # pragma: no cover
    from tensordict import TensorDict, TensorDictBase

    from .run_state import RunState
    from .._backends.workers import WorkerHandle

_ENDLESS = 1 << 62
_THROTTLED_POLL = 0.005  # seconds: frames_per_update looks for a new weight version this often
_THREAD_COPY_BYTES = 8 << 20  # larger batches are copied out of shared memory in a thread


def _nest(flat: dict[Key, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value
    return out


def _aligned(pos: int) -> int:
    return -(-pos // 64) * 64


def out_nbytes(layout: SlotLayout, rows: int) -> int:
    """Bytes of a copied batch of ``rows`` env rows (its leaves 64-byte aligned in one chunk)."""
    pos = 0
    for leaf in layout.leaves:
        pos = _aligned(pos + rows * layout.frames_per_env * leaf.np_dtype.itemsize * int(np.prod(leaf.shape, dtype=np.int64)))
    return max(pos, 1)


def whole_slots(layout: SlotLayout, buffer: Any) -> list[dict[Key, np.ndarray]]:
    """Per slot: every worker's rows of each leaf, as numpy views over ``buffer``."""
    return [layout.views(buffer, s) for s in range(layout.num_slots)]


class Lease:
    """zero_copy: the slots a delivered batch is a view on, held until the consumer asks for the
    next batch. With ``zero_copy="debug"`` the batch is a view on mappings of its own, which
    :meth:`protect` makes unreadable (reading a handed-back batch crashes with a traceback)."""

    __slots__ = ("parts", "mappings")

    def __init__(self, parts: list[tuple["WorkerHandle", int]], mappings: list[Any]) -> None:
        self.parts = parts
        self.mappings = mappings

    def protect(self) -> None:
        for mapping in self.mappings:
            _protect(mapping)
        self.mappings = []


def _protect(mapping: Any) -> None:
    """Make a mapping unreadable (PROT_NONE); it is unmapped once nothing refers to it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    address = np.frombuffer(mapping, np.uint8).ctypes.data
    if libc.mprotect(address, len(mapping), 0) != 0:  # pragma: no cover - a kernel refusing it
        raise OSError(ctypes.get_errno(), "mprotect failed on a zero_copy='debug' batch")


def frames_in(batch: "TensorDictBase") -> int:
    mask = batch.get(("collector", "mask"), None)
    return int(mask.sum()) if mask is not None else batch.numel()


class Producer:
    def __init__(self, run: "RunState") -> None:
        self.run = run
        self.arrivals: deque[WorkerHandle] = deque()  # async delivery: workers with a batch, in order
        self.wakeup = anyio.Event()
        self.drained = anyio.Event()  # background collection: every batch is in the replay buffer
        # copies of batches go into reused memory: slots ahead, one held, and a few the consumer keeps
        self.pool = ChunkPool(run.config.num_slots + 2)
        self.loans = Loans(run.config.lend_slots)
        self.storing = run.config.devices["storing_device"] if run.config.stores_on_cuda else None
        self.rounds = 0  # worker batches collected (what total_frames counts)
        self.produced = 0  # batches sent into the stream (what demand counts)
        self.first_version: int | None = None  # frames_per_update: the weight version at the start
        self.throttled = False  # frames_per_update holds the workers until the next update_weights()
        # where the loop stands, kept here (not in locals) so that a produce() cancelled while
        # parked resumes where it was: background collection moves it off the caller's loop
        self.remaining: int | None = None  # rounds to collect in all
        self.first_index = 0  # the index of the first batch this run delivers
        self.trajs: Any = None  # trajs_per_batch: the episodes of rounds not delivered yet
        self.parked = False  # waiting on wakeup alone, with nothing half-done (safe to cancel)

    def wake(self, worker: "WorkerHandle | None" = None) -> None:
        if worker is not None:
            self.arrivals.append(worker)
        self.wakeup.set()

    # -- credits and waiting --------------------------------------------------------------------
    def _allowed_rounds(self) -> int | None:
        """``frames_per_update`` (background collection): the rounds the updates so far allow in
        all, ``frames_per_update * (updates + 1)`` frames in whole rounds; ``None``: no bound."""
        run, c = self.run, self.run.config
        if c.frames_per_update is None or run.sink is None:
            return None
        if self.first_version is None:
            self.first_version = run.sync.version
        updates = max(run.sync.version - self.first_version, 0)
        return c.frames_per_update * (updates + 1) // c.frames_per_batch

    async def _pump(self, remaining: int) -> None:
        """Grant workers the credits they may collect with now."""
        run, c = self.run, self.run.config
        allowed = self._allowed_rounds()
        if allowed is not None:
            remaining = min(remaining, allowed)
            # (async delivery: each worker's round is a batch, so the rounds are shared out below)
            self.throttled = self.rounds >= allowed
        if c.delivery == "sync":
            # rounds, not deliveries: the rounds taken so far, plus one for each delivery the
            # consumers want (``prefetch`` ahead). A round delivers one batch, except under
            # ``trajs_per_batch``, where it may deliver none (episodes longer than a round) or
            # several: counting in deliveries alone would stop granting rounds while a delivery
            # still waits for its episodes to end.
            wanted = max(0, run.counts.requested + c.prefetch - self.produced)
            target = min(remaining, self.rounds + wanted)
            if c.update_at_each_batch and run.sync.can_pull and any(w.credits_sent < target for w in run.workers):
                # pulled right before the workers may start the next batch(es)
                await run.pull_weights()
        elif allowed is not None:
            # rounds in all, not per worker: one more at a time to the worker with the fewest
            owed = allowed - sum(w.credits_sent for w in run.workers)
            for w in sorted(run.workers, key=lambda w: w.credits_sent)[: max(owed, 0)]:
                try:
                    await w.grant(1)
                except BrokenWorkerError:
                    pass
            return
        else:
            target = remaining
        for w in run.workers:
            if w.credits_sent < target:
                try:
                    await w.grant(target - w.credits_sent)
                except BrokenWorkerError:
                    pass  # it died under us: its own task reports it

    def _deliverable(self) -> bool:
        if self.run.config.delivery == "sync":
            return all(w.ready for w in self.run.workers)
        return bool(self.arrivals)

    async def _wait(self, cond: Callable[[], bool], remaining: int) -> None:
        run = self.run
        while True:
            if run.errors.pending is None:
                await self._pump(remaining)
            await run.profiling.announce_traces()
            self.wakeup = anyio.Event()
            if cond():
                return
            if run.errors.pending is not None and not self._deliverable():
                raise run.errors.pending
            self.parked = True
            try:
                if self.throttled:  # nothing tells this task of an update_weights(): look again soon
                    with anyio.move_on_after(_THROTTLED_POLL):
                        await self.wakeup.wait()
                else:
                    await self.wakeup.wait()
            finally:
                self.parked = False

    # -- the loop -------------------------------------------------------------------------------
    async def produce(self) -> None:
        try:
            await self._produce()
        except BaseException as exc:
            # its frames hold batches, and a lent batch keeps its slots mapped: a traceback that a
            # reference cycle keeps (a cancellation's) must not keep them until the next gc run
            traceback.clear_frames(exc.__traceback__)
            raise

    async def _produce(self) -> None:
        run = self.run
        c = run.config
        total = c.total_batches
        workers = run.workers
        sync = c.delivery == "sync"
        if self.remaining is None:  # (the first call; a later one resumes)
            self.remaining = _ENDLESS if total is None else total - run.counts.batches
            self.first_index = run.counts.batches
            if c.trajs_per_batch is not None:
                from .trajs import TrajectoryAccumulator

                self.remaining = _ENDLESS if total is None else total - run.counts.collected // c.frames_per_batch
                self.trajs = TrajectoryAccumulator(c.trajs_per_batch, c.traj_format)
        if c.split_trajs:
            from .split import split_trajectories
        remaining, first_index, trajs = self.remaining, self.first_index, self.trajs
        while self.rounds < remaining:
            if run.errors.pending is not None and not self._deliverable():
                raise run.errors.pending
            index = first_index + self.produced
            if c.update_at_each_batch and run.sync.can_pull and not sync:
                await run.pull_weights()
            profiling = run.profiling
            recorder = profiling.recorder
            if recorder is not None:
                recorder.before(self.rounds - profiling.recorder_from)
            await run.emit(ev.BeforeRollout, index=index)
            t_wait = time.perf_counter()
            await self._wait(lambda: run.counts.requested + c.prefetch > self.produced, remaining)
            if sync:
                await self._wait(lambda: all(w.ready for w in workers), remaining)
                parts = [(w, w.take()) for w in workers]
            else:
                await self._wait(lambda: bool(self.arrivals), remaining)
                w = self.arrivals.popleft()
                parts = [(w, w.take())]
            t_assemble = time.perf_counter()
            for returned in self.loans.returned():  # lent batches the consumer has dropped
                await _release(returned)
            batch, lease, lent = await self._assemble([(w, slot) for w, (slot, _) in parts])
            if lease is None and not lent:  # copied: the slots go back to the workers now
                await _release([(w, slot) for w, (slot, _) in parts])
            if sync:
                self.arrivals.clear()
            self.rounds += 1
            run.counts.collected += c.frames_per_batch
            if self.rounds >= remaining:
                run.finish()  # the workers will collect no more: nobody waits for them
            infos = [(w.index, info) for w, (_, info) in parts]
            if trajs is not None:
                rows = run.rows_per_worker  # (each sub-env of a vector env is a row)
                envs = [w.index * rows + e for w, _ in parts for e in range(rows)]
                outputs = trajs.add(batch, envs)
            else:
                outputs = [split_trajectories(batch) if c.split_trajs else batch]
            timing = run.stats.batch(infos, wait=t_assemble - t_wait, delivery=time.perf_counter() - t_assemble)
            if run.bus.listens_to(ev.EpisodeEnded):
                for worker, info in infos:
                    for env, traj_id, ret, length, terminated in info.episodes:
                        await run.emit_event(ev.EpisodeEnded(
                            worker=worker, env=env, traj_id=traj_id, ret=ret, length=length,
                            terminated=terminated, policy_version=info.version,
                        ))
            for n, batch in enumerate(outputs):
                last = n == len(outputs) - 1  # (a lease goes with the last delivery of a round)
                await self._deliver(batch, first_index + self.produced, infos if n == 0 else [], infos, timing,
                                    lease if last else None)
            batch = outputs = lease = None  # type: ignore[assignment]  # (lent: the consumer's alone now)
            if recorder is not None and (path := recorder.after(self.rounds - 1 - profiling.recorder_from)) is not None:
                profiling.recorder = None
                await profiling.trace_ready(None, path)
            await run.profiling.announce_traces()
        run.send.close()  # consumers drain what is buffered, then get EndOfCollection
        if run.sink is not None:
            await self.drained.wait()  # every batch is in the replay buffer
        run.request_stop()  # total_frames reached: release the workers now

    async def _deliver(
        self, batch: "TensorDictBase", index: int, counted: list, infos: list, timing: dict, lease: "Lease | None" = None
    ) -> None:
        """Hooks, post-processing, pause, then into the stream (``counted``: the infos whose
        counters go with this delivery: a round's go with its first)."""
        run, c = self.run, self.run.config
        self.produced += 1
        await run.emit(ev.AfterRollout, index=index, batch=batch)
        if c.postproc is not None:
            batch = c.postproc(batch)
            if inspect.isawaitable(batch):
                batch = await batch
        await run.gate.wait_open()  # collector.pause(): hold the batch (workers stop by backpressure)
        frames = c.frames_per_batch if c.trajs_per_batch is None else frames_in(batch)
        await run.emit(
            ev.BatchReady, index=index, frames=frames, workers=tuple(w for w, _ in infos),
            policy_versions=tuple(info.version for _, info in infos), timing=timing,
        )
        await run.send.send((batch, counted, frames, lease))

    async def _assemble(self, parts: list[tuple["WorkerHandle", int]]) -> tuple["TensorDict", Lease | None, bool]:
        """The batch of ``parts`` (worker, slot), the lease that holds its slots (``zero_copy``)
        and whether it is lent (``_pool.Loans``: its slots go back once nothing refers to it).
        Without ``zero_copy`` the batch is lent where a slot can be spared, else a copy. Every
        worker's rows of a slot sit side by side, so a sync batch whose parts share a slot index
        (the usual case) is one array per key."""
        run = self.run
        layout: SlotLayout = run.slots.layout  # type: ignore[assignment]
        zero_copy = run.config.zero_copy
        slot = parts[0][1]
        whole = len(parts) == layout.workers and all(w.index == i and s == slot for i, (w, s) in enumerate(parts))
        mappings: list[Any] = []
        if zero_copy == "debug" and (whole or len(parts) == 1):
            import mmap

            mapping = mmap.mmap(run.slots.segment[0], layout.slot_nbytes, offset=slot * layout.slot_nbytes)  # type: ignore[index]
            mappings.append(mapping)
            views = [layout.views(mapping, slot, None if whole else parts[0][0].index, mapped_slot=True)]
        elif whole:
            views = [run.slots.views[slot]]
        else:
            views = [w.slots.np_views[s] for w, s in parts]
        storing = self.storing  # a CUDA storing_device: copied there (from the slot's views), nothing lent
        lent = not zero_copy and storing is None and len(views) == 1 and self.loans.can_lend(parts)
        if lent:
            array = layout.slot_array(run.slots.segment[1], slot)  # type: ignore[index]
            views = [layout.views(array, slot, None if whole else parts[0][0].index, mapped_slot=True)]
            self.loans.lend(array, parts)
            del array  # (only the loan and the views refer to it)
        share = lent or (bool(zero_copy) and len(views) == 1) or (storing is not None and len(views) == 1)
        if not share or storing is not None:
            run.stats.copied += 1
        E = layout.num_envs * len(parts)
        T = layout.frames_per_env
        chunk = None if share else self.pool.take(out_nbytes(layout, E))

        def build() -> "TensorDict":
            from tensordict import TensorDict

            flat: dict[Key, torch.Tensor] = {}
            pos = 0
            for leaf in layout.leaves:
                arrays = [v[leaf.key] for v in views]
                if chunk is None:
                    flat[leaf.key] = torch.from_numpy(arrays[0])
                    continue
                nbytes = E * T * leaf.np_dtype.itemsize * int(np.prod(leaf.shape, dtype=np.int64))
                out = chunk[pos : pos + nbytes].view(leaf.np_dtype).reshape((E, T) + leaf.shape)
                pos = _aligned(pos + nbytes)
                # numpy copies in this one thread (releasing the GIL); torch's would wake its
                # intra-op thread pool, whose spinning threads take CPU from the workers
                if len(arrays) > 1:
                    np.concatenate(arrays, out=out)
                else:
                    np.copyto(out, arrays[0])
                flat[leaf.key] = torch.from_numpy(out)
            flat[("next", "done")] = flat[("next", "terminated")] | flat[("next", "truncated")]
            for name in ("done", "terminated", "truncated"):  # flags of obs at t: envs reset at once
                flat[(name,)] = torch.zeros(E, T, 1, dtype=torch.bool)
            # device "cpu", as TorchRL's batches say (measured: a few microseconds more per batch)
            nested: Any = _nest(flat)
            return TensorDict(nested, batch_size=[E, T], names=[None, "time"], device="cpu")  # type: ignore[list-item]

        if storing is not None:  # one copy to the device, in a thread (the loop runs on meanwhile)
            return await in_own_thread(lambda: build().to(storing), "aiocollect storing copy"), None, False
        if not share and layout.slot_nbytes * len(parts) // layout.workers > _THREAD_COPY_BYTES:
            batch = await anyio.to_thread.run_sync(build)
        else:
            batch = build()
        if not share or lent:
            return batch, None, lent
        return batch, Lease(parts, mappings), False


async def _release(parts: list[tuple["WorkerHandle", int]]) -> None:
    for w, slot in parts:
        try:
            await w.release(slot)
        except BrokenWorkerError:
            pass  # it died under us: its own task reports it


__all__ = ["Lease", "Producer", "frames_in", "whole_slots"]
