"""Where an inference server's forward pass spends its time, part by part (``--pass-parts`` of
``benchmarks/inference.py``).

:class:`PassParts` wraps, in this process, the parts of the collector's inference server that a
pass goes through: gathering the waiting workers' observations, staging them in page-locked
memory, the copy to the device, the policy's forward pass, reading the actions back, writing the
answers and waking the workers; and it times the wait between two passes. On CUDA each part ends
with a wait for the server's stream (``synchronize``), so that a part's time is its own: the
instrumented pass is serial, and the parts add up to more than an uninstrumented pass (whose time
the benchmark's table gives as ms/pass). A measuring tool only: the collector's code is unchanged,
and the wrappers are taken off on exit.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

PARTS = (
    ("gather", "the waiting workers' observations as one array per leaf (a view when every worker asks)"),
    ("stage", "CUDA: into page-locked memory (a copy on the CPU)"),
    ("to device", "CUDA: the copy to the GPU, on the server's stream"),
    ("forward", "the policy's forward pass"),
    ("read back", "the actions to the CPU as numpy arrays (from the GPU: a copy that waits for the pass)"),
    ("write", "the actions into the workers' answer slots"),
    ("answer", "waking each worker (one eventfd write each)"),
)


class PassParts:
    """Seconds per part of the server's passes while active; see the module's docstring."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.seconds = {name: 0.0 for name, _ in PARTS}
        self.passes = 0
        self.pass_seconds = 0.0
        self.between = 0.0  # from the end of a pass to the start of the next
        self._last_end: float | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def _timed(self, part: str, fn: Callable, sync: bool = False) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                self._sync()
            self.seconds[part] += time.perf_counter() - t0
            return out

        return wrapper

    def _staging(self, original: Callable) -> Callable:
        def to_device(staging: Any, arr: Any) -> Any:
            # PinnedStaging.to_device, timed in two halves: the method itself (the copy into
            # page-locked memory, and the device copy put on the stream), then the wait for that
            # copy to end
            t0 = time.perf_counter()
            out = original(staging, arr)
            t1 = time.perf_counter()
            self._sync()
            self.seconds["stage"] += t1 - t0
            self.seconds["to device"] += time.perf_counter() - t1
            return out

        return to_device

    def _pass(self, original: Callable) -> Callable:
        def serve(server: Any, ready: list[int]) -> None:
            t0 = time.perf_counter()
            if self._last_end is not None:
                self.between += t0 - self._last_end
            original(server, ready)
            self._last_end = time.perf_counter()
            self.pass_seconds += self._last_end - t0
            self.passes += 1

        return serve

    @contextlib.contextmanager
    def active(self, policy_cls: type) -> Iterator["PassParts"]:
        """Wraps the server's parts (and ``policy_cls.forward``) until the block ends."""
        from aiocollect._collector import inference_server, server_parts
        from aiocollect._worker import policy as policy_mod

        patches = [
            (server_parts.ServerSegment, "requests", lambda f: self._timed("gather", f)),
            (server_parts.ServerSegment, "write", lambda f: self._timed("write", f)),
            (server_parts.ServerSegment, "answer", lambda f: self._timed("answer", f)),
            (server_parts.PinnedStaging, "to_device", self._staging),
            (policy_mod.TorchRunner, "_convert", lambda f: self._timed("read back", f)),
            (policy_cls, "forward", lambda f: self._timed("forward", f, sync=True)),
            (inference_server.InferenceServer, "_serve_seats", self._pass),
        ]
        saved = []
        try:
            for owner, name, wrap in patches:
                own = name in owner.__dict__  # (else inherited: the wrapper is removed afterwards)
                saved.append((owner, name, owner.__dict__.get(name), own))
                setattr(owner, name, wrap(getattr(owner, name)))
            yield self
        finally:
            for owner, name, original, own in reversed(saved):
                if own:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)

    def table(self) -> list[str]:
        """The lines to print: ms per pass of each part, its share of the instrumented pass."""
        n = max(self.passes, 1)
        per_pass = self.pass_seconds / n * 1e3
        lines = [f"{'part':<12} {'ms/pass':>8} {'share':>6}  what"]
        for name, what in PARTS:
            if not self.cuda and name in ("stage", "to device"):
                continue
            ms = self.seconds[name] / n * 1e3
            lines.append(f"{name:<12} {ms:>8.3f} {ms / per_pass if per_pass else 0:>6.0%}  {what}")
        rest = per_pass - sum(self.seconds.values()) / n * 1e3
        lines.append(f"{'other':<12} {rest:>8.3f} {rest / per_pass if per_pass else 0:>6.0%}  the pass's own "
                     f"bookkeeping (lock, stream, stats, conversion checks)")
        lines.append(f"{'pass':<12} {per_pass:>8.3f} {1:>6.0%}  one instrumented pass ({self.passes:,} passes)")
        between = self.between / max(self.passes - 1, 1) * 1e3
        lines.append(f"{'between':<12} {between:>8.3f} {'':>6}  from the end of a pass to the start of the next "
                     f"(waiting for the workers' next requests)")
        return lines
