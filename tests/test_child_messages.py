"""The parent's side of a child's socket (:class:`ChildProcess`): messages leave whole and in order,
also those queued (``send_nowait``, ``send_later``) while a message with fds is half sent."""

from __future__ import annotations

import os
import socket
import threading

import anyio
import pytest

from aiocollect._backends import child as child_module
from aiocollect._backends.child import ChildProcess
from aiocollect._core import wire

pytestmark = pytest.mark.timeout(60)


def _read_messages(sock: socket.socket, count: int, out: list) -> None:
    """In a thread: read ``count`` messages (and their fds) from the blocking ``sock``."""
    reader = wire.FrameReader()
    while len(out) < count:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, wire.MAX_FDS)
        for fd in fds:
            os.close(fd)
        if not data:
            return
        out.extend(reader.feed(data))


async def test_a_message_queued_while_one_with_fds_is_half_sent_follows_it_whole(monkeypatch):
    """The fds' message is longer than one write takes (its first 64 KiB go with the fds): a
    message queued while it waits for the socket goes after all of it, not into its middle."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ChildProcess(ours, index=0, who="worker 0")
    big = ("big", b"x" * 300_000)
    real_wait, sent_send_fds, waits = child_module.anyio.wait_writable, socket.send_fds, []

    def send_fds_once_full(sock, buffers, fds, *args):  # the first try finds the socket full
        if not waits:
            raise BlockingIOError
        return sent_send_fds(sock, buffers, fds, *args)

    async def wait_writable(sock):  # while it waits: the other messages are queued
        if not waits:
            proc.send_nowait(("nowait", 1))
            proc.send_later(("later", 2))
        waits.append(1)
        await real_wait(sock)

    monkeypatch.setattr(child_module.socket, "send_fds", send_fds_once_full)
    monkeypatch.setattr(child_module.anyio, "wait_writable", wait_writable)
    got: list = []
    reader = threading.Thread(target=_read_messages, args=(theirs, 3, got), daemon=True)
    reader.start()
    r, w = os.pipe()
    try:
        with anyio.fail_after(30):
            await proc.send(big, fds=(r,))
        reader.join(30)
        assert got == [big, ("nowait", 1), ("later", 2)]
    finally:
        os.close(r)
        os.close(w)
        ours.close()
        theirs.close()


async def test_send_later_goes_with_the_next_message_in_order():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ChildProcess(ours, index=0, who="worker 0")
    try:
        proc.send_later(wire.Release(1))
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing written yet
            theirs.recv(1)
        theirs.setblocking(True)
        await proc.send(wire.Credit(2))
        got: list = []
        _read_messages(theirs, 2, got)
        assert got == [wire.Release(1), wire.Credit(2)]
    finally:
        ours.close()
        theirs.close()
