"""The weights the inference server runs (:class:`ServerWeights`): its own copy of the user's
policy, their version, the lock every forward pass and every load holds, and on CUDA the server's
own stream. Why a copy, and what a load guarantees: :mod:`aiocollect._collector.inference_server`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any

from .._core.errors import ConfigError


_RETRY_S = 0.002  # how often a load left for the server's thread looks whether the lock is free


@dataclass(eq=False)
class _Load:
    """A load :meth:`ServerWeights.load` left for the server's thread: what to copy, and the
    eventfd its caller waits on."""

    state: dict[str, Any]
    version: int
    caller: Any  # the caller's CUDA stream, or None
    fd: int = -1  # made once the caller has to wait
    done: bool = False
    error: BaseException | None = None


class ServerWeights:
    """The policy the server runs on ``device`` (``mode="copy"``: a copy of ``policy`` that only
    :meth:`load` changes; ``"shared"``: ``policy`` itself), its tensors by name
    (:attr:`tensors`, laid out as :attr:`layout`, None for a policy without weights) and their
    :attr:`version`. A forward pass holds :attr:`lock` and runs :meth:`on_stream`, reading the
    version there; :meth:`load` holds the same lock, so a pass reads both the weights and the
    version old or both new, never a torn state."""

    def __init__(self, policy: Any, device: Any, mode: str = "copy") -> None:
        self.device = device  # a torch.device, or None: the CPU (see place_policy)
        self.policy = own_policy(policy, device, mode)
        # the tensors update_weights loads into (by name, as the workers' weight layout names them)
        self.tensors: dict[str, Any] = weight_tensors(self.policy)
        self.layout: Any = None  # a WeightLayout
        if self.tensors:
            from .._worker.weights import WeightLayout

            self.layout = WeightLayout.of(self.tensors)
        self.cuda = device is not None and device.type == "cuda"
        self.stream: Any = None
        if self.cuda:
            import torch

            self.stream = torch.cuda.Stream(device)  # the server's own: never the user's default stream
            self.stream.wait_stream(torch.cuda.current_stream(device))  # (the copy of the weights made above)
        self.version = 0
        self.lock = threading.Lock()  # held by each forward pass and by weight loads
        self._pending: list[_Load] = []  # loads left for the server's thread while a pass held the lock
        self._pending_lock = threading.Lock()

    def on_stream(self) -> Any:
        """CUDA: the server's own stream, which never waits on the trainer's streams (its weights
        are its own: only :meth:`load` orders it after the caller's work)."""
        if not self.cuda:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self.stream)

    async def load(self, state: dict[str, Any], version: int) -> None:
        """``update_weights``: copy ``state`` (tensors keyed as :attr:`tensors` names them, all
        or some of them, already matched by the weight sync) into the server's weights and make
        ``version`` theirs, in one hold of the lock under which forward passes run: the next pass
        uses both, no pass sees one without the other. On CUDA the copies are queued on the
        server's stream after what the caller queued on its current stream, and the caller's
        stream waits for them before anything it queues next (an in-place optimizer step cannot
        change a tensor while it is copied). Tensors the server runs itself
        (``server_weights="shared"``) are not copied onto themselves.

        The event loop never waits for the lock: while a forward pass holds it (a pass of a big
        model, or one a busy Python thread slows: each torch call gives the GIL away), the load
        is left for the server's thread, which makes it once that pass has answered
        (:meth:`apply_pending`), and this coroutine waits for it, shielded from cancellation
        (the version is made: the server takes it)."""
        import anyio
        import torch

        caller = torch.cuda.current_stream(self.device) if self.cuda else None  # (the calling thread's)
        job = _Load(state, version, caller)
        with self._pending_lock:
            self._pending.append(job)
        try:
            while True:
                # the lock free (no pass under way, or it ended and the server went idle before
                # it saw the job): made here, in one hold of it, with any load left before it
                if self.lock.acquire(blocking=False):
                    try:
                        self._apply_pending()
                    finally:
                        self.lock.release()
                with self._pending_lock:
                    if job.done:
                        break
                    if job.fd < 0:
                        job.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
                with anyio.CancelScope(shield=True), anyio.move_on_after(_RETRY_S):
                    await anyio.wait_readable(job.fd)
        finally:
            with self._pending_lock:  # (the server's thread writes the fd under this lock, before done)
                if job.fd >= 0:
                    os.close(job.fd)
        if job.error is not None:
            raise job.error

    def apply_pending(self) -> None:
        """The server's thread, after each pass has answered: make the loads :meth:`load` left
        while the pass held the lock (in the order they were made), and wake their callers."""
        if self._pending:
            with self.lock:
                self._apply_pending()

    def _apply_pending(self) -> None:
        """Make the loads left (the lock held), each in one hold of it with the others."""
        with self._pending_lock:
            jobs, self._pending = self._pending, []
        for job in jobs:
            try:
                self._copy(job.state, job.version, job.caller)
            except BaseException as exc:  # (the caller's update_weights raises it)
                job.error = exc
            with self._pending_lock:
                if job.fd >= 0:
                    os.eventfd_write(job.fd, 1)
                job.done = True

    def _copy(self, state: dict[str, Any], version: int, caller: Any) -> None:
        """:meth:`load`'s copies and version, the lock held; ``caller``: the stream of the thread
        that called ``update_weights`` (CUDA), which a copy waits for and which waits for it."""
        import torch

        if self.cuda:
            self.stream.wait_stream(caller)
        with torch.no_grad(), self.on_stream():
            for name, value in state.items():
                own = self.tensors[name]
                if value.data_ptr() != own.data_ptr() or value.device != own.device:
                    # (asynchronous from a device tensor only: a host tensor the caller changes
                    # right after this returns must have been read already)
                    own.copy_(value, non_blocking=value.is_cuda)
        if self.cuda:
            done = torch.cuda.Event()
            done.record(self.stream)
            caller.wait_event(done)
        self.version = version

    def attr(self, name: str) -> Any:
        """The attribute ``name`` of the policy the server runs, read under the lock (never
        half-loaded weights); the object itself, not a copy. Raises its ``AttributeError``."""
        with self.lock:
            return getattr(self.policy, name)


