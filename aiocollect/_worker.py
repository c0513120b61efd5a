"""A worker process: steps its envs and writes batches into its shared-memory slots.

Started by the launcher (a fork of our clean template process) or as ``python -m
aiocollect._worker FD``. It talks to the collector over one Unix socket: small messages only.
It exits by itself when the collector's process dies (its socket reaches end-of-file, or the
launcher it was forked from dies, which sends it SIGKILL). Protocol (``C`` collector, ``W``
worker)::

    W: ("hello", pid)
    C: ("config", cloudpickle(RolloutConfig))
    W: ("spec", {"obs": leaves, "act": leaves, "extras": leaves, "weights": layout or None})
    C: ("layout", SlotLayout, weight layout or None, free slots, heartbeat?)  + fds: the slots'
       memfd (and the weight store's); the heartbeat area follows the slots in the same memfd
    C: ("credit", n)        collect n more batches     ("release", slot)  the slot is free again
    C: ("weights",)         new weights are published: applied now if idle, else at the boundary
    C: ("store", layout)    + fd: a weight store of this worker's own
    C: ("profile", settings, path) / ("profile_off",)
    W: ("ready", slot, n, info)   batch n is in slot     ("applied", version, time)
    W: ("trace", path)            a profiler trace was written
    W: ("error", packed exception, traceback): it then exits
    C: end-of-file (shutdown(SHUT_WR)): close the envs and exit

Messages from the collector are read between steps (every ``_TICK`` seconds at most) and while
waiting; weights change only at batch boundaries.
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import time
from collections import deque
from typing import Any

from . import _heartbeat
from ._peer import _TICK, Peer, _Stop, pack_exception, serve_peer  # noqa: F401 - re-exported


class Worker(Peer):
    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.credits = 0
        self.free: deque[int] = deque()
        self.rollout: Any = None
        self.recorder: Any = None
        self.batches = 0  # batches this process collected
        self.profiled_from = 0  # the batch a profile request arrived before

    def apply_weights(self) -> None:
        version = self.rollout.apply_weights()
        if version is not None:
            self.send(("applied", version, time.time()))

    def handle(self, msg: Any, fds: list[int] = ()) -> None:  # type: ignore[assignment]
        op = msg[0]
        if op == "credit":
            self.credits += msg[1]
        elif op == "release":
            if msg[1] not in self.free:  # (a replacement worker may hear of a slot twice)
                self.free.append(msg[1])
        elif op == "stop":
            raise _Stop
        elif op == "weights":  # new weights: applied now if idle, else at the batch boundary
            pass
        elif op == "store":  # a store of this worker's own (per-worker weights)
            from ._weights import map_store

            self.rollout.add_store(map_store(fds[0], msg[1]))
            os.close(fds[0])
        elif op == "profile":  # profile the next rollouts
            from ._profiling import Recorder

            if self.recorder is not None:
                self.recorder.abort()
            self.recorder = Recorder(msg[1], msg[2])
            self.profiled_from = self.batches
        elif op == "profile_off":
            if self.recorder is not None:
                self.recorder.abort()
                self.recorder = None
        else:  # pragma: no cover - protocol error
            raise RuntimeError(f"aiocollect worker: unknown message {op!r}")

    def _map(self, layout: Any, weight_layout: Any, watch: bool, fds: list[int]) -> Any:
        """Map the slots (and the heartbeat areas after them, one per worker); take the weight store."""
        try:
            mm = mmap.mmap(fds[0], layout.nbytes + layout.workers * _heartbeat.NBYTES)
            if weight_layout is not None:
                from ._weights import map_store

                self.rollout.add_store(map_store(fds[1], weight_layout))
            if watch:  # a step_timeout: keep a heartbeat, and dump the stack on SIGUSR1
                self.rollout.heartbeat = _heartbeat.install(mm, fds[0], _heartbeat.heartbeat_offset(layout, self.rollout.cfg.worker))
        finally:
            for fd in fds:
                os.close(fd)
        return mm

    def run(self) -> None:
        import cloudpickle

        from ._vector import open_rollout

        self.send(("hello", os.getpid()))
        msg, _ = self.recv()
        cfg = cloudpickle.loads(msg[1])
        self.rollout = rollout = open_rollout(cfg)  # a Rollout, or a VectorRollout for vector envs
        self.send(("spec", rollout.spec()))
        msg, fds = self.recv()
        _, layout, weight_layout, free, watch = msg
        mm = self._map(layout, weight_layout, watch, fds)
        views = [layout.views(mm, s, cfg.worker) for s in range(layout.num_slots)]
        self.free.extend(free)
        if cfg.profile is not None:
            from ._profiling import Recorder

            self.recorder = Recorder(*cfg.profile)
        while True:
            self.apply_weights()  # a batch boundary: the only place weights change
            while not (self.credits > 0 and self.free):
                self.handle(*self.recv())
                self.apply_weights()  # an idle worker takes new weights at once
            slot = self.free.popleft()
            self.credits -= 1
            recorder = self.recorder
            n = self.batches - self.profiled_from
            if recorder is not None:
                recorder.before(n)
            rollout.run_batch(views[slot], rollout.version, self.tick)
            self.send(("ready", slot, self.batches, rollout.batch_info()))
            if recorder is not None and (path := recorder.after(n)) is not None:
                self.recorder = None
                self.send(("trace", path))
            self.batches += 1


def _close(worker: Worker) -> None:
    if worker.rollout is not None:
        worker.rollout.close()


def serve(fd: int) -> None:
    """Run a worker on the socket ``fd``; never returns."""
    serve_peer(fd, Worker, _close)


if __name__ == "__main__":  # pragma: no cover - spawned-interpreter mode
    serve(int(sys.argv[1]))
