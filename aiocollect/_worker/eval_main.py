"""The evaluator's worker process: runs whole episodes with a replica of the policy and reports
each episode's return and length.

Forked by the launcher (entry ``aiocollect._worker.eval_main:serve``) and talked to over one Unix
socket with the typed messages of :mod:`aiocollect._core.eval_wire` (whose docstring holds the
protocol); weights arrive as a state dict pickled in the :class:`~aiocollect._core.eval_wire.Evaluate`
message. The socket's shell (blocking sends and receives, the serve loop, how a fatal error is
reported) is :mod:`aiocollect._worker.peer`, shared with the rollout workers; making and closing the
envs is :mod:`aiocollect._worker.envs`; the episodes are stepped by the rollout's loop
(:mod:`aiocollect._worker.episodes`, imported once the worker is configured).

With a ``step_timeout`` the worker keeps a heartbeat (:mod:`aiocollect._core.heartbeat`) in the memfd
sent with the config: before each env reset, env step and policy call of an evaluation, and idle
otherwise (while it starts, loads weights or waits for the next request); ``SIGUSR1`` makes
:mod:`faulthandler` write its stack there.

Env calls (``Evaluator.call``, ``set_attr`` ...: a :class:`~aiocollect._core.wire.EnvCall`,
answered with an :class:`~aiocollect._core.wire.EnvCallDone`) are applied between evaluations, by
the rollout workers' own code (:mod:`aiocollect._worker.env_calls`); one that arrives during an
evaluation waits for its end.

An evaluation that fails leaves the worker usable (the next one resets every env). The worker
exits when the parent's end of the socket closes (``shutdown(SHUT_WR)`` is how the evaluator asks
it to stop: it works even in the middle of a message), checking every few milliseconds while it
runs episodes, or when the launcher it was forked from dies (SIGKILL by the parent-death signal).
"""

from __future__ import annotations

import mmap
import os
import socket
import traceback
from typing import Any

from .._core import heartbeat as _heartbeat
from .._core.affinity import apply_cpus
from .envs import add_envs, close_envs
from .._core.errors import ConfigTypeError, SpecError
from .._core.eval_wire import Abort, Aborted, Configure, EvalWorkerConfig, Evaluate, Failed, Hello, Ready, Result
from .._core.wire import EnvCall
from .peer import Peer, _Stop, pack_exception, serve_peer


class _Abort(Exception):
    """The parent gave up on the evaluation in progress."""


def _own_scheduling_group(nice: int) -> None:
    """Make this process a session of its own, at ``nice`` among sessions: Linux's autogroups
    share the CPU between sessions first and apply ``nice`` only within one, so a niceness alone
    would rank the worker below the collector's workers (its session) but not below the training
    loop (the user's). Best effort: without autogroups the plain niceness does it."""
    try:
        os.setsid()
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


