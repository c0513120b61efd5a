"""The consumer's side of a run's batch stream: :class:`BatchStream`.

The producer (:mod:`aiocollect._collector.producer`) sends the batches into a bounded memory
stream; :class:`BatchStream` holds its receiving side and hands the batches out: to the user's
``collect()`` and ``async for``, or to the drain into the sink of background collection. It owns
what the consumer holds (the lease of a ``zero_copy`` batch, handed back when the next one is
asked for) and accounts for each batch delivered; at the end of the stream it says why (the
run's error, :class:`~aiocollect.EndOfCollection`, a closed collector), and moves the run to
its ended phase once its consumer saw the end. It is part of the run's lifecycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn, Protocol

import anyio

from .._core.errors import AiocollectError, BrokenWorkerError, CollectorClosedError, EndOfCollection
from .run_state import Phase, RunState

if TYPE_CHECKING:  # pragma: no cover
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
    from tensordict import TensorDict

    from .._core.wire import BatchInfo
    from .delivery import Lease


class RunLifecycle(Protocol):
    """What the consumer's side asks of the run's lifecycle."""

    done: anyio.Event  # the workers are gone (set by the run's task at its end)

    @property
    def loop_gone(self) -> bool: ...

    def closed_error(self, what: str) -> CollectorClosedError: ...

    def check_loop(self) -> None: ...


class BatchStream:
    """The consumer's side of the batch stream (see the module docstring)."""

    def __init__(self, state: RunState, life: RunLifecycle) -> None:
        self.state = state
        self.life = life
        self.recv: MemoryObjectReceiveStream[tuple[TensorDict, list, int, Lease | None]] | None = None
        self.lease: Lease | None = None  # zero_copy: the slots of the batch the consumer has
        self.waiting = 0  # the user's collect() calls waiting for a batch

    def open(self) -> "MemoryObjectSendStream[tuple[TensorDict, list, int, Lease | None]]":
        """Make the stream (``prefetch`` batches ahead at most); its sending side is returned."""
        size = max(self.state.config.prefetch, 1)
        send, self.recv = anyio.create_memory_object_stream[tuple["TensorDict", list, int, "Lease | None"]](size)
        return send

    async def consume(self) -> "TensorDict":
        """The user's :meth:`collect`: with ``zero_copy``, one consumer task at a time (taking a
        batch hands the previous one back to the workers, whoever holds it)."""
        zero_copy = self.state.config.zero_copy
        if self.waiting and zero_copy:
            raise AiocollectError(
                f"zero_copy={zero_copy!r}: another task is already waiting for a batch of this collector "
                f"(collect() or `async for`); with zero_copy=True each batch goes back to the workers as soon as the "
                f"next one is asked for, so two consumer tasks would read each other's batches overwritten. Take "
                f"batches in one task (and pass copies on), or leave zero_copy=False (the default), whose batches "
                f"several tasks may share"
            )
        self.waiting += 1
        try:
            batch = await self.collect()
        finally:
            self.waiting -= 1
        watch = self.state.sync.watch
        if watch is not None:
            watch.handed_out()
        return batch

    async def collect(self, *, drain: bool = False) -> "TensorDict":
        """The next batch; ``drain``: for the drain into the sink (which the run's task itself
        waits for, so the end is reported without waiting for the workers to be gone)."""
        s, life = self.state, self.life
        if s.phase is Phase.CLOSED:
            raise life.closed_error("collect()")
        life.check_loop()
        if s.phase is Phase.ENDED:
            self.raise_end()
        if self.lease is not None:  # zero_copy: the consumer is done with the batch it has
            await self.release_lease()
        s.delivery.counts.requested += 1
        s.wake()
        try:
            batch, parts, frames, self.lease = await self._recv().receive()
        except anyio.EndOfStream:
            if not drain:  # (the drain into a replay buffer is what the runner itself waits for)
                await life.done.wait()  # the workers are gone before the end is reported
            if s.phase.closing:
                if s.errors.error is None:
                    raise life.closed_error("collect() waiting for a batch") from None
            elif not drain:
                # the end was seen: nothing is left to release (a consumer that never calls
                # aclose(), as in `async for b in Collector(...)`, leaves nothing open)
                if s.phase in (Phase.COMPLETED, Phase.STOPPED):
                    s.move_to(Phase.ENDED)
                self._recv().close()
            self.raise_end()
        except anyio.ClosedResourceError:
            if s.phase is Phase.ENDED:
                # another consumer task saw the end and closed the stream while this one entered
                # receive() (which yields before it reads): this one sees the same end
                self.raise_end()
            raise life.closed_error("collect() waiting for a batch") from None
        self.delivered(parts, frames)
        return batch

    async def release_lease(self) -> None:
        """zero_copy: hand the slots of the consumer's batch back to the workers."""
        lease, self.lease = self.lease, None
        assert lease is not None
        lease.protect()
        for w, slot in lease.parts:
            try:
                await w.release(slot)
            except (BrokenWorkerError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # it died under us: its own task reports it

    def drop_lease(self) -> None:
        """The workers are gone: the consumer's batch has nothing to go back to."""
        if self.lease is not None:
            self.lease.protect()
            self.lease = None

    def close(self) -> None:
        """Close the consumer's side of the stream, dropping the batches still in it: nobody will
        receive them, and a lent batch would keep its slots' mapping alive."""
        recv = self.recv
        if recv is None:  # (never started)
            return
        while True:
            try:
                recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
        recv.close()

    def _recv(self) -> "MemoryObjectReceiveStream[tuple[TensorDict, list, int, Lease | None]]":
        assert self.recv is not None, "the batch stream is made when the run starts"
        return self.recv

    def raise_end(self) -> NoReturn:
        """Raise why the stream ended: the run's error, or :class:`EndOfCollection`."""
        errors = self.state.errors
        if errors.error is not None:
            errors.seen = True
            raise errors.error from errors.error.__cause__
        if self.life.loop_gone:
            self.life.check_loop()
        raise EndOfCollection(f"all {self.state.config.total_frames} frames (total_frames) have been collected")

    def delivered(self, parts: "list[tuple[int, BatchInfo]]", frames: int) -> None:
        """Account for a batch the consumer received (counters, state_dict, progress)."""
        s = self.state
        counts = s.delivery.counts
        if counts.traj_counters is None:
            counts.traj_counters = list(counts.start_counters or [0] * s.pool.total_rows)
        rows = s.pool.rows_per_worker
        for index, info in parts:
            counts.traj_counters[index * rows : (index + 1) * rows] = info.traj_counters
        counts.frames += frames
        counts.batches += 1
        if s.delivery.bar is not None:
            s.delivery.bar.update_to(counts.frames, s.stats.mean_return)


__all__ = ["BatchStream", "RunLifecycle"]
