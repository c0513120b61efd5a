"""Server inference (``inference="server"``), the collector's side: :class:`InferenceServer` runs
a copy of the user's policy (weights of its own) on the observations of many workers at once
(the protocol and the worker's side are in :mod:`aiocollect._worker.inference_client`).

**Where it runs.** The forward passes run in a thread of their own, not as a coroutine on the
user's event loop: a step of the server is a wait on every worker's request eventfd
(``epoll``, outside the GIL), one forward pass (torch releases the GIL in its kernels) and the
copies of observations and actions. As a coroutine each of those passes would hold the user's
loop (a CartPole MLP over 64 envs takes ~0.1 ms, a Nature-CNN over 8 Atari frames ~2 ms, once
per step of the envs: hundreds of times a second), and every step would cost two trips through
the loop's selector. In a thread the loop only shares the GIL with it, between kernels.

**Weights.** The server runs weights of its own (``server_weights="copy"``, the default): a
copy of the user's policy made once, on ``policy_device``, that nothing but
:meth:`InferenceServer.load` changes (they are its
:class:`~aiocollect._collector.server_weights.ServerWeights`; the server's other parts are in
:mod:`aiocollect._collector.server_parts`). ``update_weights`` matches what it is given against the
copy's tensors (in the weight sync, as for the workers' store) and :meth:`~InferenceServer.load`
copies them in and sets the new version in one hold of the server's lock, under which every
forward pass runs and reads the version: a pass sees both old or both new, never a torn state,
whatever the trainer does to its own module meanwhile. On CUDA the copies run on the server's
stream, after the work the caller queued on its current stream, and the caller's stream then
waits for them (so a later in-place step cannot change what is being copied); forward passes
never wait on the trainer's stream otherwise. ``compile_policy`` and ``cudagraph_policy`` wrap
the copy: loads are in-place ``copy_`` into the same tensors, so a graph is never rebuilt.
``server_weights="shared"`` runs the user's module itself (no second copy): in-place training
then reaches forward passes before its version is made.
"""

from __future__ import annotations

import time
from typing import Any

from .._core.errors import ConfigError
from .._core.layout import Leaf
from .._worker.inference_client import SERVER_STOPPED, ServerLayout
from .server_parts import PassStats, PinnedStaging, Requests, ServerOptions, ServerRunners, ServerSegment, ServingThread
from .server_parts import StarvationWatch as StarvationWatch  # (its home before the parts: tests patch it here)
from .server_weights import ServerWeights, place_policy
from .server_weights import own_policy as own_policy

SERVE_IN = "thread"  # or "loop": benchmarks/inference.py --serve-in measures both (docs/inference.md)


