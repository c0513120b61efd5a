"""Small control messages between the collector and its rollout workers, and how they travel.

Frames are a 4-byte big-endian length and a pickle. File descriptors (shared-memory segments,
sockets) ride along with a message as SCM_RIGHTS ancillary data. Tensors never travel here:
batches live in shared memory. Imported by worker processes: standard library only.

The rollout protocol (``C`` the collector's :class:`~aiocollect._backends.workers.ProcessWorker`, ``W`` the
worker process, :mod:`aiocollect._worker.main`); every message is one of the frozen types below::

    W: Hello(pid)
    C: Config(payload)                 the cloudpickled RolloutConfig
    W: Spec(spec)                      the batch leaves: {"obs", "act", "extras", "weights"}
                                       (server inference: and "act_space")
    C: Slots(layout, weight_layout, free, heartbeat, server)   + fds: the slots' memfd (the
                                       heartbeat areas follow the slots in it), the weight
                                       store's, and with server inference the server's segment
                                       and this worker's request and response eventfds
                                       (:mod:`aiocollect._worker.inference_client`: no message per step)
    C: Credit(n)                       collect n more batches
    C: Release(slot)                   the consumer is done with the slot: fill it again
    C: WeightsPublished()              applied now if the worker is idle, else at the boundary
    C: Store(layout)                   + fd: a weight store of this worker's own
    C: Profile(settings, path) / ProfileOff()
    C: EnvCall(id, kind, name, payload, rows, epoch)   call, get or set something of the envs (or
                                       the policy), applied between two env steps
                                       (:mod:`aiocollect._worker.env_calls`)
    W: Ready(slot, n, info)            batch n is in slot; info: a BatchInfo
    W: Applied(version, time)          the worker now acts with weights ``version``
    W: Trace(path)                     a profiler trace was written
    W: EnvCallDone(id, result, error)  the EnvCall was applied: its results (one per row), or
                                       what it raised (the worker goes on)
    W: Error(exception, traceback)     the cloudpickled exception; the worker then exits
    C: end-of-file (shutdown(SHUT_WR)): close the envs and exit

A worker reads the collector's messages between env steps (every ``_TICK`` seconds at most) and
while it waits; weights change only at batch boundaries. The launcher reports a failed fork on
the child's socket with the same :class:`Error`.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import struct
from typing import Any, Iterator, TypeVar, dataclass_transform

_T = TypeVar("_T")

import numpy as np

@dataclass_transform(frozen_default=True)
def _frozen(cls: type[_T]) -> type[_T]:
    """A message type: a frozen, slotted dataclass (declared so that type checkers see its fields)."""
    return dataclasses.dataclass(frozen=True, slots=True)(cls)


# -- worker to collector ------------------------------------------------------------------------
@_frozen
class Hello:
    pid: int


@_frozen
class Spec:
    spec: dict


@_frozen
class Episodes:
    """The episodes that ended in one batch, in the order they ended, as columns: lists, or
    numpy arrays from a vector env's worker (which ends about a thousand episodes per batch: no
    object per episode on either side of the wire, and arrays pickle as their bytes)."""

    env: "list[int] | np.ndarray"  # the global env (row) index
    traj_id: "list[int] | np.ndarray"
    ret: "list[float] | np.ndarray"
    length: "list[int] | np.ndarray"
    terminated: "list[bool] | np.ndarray"

    @classmethod
    def from_rows(cls, rows: list[tuple[int, int, float, int, bool]]) -> "Episodes":
        if not rows:
            return NO_EPISODES
        return cls(*(list(col) for col in zip(*rows)))

    def __len__(self) -> int:
        return len(self.env)

    def __iter__(self) -> Iterator[tuple[int, int, float, int, bool]]:
        """``(env, traj_id, ret, length, terminated)`` per episode, as Python numbers."""
        return zip(*(c.tolist() if isinstance(c, np.ndarray) else c for c in (
            self.env, self.traj_id, self.ret, self.length, self.terminated)))

    def last_returns(self, n: int) -> list[float]:
        """The returns of the last ``n`` episodes, as Python floats."""
        ret = self.ret[-n:] if n else self.ret[:0]
        return ret.tolist() if isinstance(ret, np.ndarray) else [float(r) for r in ret]


NO_EPISODES = Episodes([], [], [], [], [])

# an episode as it travels in a BatchInfo's pickle: the columns of Episodes, one record each
_EPISODE_ROW = np.dtype([("env", "<i8"), ("traj_id", "<i8"), ("ret", "<f8"), ("length", "<i8"), ("terminated", "?")])


def _packed(episodes: Episodes) -> bytes:
    """``episodes`` as the bytes of one record array (:data:`_EPISODE_ROW`)."""
    if not len(episodes):
        return b""
    rows = np.empty(len(episodes), _EPISODE_ROW)
    rows["env"] = episodes.env
    rows["traj_id"] = episodes.traj_id
    rows["ret"] = episodes.ret
    rows["length"] = episodes.length
    rows["terminated"] = episodes.terminated
    return rows.tobytes()


def _batch_info(packed: bytes, traj_counters: list[int], timing: dict[str, float], version: int) -> "BatchInfo":
    """A :class:`BatchInfo` from its pickle (:meth:`BatchInfo.__reduce__`): the episodes' columns
    are views on one read-only record array."""
    if packed:
        rows = np.frombuffer(packed, _EPISODE_ROW)
        episodes = Episodes(rows["env"], rows["traj_id"], rows["ret"], rows["length"], rows["terminated"])
    else:
        episodes = NO_EPISODES
    return BatchInfo(episodes, traj_counters, timing, version)


@_frozen
class BatchInfo:
    """What the collector learns with each batch, besides the batch in shared memory."""

    episodes: Episodes
    traj_counters: list[int]  # per env (row) of the worker: the trajectory it is in now
    timing: dict[str, float]  # seconds in env.step and in the policy
    version: int  # the policy version the batch was collected with (its last step's)

    def __reduce__(self) -> tuple:
        """Pickled once per batch and worker, on both sides of the critical path of a round: the
        episodes go as the bytes of one record array (a fifth of the time of the dataclasses'
        and arrays' own pickling, both ways)."""
        return _batch_info, (_packed(self.episodes), self.traj_counters, self.timing, self.version)


@_frozen
class Ready:
    slot: int
    n: int  # the batch's number among this process's batches
    info: BatchInfo

    def __reduce__(self) -> tuple:
        return Ready, (self.slot, self.n, self.info)  # (not the dataclass's state functions: slower)


@_frozen
class Applied:
    version: int
    time: float


@_frozen
class Trace:
    path: str


@_frozen
class Error:
    """The worker failed (and exits): the cloudpickled exception and its formatted traceback."""

    exception: bytes
    traceback: str


@_frozen
class EnvCallDone:
    """An :class:`EnvCall` was applied: the cloudpickled list of its results (one per row), or,
    with ``error`` (the worker's traceback), the cloudpickled exception it raised."""

    id: int
    result: bytes
    error: str | None = None


# -- collector to worker ------------------------------------------------------------------------
@_frozen
class Config:
    payload: bytes  # cloudpickle of a RolloutConfig


@_frozen
class Slots:
    layout: Any  # a SlotLayout
    weight_layout: Any  # the shared weight store's layout, or None
    free: list[int]
    heartbeat: bool  # a step_timeout: keep a heartbeat, dump the stack on SIGUSR1
    server: Any = None  # inference="server": the server's ServerLayout (its 3 fds come last)


@_frozen
class Credit:
    n: int


@_frozen
class Release:
    slot: int


@_frozen
class WeightsPublished:
    pass


@_frozen
class Store:
    layout: Any


@_frozen
class Profile:
    settings: dict
    path: str


@_frozen
class ProfileOff:
    pass

@_frozen
class EnvCall:
    """Reach into the worker's envs (or its policy) between two env steps. ``kind``: ``"call"``
    (the method ``name`` of each env), ``"get"`` / ``"set"`` (the attribute ``name``, through
    gymnasium's wrappers), ``"fn"`` (a function ``fn(env, ...)``), ``"policy"`` (an attribute of
    the policy). ``payload``: the cloudpickled ``(args, kwargs)`` (``"set"``: ``((values per
    row,), {})``; ``"fn"``: ``((fn, *args), kwargs)``). ``rows``: the worker's env rows (a vector
    env's sub-envs are rows; ``None``: all). ``epoch``: the env epoch its rows enter once it is
    applied (0: a read, which starts none)."""

    id: int
    kind: str
    name: str
    payload: bytes
    rows: tuple[int, ...] | None = None
    epoch: int = 0


_HEADER = struct.Struct("!I")
MAX_FDS = 16


def encode(obj: Any) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def send_blocking(sock: socket.socket, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one message on a blocking socket (worker and launcher side)."""
    data = encode(obj)
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def _recv_exactly(sock: socket.socket, n: int, fds: list[int]) -> bytes | None:
    chunks = []
    while n:
        msg, new_fds, _flags, _addr = socket.recv_fds(sock, min(n, 1 << 20), MAX_FDS)
        if not msg:
            for fd in new_fds:  # pragma: no cover - fds with a closing peer
                _close_quietly(fd)
            return None
        fds.extend(new_fds)
        chunks.append(msg)
        n -= len(msg)
    return b"".join(chunks)


def recv_blocking(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """Receive one message and the fds sent with it; ``None`` when the peer closed."""
    fds: list[int] = []
    header = _recv_exactly(sock, _HEADER.size, fds)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    payload = _recv_exactly(sock, size, fds)
    if payload is None:
        return None
    return pickle.loads(payload), fds


def message_waiting(sock: socket.socket) -> bool:
    """Whether a message can be read from a blocking socket without waiting (a worker's check
    between steps). Raises ``EOFError`` once the peer has closed or the socket failed."""
    try:
        peek = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        raise EOFError from None
    if not peek:
        raise EOFError
    return True


class FrameReader:
    """Incremental parser for a non-blocking reader (the collector's side of a worker pipe)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        buf = self._buf
        while len(buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buf)
            end = _HEADER.size + size
            if len(buf) < end:
                break
            out.append(pickle.loads(bytes(buf[_HEADER.size:end])))
            del buf[:end]
        return out


def _close_quietly(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