class EvalWorker(Peer):
    own_session = True  # a worker process (not a Ray actor, whose process is Ray's)

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        self.envs: list[Any] = []
        self.current: int | None = None  # id of the evaluation in progress
        self.hb: _heartbeat.Heartbeat | None = None  # with a step_timeout
        self.env_calls: list[EnvCall] = []  # env calls that arrived during an evaluation: after it

    def handle(self, msg: Any, fds: list[int]) -> None:
        """A message between steps (see :meth:`Peer.tick`): an abort of the evaluation in
        progress; an env call waits for the evaluation's end (an evaluation runs with the
        settings it started with)."""
        if isinstance(msg, Abort) and msg.id == self.current:
            raise _Abort
        if isinstance(msg, EnvCall):
            self.env_calls.append(msg)

    def answer_env_calls(self) -> None:
        """Apply the env calls received (``Evaluator.call``, ``set_attr`` ...) and answer each
        (what the env raised travels in the answer: the worker goes on)."""
        from .env_calls import answer

        calls, self.env_calls = self.env_calls, []
        for call in calls:
            self.send(answer(self.loop, call))

    # -- set-up -----------------------------------------------------------------------------------
    def setup(self, cfg: EvalWorkerConfig) -> None:
        import cloudpickle

        self.cfg = cfg
        if cfg.nice:
            if self.own_session:
                _own_scheduling_group(cfg.nice)
            os.nice(cfg.nice)
        if self.own_session:  # (a Ray actor's CPUs are Ray's to choose)
            apply_cpus(cfg.cpus, "the evaluator's worker")
        self.obs_space, self.act_space = add_envs(
            self.envs, cfg.num_envs, cfg.env_fn, cfg.env_kwargs, "the evaluator", cfg.registry
        )
        from .episodes import EpisodeRollout  # (the rollout's stepping loop: imported once the worker starts)

        self.loop = EpisodeRollout(cfg, self.envs, self.obs_space, self.act_space)

        self.root: Any = None  # the policy object weights are loaded into
        self.inner: Any = None  # what the runner calls (the root, or its unwrapped module)
        self.initial: dict | None = None  # the weights the policy was built with, once replaced
        self.uses_torch = cfg.policy_mode != "random"
        if self.uses_torch:
            import torch

            # one intra-op thread: the evaluator must not take the training loop's cores; and no
            # autograd in this process at all
            torch.set_num_threads(1)
            torch.set_grad_enabled(False)
            payload = cloudpickle.loads(cfg.policy_payload)
            self.root = payload() if cfg.policy_mode == "factory" else payload
            if isinstance(self.root, torch.nn.Module):
                self.root.eval()  # evaluation: dropout off, batch norm on its running statistics
        # real observations (each env's first episode) to check the env and the policy with
        self.loop.begin(self._build_runner(), self.uses_torch)

    def _build_runner(self) -> Any:
        from .policy import RandomRunner, classify, is_recurrent, make_runner

        loop = self.loop
        if not self.uses_torch:
            return RandomRunner(loop.action_spaces, loop.act_leaves)
        state = self.cfg.recurrent_state
        kind, fn, in_keys, out_keys = classify(self.root, is_recurrent(self.root, state))
        self.inner = fn
        common = (self.act_space, loop.act_leaves, loop.obs_leaves, self.cfg.num_envs)
        return make_runner(kind, fn, in_keys, out_keys, self.cfg.exploration_type, common, state)

    # -- weights ----------------------------------------------------------------------------------
    def load_weights(self, weights: tuple[str, dict] | None) -> None:
        """Load ``(kind, state)`` into the policy; ``None``: the weights it was built with."""
        if weights is None:
            if self.initial is not None:
                self._load(self.initial, "state_dict")
                self.initial = None
            return
        import torch

        if not isinstance(self.root, torch.nn.Module):
            what = "a random policy (policy=None)" if self.root is None else f"a {type(self.root).__name__}"
            raise ConfigTypeError(
                f"weights were given, but the evaluator's policy is {what}, not a torch.nn.Module "
                f"that could load them; pass weights=None, or build the Evaluator with an nn.Module policy"
            )
        if self.initial is None:
            self.initial = {k: v.clone() for k, v in self.root.state_dict().items()}
        kind, state = weights
        self._load(state, kind)

    def _load(self, state: dict, kind: str) -> None:
        import torch

        # the root first; a simple TensorDictModule runs its inner module, whose names lack the
        # "module." prefix: weights of either fit
        targets = [self.root]
        if isinstance(self.inner, torch.nn.Module) and self.inner is not self.root:
            targets.append(self.inner)
        given = set(state)
        mismatch = ""
        for target in targets:
            required = set(target.state_dict().keys())
            allowed = required
            if kind == "params":  # TensorDict.from_module also holds non-persistent buffers
                allowed = required | {name for name, _ in target.named_buffers()}
            missing, unexpected = sorted(required - given), sorted(given - allowed)
            if not missing and not unexpected:
                target.load_state_dict({k: v for k, v in state.items() if k in required})
                return
            if not mismatch:
                mismatch = f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        raise SpecError(
            f"the weights do not fit the evaluator's policy {type(self.root).__name__} ({mismatch}); pass "
            f"the policy module itself, its state_dict() or TensorDict.from_module(policy)"
        )

    # -- episodes ---------------------------------------------------------------------------------
    def evaluate(self, n: int) -> tuple[list[float], list[int]]:
        """Run ``n`` episodes; episode ``j`` starts with ``reset(seed=seed + j)`` on whichever env
        is free, so the results do not depend on the number of envs. The heartbeat is idle again
        when it returns or raises (before the parent hears of it)."""
        self.loop.heartbeat = self.hb  # (set after start-up: by run, or by a Ray actor)
        try:
            return self.loop.run_episodes(n, self.tick)
        finally:
            if self.hb is not None:
                self.hb.idle()

    def take_video(self, number: int) -> Any:
        """record_video: the frames of the evaluation's first episode (``uint8 [T, H, W, 3]``), or,
        with a ``video_dir``, the path of the file written from them (``<video_prefix>_<number>.mp4``)."""
        video = self.loop.video
        frames = video.take() if video is not None else None
        if frames is None or self.cfg.video_dir is None:
            return frames
        from .._core.video import write_video

        return write_video(frames, self.cfg.video_dir, f"{self.cfg.video_prefix}_{number}", self.cfg.video_fps)

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> None:
        import cloudpickle

        self.send(Hello(os.getpid()))
        msg, fds = self.recv()
        try:
            if not isinstance(msg, Configure):  # pragma: no cover - protocol error
                raise RuntimeError(f"the evaluator's worker: expected Configure, got {msg!r:.100}")
            self.setup(cloudpickle.loads(msg.config))
            if fds:  # a step_timeout: from now on (start-up is not watched)
                self.hb = _heartbeat.install(mmap.mmap(fds[0], _heartbeat.NBYTES), fds[0], 0)
        finally:
            for fd in fds:
                os.close(fd)
        self.send(Ready())
        while True:
            self.answer_env_calls()
            msg = self.recv()[0]
            if isinstance(msg, EnvCall):  # between evaluations: applied at once
                self.env_calls.append(msg)
                continue
            if not isinstance(msg, Evaluate):
                continue  # an Abort that came after its evaluation finished
            self.current = rid = msg.id
            try:
                self.load_weights(msg.weights)
                returns, lengths = self.evaluate(msg.episodes)
                video = self.take_video(rid if msg.step is None else msg.step)
            except _Abort:
                self.send(Aborted(rid))
            except (_Stop, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 - reported; the worker stays usable
                self.send(Failed(rid, pack_exception(exc), traceback.format_exc()))
            else:
                self.send(Result(rid, returns, lengths, video))
            finally:
                self.current = None

    def close(self) -> None:
        close_envs(self.envs)


def serve(fd: int) -> None:
    """Run the evaluator's worker on the socket ``fd``; never returns."""
    serve_peer(fd, EvalWorker, EvalWorker.close)
