"""The parts of the inference server (:class:`~aiocollect._collector.inference_server.InferenceServer`),
each built with what it needs and owning what it allocates until it closes:

- :class:`ServerOptions`: how it runs (the collector's options that concern it);
- :class:`ServerRunners`: the policy's runners, one per number of rows a pass serves, and what
  they share (a recurrent policy's memory, :class:`PinnedStaging` on CUDA, the compiled policy);
- :class:`ServerSegment`: the shared memory and the eventfds the workers ask and are answered through;
- :class:`Requests`: what the serving thread waits on, and when the waiting requests make a pass;
- :class:`ServingThread`, :class:`PassStats` and :class:`StarvationWatch`: the thread, what its
  passes did, and whether ``SCHED_IDLE`` starves it.

The weights it runs are :class:`~aiocollect._collector.server_weights.ServerWeights`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .._core import shm as _shm
from .._core.layout import Key, Leaf
from .._worker.inference_client import ACTIONS_READY, REQUEST, ServerLayout

if TYPE_CHECKING:
    from .._worker.policy import TorchRunner
    from .._worker.recurrent import RecurrentMemory

log = logging.getLogger("aiocollect")

_FLAGS = os.EFD_CLOEXEC | os.EFD_NONBLOCK


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """How the inference server runs: the collector's options that concern it, as the config
    checked them (the fields in the order the server's constructor took them before)."""

    exploration_type: str = "random"
    """tensordict's interaction type of the forward passes (``exploration_type``)."""
    device: Any = None
    """``policy_device``: where the forward passes run (None: where the policy's parameters are)."""
    compile_policy: bool | dict = False
    """``torch.compile`` the policy (a dict: its keyword arguments)."""
    cudagraph_policy: bool | dict = False
    """Run the policy as tensordict's ``CudaGraphModule`` (a dict: its keyword arguments); CUDA only."""
    env_batch_size: int | None = None
    """A pass waits for this many env rows, or for every worker that may still ask (None: serve at once)."""
    priority: str = "normal"
    """The serving thread's priority: ``"normal"``, ``"idle"`` (``SCHED_IDLE``) or ``"auto"``
    (``SCHED_IDLE`` until it starves; ``server_priority`` as the run resolved it)."""
    state: tuple[Leaf, ...] = ()
    """``recurrent_state``: the state a recurrent TensorDict policy carries."""
    weights: str = "copy"
    """``server_weights``: ``"copy"`` (weights of the server's own) or ``"shared"`` (the user's module)."""
    out_keys: Sequence[Any] | None = None
    """``policy_out_keys`` (as the config checked them: keys): the names of a plain module's outputs."""

    @property
    def wraps(self) -> bool:
        """Whether the policy is compiled or run as a CUDA graph (runners warm up before collection)."""
        return self.compile_policy is not False or self.cudagraph_policy is not False


class PassStats:
    """What the server's forward passes did: their number, the env rows they served and the
    seconds they took (copies in and out included)."""

    def __init__(self) -> None:
        self.forward_passes = 0
        self.rows_served = 0
        self.busy = 0.0

    def add(self, rows: int, seconds: float) -> None:
        self.busy += seconds
        self.forward_passes += 1
        self.rows_served += rows


class StarvationWatch:
    """``server_priority="idle"``: the server's thread under ``SCHED_IDLE`` gets only the CPU time
    no other thread wants, and a busy machine (training on the CPU beside the collector) can leave
    it almost none: collection then nearly stops (Pong, 2 workers on 2 cores, a trainer thread
    beside: 22 frames/s against 1,217 at normal priority; ``docs/inference.md``). Checked after
    each wake-up of the thread: when, over a window of :attr:`WINDOW` seconds, it spent more than
    :attr:`SHARE` of the time runnable but waiting for a CPU (its ``run_delay`` in
    ``/proc/thread-self/schedstat``; 25-40% while serving 2 or 4 workers on 2 cores, 70-97% beside
    a busy trainer thread), say so once on the ``aiocollect`` logger, with the way out.

    ``server_priority="auto"`` (``fall_back``): then the thread goes back to normal priority
    (``SCHED_OTHER``) for the rest of the run instead, and says so at the ``INFO`` level: the
    default never lets collection stall. Made in the thread it watches."""

    WINDOW = 3.0
    SHARE = 0.6

    def __init__(self, stats: PassStats, fall_back: bool = False) -> None:
        self.stats = stats
        self.fall_back = fall_back
        try:  # (closed once it has warned: it warns once)
            self.fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:  # pragma: no cover - no schedstat (a kernel without it): nothing to watch
            self.fd = None
        self.t0, self.wait0, self.passes0 = time.monotonic(), self._waited(), stats.forward_passes

    def _waited(self) -> float:
        if self.fd is None:
            return 0.0
        return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9

    def check(self) -> None:
        now = time.monotonic()
        if self.fd is None or now - self.t0 < self.WINDOW:
            return
        waited, passes = self._waited(), self.stats.forward_passes
        share = (waited - self.wait0) / (now - self.t0)
        if share > self.SHARE and self.fall_back:
            self.close()
            log.info(  # (said first: whoever finds the thread at normal priority finds the line too)
                "aiocollect: the inference server's thread (server_priority='auto': SCHED_IDLE) waited for a CPU %.0f%% "
                "of the last %.0f s; it runs at normal priority from now on, so that collection is not held back by "
                "this machine's busy cores", share * 100, now - self.t0,
            )
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            return
        if share > self.SHARE:
            self.close()
            log.warning(
                "aiocollect: the inference server's thread (server_priority='idle') waited for a CPU %.0f%% of the "
                "last %.0f s (%.1f forward passes per second): under SCHED_IDLE it only gets CPU time that no other "
                "thread wants, and something keeps this machine's cores busy (training on the CPU in this process, "
                "other programs), so collection is held back with it. Use server_priority='normal' while the CPUs "
                "are busy (see docs/inference.md)",
                share * 100, now - self.t0, (passes - self.passes0) / (now - self.t0),
            )
            return
        self.t0, self.wait0, self.passes0 = now, waited, passes

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class PinnedStaging:
    """CUDA: observations into page-locked memory, then to ``device`` without blocking, on the
    current stream (the server's). One buffer per input of a pass, by shape, dtype and order: two
    inputs of one shape in a pass must not share a buffer, whose copy to the device may still be
    pending; reused across passes: the previous pass's copies are complete, since each pass ends
    by waiting for its outputs on the same stream."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._pinned: dict[tuple, Any] = {}
        self._uses: dict[tuple, int] = {}  # this pass's inputs staged, per shape and dtype

    def new_pass(self) -> None:
        """A new pass: its inputs take the buffers from the first."""
        self._uses.clear()

    def to_device(self, arr: np.ndarray) -> Any:
        import torch

        shape_key = (arr.shape, arr.dtype.str)
        nth = self._uses.get(shape_key, 0)
        self._uses[shape_key] = nth + 1
        key = shape_key + (nth,)
        pinned = self._pinned.get(key)
        if pinned is None:
            pinned = self._pinned[key] = torch.empty(arr.shape, dtype=torch.from_numpy(arr[:0]).dtype, pin_memory=True)
        pinned.copy_(torch.from_numpy(arr))
        return pinned.to(self.device, non_blocking=True)


class _Arrays:
    """The server's runners give the action arrays back to the workers: no per-env conversion."""

    def per_env(self, arrays: list[np.ndarray], num_envs: int) -> None:
        return None


class ServerRunners:
    """The runners of ``policy`` (the server's own) for the spaces in ``spec``, one per number of
    rows a pass serves (made at the first pass of that size), all sharing what :meth:`TorchRunner.attach
    <aiocollect._worker.policy.TorchRunner.attach>` hands them: a recurrent policy's :attr:`memory`
    (one row per env served, ``rows_served`` in all: seat ``s``'s rows are ``s * rows ...``),
    ``staging`` (CUDA), one ``torch.compile`` of the policy, and the extra outputs :meth:`probe`
    found."""

    def __init__(self, policy: Any, spec: dict, options: ServerOptions, rows_served: int,
                 staging: PinnedStaging | None = None) -> None:
        from .._worker.policy import PolicySpec, build_runner

        self.obs_leaves: list[Leaf] = spec["obs"]
        self.act_leaves: list[Leaf] = spec["act"]
        act_space = spec["act_space"]
        named: dict[str, Any] = {} if options.out_keys is None else {"out_keys": options.out_keys}
        local = PolicySpec("local", exploration_type=options.exploration_type, state=options.state, **named)
        self._build = lambda n: build_runner(local, act_space, self.act_leaves, self.obs_leaves, n, [], policy)
        self._options, self._rows_served, self._staging = options, rows_served, staging
        self._by_rows: dict[int, TorchRunner] = {}
        self.memory: RecurrentMemory | None = None  # a recurrent policy's, once a runner is made
        self.extra_keys: list[Key] = []
        self._compiled: Any = None

    def for_pass(self, n: int) -> TorchRunner:
        """The runner for a pass over ``n`` rows (called once at the start of every pass)."""
        if self._staging is not None:
            self._staging.new_pass()
        runner = self._by_rows.get(n)
        if runner is None:
            runner = self._by_rows[n] = self._new(n)
        return runner

    def _new(self, n: int) -> TorchRunner:
        runner = self._build(n)
        if runner.memory is not None and self.memory is None:
            from .._worker.recurrent import RecurrentMemory

            self.memory = RecurrentMemory(runner.memory.leaves, self._rows_served)
        return runner.attach(
            memory=self.memory, to_device=None if self._staging is None else self._staging.to_device,
            wrap=self._wrap if self._options.wraps else None, extra_keys=self.extra_keys, env_actions=_Arrays(),
        )

    def _wrap(self, fn: Any) -> Any:
        """``compile_policy``: one ``torch.compile`` of the policy, shared by every runner (new
        numbers of rows recompile, during the warm-up); ``cudagraph_policy``: tensordict's
        ``CudaGraphModule`` per runner (a graph per input shape)."""
        import torch

        compile_policy, cudagraph = self._options.compile_policy, self._options.cudagraph_policy
        if compile_policy is not False:
            if self._compiled is None:
                self._compiled = torch.compile(fn, **(compile_policy if isinstance(compile_policy, dict) else {}))
            fn = self._compiled
        if cudagraph is not False:
            from tensordict.nn import CudaGraphModule

            fn = CudaGraphModule(fn, **(cudagraph if isinstance(cudagraph, dict) else {}))
        return fn

    def zeros(self, n: int) -> list[np.ndarray]:
        """Zero observations for ``n`` rows (probes and warm-ups)."""
        return [np.zeros((n,) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves]

    def probe(self, rows: int) -> list[Leaf]:
        """The policy's extra outputs per env row, from one forward pass over zero observations of
        ``rows`` rows (the first rows of the memory, left as they were); every runner made from
        now on writes them."""
        extras = list(self.for_pass(rows).probe(self.zeros(rows)))  # (probe sets that runner's extra keys)
        self.extra_keys[:] = [leaf.key for leaf in extras]
        return extras

    def warm_up(self, sizes: list[int], passes: int) -> None:
        """``passes`` forward passes over zeros for each number of rows in ``sizes``, leaving a
        recurrent policy's memory as it was."""
        self.for_pass(sizes[0])  # (a recurrent policy's memory: made, to be kept as it was)
        kept = None if self.memory is None else self.memory.saved()
        for n in sizes:
            zeros = self.zeros(n)
            for _ in range(passes):
                self.for_pass(n).act(zeros)
        if kept is not None:
            assert self.memory is not None
            self.memory.restore(kept)


class ServerSegment:
    """The shared memory of ``layout`` (requests and answers of every seat, see
    :class:`~aiocollect._worker.inference_client.ServerLayout`) and each seat's request and
    response eventfds; every worker's, kept for its replacements. Closed by :meth:`close`."""

    def __init__(self, layout: ServerLayout) -> None:
        self.layout = layout
        self.fd, mapping = _shm.allocate(layout.nbytes, f"aiocollect-{os.getpid()}-server")
        self._mapping: Any = mapping  # (unmapped once no view refers to it)
        self.obs, self.act, self.extras, self.versions = layout.arrays(mapping)
        self.init_req = self.obs.pop() if layout.recurrent else None  # [seats, rows]: is_init per request
        self.req_fds = [os.eventfd(0, _FLAGS) for _ in range(layout.seats)]
        self.resp_fds = [os.eventfd(0, _FLAGS) for _ in range(layout.seats)]

    def link(self, worker: int, groups: int = 1) -> tuple[ServerLayout, tuple[int, ...]]:
        """What worker ``worker`` is given (its duplicates of the fds travel with its slots): the
        layout, and the segment's descriptor, then its seats' request and response descriptors
        (one pair per group of its envs)."""
        fds = [self.fd]
        for seat in range(worker * groups, (worker + 1) * groups):
            # a replacement starts afresh: no request of its predecessor is left (an answer to one
            # the server took already is drained by the replacement when it connects)
            try:
                os.eventfd_read(self.req_fds[seat])
            except BlockingIOError:
                pass
            fds += [self.req_fds[seat], self.resp_fds[seat]]
        return self.layout, tuple(fds)

    def requests(self, ready: list[int]) -> tuple[list[np.ndarray], np.ndarray | None, np.ndarray | None]:
        """What the seats ``ready`` (sorted) ask: their observations, one array per leaf; for a
        recurrent policy, the rows of the server's memory they are (None: all) and which of them
        start an episode (else None, None)."""
        rows = self.layout.rows
        whole = len(ready) == self.layout.seats
        if whole:  # every seat asked: their rows are one contiguous array already
            inputs = [a.reshape((-1,) + a.shape[2:]) for a in self.obs]
        else:
            inputs = [np.concatenate([a[w] for w in ready]) for a in self.obs]
        if self.init_req is None:
            return inputs, None, None
        if whole:
            return inputs, None, self.init_req.reshape(-1)
        state_rows = np.concatenate([np.arange(w * rows, (w + 1) * rows) for w in ready])
        return inputs, state_rows, np.concatenate([self.init_req[w] for w in ready])

    def write(self, ready: list[int], actions: list[np.ndarray], extras: list[np.ndarray], version: int) -> None:
        """The answers of the seats ``ready``, from a pass over their rows in order."""
        rows = self.layout.rows
        for i, w in enumerate(ready):
            part = slice(i * rows, (i + 1) * rows)
            for dst, arr in zip(self.act, actions):
                dst[w] = arr[part]
            for dst, arr in zip(self.extras, extras):
                dst[w] = arr[part]
            self.versions[w] = version

    def answer(self, seats: list[int], answer: int = ACTIONS_READY) -> None:
        for w in seats:
            os.eventfd_write(self.resp_fds[w], answer)

    def wake_all(self, answer: int) -> None:
        """Answer every seat (``SERVER_STOPPED``), whether it waits or not."""
        for fd in self.resp_fds:
            try:
                os.eventfd_write(fd, answer)
            except OSError:
                pass

    def close(self) -> None:
        """Close the fds; the segment is unmapped once no view refers to it."""
        for fd in self.req_fds + self.resp_fds + [self.fd]:
            os.close(fd)
        self.req_fds, self.resp_fds = [], []
        self.obs = self.act = self.extras = []
        self.versions = self.init_req = None  # type: ignore[assignment]
        self._mapping = None


class Requests:
    """What the server waits on: an epoll set of the seats' request eventfds (``req_fds``) and
    a stop eventfd. Keeps which seats wait for an answer and which are between batches (their
    worker says so: ``IDLE``), and says when the waiting ones make a pass: at once, or with
    ``env_batch_size`` (``min_rows``) once they hold that many env rows (``rows`` per seat) or
    every other seat is between batches. Closed by :meth:`close`."""

    def __init__(self, req_fds: list[int], rows: int, min_rows: int | None) -> None:
        self.rows, self.min_rows, self.seats = rows, min_rows, len(req_fds)
        self._pending: set[int] = set()  # seats whose request is not answered yet
        self._idle = set(range(self.seats))  # seats between batches
        self._stop_fd = os.eventfd(0, _FLAGS)
        self._poller = select.epoll()
        for fd in req_fds:
            self._poller.register(fd, select.EPOLLIN)
        self._poller.register(self._stop_fd, select.EPOLLIN)
        self._by_fd = {fd: w for w, fd in enumerate(req_fds)}

    def fileno(self) -> int:
        """Readable when a request (or the stop) came: serving on the event loop waits on it."""
        return self._poller.fileno()

    def ready(self, timeout: float) -> list[int] | None:
        """Wait up to ``timeout`` seconds (-1: until something happens) for requests; the seats
        to serve now (sorted; often none), or None once asked to stop."""
        pending, idle = self._pending, self._idle
        for fd, _ in self._poller.poll(timeout):
            if fd == self._stop_fd:
                return None
            try:
                signals = os.eventfd_read(fd)  # (IDLE then REQUEST add up: the request is the news)
            except BlockingIOError:
                continue
            w = self._by_fd[fd]
            if signals & REQUEST:
                pending.add(w)
                idle.discard(w)
            else:
                idle.add(w)
        if pending and (
            self.min_rows is None or len(pending) * self.rows >= self.min_rows or len(pending) + len(idle) >= self.seats
        ):
            ready = sorted(pending)
            pending.clear()
            return ready
        return []

    def stop(self) -> None:
        """Make :meth:`ready` say stop (from any thread)."""
        os.eventfd_write(self._stop_fd, 1)

    def close(self) -> None:
        self._poller.close()
        os.close(self._stop_fd)


class ServingThread:
    """The server's thread: runs ``serve(-1)`` (wait, then serve what is ready) until it returns
    False, under ``priority`` (``"idle"``, ``"auto"``: ``SCHED_IDLE``, for this thread only,
    with a :class:`StarvationWatch` over ``stats``). A failure of the policy is kept in
    :attr:`error`, and :attr:`failed_fd` becomes readable (the run's task waits on it). Closed by
    :meth:`close`, once joined."""

    def __init__(self, serve: Callable[[float], bool], priority: str, stats: PassStats) -> None:
        self._serve, self._priority, self._stats = serve, priority, stats
        self.error: BaseException | None = None
        self.failed_fd = os.eventfd(0, _FLAGS)
        self._thread = threading.Thread(target=self._run, name="aiocollect inference server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        """Wait for the thread's end (its caller has asked it to stop: a pass under way finishes first)."""
        if self._thread.ident is not None:
            self._thread.join()

    def _run(self) -> None:
        import torch

        watch = None
        if self._priority in ("idle", "auto"):  # (this thread only: Linux schedules threads one by one)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            watch = StarvationWatch(self._stats, fall_back=self._priority == "auto")
        try:
            with torch.no_grad():
                while self._serve(-1):
                    if watch is not None:
                        watch.check()
        except BaseException as exc:  # noqa: BLE001 - the policy failed: the run ends with it
            self.error = exc
            os.eventfd_write(self.failed_fd, 1)  # the run raises it and stops the workers (they wait meanwhile)
        finally:
            if watch is not None:
                watch.close()

    def close(self) -> None:
        if self.failed_fd >= 0:
            os.close(self.failed_fd)
            self.failed_fd = -1


__all__ = [
    "PassStats", "PinnedStaging", "Requests", "ServerOptions", "ServerRunners", "ServerSegment", "ServingThread",
    "StarvationWatch",
]
