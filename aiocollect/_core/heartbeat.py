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
(:meth:`aiocollect._backends.child.ChildProcess.hung_error`). Imported by worker processes: standard
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
# what the parent infers without the worker's help (never written by a worker)
WAITING, UNRESPONSIVE = 4, 5
DOING = {
    IDLE: "waiting for the collector",
    STEP: "step()",
    RESET: "reset()",
    POLICY: "the policy's forward pass",
    WAITING: "starting the work it was given",
    UNRESPONSIVE: "answering the watchdog",
}
STOPPED = ("T", "t")  # /proc/<pid>/stat states of a stopped process: by a signal, by a tracer


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

    def stamp(self) -> int:
        """The heartbeat's stamp: it changes with every call the worker begins."""
        return self._words[0]

    def doing(self) -> tuple[int, int]:
        """``(what, env)`` the worker is doing now (or did last: ``what`` is :data:`IDLE` between)."""
        doing = self._words[1]
        return doing >> 32, doing & 0xFFFFFFFF

    def stack_dump(self) -> str:
        raw = bytes(self._buffer[self._offset + DUMP_OFFSET : self._offset + NBYTES])
        return raw.split(b"\0", 1)[0].decode("utf-8", "replace").rstrip()

    def release(self) -> None:
        self._words.release()


def describe(what: int, env: int) -> str:
    return f"env {env}'s {DOING[what]}" if what in (STEP, RESET) else DOING[what]


def env_of(what: int, env: int) -> int | None:
    """The env a hang names (:attr:`WorkerTimeoutError.env <aiocollect.WorkerTimeoutError>`)."""
    return env if what in (STEP, RESET) else None


def process_state(pid: int | None) -> tuple[str, int] | None:
    """``(state, cpu)`` of process ``pid`` on this machine, from ``/proc/<pid>/stat``: its state
    letter (``"R"``, ``"S"``, ``"T"`` ...) and the CPU time all its threads used (clock ticks);
    ``None`` if it is gone or there is no ``/proc``."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[11]) + int(fields[12])  # state, utime + stime
    except (OSError, IndexError, ValueError):
        return None


class ProgressWatch:
    """Collector side: hangs found from what the parent sees alone, so that a worker that cannot
    help (stopped by ``SIGSTOP`` or a debugger, frozen) is found too.

    Progress is anything the parent can observe: bytes received from the worker, its heartbeat's
    stamp, the CPU time its process used (``/proc/<pid>/stat``). :meth:`check` finds a worker

    - stopped (state ``T``/``t``) with no CPU time used, for longer than the timeout, whatever it
      was doing; or
    - that the parent waits on (``waiting`` is not ``None``: it was given work) and that made no
      progress at all for longer than the timeout, although its heartbeat says it is not busy
      (a busy one is the heartbeat's own check) and it is not runnable (a process starved of
      CPU on a loaded machine is not hung).

    A worker that is idle because it was given no work (backpressure, a paused collector) is
    never hung.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._stopped_since: float | None = None
        self._cpu = -1
        self._key: object = None
        self._token: tuple | None = None
        self._since = 0.0

    def check(
        self, pid: int | None, timeout: float, waiting: object, received: int, monitor: HeartbeatMonitor
    ) -> tuple[int, int, float] | None:
        """``(what, env, seconds)`` as :meth:`HeartbeatMonitor.stuck` if the worker is hung:
        ``what`` is what its heartbeat says it was doing when it stopped, or :data:`WAITING`.
        ``waiting``: a key for the work it was given (a new key starts a new deadline), or
        ``None`` if it was given none."""
        now = time.monotonic()
        state = process_state(pid)
        if state is None:
            return None  # gone: its death is seen on its socket
        letter, cpu = state
        if letter in STOPPED and cpu == self._cpu:
            if self._stopped_since is None:
                self._stopped_since = now
            elif now - self._stopped_since > timeout:
                what, env = monitor.doing()
                return what, env, now - self._stopped_since
        else:
            self._stopped_since = None if letter not in STOPPED else now
        self._cpu = cpu
        if waiting is None:
            self._key = None
            return None
        token = (received, monitor.stamp(), cpu)
        if waiting != self._key or token != self._token:
            self._key, self._token, self._since = waiting, token, now
            return None
        if now - self._since > timeout and monitor.doing()[0] == IDLE and letter != "R":  # (R: waits for a CPU)
            return WAITING, 0, now - self._since
        return None


def hang_message(
    who: str, what: int, env: int, seconds: float, timeout: float, stack: str, state: str | None, fix: str
) -> str:
    """The message of a :class:`~aiocollect.WorkerTimeoutError`: ``who`` was found hung doing
    ``what`` (``env``) for ``seconds``; ``state`` is its process state when it was declared
    hung (``None``: unknown, another machine), ``stack`` its Python stack if it could write one,
    ``fix`` the last sentence (what to pass to go on)."""
    if state in STOPPED:
        how = "by a signal: SIGSTOP, SIGTSTP" if state == "T" else "by a debugger or tracer (ptrace)"
        where = {
            IDLE: "while it waited for the collector",
            WAITING: "before starting the work it was given",
            UNRESPONSIVE: "and it did not answer the watchdog",
        }.get(what, f"in {describe(what, env)}")
        return (
            f"{who} is stopped (process state {state}, stopped {how}): it has not run for {seconds:.1f} s "
            f"(step_timeout={timeout:g}), {where}. It was killed. A stopped process cannot write its stack, so "
            f"there is none.\n\nIf it was stopped on purpose (a debugger attached, a container or cgroup frozen, "
            f"job control), resume it (SIGCONT) within step_timeout, or pass step_timeout=None while you debug; "
            f"{fix}"
        )
    dump = f"Its stack when it was declared hung:\n{stack.rstrip() or '(not available)'}"
    if what == WAITING:
        head = (
            f"{who} is hung: it was given work {seconds:.1f} s ago and has not started it (step_timeout="
            f"{timeout:g}): since then it sent nothing, its heartbeat did not move and it used no CPU time"
        )
    elif what == UNRESPONSIVE:
        head = (
            f"{who} is hung: it has not answered the watchdog for {seconds:.1f} s (step_timeout={timeout:g}): its "
            f"process is stopped (SIGSTOP, a debugger, a frozen container) or stuck in native code that holds "
            f"the GIL"
        )
    else:
        head = f"{who} is hung: {describe(what, env)} has not returned after {seconds:.1f} s (step_timeout={timeout:g})"
    return (
        f"{head}. It was killed. {dump}\n\nRaise step_timeout if such calls can legitimately take this long, "
        f"or {fix}"
    )
