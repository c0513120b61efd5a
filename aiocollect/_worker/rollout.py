"""The rollout engine: steps a worker's envs with the policy and writes frames in place into a
batch slot. Runs in worker processes, or in the collector's process for the local backend.

Imported by worker processes: numpy and gymnasium only (torch through the policy runner).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import gymnasium as gym
import numpy as np

from .._core.datachecks import ActionBounds, ActionGuard, check_reward, check_value, first_nonfinite, short
from .decorrelate import decorrelate, decorrelation_draws
from .env_calls import EnvEpochs
from .envs import add_envs, close_envs
from .._core.errors import SpecError
from .._core.heartbeat import POLICY, RESET, STEP
from .._core.layout import Key, Leaf, action_leaves, flattener, is_bare, leaf_spaces, observation_leaves
from .policy import EnvActions, PolicySpec, RandomRunner, build_runner
from .recurrent import random_step_extras
from .._core.wire import NO_EPISODES, BatchInfo, Episodes


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Settings one worker's rollout needs (picklable, sent to each worker)."""

    env_fn: Any  # a gymnasium id (str) or a callable returning a gymnasium.Env; or a tuple of one per env
    env_kwargs: dict | tuple[dict, ...]  # (a tuple: one per env of the worker)
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
    decorrelation_steps: int = 0  # max_decorrelation_steps: random steps of each env before the first batch
    env_fn_index: tuple[int, ...] | None = None  # per env of the worker: its factory's index in create_env_fn
    env_calls: tuple = ()  # EnvCalls a replacement applies once its envs are made (set_attr, persisted calls)


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


