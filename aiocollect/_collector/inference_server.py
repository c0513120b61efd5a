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
:meth:`InferenceServer.load` changes. ``update_weights`` matches what it is given against the
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

import contextlib
import logging
import os
import select
import threading
import time
from typing import Any

import numpy as np

from .._core import shm as _shm
from .._core.errors import ConfigError
from .._core.layout import Leaf
from .._worker.inference_client import ACTIONS_READY, REQUEST, SERVER_STOPPED, ServerLayout

log = logging.getLogger("aiocollect")

_FLAGS = os.EFD_CLOEXEC | os.EFD_NONBLOCK

SERVE_IN = "thread"  # or "loop": benchmarks/inference.py --serve-in measures both (docs/inference.md)


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
    default never lets collection stall."""

    WINDOW = 3.0
    SHARE = 0.6

    def __init__(self, server: "InferenceServer", fall_back: bool = False) -> None:
        self.server = server
        self.fall_back = fall_back
        try:  # (closed once it has warned: it warns once)
            self.fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:  # pragma: no cover - no schedstat (a kernel without it): nothing to watch
            self.fd = None
        self.t0, self.wait0, self.passes0 = time.monotonic(), self._waited(), server.forward_passes

    def _waited(self) -> float:
        if self.fd is None:
            return 0.0
        return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9

    def check(self) -> None:
        now = time.monotonic()
        if self.fd is None or now - self.t0 < self.WINDOW:
            return
        waited, passes = self._waited(), self.server.forward_passes
        share = (waited - self.wait0) / (now - self.t0)
        if share > self.SHARE and self.fall_back:
            self.close()
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            log.info(
                "aiocollect: the inference server's thread (server_priority='auto': SCHED_IDLE) waited for a CPU %.0f%% "
                "of the last %.0f s; it runs at normal priority from now on, so that collection is not held back by "
                "this machine's busy cores", share * 100, now - self.t0,
            )
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


class InferenceServer:
    """Serves one run's workers: ``seats`` of ``rows`` env rows each (a seat is a worker, or one
    of its ``worker_groups`` groups of envs, with its own request and answer). Made once the
    workers reported their spaces; :meth:`probe` finds the policy's extra outputs (they are part
    of the batch layout), :meth:`start` starts the thread, :meth:`stop` ends it and wakes every
    waiting worker."""

    def __init__(self, policy: Any, spec: dict, seats: int, rows: int, exploration_type: str,
                 device: Any = None, compile_policy: Any = False, cudagraph_policy: Any = False,
                 env_batch_size: int | None = None, priority: str = "normal", state: tuple = (),
                 weights: str = "copy", out_keys: Any = None) -> None:
        from .._worker.policy import PolicySpec, build_runner

        self.device = _place(policy, device)  # where the forward passes run
        policy = self.policy = own_policy(policy, device, weights)
        self.seats, self.rows = seats, rows
        self.obs_leaves: list[Leaf] = spec["obs"]
        self.act_leaves: list[Leaf] = spec["act"]
        self.act_space = spec["act_space"]
        named: dict[str, Any] = {} if out_keys is None else {"out_keys": out_keys}  # policy_out_keys
        local = PolicySpec("local", exploration_type=exploration_type, state=state, **named)
        self._build = lambda n: _served(build_runner(  # a runner per number of rows served at once
            local, self.act_space, self.act_leaves, self.obs_leaves, n, [], policy
        ))
        self._runners: dict[int, Any] = {}
        self.memory: Any = None  # a recurrent policy: one state row per env served (seat * rows + row)
        self._extra_keys: list[Any] = []
        self.compile, self.cudagraph = compile_policy, cudagraph_policy
        # env_batch_size: a pass waits for this many rows, or for every worker that may still ask
        self.min_rows = env_batch_size
        if env_batch_size is not None and env_batch_size > seats * rows:
            raise ConfigError(
                f"env_batch_size={env_batch_size} but the workers have {seats * rows} envs in all (each sub-env of a "
                f"vector env counts); use at most {seats * rows}"
            )
        self._pending: set[int] = set()  # seats whose request is not answered yet
        self._idle = set(range(seats))  # seats between batches (their worker says so: IDLE)
        self._compiled: Any = None
        # the tensors update_weights loads into (by name, as the workers' weight layout names them)
        self.weights: dict[str, Any] = weight_tensors(policy)
        self.weights_layout: Any = None
        if self.weights:
            from .._worker.weights import WeightLayout

            self.weights_layout = WeightLayout.of(self.weights)
        if cudagraph_policy is not False and (self.device is None or self.device.type != "cuda"):
            raise ConfigError(
                f"cudagraph_policy={cudagraph_policy!r} needs the policy on a CUDA device (CUDA graphs); the server's "
                f"policy runs on {self.device or 'the CPU'}: pass policy_device='cuda', or drop cudagraph_policy"
            )
        self.cuda = self.device is not None and self.device.type == "cuda"
        if self.cuda:
            import torch

            self.stream = torch.cuda.Stream(self.device)  # the server's own: never the user's default stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # (the copy of the weights made above)
            self._pinned: dict[tuple, Any] = {}
            self._pinned_uses: dict[tuple, int] = {}  # this pass's inputs staged, per shape and dtype
        self.version = 0
        self.forward_passes = 0
        self.rows_served = 0
        self.busy = 0.0  # seconds in forward passes (copies in and out included)
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # held by each forward pass and by weight loads
        self.layout: ServerLayout | None = None
        self.segment: tuple[int, Any] | None = None
        self.req_fds: list[int] = []
        self.resp_fds: list[int] = []
        self._stop_fd = -1
        self.failed_fd = -1  # readable once the policy failed (the run's task waits on it)
        self._thread: threading.Thread | None = None
        self.priority = priority  # "idle": the thread runs under SCHED_IDLE; "auto": so, until it starves
        self._poller: Any = None
        self.in_loop = False

    def _runner(self, n: int) -> Any:
        """The runner for a pass over ``n`` rows (called once at the start of every pass)."""
        if self.cuda:
            self._pinned_uses.clear()  # a new pass: its inputs take the staging buffers from the first
        runner = self._runners.get(n)
        if runner is None:
            runner = self._runners[n] = self._new_runner(n)
            if hasattr(runner, "extra_keys"):  # the outputs found by probe()
                runner.extra_keys = list(self._extra_keys)
        return runner

    def _new_runner(self, n: int) -> Any:
        runner = self._build(n)
        if getattr(runner, "memory", None) is not None:  # (every runner carries the server's rows)
            from .._worker.recurrent import RecurrentMemory

            if self.memory is None:
                self.memory = RecurrentMemory(runner.memory.leaves, self.seats * self.rows)
            runner.memory, runner.is_init = self.memory, None
            runner.state_rows = np.arange(n)  # (probes and warm-ups: the first rows; a pass sets its own)
        if self.cuda:
            runner._from_numpy = self._to_device
        if self.compile is not False or self.cudagraph is not False:
            attr = "module" if hasattr(runner, "module") else "policy"  # (ModuleRunner, TensorDictRunner)
            setattr(runner, attr, self._wrap(getattr(runner, attr)))
        return runner

    def _wrap(self, fn: Any) -> Any:
        """``compile_policy``: one ``torch.compile`` of the policy, shared by every runner (new
        numbers of rows recompile, during the warm-up); ``cudagraph_policy``: tensordict's
        ``CudaGraphModule`` per runner (a graph per input shape)."""
        import torch

        if self.compile is not False:
            if self._compiled is None:
                self._compiled = torch.compile(fn, **(self.compile if isinstance(self.compile, dict) else {}))
            fn = self._compiled
        if self.cudagraph is not False:
            from tensordict.nn import CudaGraphModule

            fn = CudaGraphModule(fn, **(self.cudagraph if isinstance(self.cudagraph, dict) else {}))
        return fn

    def warm_up(self) -> None:
        """``compile_policy``/``cudagraph_policy``: one forward pass (twice for a graph's own
        warm-up and capture) for each number of rows a pass can have, before collection starts
        (not counted in it), leaving torch's random state as it was."""
        if self.compile is False and self.cudagraph is False:
            return
        import torch

        passes = 3 if self.cudagraph is not False else 1
        self._runner(self.rows)  # (a recurrent policy's memory: kept as it was)
        kept = None if self.memory is None else self.memory.saved()
        with torch.no_grad(), torch.random.fork_rng(devices=[self.device] if self.cuda else []), self._on_stream():
            for k in range(1, self.seats + 1):
                zeros = [np.zeros((k * self.rows,) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves]
                for _ in range(passes):
                    self._runner(k * self.rows).act(zeros)
        if kept is not None:
            self.memory.restore(kept)

    def _to_device(self, arr: np.ndarray) -> Any:
        """CUDA: observations into page-locked memory (one buffer per input of a pass, by shape,
        dtype and order: two inputs of one shape in a pass must not share a buffer, whose copy to
        the device may still be pending; reused across passes: the previous pass's copies are
        complete, since each pass ends by waiting for its outputs on the same stream), then to
        the device without blocking, on the server's stream."""
        import torch

        shape_key = (arr.shape, arr.dtype.str)
        nth = self._pinned_uses.get(shape_key, 0)
        self._pinned_uses[shape_key] = nth + 1
        key = shape_key + (nth,)
        pinned = self._pinned.get(key)
        if pinned is None:
            pinned = self._pinned[key] = torch.empty(arr.shape, dtype=torch.from_numpy(arr[:0]).dtype, pin_memory=True)
        pinned.copy_(torch.from_numpy(arr))
        return pinned.to(self.device, non_blocking=True)

    # -- set-up ---------------------------------------------------------------------------------
    def probe(self) -> list[Leaf]:
        """The policy's extra outputs (``sample_log_prob``, ``logits``, values ...) per env row,
        from one forward pass over zero observations of one worker's rows (as a worker probes its
        own policy); the policy's errors surface here, before anything starts."""
        zeros = [np.zeros((self.rows,) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves]
        import torch

        with torch.no_grad(), self._on_stream():
            extras = list(self._runner(self.rows).probe(zeros))  # (probe sets that runner's extra keys)
        self._extra_keys = [leaf.key for leaf in extras]  # (and every runner made after it gets them)
        return extras

    def allocate(self, extras: list[Leaf]) -> None:
        """The shared segment and the eventfds (every worker's, kept for replacements)."""
        self.layout = ServerLayout(tuple(self.obs_leaves), tuple(self.act_leaves), tuple(extras), self.seats, self.rows,
                                   signal_idle=self.min_rows is not None, recurrent=self.memory is not None)
        self.segment = _shm.allocate(self.layout.nbytes, f"aiocollect-{os.getpid()}-server")
        self.obs, self.act, self.extras, self.versions = self.layout.arrays(self.segment[1])
        self.init_req = self.obs.pop() if self.memory is not None else None  # [seats, rows]: is_init per request
        self.req_fds = [os.eventfd(0, _FLAGS) for _ in range(self.seats)]
        self.resp_fds = [os.eventfd(0, _FLAGS) for _ in range(self.seats)]
        self._stop_fd = os.eventfd(0, _FLAGS)
        self.failed_fd = os.eventfd(0, _FLAGS)

    def link(self, worker: int, groups: int = 1) -> tuple[ServerLayout, tuple[int, ...]]:
        """What worker ``worker`` is given (its duplicates of the fds travel with its slots): the
        layout, and the segment's descriptor, then its seats' request and response descriptors
        (one pair per group of its envs)."""
        assert self.layout is not None and self.segment is not None
        fds = [self.segment[0]]
        for seat in range(worker * groups, (worker + 1) * groups):
            # a replacement starts afresh: no request of its predecessor is left (an answer to one
            # the server took already is drained by the replacement when it connects)
            try:
                os.eventfd_read(self.req_fds[seat])
            except BlockingIOError:
                pass
            fds += [self.req_fds[seat], self.resp_fds[seat]]
        return self.layout, tuple(fds)

    def start(self) -> None:
        """Start serving: in a thread of its own (``SERVE_IN="thread"``, the default), or as
        the run's task on the event loop (``"loop"``, kept to measure the choice against)."""
        self._poller = select.epoll()
        for fd in self.req_fds:
            self._poller.register(fd, select.EPOLLIN)
        self._poller.register(self._stop_fd, select.EPOLLIN)
        self._by_fd = {fd: w for w, fd in enumerate(self.req_fds)}
        self.in_loop = SERVE_IN == "loop"
        if not self.in_loop:
            self._thread = threading.Thread(target=self._serve, name="aiocollect inference server", daemon=True)
            self._thread.start()

    # -- serving --------------------------------------------------------------------------------
    def _serve(self) -> None:
        import torch

        watch = None
        if self.priority in ("idle", "auto"):  # (this thread only: Linux schedules threads one by one)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            watch = StarvationWatch(self, fall_back=self.priority == "auto")
        try:
            with torch.no_grad():
                while self._serve_ready(timeout=-1):
                    if watch is not None:
                        watch.check()
        except BaseException as exc:  # noqa: BLE001 - the policy failed: the run ends with it
            self.error = exc
            os.eventfd_write(self.failed_fd, 1)  # the run raises it and stops the workers (they wait meanwhile)
        finally:
            if watch is not None:
                watch.close()

    def _serve_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (-1: until something happens) for requests; answer
        those waiting with one forward pass: at once, or with ``env_batch_size`` once they hold
        that many env rows or every other worker is between batches. False once asked to stop."""
        pending, idle = self._pending, self._idle
        for fd, _ in self._poller.poll(timeout):
            if fd == self._stop_fd:
                return False
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
            self._serve_workers(ready)
        return True

    def _serve_workers(self, ready: list[int]) -> None:
        """One forward pass over the rows of the workers ``ready`` (sorted); their answers."""
        rows = self.rows
        whole = len(ready) == self.seats
        if whole:  # every worker asked: their rows are one contiguous array already
            inputs = [a.reshape((-1,) + a.shape[2:]) for a in self.obs]
        else:
            inputs = [np.concatenate([a[w] for w in ready]) for a in self.obs]
        t0 = time.perf_counter()
        with self.lock, self._on_stream():
            version = self.version
            # (on CUDA the outputs come back with a copy that waits for the pass: the thread waits
            # outside the GIL, the event loop runs meanwhile)
            runner = self._runner(rows * len(ready))
            if self.memory is not None:  # the state rows of these seats, and which start an episode
                assert self.init_req is not None
                runner.state_rows = None if whole else np.concatenate([np.arange(w * rows, (w + 1) * rows) for w in ready])
                runner.state_init = self.init_req.reshape(-1) if whole else np.concatenate([self.init_req[w] for w in ready])
            _, act_arrays, extras = runner.act(inputs)
            for i, w in enumerate(ready):
                part = slice(i * rows, (i + 1) * rows)
                for dst, arr in zip(self.act, act_arrays):
                    dst[w] = arr[part]
                for dst, arr in zip(self.extras, extras):
                    dst[w] = arr[part]
                self.versions[w] = version
        self.busy += time.perf_counter() - t0
        self.forward_passes += 1
        self.rows_served += rows * len(ready)
        for w in ready:
            os.eventfd_write(self.resp_fds[w], ACTIONS_READY)

    def _on_stream(self) -> Any:
        """CUDA: the server's own stream, which never waits on the trainer's streams (its weights
        are its own: only :meth:`load` orders it after the caller's work)."""
        if not self.cuda:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.stream(self.stream)

    def _wake_all(self, answer: int) -> None:
        for fd in self.resp_fds:
            try:
                os.eventfd_write(fd, answer)
            except OSError:
                pass

    async def watch(self) -> None:
        """The run's task for the server: raises the policy's error if a forward pass fails."""
        import anyio

        if self.in_loop:  # serving on the loop: woken by the epoll set of every request
            try:
                while True:
                    await anyio.wait_readable(self._poller.fileno())
                    self._serve_ready(timeout=0)  # (the runners disable autograd per forward pass)
            except Exception as exc:
                self.error = exc
        else:
            await anyio.wait_readable(self.failed_fd)
        assert self.error is not None
        error = self.error
        if hasattr(error, "add_note"):
            error.add_note("(raised by the policy in the collector's inference server, inference='server')")
        raise error

    # -- weights --------------------------------------------------------------------------------
    def load(self, state: dict[str, Any], version: int) -> None:
        """``update_weights``: copy ``state`` (tensors keyed as :attr:`weights` names them, all
        or some of them, already matched by the weight sync) into the server's weights and make
        ``version`` theirs, in one hold of the lock under which forward passes run: the next pass
        uses both, no pass sees one without the other. On CUDA the copies are queued on the
        server's stream after what the caller queued on its current stream, and the caller's
        stream waits for them before anything it queues next (an in-place optimizer step cannot
        change a tensor while it is copied). Tensors the server runs itself
        (``server_weights="shared"``) are not copied onto themselves."""
        import torch

        with self.lock:
            if self.cuda:
                caller = torch.cuda.current_stream(self.device)
                self.stream.wait_stream(caller)
            with torch.no_grad(), self._on_stream():
                for name, value in state.items():
                    own = self.weights[name]
                    if value.data_ptr() != own.data_ptr() or value.device != own.device:
                        # (asynchronous from a device tensor only: a host tensor the caller changes
                        # right after this returns must have been read already)
                        own.copy_(value, non_blocking=value.is_cuda)
            if self.cuda:
                done = torch.cuda.Event()
                done.record(self.stream)
                caller.wait_event(done)
            self.version = version

    def policy_attr(self, name: str) -> Any:
        """``getattr_policy``: the attribute ``name`` of the server's own policy (the one that
        acts), read under the lock of forward passes and weight loads (never half-loaded weights);
        the object itself, not a copy. Raises its ``AttributeError``."""
        with self.lock:
            return getattr(self.policy, name)

    # -- the end --------------------------------------------------------------------------------
    def stop(self) -> None:
        """End the thread (a forward pass under way finishes first), answer every worker that
        waits that the server stopped, and close the fds and the segment."""
        if self._thread is not None:
            os.eventfd_write(self._stop_fd, 1)
            self._thread.join()
            self._thread = None
        self._wake_all(SERVER_STOPPED)
        if self._poller is not None:
            self._poller.close()
            self._poller = None
        for fd in self.req_fds + self.resp_fds + [fd for fd in (self._stop_fd, self.failed_fd) if fd >= 0]:
            os.close(fd)
        self.req_fds, self.resp_fds, self._stop_fd, self.failed_fd = [], [], -1, -1
        if self.segment is not None:
            os.close(self.segment[0])
            self.obs = self.act = self.extras = []
            self.versions = None  # type: ignore[assignment]
            self.segment = None  # (unmapped once no view refers to it)


def _place(policy: Any, device: Any) -> Any:
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


def _served(runner: Any) -> Any:
    """A runner whose actions go back to workers as arrays (no per-env conversion here)."""
    runner.env_actions = _Arrays()
    return runner


class _Arrays:
    def per_env(self, arrays: list[np.ndarray], num_envs: int) -> None:
        return None


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