class InferenceServer:
    """Serves one run's workers: ``seats`` of ``rows`` env rows each (a seat is a worker, or one
    of its ``worker_groups`` groups of envs, with its own request and answer), for the spaces in
    ``spec``, as ``options`` (a :class:`~aiocollect._collector.server_parts.ServerOptions`) say.
    Made once the workers reported their spaces; :meth:`probe` finds the policy's extra outputs
    (they are part of the batch layout), :meth:`warm_up` compiles, :meth:`allocate` makes the
    shared memory that :meth:`link` hands to each worker, :meth:`start` starts the thread,
    :meth:`stop` ends it, wakes every waiting worker and frees what the server holds.

    Its parts: :attr:`weights` (the policy it runs and their version), :attr:`runners`,
    :attr:`stats`, and once allocated and started :attr:`segment`, :attr:`requests` and
    :attr:`thread`. Raises :class:`ConfigError` for an ``env_batch_size`` over the envs served,
    or ``cudagraph_policy`` off a CUDA device."""

    def __init__(self, policy: Any, spec: dict, seats: int, rows: int, options: ServerOptions) -> None:
        opts = self.options = options
        self.seats, self.rows = seats, rows
        k = opts.env_batch_size
        if k is not None and k > seats * rows:
            raise ConfigError(
                f"env_batch_size={k} but the workers have {seats * rows} envs in all (each sub-env of a "
                f"vector env counts); use at most {seats * rows}"
            )
        device = place_policy(policy, opts.device)  # where the forward passes run
        if opts.cudagraph_policy is not False and (device is None or device.type != "cuda"):
            raise ConfigError(
                f"cudagraph_policy={opts.cudagraph_policy!r} needs the policy on a CUDA device (CUDA graphs); the "
                f"server's policy runs on {device or 'the CPU'}: pass policy_device='cuda', or drop cudagraph_policy"
            )
        self.weights = ServerWeights(policy, device, opts.weights)
        staging = PinnedStaging(device) if self.weights.cuda else None
        self.runners = ServerRunners(self.weights.policy, spec, opts, seats * rows, staging)
        self.stats = PassStats()
        self.segment: ServerSegment | None = None
        self.requests: Requests | None = None
        self.thread: ServingThread | None = None  # None while serving on the event loop

    # -- set-up ---------------------------------------------------------------------------------
    def probe(self) -> list[Leaf]:
        """The policy's extra outputs (``sample_log_prob``, ``logits``, values ...) per env row,
        from one forward pass over zero observations of one worker's rows (as a worker probes its
        own policy); the policy's errors surface here, before anything starts."""
        import torch

        with torch.no_grad(), self.weights.on_stream():
            return self.runners.probe(self.rows)

    def warm_up(self) -> None:
        """``compile_policy``/``cudagraph_policy``: one forward pass (twice for a graph's own
        warm-up and capture) for each number of rows a pass can have, before collection starts
        (not counted in it), leaving torch's random state and a recurrent policy's memory as they
        were."""
        if not self.options.wraps:
            return
        import torch

        passes = 3 if self.options.cudagraph_policy is not False else 1
        devices = [self.weights.device] if self.weights.cuda else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices), self.weights.on_stream():
            self.runners.warm_up([k * self.rows for k in range(1, self.seats + 1)], passes)

    def allocate(self, extras: list[Leaf]) -> None:
        """The shared segment and the eventfds (every worker's, kept for replacements)."""
        runners = self.runners
        self.segment = ServerSegment(ServerLayout(
            tuple(runners.obs_leaves), tuple(runners.act_leaves), tuple(extras), self.seats, self.rows,
            signal_idle=self.options.env_batch_size is not None, recurrent=runners.memory is not None,
        ))

    def link(self, worker: int, groups: int = 1) -> tuple[ServerLayout, tuple[int, ...]]:
        """What worker ``worker`` is given (its duplicates of the fds travel with its slots): the
        layout, and the segment's descriptor, then its seats' request and response descriptors
        (one pair per group of its envs)."""
        assert self.segment is not None
        return self.segment.link(worker, groups)

    def start(self) -> None:
        """Start serving: in a thread of its own (``SERVE_IN="thread"``, the default), or as
        the run's task on the event loop (``"loop"``, kept to measure the choice against)."""
        assert self.segment is not None
        self.requests = Requests(self.segment.req_fds, self.rows, self.options.env_batch_size)
        if SERVE_IN != "loop":
            self.thread = ServingThread(self._serve_ready, self.options.priority, self.stats)
            self.thread.start()

    # -- serving --------------------------------------------------------------------------------
    def _serve_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (-1: until something happens) for requests; answer
        those :class:`Requests` says make a pass with one forward pass. False once asked to stop."""
        assert self.requests is not None
        ready = self.requests.ready(timeout)
        if ready is None:
            return False
        if ready:
            self._serve_seats(ready)
        return True

    def _serve_seats(self, ready: list[int]) -> None:
        """One forward pass over the rows of the seats ``ready`` (sorted); their answers."""
        segment = self.segment
        assert segment is not None
        inputs, state_rows, is_init = segment.requests(ready)
        n, weights = self.rows * len(ready), self.weights
        t0 = time.perf_counter()
        # (on CUDA the outputs come back with a copy that waits for the pass: the thread waits
        # outside the GIL, the event loop runs meanwhile)
        with weights.lock, weights.on_stream():  # (the version and the weights of one load)
            version = weights.version
            _, actions, extras = self.runners.for_pass(n).act(inputs, state_rows, is_init)
            segment.write(ready, actions, extras, version)
        self.stats.add(n, time.perf_counter() - t0)
        segment.answer(ready)
        weights.apply_pending()  # (update_weights made during the pass: after its answers)

    async def watch(self) -> None:
        """The run's task for the server: raises the policy's error if a forward pass fails
        (serving on the event loop: serves, woken by the epoll set of every request)."""
        import anyio

        thread, requests = self.thread, self.requests
        assert requests is not None, "watch() runs once the server started"
        error: BaseException | None = None
        if thread is None:
            try:
                while True:
                    await anyio.wait_readable(requests.fileno())
                    self._serve_ready(timeout=0)  # (the runners disable autograd per forward pass)
            except Exception as exc:
                error = exc
        else:
            await anyio.wait_readable(thread.failed_fd)
            error = thread.error
        assert error is not None
        if hasattr(error, "add_note"):
            error.add_note("(raised by the policy in the collector's inference server, inference='server')")
        raise error

    # -- what the run reads and loads -----------------------------------------------------------
    @property
    def weights_layout(self) -> Any:
        """The layout of the weights the server runs (None: a policy without weights)."""
        return self.weights.layout

    async def load(self, state: dict[str, Any], version: int) -> None:
        """``update_weights``: :meth:`ServerWeights.load
        <aiocollect._collector.server_weights.ServerWeights.load>` (the next pass uses both
        ``state`` and ``version``; no pass sees one without the other; the loop runs on while a
        pass in progress is waited for)."""
        await self.weights.load(state, version)

    def policy_attr(self, name: str) -> Any:
        """``getattr_policy``: the attribute ``name`` of the server's own policy (the one that
        acts), read under the lock of forward passes and weight loads (never half-loaded weights);
        the object itself, not a copy. Raises its ``AttributeError``."""
        return self.weights.attr(name)

    @property
    def forward_passes(self) -> int:
        return self.stats.forward_passes

    @property
    def rows_served(self) -> int:
        return self.stats.rows_served

    @property
    def busy(self) -> float:
        """Seconds in forward passes (copies in and out included)."""
        return self.stats.busy

    # -- the end --------------------------------------------------------------------------------
    def stop(self) -> None:
        """End the thread (a forward pass under way finishes first), answer every worker that
        waits that the server stopped, and close the fds and the segment."""
        if self.requests is not None:
            if self.thread is not None:
                self.requests.stop()
                self.thread.join()
        if self.segment is not None:
            self.segment.wake_all(SERVER_STOPPED)
        if self.requests is not None:
            self.requests.close()
            self.requests = None
        if self.thread is not None:
            self.thread.close()
            self.thread = None
        if self.segment is not None:
            self.segment.close()
            self.segment = None


def check_wrapping(config: Any) -> None:
    """``compile_policy`` and ``cudagraph_policy``: ``False``, ``True`` or a dict of keyword
    arguments, for the server's policy only."""
    for name in ("compile_policy", "cudagraph_policy"):
        value = getattr(config, name)
        if not isinstance(value, (bool, dict)) or (isinstance(value, dict) and not all(isinstance(k, str) for k in value)):
            raise ConfigError(f"{name}={value!r} must be False, True or a dict of keyword arguments (str keys)")
    if config.cudagraph_policy is not False:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"cudagraph_policy={config.cudagraph_policy!r} needs the policy on a CUDA device (CUDA graphs), and "
                f"CUDA is not available here; drop cudagraph_policy"
            )