def place_policy(policy: Any, device: Any) -> Any:
    """The device the server's forward passes run on: ``policy_device``, else where the policy's
    parameters are (``None``: no parameters, the CPU)."""
    import torch

    if device is not None:
        return torch.device(device)
    if isinstance(policy, torch.nn.Module):
        for p in policy.parameters():
            return p.device
    return None


def own_policy(policy: Any, device: Any, weights: str) -> Any:
    """The policy object the server runs. ``weights="copy"``: a deep copy of a module (gradients
    dropped), on ``device`` if given; the user's module is left where and what it is.
    ``"shared"``: the module itself, moved to ``device`` in place. A policy that is not a module
    (a plain function) has no weights of its own to copy: it is run as it is."""
    import copy

    import torch

    if not isinstance(policy, torch.nn.Module):
        return policy
    if weights == "shared":
        return policy if device is None else policy.to(device)
    try:
        own = copy.deepcopy(policy)
    except Exception as exc:
        raise ConfigError(
            f"inference='server' runs a copy of the policy's weights of its own, and copy.deepcopy() of the policy "
            f"({type(policy).__name__}) failed ({type(exc).__name__}: {exc}); make it deep-copyable, or pass "
            f"server_weights='shared' to run your module itself (then train a copy and pass its weights to "
            f"update_weights)"
        ) from exc
    for p in own.parameters():
        p.grad = None
    return own if device is None else own.to(device)


def weight_tensors(policy: Any) -> dict[str, Any]:
    """The server's weights, keyed as the workers' weight layout names them (the state dict of the
    module a TensorDictModule wraps, as :func:`~aiocollect._worker.weights.state_of` unwraps it),
    as the tensors themselves (parameters included) so that loads are in place."""
    import torch

    from .._worker.policy import classify

    if not isinstance(policy, torch.nn.Module):
        return {}
    _, fn, _, _ = classify(policy)
    module = fn if isinstance(fn, torch.nn.Module) else policy
    return {name: t for name, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}


__all__ = ["ServerWeights", "own_policy", "place_policy", "weight_tensors"]
