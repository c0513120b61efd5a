"""The rollout engine: steps a worker's envs with the policy and writes frames in place into a
batch slot. Runs in worker processes, or in the collector's process for the local backend.

Imported by worker processes: numpy and gymnasium only (torch through the policy runner).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Any, Callable, Iterator, Sequence

import gymnasium as gym
import numpy as np

from .._core.datachecks import ActionBounds, ActionGuard, check_reward, check_value, first_nonfinite, short
from .envs import add_envs, close_envs
from .._core.errors import SpecError
from .._core.heartbeat import POLICY, RESET, STEP
from .._core.layout import Key, Leaf, action_leaves, flattener, is_bare, leaf_spaces, observation_leaves
from .policy import EnvActions, PolicySpec, RandomRunner, build_runner
from .._core.wire import BatchInfo, Episodes


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Settings one worker's rollout needs (picklable, sent to each worker)."""

    env_fn: Any  # a gymnasium id (str) or a callable returning a gymnasium.Env
    env_kwargs: dict
    policy: PolicySpec
    worker: int
    envs_per_worker: int
    total_envs: int
    frames_per_env: int
    seed: int | None = None
    static_seed: bool = False
    max_frames_per_traj: int | None = None
    random_steps: int = 0
    reset_at_each_iter: bool = False
    traj_counters: tuple[int, ...] | None = None  # per global env: next trajectory number
    profile: tuple[dict, str] | None = None  # (ProfileConfig.for_worker(), trace path) or None
    restart: int = 0  # how many times this worker was replaced (seeds are derived from it)
    registry: tuple = ()  # _registry.snapshot() of the collector's process, installed before the envs are made
    check_finite: bool = False  # SpecError on NaN/inf in observations, rewards and policy actions
    action_bounds: ActionBounds = "pass"  # Box actions outside their bounds: "pass", "clip" or "error"
    worker_groups: int = 1  # server inference: groups of envs that alternate (see _groups)
    ahead: bool = False  # server inference: ask for the next step's actions as soon as its obs are final
    cpus: tuple[int, ...] | None = None  # worker_cpus: the CPUs this worker runs on (None: the kernel's choice)
    one_hot_actions: bool = False  # categorical_action_encoding=False: a Discrete action stored one-hot


def derived_seed(seed: int, env: int, restart: int) -> int:
    """The seed of global env ``env`` in the ``restart``-th replacement of its worker."""
    return int(np.random.SeedSequence([seed & (2**63 - 1), env, restart]).generate_state(1, np.uint32)[0])


def write_traj_ids(traj_buf: np.ndarray, ends: np.ndarray, first_traj: np.ndarray, total_envs: int) -> None:
    """Fill ``traj_buf`` (``[E, T]``) from each row's first id and its episode ends (``[E, T]``):
    a new trajectory starts after each end, and ids advance by ``total_envs`` each time."""
    traj_buf[:, 0] = first_traj
    np.cumsum(ends[:, :-1], axis=1, out=traj_buf[:, 1:])
    traj_buf[:, 1:] *= total_envs
    traj_buf[:, 1:] += first_traj[:, None]


def write_step_counts(views: dict[Key, np.ndarray], ends: np.ndarray, start_len: np.ndarray) -> None:
    """``max_frames_per_traj``: fill ``step_count`` and ``("next", "step_count")`` (``[E, T, 1]``,
    as TorchRL's ``StepCounter``: the frames of the trajectory before the step, and after it) from
    each row's trajectory length at the batch's start (``start_len``) and its episode ends
    (``[E, T]``). Nothing to do where the layout has no step counts."""
    step_buf = views.get(("step_count",))
    if step_buf is None:
        return
    E, T = ends.shape
    steps = np.arange(T, dtype=np.int64)
    # per frame: the batch step at which its trajectory started (-start_len: before the batch)
    start = np.empty((E, T), np.int64)
    start[:, 0] = -np.asarray(start_len, dtype=np.int64)
    start[:, 1:] = np.where(ends[:, :-1], steps[1:], start[:, :1])
    np.maximum.accumulate(start, axis=1, out=start)
    step_buf[..., 0] = steps - start
    views[("next", "step_count")][..., 0] = step_buf[..., 0] + 1


