"""The evaluator's worker process: runs whole episodes with a replica of the policy and reports
each episode's return and length.

Forked by the launcher (entry ``aiocollect._worker.eval_main:serve``) and talked to over one Unix
socket with the typed messages of :mod:`aiocollect._core.eval_wire` (whose docstring holds the
protocol); weights arrive as a state dict pickled in the :class:`~aiocollect._core.eval_wire.Evaluate`
message. The socket's shell (blocking sends and receives, the serve loop, how a fatal error is
reported) is :mod:`aiocollect._worker.peer`, shared with the rollout workers; making and closing the
envs is :mod:`aiocollect._worker.envs`.

With a ``step_timeout`` the worker keeps a heartbeat (:mod:`aiocollect._core.heartbeat`) in the memfd
sent with the config: before each env reset, env step and policy call of an evaluation, and idle
otherwise (while it starts, loads weights or waits for the next request); ``SIGUSR1`` makes
:mod:`faulthandler` write its stack there.

An evaluation that fails leaves the worker usable (the next one resets every env). The worker
exits when the parent's end of the socket closes (``shutdown(SHUT_WR)`` is how the evaluator asks
it to stop: it works even in the middle of a message), checking every few milliseconds while it
runs episodes, or when the launcher it was forked from dies (SIGKILL by the parent-death signal).
"""

from __future__ import annotations

import copy
import math
import mmap
import os
import socket
import traceback
from typing import Any

import numpy as np

