"""Hang detection: a worker's heartbeat in shared memory, and room for its stack dump.

A worker collecting with a ``step_timeout`` writes, before each env step, env reset and policy
call, the time (``CLOCK_MONOTONIC``, the same clock in every process) and what it is about to do
into a few words at the end of its shared-memory segment, and marks itself idle while it waits
for the collector. The collector reads them a few times per timeout: a worker busy with the same
call for longer than the timeout is hung. Nothing is written when no timeout is set. The
evaluator's worker does the same during an evaluation, in a small memfd of its own.

Before killing a hung worker the collector (or evaluator) sends it ``SIGUSR1``; :mod:`faulthandler`
in the worker (set up by :func:`install`) then writes every thread's Python stack into the dump
area of the same segment, so that the error says where it hung
(:meth:`aiocollect._child.ChildProcess.hung_error`). Imported by worker processes: standard
library only.
"""

from __future__ import annotations

import os
import time
from typing import Any

WORDS = 2  # [stamp (ns, CLOCK_MONOTONIC), what << 32 | env]
DUMP_OFFSET = 64
NBYTES = 64 * 1024  # words, then the stack dump

IDLE, STEP, RESET, POLICY = 0, 1, 2, 3
DOING = {STEP: "step()", RESET: "reset()", POLICY: "the policy's forward pass"}


class Heartbeat:
    """Worker side: record what the worker is doing now (about 0.2 µs a call)."""

    __slots__ = ("_words",)

    def __init__(self, buffer: Any, offset: int) -> None:
        self._words = memoryview(buffer)[offset : offset + 8 * WORDS].cast("q")

    def begin(self, what: int, env: int = 0) -> None:
        words = self._words
        words[0] = time.monotonic_ns()
        words[1] = what << 32 | env

    def idle(self) -> None:
        self._words[1] = IDLE << 32


def heartbeat_offset(layout: Any, worker: int) -> int:
    """Where worker ``worker``'s heartbeat lives in the slots' segment: after the slots."""
    return layout.nbytes + worker * NBYTES


def install(buffer: Any, fd: int, offset: int) -> Heartbeat:
    """Worker side: the heartbeat at ``offset`` of ``buffer`` (a mapping of the memfd ``fd``),
    and :mod:`faulthandler` set to write every thread's stack into its dump area on ``SIGUSR1``
    (through a file descriptor of its own: ``fd`` may be closed after this).

    The segment is shared by every worker, so the descriptor is a new open of the memfd (a file
    position of its own), not a ``dup`` whose position another worker's seek would move."""
    import faulthandler
    import signal

    try:
        dump = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:  # pragma: no cover - no /proc: a position shared with the other workers
        dump = os.dup(fd)
    os.lseek(dump, offset + DUMP_OFFSET, os.SEEK_SET)
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    return Heartbeat(buffer, offset)


class HeartbeatMonitor:
    """Collector side: reads one worker's heartbeat."""

    def __init__(self, buffer: Any, offset: int) -> None:
        self._buffer = buffer
        self._offset = offset
        self._words = memoryview(buffer)[offset : offset + 8 * WORDS].cast("q")

    def reset(self) -> None:
        self._words[0] = 0
        self._words[1] = IDLE << 32
        self._buffer[self._offset + DUMP_OFFSET : self._offset + NBYTES] = bytes(NBYTES - DUMP_OFFSET)

    def stuck(self, timeout: float) -> tuple[int, int, float] | None:
        """``(what, env, seconds)`` if the worker has been busy with one call for longer than
        ``timeout`` seconds, else ``None``."""
        stamp, doing = self._words[0], self._words[1]
        what = doing >> 32
        if what == IDLE:
            return None
        elapsed = (time.monotonic_ns() - stamp) / 1e9
        if elapsed <= timeout or self._words[0] != stamp:  # (or it moved on while we read)
            return None
        return what, doing & 0xFFFFFFFF, elapsed

    def stack_dump(self) -> str:
        raw = bytes(self._buffer[self._offset + DUMP_OFFSET : self._offset + NBYTES])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace").rstrip()

    def release(self) -> None:
        self._words.release()


def describe(what: int, env: int) -> str:
    return f"env {env}'s {DOING[what]}" if what != POLICY else DOING[what]
