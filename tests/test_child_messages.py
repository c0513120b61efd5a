"""The parent's side of a child's socket (:class:`ChildProcess`): messages leave whole and in order,
also those queued (``send_nowait``, ``send_later``) while a message with fds is half sent."""

from __future__ import annotations

import os
import socket
import threading

import anyio
import numpy as np
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


@pytest.mark.parametrize("columns", ["arrays", "lists", "vector env dtypes"])
def test_a_batch_info_travels_with_every_episode_as_it_was(columns):
    """A ``Ready`` through the wire's own encoding (its episodes packed as one record array): every
    episode's env, trajectory id, return, length and flag come back as they left, in order, with
    the trajectory counters, the timing and the version; none of them turned into another value."""
    rng = np.random.default_rng(0)
    n = 1000
    env = rng.integers(0, 256, n)
    traj = rng.integers(0, 2**40, n)
    ret = rng.normal(size=n)
    ret[:3] = [np.inf, -np.inf, 3e38]
    length = rng.integers(1, 10_000, n)
    term = rng.random(n) < 0.5
    if columns == "lists":
        cols = [env.tolist(), traj.tolist(), ret.tolist(), length.tolist(), term.tolist()]
    elif columns == "vector env dtypes":
        cols = [env.astype(np.int32), traj, ret.astype(np.float32), length.astype(np.int32), term]
    else:
        cols = [env, traj, ret, length, term]
    episodes = wire.Episodes(*cols)
    info = wire.BatchInfo(episodes, [3, 1, 4], {"env": 0.25, "policy": 0.125}, 7)
    [back] = wire.FrameReader().feed(wire.encode(wire.Ready(2, 9, info)))
    assert (back.slot, back.n) == (2, 9)
    assert (back.info.traj_counters, back.info.timing, back.info.version) == ([3, 1, 4], {"env": 0.25, "policy": 0.125}, 7)
    assert list(back.info.episodes) == list(episodes)
    assert back.info.episodes.last_returns(5) == episodes.last_returns(5)
    assert all(type(v) is t for v, t in zip(next(iter(back.info.episodes)), (int, int, float, int, bool)))


def test_a_batch_info_without_episodes_travels_as_none():
    info = wire.BatchInfo(wire.NO_EPISODES, [0], {}, 0)
    [back] = wire.FrameReader().feed(wire.encode(wire.Ready(0, 0, info)))
    assert len(back.info.episodes) == 0 and list(back.info.episodes) == [] and back.info.episodes.last_returns(3) == []
