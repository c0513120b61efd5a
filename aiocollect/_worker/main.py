"""A worker process: steps its envs and writes batches into its shared-memory slots.

Started by the launcher (a fork of our clean template process) or as ``python -m
aiocollect._worker.main FD``. It talks to the collector over one Unix socket: small typed messages
only, the protocol is in :mod:`aiocollect._core.wire`. It exits by itself when the collector's process
dies (its socket reaches end-of-file, or the launcher it was forked from dies, which sends it
SIGKILL).
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import time
from collections import deque
from typing import Any

from .._core import heartbeat as _heartbeat
from .._core.affinity import apply_cpus, batch_scheduling
from .peer import Peer, serve_peer
from .._core.wire import (
    Applied, Config, Credit, EnvCall, Hello, Profile, ProfileOff, Ready, Release, Slots, Spec, Store, Trace,
    WeightsPublished,
)


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
            self.send(Applied(version, time.time()))

    def handle(self, msg: Any, fds: list[int] = ()) -> None:  # type: ignore[assignment]
        match msg:
            case Credit(n):
                self.credits += n
            case Release(slot):
                if slot not in self.free:  # (a replacement worker may hear of a slot twice)
                    self.free.append(slot)
            case WeightsPublished():  # applied now if idle, else at the batch boundary
                pass
            case Store(layout):  # a store of this worker's own (per-worker weights)
                from .weights import map_store

                self.rollout.add_store(map_store(fds[0], layout))
                os.close(fds[0])
            case Profile(settings, path):  # profile the next rollouts
                from .._core.profiling import Recorder

                if self.recorder is not None:
                    self.recorder.abort()
                self.recorder = Recorder(settings, path)
                self.profiled_from = self.batches
            case ProfileOff():
                if self.recorder is not None:
                    self.recorder.abort()
                    self.recorder = None
            case EnvCall():  # between two env steps (or idle): reach into the envs or the policy
                from .env_calls import answer

                self.send(answer(self.rollout, msg))
            case _:  # pragma: no cover - protocol error
                raise RuntimeError(f"aiocollect worker: unexpected message {msg!r}")

    def expect(self, kind: type) -> Any:
        msg, fds = self.recv()
        for fd in fds:  # pragma: no cover - protocol error
            os.close(fd)
        if not isinstance(msg, kind):  # pragma: no cover - protocol error
            raise RuntimeError(f"aiocollect worker: expected {kind.__name__}, got {msg!r}")
        return msg

    def _map(self, layout: Any, weight_layout: Any, watch: bool, fds: list[int], server: Any = None) -> Any:
        """Map the slots (and the heartbeat areas after them, one per worker); take the weight
        store; with server inference connect to the server (its segment, then a request and a
        response eventfd per group of envs: the last fds; the eventfds are kept by the runners)."""
        try:
            if server is not None:
                n = 2 * self.rollout.cfg.worker_groups
                seg, pairs = fds[-n - 1], fds[-n:]
                del fds[-n:]  # (the segment's fd is closed with the others once mapped)
                self.rollout.connect_server(server, mmap.mmap(seg, server.nbytes), pairs, self.sock, self.drain)
            mm = mmap.mmap(fds[0], layout.nbytes + layout.workers * _heartbeat.NBYTES)
            if weight_layout is not None:
                from .weights import map_store

                self.rollout.add_store(map_store(fds[1], weight_layout))
            if watch:  # a step_timeout: keep a heartbeat, and dump the stack on SIGUSR1
                self.rollout.heartbeat = _heartbeat.install(mm, fds[0], _heartbeat.heartbeat_offset(layout, self.rollout.cfg.worker))
        finally:
            for fd in fds:
                os.close(fd)
        return mm

    def run(self) -> None:
        import cloudpickle

        from .vector import open_rollout

        self.send(Hello(os.getpid()))
        config = self.expect(Config)
        cfg = cloudpickle.loads(config.payload)
        apply_cpus(cfg.cpus, f"worker {cfg.worker}")  # before the envs: what they start inherits it
        if cfg.policy.kind != "server":
            batch_scheduling()  # (the same share of the CPU; a worker woken by its credit preempts no one)
        self.rollout = rollout = open_rollout(cfg)  # a Rollout, or a VectorRollout for vector envs
        self.send(Spec(rollout.spec()))
        slots, fds = self.recv()
        if not isinstance(slots, Slots):  # pragma: no cover - protocol error
            raise RuntimeError(f"aiocollect worker: expected Slots, got {slots!r}")
        layout = slots.layout
        mm = self._map(layout, slots.weight_layout, slots.heartbeat, fds, slots.server)
        views = [layout.views(mm, s, cfg.worker) for s in range(layout.num_slots)]
        self.free.extend(slots.free)
        if cfg.profile is not None:
            from .._core.profiling import Recorder

            self.recorder = Recorder(*cfg.profile)
        spin = cfg.credit_spin
        while True:
            self.apply_weights()  # a batch boundary: the only place weights change
            while not (self.credits > 0 and self.free):
                if spin:  # (a CPU of its own: the next credit read as it comes)
                    self.look(spin)
                self.handle(*self.recv())
                self.apply_weights()  # an idle worker takes new weights at once
            slot = self.free.popleft()
            self.credits -= 1
            recorder = self.recorder
            n = self.batches - self.profiled_from
            if recorder is not None:
                recorder.before(n)
            rollout.run_batch(views[slot], rollout.version, self.tick)
            self.send(Ready(slot, self.batches, rollout.batch_info()))
            if recorder is not None and (path := recorder.after(n)) is not None:
                self.recorder = None
                self.send(Trace(path))
            self.batches += 1


def _close(worker: Worker) -> None:
    if worker.rollout is not None:
        worker.rollout.close()


def serve(fd: int) -> None:
    """Run a worker on the socket ``fd``; never returns."""
    serve_peer(fd, Worker, _close)


if __name__ == "__main__":  # pragma: no cover - spawned-interpreter mode
    serve(int(sys.argv[1]))
