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
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import anyio
import numpy as np
import torch

from .. import events as ev
from .._core.errors import BrokenWorkerError
from .._core.layout import Key, SlotLayout
from .batch_memory import ChunkPool, Loans
from .delivery import Lease
from .._service.resource import in_own_thread

if TYPE_CHECKING:  # pragma: no cover
    from tensordict import TensorDict, TensorDictBase

    from .._backends.seat import RolloutSeat
    from .._core.profiling import RunProfiling
    from .config import CollectorConfig
    from .pool import WorkerPool
    from .delivery import Delivery
    from .stats import Stats
    from .weightsync import WeightSync

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
        pos = _aligned(pos + rows * layout.frames_per_row * leaf.np_dtype.itemsize * math.prod(leaf.shape))
    return max(pos, 1)


def whole_slots(layout: SlotLayout, buffer: Any) -> list[dict[Key, np.ndarray]]:
    """Per slot: every worker's rows of each leaf, as numpy views over ``buffer``."""
    return [layout.views(buffer, s) for s in range(layout.num_slots)]


def frames_in(batch: "TensorDictBase") -> int:
    mask = batch.get(("collector", "mask"), None)
    return int(mask.sum()) if mask is not None else batch.numel()


@dataclasses.dataclass(frozen=True)
class ProducerHooks:
    """What the producer tells the run, and asks of it."""

    pending: Callable[[], BaseException | None]
    """A worker's failure, raised after the batches it completed (``None``: none)."""
    emit: Callable[..., Awaitable[None]]
    """Emit an event of a type built from fields (if someone listens)."""
    emit_event: Callable[[ev.Event], Awaitable[None]]
    listens_to: Callable[[type[ev.Event]], bool]
    finish: Callable[[], None]
    """Every batch is collected: the workers will collect no more."""
    request_stop: Callable[[], None]
    """The run is to stop its workers (``total_frames`` delivered)."""
    pull_weights: Callable[[], Awaitable[None]]
    """``update_at_each_batch``: publish the constructor's policy as a new version."""


