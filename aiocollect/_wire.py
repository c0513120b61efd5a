"""Small control messages between the collector, the launcher and the workers.

Frames are a 4-byte big-endian length and a pickle. File descriptors (shared-memory segments,
sockets) ride along with a message as SCM_RIGHTS ancillary data. Tensors never travel here:
batches live in shared memory. Imported by worker processes: standard library only.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

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