def check_server_config(config: Any) -> None:
    """What ``inference="server"`` needs from the collector's options (raised at construction)."""
    g = config.worker_groups
    if isinstance(g, bool) or g not in (1, 2):
        raise ConfigError(f"worker_groups={g!r} must be 1 or 2")
    if g == 2 and (not isinstance(config.envs_per_worker, int) or config.envs_per_worker % 2):
        raise ConfigError(
            f"worker_groups=2 splits each worker's envs into two equal groups: envs_per_worker={config.envs_per_worker!r} "
            f"must be even; use envs_per_worker={config.envs_per_worker + 1 if isinstance(config.envs_per_worker, int) else 2}"
        )
    k = config.env_batch_size
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ConfigError(
            f"env_batch_size={k!r} must be a positive int (at most the envs of all workers), or None (each forward "
            f"pass serves whoever waits, at once)"
        )
    if config.num_workers == 0:
        raise ConfigError(
            "inference='server' runs the policy in this process for worker processes; with num_workers=0 the "
            "policy runs in this process already: use inference='worker' (the default), or num_workers >= 1"
        )
    if isinstance(config.policy_factory, (list, tuple)):
        raise ConfigError(
            "inference='server' runs one policy for every worker; one policy_factory per worker needs "
            "inference='worker'"
        )
    if config.policy is None and config.policy_factory is None:
        raise ConfigError(
            "inference='server' needs a policy to serve (policy=None samples random actions in the workers: "
            "use inference='worker' for that)"
        )


__all__ = ["InferenceServer", "check_server_config", "check_wrapping"]