from .._core.datachecks import ActionGuard, check_reward, check_value, short
from .._core import heartbeat as _heartbeat
from .._core.affinity import apply_cpus
from .envs import add_envs, close_envs
from .._core.errors import ConfigTypeError, SpecError
from .._core.eval_wire import Abort, Aborted, Configure, EvalWorkerConfig, Evaluate, Failed, Hello, Ready, Result
from .._core.layout import action_leaves, flattener, is_bare, leaf_spaces, observation_leaves
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

    def handle(self, msg: Any, fds: list[int]) -> None:
        """A message between steps (see :meth:`Peer.tick`): only an abort of the evaluation in
        progress matters there."""
        if isinstance(msg, Abort) and msg.id == self.current:
            raise _Abort

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
        self.obs_leaves = observation_leaves(self.obs_space)
        self.act_leaves = action_leaves(self.act_space, cfg.one_hot_actions)
        self.obs_spaces = leaf_spaces(self.obs_space)
        self.flatten_obs = flattener(self.obs_space, "observation")
        self.finite_obs = [k for k, leaf in enumerate(self.obs_leaves) if leaf.np_dtype.kind == "f"] if cfg.check_finite else []
        self.lengths: list[int] = []  # per episode of the evaluation in progress: steps so far
        self.running: dict[int, int] = {}  # env -> its episode in the evaluation in progress
        self.obs = [np.zeros((cfg.num_envs,) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves]
        self.action_spaces = [copy.deepcopy(env.action_space) for env in self.envs]

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
        self.runner = self._build_runner()
        self.guard: ActionGuard | None = None  # for a policy's actions (random ones need none)
        if self.uses_torch:
            from .policy import EnvActions

            env_actions = EnvActions(self.act_space, self.act_leaves)
            guard = ActionGuard(
                self.act_space,
                self.act_leaves,
                [f"eval env {i}" for i in range(cfg.num_envs)],
                lambda arrays: env_actions.per_env(arrays, cfg.num_envs),
                check_finite=cfg.check_finite,
                action_bounds=cfg.action_bounds,
            )
            self.guard = guard if guard.active else None
        for i in range(cfg.num_envs):  # real observations to check the env and the policy with
            self._start_episode(i, i)
        self.runner.probe(self.obs)  # a policy that does not fit fails here, at start (RNG untouched)

    def _build_runner(self) -> Any:
        from .policy import ModuleRunner, RandomRunner, TensorDictRunner, classify

        if not self.uses_torch:
            return RandomRunner(self.action_spaces, self.act_leaves)
        kind, fn, in_keys, out_keys = classify(self.root)
        self.inner = fn
        common = (self.act_space, self.act_leaves, self.obs_leaves, self.cfg.num_envs)
        if kind == "module":
            return ModuleRunner(fn, in_keys, out_keys, *common)
        return TensorDictRunner(fn, self.cfg.exploration_type, *common)

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
    def _start_episode(self, i: int, episode: int) -> None:
        seed = self.cfg.seed
        if self.hb is not None:
            self.hb.begin(_heartbeat.RESET, i)
        obs, _ = self.envs[i].reset(seed=None if seed is None else seed + episode)
        if seed is not None and not self.uses_torch:
            self.action_spaces[i].seed(seed + episode)
        self._set_obs(i, obs)

    def _when(self, i: int) -> str:
        """When env ``i`` takes its next action, or got its reward (for messages)."""
        episode = self.running[i]
        return f"at step {self.lengths[episode] + 1} of episode {episode}"

    def _obs_when(self, i: int) -> str:
        episode = self.running.get(i)
        if episode is None:
            return "returned by reset"
        return f"returned by step {self.lengths[episode]} of episode {episode}"

    def _set_obs(self, i: int, obs: Any) -> None:
        what = f"eval env {i}'s observation"
        if is_bare(self.obs_space):  # (a one-leaf Dict/Tuple obs is a dict/tuple: flattened)
            self.obs[0][i] = check_value(obs, self.obs_leaves[0], what, self.obs_spaces[0])
        else:
            for leaf, space, buf, value in zip(self.obs_leaves, self.obs_spaces, self.obs, self.flatten_obs(obs)):
                buf[i] = check_value(value, leaf, what, space)
        for k in self.finite_obs:
            if not np.isfinite(self.obs[k][i]).all():
                raise SpecError(
                    f"{what} for key {'.'.join(self.obs_leaves[k].key)!r} {self._obs_when(i)} is "
                    f"{short(self.obs[k][i])}: not finite (check_finite=True)"
                )

    def evaluate(self, n: int) -> tuple[list[float], list[int]]:
        """Run ``n`` episodes; episode ``j`` starts with ``reset(seed=seed + j)`` on whichever env
        is free, so the results do not depend on the number of envs. The heartbeat is idle again
        when it returns or raises (before the parent hears of it)."""
        try:
            return self._episodes(n)
        finally:
            if self.hb is not None:
                self.hb.idle()

    def _episodes(self, n: int) -> tuple[list[float], list[int]]:
        cfg = self.cfg
        if self.uses_torch and cfg.seed is not None:
            import torch

            torch.manual_seed(cfg.seed)
        returns = [0.0] * n
        self.lengths = lengths = [0] * n
        self.running = running = {}  # env -> episode
        started = 0
        for i in range(min(len(self.envs), n)):
            self._start_episode(i, started)
            running[i] = started
            started += 1
        max_steps = cfg.max_steps
        guard = self.guard
        hb = self.hb
        while running:
            self.tick()
            if hb is not None:
                hb.begin(_heartbeat.POLICY)
            actions, arrays, _ = self.runner.act(self.obs)
            if guard is not None:  # only the rows of envs that step: the others keep a stale obs
                actions = guard.apply(arrays, actions, self._when, rows=list(running))
            for i, episode in list(running.items()):
                if hb is not None:
                    hb.begin(_heartbeat.STEP, i)
                obs, reward, terminated, truncated, _ = self.envs[i].step(actions[i])
                if not isinstance(reward, (float, int)):
                    reward = check_reward(reward, f"eval env {i}'s reward {self._when(i)}")
                if cfg.check_finite and not math.isfinite(reward):
                    raise SpecError(f"eval env {i}'s reward {self._when(i)} is {reward!r}: not finite (check_finite=True)")
                returns[episode] += float(reward)
                lengths[episode] += 1
                if terminated or truncated or (max_steps is not None and lengths[episode] >= max_steps):
                    if started < n:
                        del running[i]  # the next observation comes from reset
                        self._start_episode(i, started)
                        running[i] = started
                        started += 1
                    else:
                        del running[i]
                else:
                    self._set_obs(i, obs)
        return returns, lengths

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
            msg = self.recv()[0]
            if not isinstance(msg, Evaluate):
                continue  # an Abort that came after its evaluation finished
            self.current = rid = msg.id
            try:
                self.load_weights(msg.weights)
                returns, lengths = self.evaluate(msg.episodes)
            except _Abort:
                self.send(Aborted(rid))
            except (_Stop, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 - reported; the worker stays usable
                self.send(Failed(rid, pack_exception(exc), traceback.format_exc()))
            else:
                self.send(Result(rid, returns, lengths))
            finally:
                self.current = None

    def close(self) -> None:
        close_envs(self.envs)


def serve(fd: int) -> None:
    """Run the evaluator's worker on the socket ``fd``; never returns."""
    serve_peer(fd, EvalWorker, EvalWorker.close)