class Producer:
    """The run's delivery loop (see the module docstring): built by the run's lifecycle with the
    worker pool it takes batches from, the delivery it fills (stream, sink, pause gate,
    counters), the weight sync (versions), the profiling and the stats it records."""

    def __init__(self, config: "CollectorConfig", pool: "WorkerPool", delivery: "Delivery", sync: "WeightSync",
                 profiling: "RunProfiling", stats: "Stats", hooks: ProducerHooks) -> None:
        self.config, self.pool, self.delivery, self.sync = config, pool, delivery, sync
        self.profiling, self.stats, self.hooks = profiling, stats, hooks
        self.arrivals: deque[RolloutSeat] = deque()  # async delivery: workers with a batch, in order
        self.wakeup = anyio.Event()
        self.drained = anyio.Event()  # background collection: every batch is in the replay buffer
        # copies of batches go into reused memory: slots ahead, one held, and a few the consumer keeps
        self.chunks = ChunkPool(config.num_slots + 2)
        self.loans = Loans(config.lend_slots)
        self.storing = config.devices["storing_device"] if config.stores_on_cuda else None
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
        # sync delivery: the next batch's tensors on the slot its first part came in, made while
        # the other workers finish theirs (see _prepare)
        self.prepared: _Prepared | None = None
        self.made_ahead = 0  # batches delivered from what _prepare made

    def wake(self, worker: "RolloutSeat | None" = None) -> None:
        if worker is not None:
            self.arrivals.append(worker)
        self.wakeup.set()

    # -- credits and waiting --------------------------------------------------------------------
    def _allowed_rounds(self) -> int | None:
        """``frames_per_update`` (background collection): the rounds the updates so far allow in
        all, ``frames_per_update * (updates + 1)`` frames in whole rounds; ``None``: no bound."""
        c = self.config
        if c.frames_per_update is None or self.delivery.sink is None:
            return None
        if self.first_version is None:
            self.first_version = self.sync.version
        updates = max(self.sync.version - self.first_version, 0)
        return c.frames_per_update * (updates + 1) // c.frames_per_batch

    async def _pump(self, remaining: int) -> None:
        """Grant workers the credits they may collect with now."""
        c, workers = self.config, self.pool.workers
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
            wanted = max(0, self.delivery.counts.requested + c.prefetch - self.produced)
            target = min(remaining, self.rounds + wanted)
            if c.update_at_each_batch and self.sync.can_pull and any(w.credits_sent < target for w in workers):
                # pulled right before the workers may start the next batch(es)
                await self.hooks.pull_weights()
            targets = [target] * len(workers)
        elif allowed is not None:
            # rounds in all, not per worker: one more at a time to the worker with the fewest
            owed = allowed - sum(w.credits_sent for w in workers)
            for w in sorted(workers, key=lambda w: w.credits_sent)[: max(owed, 0)]:
                await _grant(w, 1)
            return
        else:
            # each worker runs ahead by its slots to fill (``prefetch + 1``, at least two), not
            # into the slots kept for lending: a batch handed out after an update was started at
            # most that many batches of its worker before it
            ahead = min(c.fill_slots, max(remaining - self.rounds, 0))
            targets = [w.completed - len(w.ready) + ahead for w in workers]  # (its batches taken, plus those)
        for w, target in zip(workers, targets):
            if w.credits_sent < target:
                await _grant(w, target - w.credits_sent)

    def _deliverable(self) -> bool:
        if self.config.delivery == "sync":
            return all(w.ready for w in self.pool.workers)
        return bool(self.arrivals)

    async def _wait(self, cond: Callable[[], bool], remaining: int,
                    meanwhile: Callable[[], Awaitable[None]] | None = None) -> None:
        """Until ``cond()`` holds: grant what may be granted, and park until woken
        (``meanwhile()`` first, each time it parks)."""
        while True:
            pending = self.hooks.pending()
            if pending is None:
                await self._pump(remaining)
            await self.profiling.announce_traces()
            self.wakeup = anyio.Event()
            if cond():
                return
            pending = self.hooks.pending()
            if pending is not None and not self._deliverable():
                raise pending
            if meanwhile is not None:
                await meanwhile()
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
        finally:
            self.prepared = None  # (its views keep the slots mapped)

    async def _produce(self) -> None:
        self._begin()
        remaining = self.remaining
        assert remaining is not None
        while self.rounds < remaining:
            await self._round(remaining)
        self.delivery.stream().close()  # consumers drain what is buffered, then get EndOfCollection
        if self.delivery.sink is not None:
            await self.drained.wait()  # every batch is in the replay buffer
        self.hooks.request_stop()  # total_frames reached: release the workers now

    def _begin(self) -> None:
        """Where the loop starts, on the first call only (a later call resumes from here)."""
        if self.remaining is not None:
            return
        c, counts = self.config, self.delivery.counts
        total = c.total_batches
        self.remaining = _ENDLESS if total is None else total - counts.batches
        self.first_index = counts.batches
        if c.trajs_per_batch is not None:
            from .trajs import TrajectoryAccumulator

            self.remaining = _ENDLESS if total is None else total - counts.collected // c.frames_per_batch
            self.trajs = TrajectoryAccumulator(c.trajs_per_batch, c.traj_format)

    async def _round(self, remaining: int) -> None:
        """One round: wait for demand and the parts of a batch, assemble them, deliver the
        batch (or, under ``trajs_per_batch``, the batches its finished episodes complete)."""
        c, hooks, profiling = self.config, self.hooks, self.profiling
        pending = hooks.pending()
        if pending is not None and not self._deliverable():
            raise pending
        index = self.first_index + self.produced
        if c.update_at_each_batch and self.sync.can_pull and c.delivery != "sync":
            await hooks.pull_weights()
        recorder = profiling.recorder
        if recorder is not None:
            recorder.before(self.rounds - profiling.recorder_from)
        await hooks.emit(ev.BeforeRollout, index=index)
        t_wait = time.perf_counter()
        parts = await self._take(remaining)
        t_assemble = time.perf_counter()
        batch, lease = await self._collect(parts, remaining)
        infos = [(w.index, info) for w, (_, info) in parts]
        outputs = self._outputs(batch, parts)
        timing = self.stats.batch(infos, wait=t_assemble - t_wait, delivery=time.perf_counter() - t_assemble)
        await self._episodes_ended(infos)
        for n, batch in enumerate(outputs):
            last = n == len(outputs) - 1  # (a lease goes with the last delivery of a round)
            await self._deliver(batch, self.first_index + self.produced, infos if n == 0 else [], infos, timing,
                                lease if last else None)
        del batch, outputs, lease  # (lent: the consumer's alone now)
        if recorder is not None and (path := recorder.after(self.rounds - 1 - profiling.recorder_from)) is not None:
            profiling.recorder = None
            await profiling.trace_ready(None, path)
        await profiling.announce_traces()

    async def _take(self, remaining: int) -> list[tuple["RolloutSeat", Any]]:
        """Wait until a delivery is wanted and its parts are ready; take them, as (worker, (slot,
        info)): every worker's next slot in ``sync`` delivery, the first to arrive in ``async``."""
        counts, prefetch = self.delivery.counts, self.config.prefetch
        await self._wait(lambda: counts.requested + prefetch > self.produced, remaining)
        if self.config.delivery == "sync":
            workers = self.pool.workers
            await self._wait(lambda: all(w.ready for w in workers), remaining, self._prepare)
            return [(w, w.take()) for w in workers]
        await self._wait(lambda: bool(self.arrivals), remaining)
        w = self.arrivals.popleft()
        part = w.take()
        await self._pump(remaining)  # its next credit now, not after the delivery (which may wait)
        return [(w, part)]

    async def _prepare(self) -> None:
        """Sync delivery, while a batch waits for its last parts: the batch that lending the
        slot of its first part will deliver (its tensors, views on the slot; ``("next", "done")``
        left to fill), so that once the last worker is done only that is left to compute before
        the batch goes out and the workers get their next credits. :meth:`_assemble` uses it
        where the batch is lent whole from that slot, and drops it otherwise."""
        if self.prepared is not None or self.config.zero_copy or self.storing is not None:
            return
        await self._take_back()
        workers = self.pool.workers
        first = next((w for w in workers if w.ready), None)
        segment, layout = self.pool.slots.segment, self.pool.slots.layout
        if first is None or segment is None or layout is None or not self.loans.can_lend([(w, None) for w in workers]):
            return  # (nothing to lend from yet, or the consumer holds all it may: the batch is copied)
        slot = first.ready[0][0]
        array = layout.slot_array(segment[1], slot)
        views = layout.views(array, slot, mapped_slot=True)
        batch = _build(layout, [views], None, layout.rows * layout.workers, done=False)
        flags = (batch.get(("next", "terminated")), batch.get(("next", "truncated")))
        self.prepared = _Prepared(slot, array, batch, flags, batch.get(("next", "done")))

    async def _take_back(self) -> None:
        """The slots of the lent batches the consumer has dropped go back to their workers."""
        for returned in self.loans.returned():
            await _release(returned)

    async def _collect(self, parts: list[tuple["RolloutSeat", Any]], remaining: int) -> tuple["TensorDict", Lease | None]:
        """Assemble the round's batch, give back the slots it does not hold, count the round."""
        await self._take_back()
        batch, lease, lent = await self._assemble([(w, slot) for w, (slot, _) in parts])
        if lease is None and not lent:  # copied: the slots go back to the workers now
            await _release([(w, slot) for w, (slot, _) in parts])
        if self.config.delivery == "sync":
            self.arrivals.clear()
        self.rounds += 1
        self.delivery.counts.collected += self.config.frames_per_batch
        if self.rounds >= remaining:
            self.hooks.finish()  # the workers will collect no more: nobody waits for them
        return batch, lease

    def _outputs(self, batch: "TensorDict", parts: list[tuple["RolloutSeat", Any]]) -> list[Any]:
        """The deliveries of a round: its batch (split into trajectories under ``split_trajs``),
        or under ``trajs_per_batch`` the batches of episodes it completes (none, one or more)."""
        if self.trajs is not None:
            rows = self.pool.rows_per_worker  # (each sub-env of a vector env is a row)
            envs = [w.index * rows + e for w, _ in parts for e in range(rows)]
            return self.trajs.add(batch, envs)
        if self.config.split_trajs:
            from .split import split_trajectories

            return [split_trajectories(batch)]
        return [batch]

    async def _episodes_ended(self, infos: list[tuple[int, Any]]) -> None:
        if not self.hooks.listens_to(ev.EpisodeEnded):
            return
        for worker, info in infos:
            for env, traj_id, ret, length, terminated in info.episodes:
                await self.hooks.emit_event(ev.EpisodeEnded(
                    worker=worker, env=env, traj_id=traj_id, ret=ret, length=length,
                    terminated=terminated, policy_version=info.version,
                ))

    async def _deliver(
        self, batch: "TensorDictBase", index: int, counted: list, infos: list, timing: dict, lease: "Lease | None" = None
    ) -> None:
        """Hooks, post-processing, pause, then into the stream (``counted``: the infos whose
        counters go with this delivery: a round's go with its first)."""
        c, hooks = self.config, self.hooks
        self.produced += 1
        await hooks.emit(ev.AfterRollout, index=index, batch=batch)
        if c.postproc is not None:
            batch = c.postproc(batch)
            if inspect.isawaitable(batch):
                batch = await batch
        await self.delivery.gate.wait_open()  # collector.pause(): hold the batch (workers stop by backpressure)
        frames = c.frames_per_batch if c.trajs_per_batch is None else frames_in(batch)
        await hooks.emit(
            ev.BatchReady, index=index, frames=frames, workers=tuple(w for w, _ in infos),
            policy_versions=tuple(info.version for _, info in infos), timing=timing,
        )
        await self.delivery.stream().send((batch, counted, frames, lease))

    async def _assemble(self, parts: list[tuple["RolloutSeat", int]]) -> tuple["TensorDict", Lease | None, bool]:
        """The batch of ``parts`` (worker, slot), the lease that holds its slots (``zero_copy``)
        and whether it is lent (``_pool.Loans``: its slots go back once nothing refers to it).
        Without ``zero_copy`` the batch is lent where a slot can be spared, else a copy. Every
        worker's rows of a slot sit side by side, so a sync batch whose parts share a slot index
        (the usual case) is one array per key."""
        slots = self.pool.slots
        layout = slots.layout
        segment = slots.segment
        assert layout is not None and segment is not None
        zero_copy = self.config.zero_copy
        slot = parts[0][1]
        whole = len(parts) == layout.workers and all(w.index == i and s == slot for i, (w, s) in enumerate(parts))
        prepared, self.prepared = self.prepared, None
        if prepared is not None and whole and prepared.slot == slot and self.loans.can_lend(parts):
            torch.logical_or(*prepared.flags, out=prepared.done)
            self.loans.lend(prepared.array, parts)
            self.made_ahead += 1
            return prepared.batch, None, True
        del prepared  # (not this batch's: its views go)
        mappings: list[Any] = []
        if zero_copy == "debug" and (whole or len(parts) == 1):
            import mmap

            mapping = mmap.mmap(segment[0], layout.slot_nbytes, offset=slot * layout.slot_nbytes)
            mappings.append(mapping)
            views = [layout.views(mapping, slot, None if whole else parts[0][0].index, mapped_slot=True)]
        elif whole:
            views = [slots.views[slot]]
        else:
            views = [w.slots.np_views[s] for w, s in parts]
        storing = self.storing  # a CUDA storing_device: copied there (from the slot's views), nothing lent
        lent = not zero_copy and storing is None and len(views) == 1 and self.loans.can_lend(parts)
        if lent:
            array = layout.slot_array(segment[1], slot)
            views = [layout.views(array, slot, None if whole else parts[0][0].index, mapped_slot=True)]
            self.loans.lend(array, parts)
            del array  # (only the loan and the views refer to it)
        share = lent or (bool(zero_copy) and len(views) == 1) or (storing is not None and len(views) == 1)
        if not share or storing is not None:
            self.stats.copied += 1
        E = layout.rows * len(parts)
        chunk = None if share else self.chunks.take(out_nbytes(layout, E))

        def build() -> "TensorDict":
            return _build(layout, views, chunk, E)

        if storing is not None:  # one copy to the device, in a thread (the loop runs on meanwhile)
            return await in_own_thread(lambda: build().to(storing), "aiocollect storing copy"), None, False
        if not share and layout.slot_nbytes * len(parts) // layout.workers > _THREAD_COPY_BYTES:
            batch = await anyio.to_thread.run_sync(build)
        else:
            batch = build()
        if not share or lent:
            return batch, None, lent
        return batch, Lease(parts, mappings), False