def _copy_transposed(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[e, t] = src[t, e]`` (``dst``: ``[E, T, ...]``, ``src``: ``[T, E, ...]``). A frame's
    leaf of a few elements is moved as one item (a void of its size) where both arrays hold it
    contiguous: numpy copies that several times faster than element by element."""
    size = src.itemsize * int(np.prod(src.shape[2:], dtype=np.int64))
    if src.ndim > 2 and 0 < size <= 256 and _leaf_contiguous(dst) and _leaf_contiguous(src):
        void = np.dtype((np.void, size))
        d = dst.reshape(dst.shape[:2] + (-1,)).view(void)[..., 0]  # (views: the leaves are contiguous)
        s = src.reshape(src.shape[:2] + (-1,)).view(void)[..., 0]
        np.copyto(d, s.swapaxes(0, 1))
    else:
        np.copyto(dst, src.swapaxes(0, 1))


def _leaf_contiguous(a: np.ndarray) -> bool:
    """Whether each ``a[i, j]`` is C-contiguous."""
    stride = a.itemsize
    for dim, step in zip(reversed(a.shape[2:]), reversed(a.strides[2:])):
        if dim != 1 and step != stride:
            return False
        stride *= dim
    return True


_SLOTS_KEPT = 4  # slots whose step views a rollout keeps (a worker has two or three)


class _Staging:
    """Where one batch of ``T`` steps of ``E`` rows is written as the envs step. Rewards and
    flags: time-major buffers (``[T, E]``), written into the slot at the batch's end. Frames
    (observations, actions, extras): time-major buffers too (each step writes contiguous rows,
    and the batch goes into the slot in one copy per key at its end), or, ``in_slot``, the slot
    itself (single envs write a row at a time: no copy at the end). Each step's views are made
    once (once per slot where they are the slot's)."""

    def __init__(
        self, T: int, E: int, obs: list[Leaf], act: list[Leaf], extras: list[Leaf], carried: list[np.ndarray],
        in_slot: bool = False, reward_dtype: Any = np.float32,
    ) -> None:
        def bufs(leaves: list[Leaf]) -> list[np.ndarray]:
            return [np.zeros((T, E) + leaf.shape, leaf.np_dtype) for leaf in leaves]

        self.T, self.in_slot, self.carried = T, in_slot, carried
        self.slots: dict[int, tuple[dict, list[tuple]]] = {}  # in_slot: id(views) -> (views, its steps)
        self.rew = np.zeros((T, E), reward_dtype)
        self.term = np.zeros((T, E), bool)
        self.trunc = np.zeros((T, E), bool)
        self.done = np.zeros((T, E), bool)  # terminated | truncated (with max_frames_per_traj's cuts)
        self.sums = np.zeros((T, E), np.float64)  # running sums of the rewards (episode returns)
        if not in_slot:
            self.obs, self.next, self.act, self.extras = bufs(obs), bufs(obs), bufs(act), bufs(extras)
            self.steps = self._steps(self.obs, self.act, self.extras, self.next, time_major=True)

    def _steps(
        self, obs: list[np.ndarray], act: list[np.ndarray], extras: list[np.ndarray], nxt: list[np.ndarray],
        time_major: bool,
    ) -> list[tuple]:
        """Per step: obs, actions, extras, next obs, the obs of the step after (after the last
        step: the rollout's carried obs), reward, terminated, truncated, done."""
        T = self.T

        def at(bufs: list[np.ndarray], t: int) -> list[np.ndarray]:
            return [b[t] for b in bufs] if time_major else [b[:, t] for b in bufs]

        return [
            (
                at(obs, t), at(act, t), at(extras, t), at(nxt, t), at(obs, t + 1) if t + 1 < T else self.carried,
                self.rew[t], self.term[t], self.trunc[t], self.done[t],
            )
            for t in range(T)
        ]

    def stop_after(self, t: int, cur: list[np.ndarray], carried: list[np.ndarray]) -> None:
        """The batch stops after step ``t`` (no row has anything left to do): the steps after it
        hold no reward and no episode end, and ``cur`` (the observation after step ``t``) is
        carried."""
        for buf in (self.rew, self.term, self.trunc, self.done):
            buf[t + 1:] = 0
        if cur is not carried:
            for dst, src in zip(carried, cur):
                dst[...] = src

    def slot_steps(self, views: dict[Key, np.ndarray], obs: list[Leaf], act: list[Leaf], extras: list[Leaf]) -> list[tuple]:
        """``in_slot``: each step's views of the slot ``views``, made once per slot (a worker
        fills the same few slots, each a dict of the same arrays, over and over; the last
        :data:`_SLOTS_KEPT` are kept)."""
        kept = self.slots.get(id(views))
        if kept is not None and kept[0] is views:
            return kept[1]
        steps = self._steps(
            [views[leaf.key] for leaf in obs], [views[leaf.key] for leaf in act], [views[leaf.key] for leaf in extras],
            [views[("next",) + leaf.key] for leaf in obs], time_major=False,
        )
        if len(self.slots) >= _SLOTS_KEPT:
            del self.slots[next(iter(self.slots))]
        self.slots[id(views)] = (views, steps)
        return steps

    def into_slot(self, views: dict[Key, np.ndarray], obs: list[Leaf], others: list[Leaf]) -> None:
        """At the batch's end, into the slot: one copy per key (``[T, E, ...]`` -> ``[E, T, ...]``)."""
        if not self.in_slot:
            for leaf, st in zip(obs, self.obs):
                _copy_transposed(views[leaf.key], st)
            for leaf, st in zip(obs, self.next):
                _copy_transposed(views[("next",) + leaf.key], st)
            for leaf, st in zip(others, self.act + self.extras):
                _copy_transposed(views[leaf.key], st)
        views[("next", "reward")][..., 0] = self.rew.T
        views[("next", "terminated")][..., 0] = self.term.T
        views[("next", "truncated")][..., 0] = self.trunc.T


class Rollout:
    """Steps ``envs_per_worker`` envs; :meth:`fill` writes one batch into a slot's arrays. The
    envs are stepped as one vector of ``envs_per_worker`` rows (as PufferLib's serial backend
    does): the stepping loop is the same for single envs and for vector envs
    (:class:`~aiocollect._worker.vector.VectorRollout`, which overrides how the envs are made,
    stepped and reset)."""

    serial = True  # single envs: stepped one by one, their frames written into the slot itself
    takes_arrays = False  # the envs take the runner's per-env actions (a vector env: the action arrays)
    # whole episodes (the evaluator's): the rows that step, in order, and those with no episode
    # left, which do not step; the batch stops when no row steps (None: every row, in index order)
    stepping: list[int] | None = None
    idle: np.ndarray | None = None
    _stage: "_Staging | None" = None  # the batch's step views (kept from batch to batch: built once per slot)

    def __init__(self, cfg: RolloutConfig, local_policy: Any = None, env: gym.Env | None = None) -> None:
        self.cfg = cfg
        self.envs: list[gym.Env] = [] if env is None else [env]  # (``env``: the first, made already)
        try:
            self.obs_space, self.act_space = add_envs(
                self.envs, cfg.envs_per_worker - len(self.envs), cfg.env_fn, cfg.env_kwargs, f"worker {cfg.worker}",
                cfg.registry, cfg.env_fn_index,
            )
            self._setup(local_policy)
        except BaseException:
            self.close()
            raise

    def _setup(self, local_policy: Any) -> None:
        cfg = self.cfg
        E = cfg.envs_per_worker
        self._layout(cfg.check_finite, cfg.one_hot_actions)
        env_ids = np.arange(cfg.worker * E, (cfg.worker + 1) * E, dtype=np.int64)
        counters = cfg.traj_counters
        self._start_rows(env_ids, cfg.total_envs, [counters[g] for g in env_ids] if counters else [0] * E)
        self.random_calls = cfg.random_steps
        seeds = self._seeds()
        self.action_spaces = []
        for env, seed in zip(self.envs, seeds):
            space = copy.deepcopy(env.action_space)
            space.seed(seed)
            self.action_spaces.append(space)
        self.guard = self._make_guard([f"env {g}" for g in self.env_ids], cfg.check_finite, cfg.action_bounds)
        for i, (env, seed) in enumerate(zip(self.envs, seeds)):
            obs, _ = env.reset(seed=seed)
            self._set_obs(i, obs, checked=True)
        self._build_policy(local_policy, E, cfg.total_envs)
        self._decorrelate()

    def _decorrelate(self) -> None:
        """``max_decorrelation_steps``: each env's random steps before the first batch (see
        :mod:`aiocollect._worker.decorrelate`); also in a replacement worker, whose envs start anew."""
        cfg = self.cfg
        if cfg.decorrelation_steps:
            draws = decorrelation_draws(cfg.seed, self.env_ids, cfg.restart, cfg.decorrelation_steps, self.act_space)
            decorrelate(self, *draws)

    def _layout(self, check_finite: bool, one_hot_actions: bool) -> None:
        """The observation's and action's leaves, and how observations are checked and written."""
        self.obs_leaves: list[Leaf] = observation_leaves(self.obs_space)
        self.act_leaves: list[Leaf] = action_leaves(self.act_space, one_hot_actions)
        self.obs_spaces = leaf_spaces(self.obs_space)
        self.flatten_obs = flattener(self.obs_space, "observation")
        self.single_obs = is_bare(self.obs_space)  # (a one-leaf Dict/Tuple obs is a dict/tuple: flattened)
        self.obs_dtype0 = self.obs_leaves[0].np_dtype
        # float leaves to scan for NaN/inf after each step (integers cannot hold them)
        self.finite_obs = [k for k, leaf in enumerate(self.obs_leaves) if leaf.np_dtype.kind == "f"] if check_finite else []

    def _start_rows(self, env_ids: np.ndarray, total_rows: int, traj_k: Sequence[int]) -> None:
        """The rows' state: global env ids, trajectory ids (row ``i`` is in its ``traj_k[i]``-th
        trajectory), carried observations, episode returns and starts; step 0."""
        E = len(env_ids)
        self.env_ids, self.rows, self.total_rows = env_ids, E, total_rows
        self.steps = 0
        # each row's trajectory id, traj_k * total_rows + env_ids: a new one adds total_rows
        self.cur_traj = np.asarray(traj_k, dtype=np.int64) * total_rows + env_ids
        self.cur_obs = [np.zeros((E,) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves]
        # per row: the reward of its episode before this batch, and the step its episode began at
        # (episode returns and lengths are worked out once per batch, from the batch's rewards and ends)
        self.ep_ret = np.zeros(E, np.float64)
        self.ep_start = np.zeros(E, np.int64)
        self.env_epochs = EnvEpochs(E)  # each row's env epoch: the last env call applied to it
        self._ends: tuple[np.ndarray, ...] | None = None  # the last batch's episodes: rows, ids, returns, ...

    def _make_guard(
        self, names: list[str], check_finite: bool, action_bounds: ActionBounds,
        per_env: Callable[[list[np.ndarray]], Sequence[Any]] | None = None,
    ) -> ActionGuard | None:
        """The checks of the policy's actions (not random ones) for the rows named ``names``
        (``per_env``: the envs' actions from the action arrays); None: nothing to check."""
        if per_env is None:
            env_actions, E = EnvActions(self.act_space, self.act_leaves), len(names)
            per_env = lambda arrays: env_actions.per_env(arrays, E)  # noqa: E731
        guard = ActionGuard(
            self.act_space, self.act_leaves, names, per_env, check_finite=check_finite, action_bounds=action_bounds,
        )
        return guard if guard.active else None

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
            return [derived_seed(cfg.seed, int(g), cfg.restart) for g in self.env_ids]
        return [cfg.seed + int(g) for g in self.env_ids]

    def spec(self) -> dict[str, Any]:
        """What the collector needs to lay out the batch (compared across workers)."""
        spec = {"obs": self.obs_leaves, "act": self.act_leaves, "extras": self.extra_leaves,
                "weights": None if self.weights is None else self.weights.layout}
        if self.runner.remote:  # the server builds the policy's runner for this action space
            spec["act_space"] = self.act_space
        if self.cfg.env_fn_index is not None:  # factories of their own: the spaces are compared as they are
            spec["spaces"] = (self.obs_space, self.act_space)
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
        if self.single_obs:
            leaf = self.obs_leaves[0]
            if checked or getattr(obs, "dtype", None) is not self.obs_dtype0 or obs.shape != leaf.shape:
                obs = check_value(obs, leaf, f"env {self.env_ids[i]}'s observation", self.obs_spaces[0])
            bufs[0][i] = obs
        else:
            what = f"env {self.env_ids[i]}'s observation"
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
        """Names row ``i``'s current step in messages: its number since the collector started and
        in its episode, counted from 1 (during a step the episode's count of it is the same whether
        it is ``taken`` or not)."""
        return f"step {self.steps + 1} (step {self.steps + 1 - int(self.ep_start[i])} of its episode)"

    def _check_finite(self, next_obs: list[np.ndarray], rewards: np.ndarray) -> None:
        """check_finite: the observations (single envs; a vector env's are checked as they are
        written) and the rewards of this step."""
        if self.serial:
            for k in self.finite_obs:
                row = first_nonfinite(next_obs[k])
                if row is not None:
                    self._nonfinite_obs(k, row, next_obs[k][row], f"returned by {self._step_text(row, taken=True)}")
        if not np.isfinite(rewards).all():
            row = int(np.flatnonzero(~np.isfinite(rewards))[0])
            raise SpecError(
                f"env {int(self.env_ids[row])}'s reward returned by {self._step_text(row, taken=True)} is "
                f"{float(rewards[row])!r}: not finite (check_finite=True)"
            )

    def _action_step(self, row: int) -> str:
        return f"at {self._step_text(row)}"

    def _new_trajs(self, rows: np.ndarray) -> None:
        """The rows ``rows`` start a new trajectory (between batches)."""
        self.cur_traj[rows] += self.total_rows
        self.ep_ret[rows] = 0.0
        self.ep_start[rows] = self.steps

    # -- the stepping loop (single envs: a vector of ``envs_per_worker`` rows; vector envs: vector.py) --
    def _staging(self, T: int) -> _Staging:
        stage = self._stage
        if stage is None or stage.T != T:
            stage = self._stage = _Staging(
                T, self.rows, self.obs_leaves, self.act_leaves, self.extra_leaves, self.cur_obs, in_slot=self.serial,
                reward_dtype=np.float64 if self.serial else np.float32,
            )
        return stage

    def fill(self, views: dict[Key, np.ndarray], version: int = 0) -> Iterator[None]:
        """Write one batch of ``frames_per_env`` steps into ``views``; yields after each step so
        the driver can check for a stop request (worker) or let its event loop run (local).

        Each step of the policy is one step of every env (a single env is a vector of one row); the
        rows that ended an episode get their reset observation before the next step. The
        observation the policy sees at step ``t`` is where the step before wrote it: single envs
        write their frames into the slot itself, vector envs into time-major buffers of this process
        (a step's rows are contiguous there) copied into the slot once, at the end of the batch. At
        the end, :attr:`episodes` lists the episodes that ended in this batch.
        """
        cfg = self.cfg
        if cfg.reset_at_each_iter and self.batches > 0:
            self._reset_all()
            self._new_trajs(np.arange(self.rows))
        traj_buf = views[("collector", "traj_ids")]
        T = traj_buf.shape[1]
        stage = self._staging(T)
        frames = stage.slot_steps(views, self.obs_leaves, self.act_leaves, self.extra_leaves) if stage.in_slot else stage.steps
        for dst, carried in zip(frames[0][0], self.cur_obs):
            dst[...] = carried
        first_traj = self.cur_traj.copy()
        first_step, first_start = self.steps, self.ep_start.copy()
        self.env_epochs.begin(lambda: self.steps - first_step)
        versions = np.full(T, version, np.int64)  # per step (server inference: per forward pass)
        ends: list[tuple[int, np.ndarray]] = []  # (step of the batch, rows) for each step where episodes ended
        guard, check_finite, hb, idle = self.guard, cfg.check_finite, self.heartbeat, self.idle
        is_init = getattr(self.runner, "is_init", None)  # a recurrent policy's: rows starting an episode
        # looked up once per batch, not per step: what every step reads
        takes_arrays, ahead, step_envs, end_step = self.takes_arrays, cfg.ahead, self._step_envs, self._end_step
        random_left = self.steps < self.random_calls  # (init_random_frames: none left after the first batches)
        runner = self.runner
        clock = time.perf_counter
        policy_time = env_time = 0.0
        t_env = clock()
        for t, (obs_t, act_t, extra_t, nxt, cur, rew_t, term_t, trunc_t, done_t) in enumerate(frames):
            random = random_left and self.steps < self.random_calls
            if random_left:
                runner = self.random_runner if random else self.runner
            t_policy = clock()
            env_time += t_policy - t_env
            if hb is not None:
                hb.begin(POLICY)
            env_actions, act_arrays, extras = runner.act(obs_t)
            t_env = clock()
            policy_time += t_env - t_policy
            if runner.remote:  # the version of the server's forward pass for this step
                versions[t] = runner.version
            if random and is_init is not None:  # (a recurrent policy's trajectory starts, stored all the same)
                extras = random_step_extras(self.extra_leaves, is_init)
                # spent: the policy's state is zeros still; but a replacement's first request to the
                # server starts every row afresh (its rows there hold the state of the worker it replaces)
                is_init[:] = bool(self.runner.remote and cfg.restart) and self.steps + 1 == self.random_calls
            for dst, arr in zip(act_t, act_arrays):
                dst[...] = arr
            if takes_arrays:
                env_actions = act_arrays
            if guard is not None and not random:
                env_actions = guard.apply(act_arrays, env_actions, self._action_step, self.stepping)
            if extra_t:
                for dst, arr in zip(extra_t, extras or [0] * len(extra_t)):
                    dst[...] = arr
            finals = step_envs(env_actions, obs_t, nxt, rew_t, term_t, trunc_t)
            if check_finite:
                self._check_finite(nxt, rew_t)
            end_step(t, ends, finals, nxt, cur, term_t, trunc_t, done_t)
            if is_init is not None:  # (the rows that ended start an episode at the next step)
                np.logical_or(is_init, done_t, out=is_init)
            if ahead and t + 1 < T and self.steps >= self.random_calls:
                self.runner.ahead(cur)  # (worker_groups: computed while the other group steps)
            if idle is not None and idle.all():
                stage.stop_after(t, cur, self.cur_obs)
                break
            yield
        env_time += clock() - t_env
        if hb is not None:
            hb.idle()
        self.timing = {"env": env_time, "policy": policy_time}
        stage.into_slot(views, self.obs_leaves, self.act_leaves + self.extra_leaves)
        views[("collector", "policy_version")][...] = versions
        self.env_epochs.write(views.get(("collector", "env_epoch")))
        fn_index = views.get(("collector", "env_fn_index"))
        if fn_index is not None:  # (a list of create_env_fn: each row's factory; a vector env's sub-envs share it)
            per_env = np.asarray(cfg.env_fn_index, np.int64)
            fn_index[...] = np.repeat(per_env, self.rows // len(per_env))[:, None]
        write_traj_ids(traj_buf, stage.done.T, first_traj, self.total_rows)
        write_step_counts(views, stage.done.T, first_step - first_start)
        self.cur_traj += self.total_rows * np.count_nonzero(stage.done, axis=0)
        self._ends = self._tally(ends, stage, traj_buf, first_step, first_start)
        self.batches += 1

    def _end_step(
        self, t: int, ends: list[tuple[int, np.ndarray]], finals: list[tuple[int, dict]], nxt: list[np.ndarray],
        cur: list[np.ndarray], term_t: np.ndarray, trunc_t: np.ndarray, done_t: np.ndarray,
    ) -> None:
        """After the envs took step ``t``: episode ends (the env's, and ``max_frames_per_traj``'s
        cuts, recorded in ``trunc_t`` and ``done_t``), and ``cur`` (the next step's observation)
        filled: each row's next observation, or its reset observation after an end."""
        ended = env_ended = np.logical_or(term_t, trunc_t, out=done_t)
        cut = None
        max_len = self.cfg.max_frames_per_traj
        if max_len is not None:  # (an episode's length after this step: steps + 1 - its start)
            cut = self.ep_start <= self.steps + 1 - max_len
            cut &= ~env_ended
            if self.idle is not None:  # (rows with no episode left do not step)
                cut &= ~self.idle
            if cut.any():
                trunc_t |= cut
                env_ended = ended.copy()
                ended |= cut
        for dst, src in zip(cur, nxt):
            dst[...] = src
        rows = ended.nonzero()[0]
        if len(rows):
            ends.append((t, rows))  # (their episodes are worked out once, at the end of the batch)
            self._after_ends(rows, env_ended, cut, finals, nxt, cur)
            self.ep_start[rows] = self.steps + 1
        self.steps += 1

    def _step_envs(
        self, actions: Any, obs_t: list[np.ndarray], nxt: list[np.ndarray], rew_t: np.ndarray, term_t: np.ndarray,
        trunc_t: np.ndarray,
    ) -> list[tuple[int, dict]]:
        """One step of every env (``obs_t``: the observations they act on): writes each row's next
        observation, reward and flags. Returns what :meth:`_after_ends` needs of a same-step vector
        env (single envs: nothing)."""
        hb, ids = self.heartbeat, self.env_ids
        single, flatten = self.single_obs, self.flatten_obs
        leaf0, space0, dtype0 = self.obs_leaves[0], self.obs_spaces[0], self.obs_dtype0
        shape0 = leaf0.shape
        next0 = nxt[0]
        if single and hb is None:
            # the hot path (no heartbeat to write between the envs' steps): every env steps, then
            # the step's observations, rewards and flags are written with one numpy call each
            # where they are of the batch's own types (a numpy write per env and value costs more
            # than the Python list it is written from)
            results = [env.step(action) for env, action in zip(self.envs, actions)]
            obs_l, rew_l, term_l, trunc_l, _ = zip(*results)
            if all(getattr(obs, "dtype", None) is dtype0 and obs.shape == shape0 for obs in obs_l):
                next0[...] = obs_l
            else:
                for i, obs in enumerate(obs_l):
                    if getattr(obs, "dtype", None) is not dtype0 or obs.shape != shape0:
                        obs = check_value(obs, leaf0, f"env {ids[i]}'s observation", space0)
                    next0[i] = obs
            if all(reward.__class__ is float for reward in rew_l):  # (what most envs return)
                rew_t[:] = rew_l
            else:
                for i, reward in enumerate(rew_l):
                    if not isinstance(reward, (float, int)):
                        reward = check_reward(reward, f"env {ids[i]}'s reward at {self._step_text(i)}")
                    rew_t[i] = reward
            if all(flag.__class__ is bool for flag in term_l + trunc_l):
                term_t[:] = term_l
                trunc_t[:] = trunc_l
            else:
                for i, (terminated, truncated) in enumerate(zip(term_l, trunc_l)):
                    term_t[i] = terminated
                    trunc_t[i] = truncated
            return []
        for i, env in enumerate(self.envs):
            if hb is not None:
                hb.begin(STEP, int(ids[i]))
            obs, reward, terminated, truncated, _ = env.step(actions[i])
            if single:
                # the hot path: an array of the leaf's own dtype and shape is written as is
                if getattr(obs, "dtype", None) is not dtype0 or obs.shape != shape0:
                    obs = check_value(obs, leaf0, f"env {ids[i]}'s observation", space0)
                next0[i] = obs
            else:
                for leaf, space, buf, value in zip(self.obs_leaves, self.obs_spaces, nxt, flatten(obs)):
                    buf[i] = check_value(value, leaf, f"env {ids[i]}'s observation", space)
            if not isinstance(reward, (float, int)):  # Python floats and ints, np.float64: no check
                reward = check_reward(reward, f"env {ids[i]}'s reward at {self._step_text(i)}")
            rew_t[i] = reward
            term_t[i] = terminated
            trunc_t[i] = truncated
        return []

    def _after_ends(
        self, rows: np.ndarray, env_ended: np.ndarray, cut: np.ndarray | None, finals: list[tuple[int, dict]],
        next_obs: list[np.ndarray], cur: list[np.ndarray],
    ) -> None:
        """The rows ``rows`` ended their episode in this step: reset their envs, whose
        observations go into ``cur`` (the next step's)."""
        hb = self.heartbeat
        for i in rows.tolist():
            if hb is not None:
                hb.begin(RESET, int(self.env_ids[i]))
            obs, _ = self.envs[i].reset()
            self._set_obs(i, obs, into=cur)

    def _reset_all(self) -> None:
        """``reset_at_each_iter``: every env starts a new episode (no seed: it goes on with its generator)."""
        hb = self.heartbeat
        for i, env in enumerate(self.envs):
            if hb is not None:
                hb.begin(RESET, int(self.env_ids[i]))
            obs, _ = env.reset()
            self._set_obs(i, obs)
        self.mark_init(slice(None))

    def mark_init(self, rows: Any) -> None:
        """The rows ``rows`` start an episode at their next step (a recurrent policy's state starts afresh)."""
        is_init = getattr(self.runner, "is_init", None)
        if is_init is not None:
            is_init[rows] = True

    @property
    def episodes(self) -> Episodes:
        """The episodes that ended in the last batch, in the order they ended, made from the
        arrays kept per step (a 256-sub-env CartPole ends about a thousand episodes per batch: no
        object per episode)."""
        if self._ends is None:
            return NO_EPISODES
        rows, ids, rets, lens, terms = self._ends
        return Episodes(self.env_ids[rows], ids, rets, lens, terms)

    def _tally(
        self, ends: list[tuple[int, np.ndarray]], stage: _Staging, traj_buf: np.ndarray, first_step: int,
        first_start: np.ndarray,
    ) -> tuple[np.ndarray, ...] | None:
        """At the end of a batch: the episodes that ended in it (``ends``: the rows that ended at
        each step, in order) as columns -- rows, trajectory ids, returns, lengths, terminated, in the
        order they ended -- and each row's reward carried into the next batch (:attr:`ep_ret`).
        Worked out from the batch's rewards with a few whole-batch operations rather than per step:
        a row's return is its running sum of rewards (``float64``, from what it carried in, and
        from zero after each end: added in the order the rewards came, as a plain loop adds them);
        its length is the difference of the steps of its end and of its previous end in this batch,
        or, for its first end, from its episode's start (``first_start``: each row's episode start
        at the batch's first step, ``first_step``)."""
        sums = stage.sums  # [T, E]: each row's return up to each step (a step at a time: faster than np.cumsum here)
        np.copyto(sums, stage.rew)
        sums[0] += self.ep_ret
        ended_at = dict(ends)
        add, rew = np.add, stage.rew
        prev = sums[0]
        for t, row in enumerate(sums[1:], 1):  # (each step's row a view made once)
            add(prev, row, out=row)
            restart = ended_at.get(t - 1)
            if restart is not None:  # (after an end the sum starts again from the next reward)
                row[restart] = rew[t, restart]
            prev = row
        self.ep_ret = np.where(stage.done[-1], 0.0, sums[-1])
        if not ends:
            return None
        ts = np.repeat(np.array([t for t, _ in ends]), [len(r) for _, r in ends])
        rows = np.concatenate([r for _, r in ends])
        order = np.lexsort((ts, rows))  # by row, then by step
        er, et = rows[order], ts[order]
        first = np.empty(len(er), bool)  # the row's first end in this batch
        first[0] = True
        np.not_equal(er[1:], er[:-1], out=first[1:])
        prev = np.empty_like(et)  # the step of the row's previous end (first ends: none)
        prev[0] = 0
        prev[1:] = et[:-1]
        lens = et - prev
        lens[first] = first_step + et[first] + 1 - first_start[er[first]]
        back = np.empty_like(order)  # back into the order the episodes ended in
        back[order] = np.arange(len(order))
        return rows, traj_buf[rows, ts], sums[ts, rows], lens[back], stage.term[ts, rows]


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
        """Per env row of this worker: the number of the trajectory it is in now."""
        return ((self.cur_traj - self.env_ids) // self.total_rows).tolist()

    def close(self) -> None:
        self._stage = None  # (its steps hold views on the slots: they must not keep them mapped)
        runner = getattr(self, "runner", None)
        if runner is not None and runner.remote:
            runner.close()
        close_envs(self.envs)
