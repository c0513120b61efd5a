"""Where a run's batches go: :class:`Delivery` (the batch stream's producer side, the sink of
background collection, the pause gate, the counters, the progress bar), which the
:class:`~aiocollect._collector.producer.Producer` fills and the run's lifecycle reads."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import anyio
import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from anyio.streams.memory import MemoryObjectSendStream
    from tensordict import TensorDict

    from .._service.progress import ProgressBar
    from .offloop import CollectorLoop
    from .._backends.seat import RolloutSeat
    from .queue_sink import Sink


@dataclasses.dataclass
class Counters:
    """What the consumers received and the workers collected (``state_dict``, progress)."""

    frames: int = 0  # delivered
    batches: int = 0  # delivered
    collected: int = 0  # frames collected by the workers (total_frames counts these)
    requested: int = 0  # batches the consumers asked for
    traj_counters: list[int] | None = None  # each env row's trajectory id, as last delivered
    start_counters: list[int] | None = None  # those restored by load_state_dict


class PauseGate:
    """``collector.pause()``: while a pause is held, no batch is delivered or written. Its
    events live on the loop of the run's data plane: in background collection, the collector's
    own loop (a pause taken on the caller's loop is taken there)."""

    def __init__(self, wake: Callable[[], None], home: Callable[[], "CollectorLoop | None"]) -> None:
        self.paused = 0  # pauses held (they nest)
        self.resume = anyio.Event()
        self.resume.set()
        self.writing: anyio.Event | None = None  # set when a write into the sink ends
        self._wake = wake
        self._home = home

    async def wait_open(self) -> None:
        while self.paused:
            await self.resume.wait()

    async def _there(self, fn: Callable[[], Any]) -> None:
        home = self._home()
        if home is not None and not home.on_thread():
            await home.to_thread(fn)
        else:
            await fn()

    async def _enter(self) -> None:
        self.paused += 1
        if self.paused == 1:
            self.resume = anyio.Event()
        try:
            if self.writing is not None:
                await self.writing.wait()  # a write in progress finishes first
        except BaseException:
            await self._exit()
            raise

    async def _exit(self) -> None:
        self.paused -= 1
        if self.paused == 0:
            self.resume.set()
            self._wake()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        entered = False
        try:
            await self._there(self._enter)
            entered = True
            yield
        finally:
            if entered:
                with anyio.CancelScope(shield=True):
                    await self._there(self._exit)


class Delivery:
    """Where the run's batches go: the batch stream (the producer's side), the sink of background
    collection (``start(replay_buffer=...)``, ``start(queue=...)``), the pause gate, the counters
    and the progress bar."""

    def __init__(self, gate: PauseGate, counts: Counters) -> None:
        self.gate = gate
        self.counts = counts
        self.send: MemoryObjectSendStream[tuple[TensorDict, list, int, Lease | None]] | None = None
        self.sink: Sink | None = None
        self.bar: ProgressBar | None = None

    def stream(self) -> "MemoryObjectSendStream[tuple[TensorDict, list, int, Lease | None]]":
        """The producer's side of the batch stream (made when the run starts)."""
        assert self.send is not None, "the batch stream is made when the run starts"
        return self.send


class Lease:
    """zero_copy: the slots a delivered batch is a view on, held until the consumer asks for the
    next batch. With ``zero_copy="debug"`` the batch is a view on mappings of its own, which
    :meth:`protect` makes unreadable (reading a handed-back batch crashes with a traceback)."""

    __slots__ = ("parts", "mappings")

    def __init__(self, parts: list[tuple["RolloutSeat", int]], mappings: list[Any]) -> None:
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


__all__ = ["Counters", "Delivery", "Lease", "PauseGate"]