@dataclasses.dataclass
class _Prepared:
    """A sync batch made ahead (:meth:`Producer._prepare`): ``batch``'s tensors are views on
    ``array``, slot ``slot``'s own array (what lending it hands :class:`Loans`)."""

    slot: int
    array: np.ndarray
    batch: "TensorDict"
    flags: tuple[torch.Tensor, torch.Tensor]
    """Its ``("next", "terminated")`` and ``("next", "truncated")``."""
    done: torch.Tensor
    """Its ``("next", "done")``, to fill from ``flags`` once every part is in."""


def _build(layout: SlotLayout, views: list[dict[Key, np.ndarray]], chunk: Any, E: int, done: bool = True) -> "TensorDict":
    """The batch of ``views`` (each a part's rows of every leaf): the views themselves as tensors
    when ``chunk`` is ``None`` (one part, shared), else copies into ``chunk``, 64-byte aligned.
    ``done=False``: its ``("next", "done")`` is left uninitialised, for the caller to fill once
    the flags are written."""
    from tensordict import TensorDict

    T = layout.frames_per_row
    flat: dict[Key, torch.Tensor] = {}
    pos = 0
    for leaf in layout.leaves:
        arrays = [v[leaf.key] for v in views]
        if chunk is None:
            flat[leaf.key] = torch.from_numpy(arrays[0])
            continue
        nbytes = E * T * leaf.np_dtype.itemsize * math.prod(leaf.shape)
        out = chunk[pos : pos + nbytes].view(leaf.np_dtype).reshape((E, T) + leaf.shape)
        pos = _aligned(pos + nbytes)
        # numpy copies in this one thread (releasing the GIL); torch's would wake its
        # intra-op thread pool, whose spinning threads take CPU from the workers
        if len(arrays) > 1:
            np.concatenate(arrays, out=out)
        else:
            np.copyto(out, arrays[0])
        flat[leaf.key] = torch.from_numpy(out)
    if done:
        flat[("next", "done")] = flat[("next", "terminated")] | flat[("next", "truncated")]
    else:
        flat[("next", "done")] = torch.empty(E, T, 1, dtype=torch.bool)
    for name in ("done", "terminated", "truncated"):  # flags of obs at t: envs reset at once
        flat[(name,)] = torch.zeros(E, T, 1, dtype=torch.bool)
    # device "cpu", as TorchRL's batches say (measured: a few microseconds more per batch)
    nested: Any = _nest(flat)
    return TensorDict(nested, batch_size=[E, T], names=[None, "time"], device="cpu")  # type: ignore[list-item]


async def _grant(worker: "RolloutSeat", credits: int) -> None:
    """Let ``worker`` fill ``credits`` more batches; one that died under us is left to its own
    task, which reports it."""
    try:
        await worker.grant(credits)
    except BrokenWorkerError:
        pass


async def _release(parts: list[tuple["RolloutSeat", int]]) -> None:
    for w, slot in parts:
        try:
            await w.release(slot)
        except BrokenWorkerError:
            pass  # it died under us: its own task reports it


__all__ = ["Producer", "frames_in", "whole_slots"]