class Rollout:
    """Steps ``envs_per_worker`` envs; :meth:`fill` writes one batch into a slot's arrays."""

    def __init__(self, cfg: RolloutConfig, local_policy: Any = None, env: gym.Env | None = None) -> None:
        self.cfg = cfg
        self.envs: list[gym.Env] = [] if env is None else [env]  # (``env``: the first, made already)
        try:
            self.obs_space, self.act_space = add_envs(
                self.envs, cfg.envs_per_worker - len(self.envs), cfg.env_fn, cfg.env_kwargs, f"worker {cfg.worker}",
                cfg.registry,
            )
            self._setup(local_policy)
        except BaseException:
            self.close()
            raise

    def _setup(self, local_policy: Any) -> None:
        cfg = self.cfg
        E = cfg.envs_per_worker
        self.obs_leaves: list[Leaf] = observation_leaves(self.obs_space)
        self.act_leaves: list[Leaf] = action_leaves(self.act_space, cfg.one_hot_actions)
        self.obs_spaces = leaf_spaces(self.obs_space)
        self.flatten_obs = flattener(self.obs_space, "observation")
        self.single_obs = is_bare(self.obs_space)  # (a one-leaf Dict/Tuple obs is a dict/tuple: flattened)
        self.obs_dtype0 = self.obs_leaves[0].np_dtype
        self.env_ids = [cfg.worker * E + i for i in range(E)]
        # float leaves to scan for NaN/inf after each step (integers cannot hold them)
        self.finite_obs = [k for k, leaf in enumerate(self.obs_leaves) if leaf.np_dtype.kind == "f"] if cfg.check_finite else []
        self.steps = 0

        seeds = self._seeds()
        self.action_spaces = []
        for env, seed in zip(self.envs, seeds):
            space = copy.deepcopy(env.action_space)
            space.seed(seed)
            self.action_spaces.append(space)
        counters = cfg.traj_counters
        self.traj_k = np.array([counters[g] if counters else 0 for g in self.env_ids], dtype=np.int64)
        self.cur_traj = self.traj_k * cfg.total_envs + np.asarray(self.env_ids, dtype=np.int64)
        self.cur_obs = [np.zeros((E,) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves]
        self.ep_ret = [0.0] * E
        self.ep_len = [0] * E
        env_actions = EnvActions(self.act_space, self.act_leaves)
        guard = ActionGuard(
            self.act_space,
            self.act_leaves,
            [f"env {g}" for g in self.env_ids],
            lambda arrays: env_actions.per_env(arrays, E),
            check_finite=cfg.check_finite,
            action_bounds=cfg.action_bounds,
        )
        self.guard = guard if guard.active else None  # for the policy's actions, not random ones
        for i, (env, seed) in enumerate(zip(self.envs, seeds)):
            obs, _ = env.reset(seed=seed)
            self._set_obs(i, obs, checked=True)
        self._build_policy(local_policy, E, cfg.total_envs)

    def _build_policy(self, local_policy: Any, num_envs: int, total_envs: int) -> None:
        """The policy's runner for ``num_envs`` rows (its torch seed comes after the seeds of all
        ``total_envs`` envs), the random runner, and the weight reader."""
        cfg = self.cfg
        if cfg.policy.kind not in ("random", "server") and local_policy is None:
            import torch

            # one intra-op thread per worker: workers are the parallelism, not torch's pool; and
            # no autograd in a worker process at all (cheaper than a no_grad context per step)
            torch.set_num_threads(1)
            torch.set_grad_enabled(False)
            if cfg.seed is not None:
                torch.manual_seed(
                    derived_seed(cfg.seed, total_envs + cfg.worker, cfg.restart) if cfg.restart
                    else cfg.seed + total_envs + cfg.worker
                )
        self.random_runner = RandomRunner(self.action_spaces, self.act_leaves)
        self.runner = build_runner(
            cfg.policy, self.act_space, self.act_leaves, self.obs_leaves, num_envs, self.action_spaces, local_policy
        )
        self.extra_leaves = self.runner.probe(self.cur_obs)
        self.batches = 0
        self.heartbeat: Any = None  # a _heartbeat.Heartbeat when the collector watches for hangs
        model = getattr(self.runner, "model", None)
        if model is not None:
            from .weights import WeightReader

            self.weights: Any = WeightReader(model)
        else:
            self.weights = None

    @property
    def version(self) -> int:
        """Of the weights the policy has now (0: those it was built with); with server
        inference, of the server's policy at its last answer."""
        if self.runner.remote:
            return self.runner.version
        return 0 if self.weights is None else self.weights.version

    def connect_server(self, layout: Any, mapping: Any, fds: Sequence[int], sock: Any, drain: Any) -> None:
        """Server inference: the server's segment and this worker's request and response eventfds
        ``fds`` (see :mod:`aiocollect._worker.inference_client`); the policy's extra outputs are the server's."""
        req_fd, resp_fd = fds
        self.runner.connect(layout, mapping, self.cfg.worker, req_fd, resp_fd, sock)
        self.runner.on_socket = drain
        self.extra_leaves = list(layout.extras)

    def _seeds(self) -> list[int | None]:
        cfg = self.cfg
        if cfg.seed is None:
            return [None] * len(self.envs)
        if cfg.static_seed:
            return [cfg.seed] * len(self.envs)
        if cfg.restart:  # a replacement worker: new episodes, still determined by the seed
            return [derived_seed(cfg.seed, g, cfg.restart) for g in self.env_ids]
        return [cfg.seed + g for g in self.env_ids]

    def spec(self) -> dict[str, Any]:
        """What the collector needs to lay out the batch (compared across workers)."""
        spec = {"obs": self.obs_leaves, "act": self.act_leaves, "extras": self.extra_leaves,
                "weights": None if self.weights is None else self.weights.layout}
        if self.runner.remote:  # the server builds the policy's runner for this action space
            spec["act_space"] = self.act_space
        return spec

    def add_store(self, store: Any) -> None:
        """A weight store to read at batch boundaries (the shared one, or this worker's own)."""
        self.weights.add(store)

    def apply_weights(self) -> int | None:
        """At a batch boundary: take the newest complete weights from the stores; returns the
        version if it changed the policy."""
        return None if self.weights is None else self.weights.apply()

    def _set_obs(self, i: int, obs: Any, checked: bool = False, into: list[np.ndarray] | None = None) -> None:
        """Write env ``i``'s observation (returned by ``reset``) into row ``i`` of ``into``
        (default: the carried obs)."""
        bufs = self.cur_obs if into is None else into
        what = f"env {self.env_ids[i]}'s observation"
        if self.single_obs:
            leaf = self.obs_leaves[0]
            if checked or getattr(obs, "dtype", None) is not self.obs_dtype0 or obs.shape != leaf.shape:
                obs = check_value(obs, leaf, what, self.obs_spaces[0])
            bufs[0][i] = obs
        else:
            for leaf, space, buf, value in zip(self.obs_leaves, self.obs_spaces, bufs, self.flatten_obs(obs)):
                buf[i] = check_value(value, leaf, what, space)
        for k in self.finite_obs:
            if not np.isfinite(bufs[k][i]).all():
                self._nonfinite_obs(k, i, bufs[k][i], "returned by reset")

    def _nonfinite_obs(self, k: int, i: int, value: np.ndarray, when: str) -> None:
        leaf = self.obs_leaves[k]
        raise SpecError(
            f"env {self.env_ids[i]}'s observation for key {'.'.join(leaf.key)!r} {when} is "
            f"{short(value)}: not finite (check_finite=True; a float64 value beyond the range of "
            f"{leaf.dtype} is stored as inf too)"
        )

    def _step_text(self, i: int, taken: bool = False) -> str:
        """Names env ``i``'s current step in messages: its number since the collector started and
        in its episode, counted from 1 (``taken``: the episode's count already includes it)."""
        return f"step {self.steps + 1} (step {self.ep_len[i] + (not taken)} of its episode)"

    def _check_finite(self, next_bufs: list[np.ndarray], t: int, rewards: list[float]) -> None:
        """check_finite: the observations and rewards of step ``t`` of this batch."""
        for k in self.finite_obs:
            row = first_nonfinite(next_bufs[k][:, t])
            if row is not None:
                self._nonfinite_obs(k, row, next_bufs[k][row, t], f"returned by {self._step_text(row, taken=True)}")
        for i, reward in enumerate(rewards):
            if not math.isfinite(reward):
                raise SpecError(
                    f"env {self.env_ids[i]}'s reward returned by {self._step_text(i, taken=True)} is "
                    f"{reward!r}: not finite (check_finite=True)"
                )

    def _action_step(self, row: int) -> str:
        return f"at {self._step_text(row)}"

    def _new_traj(self, i: int) -> None:
        self.traj_k[i] += 1
        self.cur_traj[i] = self.traj_k[i] * self.cfg.total_envs + self.env_ids[i]
        self.ep_ret[i] = 0.0
        self.ep_len[i] = 0

    def fill(self, views: dict[Key, np.ndarray], version: int = 0) -> Iterator[None]:
        """Write one batch of ``frames_per_env`` steps into ``views``; yields after each step so
        the driver can check for a stop request (worker) or let its event loop run (local).

        The observation the policy sees at step ``t`` is read from the slot itself: after the envs
        step, ``("next", obs)[:, t]`` is copied to ``obs[:, t + 1]`` in one vectorized copy and
        the rows of envs that were reset are overwritten. At the end, :attr:`episodes` lists the
        episodes that ended in this batch.
        """
        cfg = self.cfg
        envs, E = self.envs, len(self.envs)
        hb = self.heartbeat
        if cfg.reset_at_each_iter and self.batches > 0:
            for i, env in enumerate(envs):
                if hb is not None:
                    hb.begin(RESET, self.env_ids[i])
                obs, _ = env.reset()
                self._new_traj(i)
                self._set_obs(i, obs)
        obs_bufs = [views[leaf.key] for leaf in self.obs_leaves]
        next_bufs = [views[("next",) + leaf.key] for leaf in self.obs_leaves]
        act_bufs = [views[leaf.key] for leaf in self.act_leaves]
        extra_bufs = [views[leaf.key] for leaf in self.extra_leaves]
        rew_buf = views[("next", "reward")]
        term_buf, trunc_buf = views[("next", "terminated")], views[("next", "truncated")]
        traj_buf = views[("collector", "traj_ids")]
        version_buf = views[("collector", "policy_version")]
        version_buf[...] = version
        for buf, carried in zip(obs_bufs, self.cur_obs):
            buf[:, 0] = carried
        first_traj = self.cur_traj.copy()
        first_len = np.asarray(self.ep_len, dtype=np.int64)  # (step counts: frames of each trajectory so far)
        # per-step scalars go to Python lists, written to the slot once per batch (vectorized)
        rew_rows: list[list[float]] = []
        term_rows: list[list[bool]] = []
        trunc_rows: list[list[bool]] = []
        single = self.single_obs
        leaf0, space0, dtype0 = self.obs_leaves[0], self.obs_spaces[0], self.obs_dtype0
        shape0 = leaf0.shape
        next0 = next_bufs[0]
        guard = self.guard
        check_finite = self.cfg.check_finite
        max_len = cfg.max_frames_per_traj
        episodes: list[tuple[int, int, float, int, bool]] = []  # (env, traj id, return, length, terminated)
        ep_ret, ep_len = self.ep_ret, self.ep_len
        T = traj_buf.shape[1]
        clock = time.perf_counter
        policy_time = env_time = 0.0
        t_env = clock()
        for t in range(T):
            obs_t = [buf[:, t] for buf in obs_bufs]
            runner = self.random_runner if self.steps < cfg.random_steps else self.runner
            t_policy = clock()
            env_time += t_policy - t_env
            if hb is not None:
                hb.begin(POLICY)
            env_actions, act_arrays, extras = runner.act(obs_t)
            t_env = clock()
            policy_time += t_env - t_policy
            for buf, arr in zip(act_bufs, act_arrays):
                buf[:, t] = arr
            if runner.remote:  # the version of the server's forward pass for this step
                version_buf[:, t] = runner.version
            if guard is not None and runner is not self.random_runner:
                env_actions = guard.apply(act_arrays, env_actions, self._action_step)
            if extra_bufs:
                if extras:
                    for buf, arr in zip(extra_bufs, extras):
                        buf[:, t] = arr
                else:  # random frames: the policy did not run
                    for buf in extra_bufs:
                        buf[:, t] = 0
            resets = []
            rewards = [0.0] * E
            terms = [False] * E
            truncs = [False] * E
            for i in range(E):
                if hb is not None:
                    hb.begin(STEP, self.env_ids[i])
                obs, reward, terminated, truncated, _ = envs[i].step(env_actions[i])
                if single:
                    # the hot path: an array of the leaf's own dtype and shape is written as is
                    if getattr(obs, "dtype", None) is not dtype0 or obs.shape != shape0:
                        obs = check_value(obs, leaf0, f"env {self.env_ids[i]}'s observation", space0)
                    next0[i, t] = obs
                else:
                    for leaf, space, buf, value in zip(self.obs_leaves, self.obs_spaces, next_bufs, self.flatten_obs(obs)):
                        buf[i, t] = check_value(value, leaf, f"env {self.env_ids[i]}'s observation", space)
                if not isinstance(reward, (float, int)):  # Python floats and ints, np.float64: no check
                    reward = check_reward(reward, f"env {self.env_ids[i]}'s reward at {self._step_text(i)}")
                rewards[i] = reward
                ep_ret[i] += reward
                ep_len[i] += 1
                if max_len is not None and ep_len[i] >= max_len and not terminated:
                    truncated = True
                terms[i] = terminated
                truncs[i] = truncated
                if terminated or truncated:
                    episodes.append((self.env_ids[i], int(self.cur_traj[i]), float(ep_ret[i]), ep_len[i], bool(terminated)))
                    resets.append(i)
            if check_finite:
                self._check_finite(next_bufs, t, rewards)
            rew_rows.append(rewards)
            term_rows.append(terms)
            trunc_rows.append(truncs)
            # the next observation of every env: its next obs, or its reset obs after an episode end
            cur = [buf[:, t + 1] for buf in obs_bufs] if t + 1 < T else self.cur_obs
            for dst, src in zip(cur, next_bufs):
                dst[...] = src[:, t]
            for i in resets:
                if hb is not None:
                    hb.begin(RESET, self.env_ids[i])
                obs, _ = envs[i].reset()
                self._new_traj(i)
                self._set_obs(i, obs, into=cur)
            self.steps += 1
            if cfg.ahead and t + 1 < T and self.steps >= cfg.random_steps:
                self.runner.ahead(cur)  # (worker_groups: computed while the other group steps)
            yield
        env_time += clock() - t_env
        if hb is not None:
            hb.idle()
        self.timing = {"env": env_time, "policy": policy_time}
        rew_buf[..., 0] = np.asarray(rew_rows, dtype=np.float32).T
        term_buf[..., 0] = np.asarray(term_rows, dtype=bool).T
        trunc_buf[..., 0] = np.asarray(trunc_rows, dtype=bool).T
        ends = term_buf[..., 0] | trunc_buf[..., 0]
        write_traj_ids(traj_buf, ends, first_traj, cfg.total_envs)
        write_step_counts(views, ends, first_len)
        self.batches += 1
        self.episodes = Episodes.from_rows(episodes)

    def batch_info(self) -> BatchInfo:
        """What the collector learns with each batch (small, sent over the worker's socket)."""
        return BatchInfo(self.episodes, self.traj_counters, self.timing, self.version)

    def run_batch(self, views: dict[Key, np.ndarray], version: int = 0, tick: Callable[[], None] | None = None) -> Episodes:
        for _ in self.fill(views, version):
            if tick is not None:
                tick()
        if self.runner.remote:
            self.runner.idle()
        return self.episodes

    @property
    def traj_counters(self) -> list[int]:
        """Per env of this worker: the number of the trajectory it is in now."""
        return self.traj_k.tolist()

    def close(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None and runner.remote:
            runner.close()
        close_envs(self.envs)
