"""The rollout engine: steps a worker's envs with the policy and writes frames in place into a
batch slot. Runs in worker processes, or in the collector's process for the local backend.

:class:`Rollout` steps the envs; its parts have owners of their own: where a batch is written as
the envs step (:class:`~aiocollect._worker.staging.Staging`), each row's trajectories and episodes
(:class:`~aiocollect._worker.trajectories.Trajectories`), the rows' seeds
(:mod:`~aiocollect._worker.seeding`), the policy's runners and action checks
(:mod:`~aiocollect._worker.policy_setup`), random steps before collection
(:mod:`~aiocollect._worker.decorrelate`).

Imported by worker processes: numpy and gymnasium only (torch through the policy runner).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import gymnasium as gym
import numpy as np

from .._core.datachecks import ActionBounds, check_reward, check_value
from .decorrelate import decorrelate, decorrelation_draws
from .env_calls import EnvEpochs
from .envs import add_envs, close_envs
from .._core.heartbeat import POLICY, RESET, STEP
from .._core.layout import Key, Leaf, action_leaves, flattener, is_bare, leaf_spaces, observation_leaves
from .policy import PolicySpec
from .policy_setup import action_guard, build_policy
from .recurrent import random_step_extras
from .seeding import row_seeds, seeded_spaces
from .staging import Staging
from .step_values import StepValues
from .trajectories import Trajectories
from .._core.wire import BatchInfo, Episodes


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Settings one worker's rollout needs (picklable, sent to each worker).

    Counts are of env *copies* (what ``create_env_fn`` returns), as
    :class:`~aiocollect._core.geometry.Geometry` counts them: the collector builds these configs
    before the workers made their envs, so a vector env's sub-envs are known only here, in the
    worker, which makes its rows of them (``envs_per_worker * num_envs``). The frames of each
    row in a batch are the slot's (its views' time dimension)."""

    env_fn: Any  # a gymnasium id (str) or a callable returning a gymnasium.Env; or a tuple of one per env
    env_kwargs: dict | tuple[dict, ...]  # (a tuple: one per env of the worker)
    policy: PolicySpec
    worker: int
    envs_per_worker: int  # env copies of this worker (Geometry.envs_per_worker)
    total_envs: int  # env copies of all workers (Geometry.total_envs)
    seed: int | None = None
    static_seed: bool = False
    max_frames_per_traj: int | None = None
    random_frames: int = 0  # frames of each env copy with random actions (a copy of n sub-envs: ceil(./n) steps)
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
    credit_spin: float = 0.0  # seconds a worker looks for its next credit before it sleeps (pool.credit_spin)
    one_hot_actions: bool = False  # categorical_action_encoding=False: a Discrete action stored one-hot
    decorrelation_steps: int = 0  # max_decorrelation_steps: random steps of each env before the first batch
    env_fn_index: tuple[int, ...] | None = None  # per env of the worker: its factory's index in create_env_fn
    env_calls: tuple = ()  # EnvCalls a replacement applies once its envs are made (set_attr, persisted calls)


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
    _stage: Staging | None = None  # the batch's step views (kept from batch to batch: built once per slot)

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
        self.random_calls = cfg.random_frames
        seeds = row_seeds(cfg.seed, cfg.static_seed, cfg.restart, self.env_ids)
        self.action_spaces = seeded_spaces([env.action_space for env in self.envs], seeds)
        self.guard = action_guard(
            self.act_space, self.act_leaves, [f"env {g}" for g in self.env_ids], cfg.check_finite, cfg.action_bounds
        )
        for i, (env, seed) in enumerate(zip(self.envs, seeds)):
            obs, _ = env.reset(seed=seed)
            self._set_obs(i, obs, checked=True)
        self._build_policy(local_policy, cfg.total_envs)
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
        """The rows' state: global env ids, trajectories and episodes (row ``i`` is in its
        ``traj_k[i]``-th trajectory: see :class:`~aiocollect._worker.trajectories.Trajectories`),
        carried observations; step 0."""
        E = len(env_ids)
        self.env_ids, self.rows, self.total_rows = env_ids, E, total_rows
        self.steps = 0
        self.trajs = Trajectories(env_ids, total_rows, traj_k)
        self.cur_obs = [np.zeros((E,) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves]
        self.env_epochs = EnvEpochs(E)  # each row's env epoch: the last env call applied to it
        self.values = StepValues(self.obs_leaves, self.obs_spaces, env_ids, self._step_text)  # (after _layout)

    def _build_policy(self, local_policy: Any, total_envs: int) -> None:
        """The policy's runner for the rows (one per seeded action space; its torch seed comes
        after the seeds of all ``total_envs`` envs), the random runner, and the weight reader (see
        :func:`~aiocollect._worker.policy_setup.build_policy`)."""
        cfg = self.cfg
        self.random_runner, self.runner, self.extra_leaves, self.weights = build_policy(
            cfg.policy, local_policy, (cfg.seed, cfg.worker, cfg.restart, total_envs), self.act_space, self.act_leaves,
            self.obs_leaves, self.action_spaces, self.cur_obs,
        )
        self.batches = 0
        self.heartbeat: Any = None  # a _heartbeat.Heartbeat when the collector watches for hangs

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
                self.values.nonfinite_obs(k, i, bufs[k][i], "returned by reset")

    def _step_text(self, i: int, taken: bool = False) -> str:
        """Names row ``i``'s current step in messages: its number since the collector started and
        in its episode, counted from 1 (during a step the episode's count of it is the same whether
        it is ``taken`` or not)."""
        return f"step {self.steps + 1} (step {self.steps + 1 - int(self.trajs.ep_start[i])} of its episode)"

    def _action_step(self, row: int) -> str:
        return f"at {self._step_text(row)}"

    # -- the stepping loop (single envs: a vector of ``envs_per_worker`` rows; vector envs: vector.py) --
    def _staging(self, T: int) -> Staging:
        stage = self._stage
        if stage is None or stage.T != T:
            stage = self._stage = Staging(
                T, self.rows, self.obs_leaves, self.act_leaves, self.extra_leaves, self.cur_obs, in_slot=self.serial,
                reward_dtype=np.float64 if self.serial else np.float32,
            )
        return stage

    def fill(self, views: dict[Key, np.ndarray], version: int = 0) -> Iterator[None]:
        """Write one batch of ``T`` steps (the views' frames per row) into ``views``; yields after each step so
        the driver can check for a stop request (worker) or let its event loop run (local).

        Each step of the policy is one step of every env (a single env is a vector of one row); the
        rows that ended an episode get their reset observation before the next step. The
        observation the policy sees at step ``t`` is where the step before wrote it: single envs
        write their frames into the slot itself, vector envs into time-major buffers of this process
        (a step's rows are contiguous there) copied into the slot once, at the end of the batch. At
        the end, :attr:`episodes` lists the episodes that ended in this batch.

        The steps: :meth:`_begin_batch`; per step, the policy's actions (random ones for the first
        ``random_calls`` steps), :meth:`_record_actions`, :meth:`_step_envs`, :meth:`_end_step`;
        :meth:`_end_batch`.
        """
        stage, frames = self._begin_batch(views)
        T = stage.T
        versions = np.full(T, version, np.int64)  # per step (server inference: per forward pass)
        ends: list[tuple[int, np.ndarray]] = []  # (step of the batch, rows) for each step where episodes ended
        if self._plain():
            yield from self._plain_steps(stage, frames, ends, versions)
            np.logical_or(stage.term, stage.trunc, out=stage.done)  # (every step's episode ends, at once)
            self._end_batch(views, stage, versions, ends, None)
            return
        # looked up once per batch, not per step: what every step reads
        check_finite, hb, idle, ahead = self.cfg.check_finite, self.heartbeat, self.idle, self.cfg.ahead
        is_init = getattr(self.runner, "is_init", None)  # a recurrent policy's: rows starting an episode
        record, step_envs, end_step = self._record_actions, self._step_envs, self._end_step
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
                extras = self._random_extras(is_init)
            env_actions = record(act_t, extra_t, env_actions, act_arrays, extras, random)
            finals = step_envs(env_actions, obs_t, nxt, rew_t, term_t, trunc_t)
            if check_finite:  # (a vector env's observations are checked as they are written)
                self.values.check_finite(nxt if self.serial else [], rew_t, self.finite_obs)
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
        self.timing = {"env": env_time, "policy": policy_time}
        self._end_batch(views, stage, versions, ends, hb)

    def _plain(self) -> bool:
        """Whether this batch can take :meth:`_plain_steps`: single envs of one observation leaf,
        and none of what acts between the steps (a heartbeat, ``check_finite``,
        ``max_frames_per_traj``, action checks, a recurrent state, random actions, the
        evaluator's whole episodes)."""
        cfg = self.cfg
        return (
            type(self)._step_envs is Rollout._step_envs and type(self)._after_ends is Rollout._after_ends
            and self.single_obs and self.heartbeat is None and self.guard is None and self.idle is None
            and not cfg.check_finite and cfg.max_frames_per_traj is None and self.steps >= self.random_calls
            and getattr(self.runner, "is_init", None) is None
        )

    def _plain_steps(
        self, stage: Staging, frames: list[tuple], ends: list[tuple[int, np.ndarray]], versions: np.ndarray,
    ) -> Iterator[None]:
        """The steps of :meth:`fill` where :meth:`_plain` holds: what :meth:`_step_envs` and
        :meth:`_end_step` do for that case, in one loop of local names, with
        no option looked at that the case does not have. What no step reads waits for the end
        of the batch: the rewards (kept as the envs returned them, one numpy call for all steps),
        the flags of the steps where no episode ended (all zeros: written only where one did) and
        their ``done`` (one numpy call for all steps). At 8 CartPole envs the rollout's own work
        is about a seventh of a step: each call and each numpy call of it counts."""
        runner, envs, T, record, ep_start = self.runner, self.envs, len(frames), self._record_actions, self.trajs.ep_start
        act, remote, ahead, after_ends, clock = runner.act, runner.remote, self.cfg.ahead, self._after_ends, time.perf_counter
        observations, rewards, flags = self.values.observations, self.values.rewards, self.values.flags
        stage.term[...], stage.trunc[...] = False, False
        act0 = len(self.act_leaves) == 1 and not self.extra_leaves and not self.takes_arrays  # (written here)
        rews: list[Any] = []  # per step: its rewards (into the stage's at the end)
        policy_time = 0.0
        t_start = clock()
        for t, (obs_t, act_t, extra_t, nxt, cur, _, term_t, trunc_t, _) in enumerate(frames):
            t_policy = clock()
            env_actions, act_arrays, extras = act(obs_t)
            policy_time += clock() - t_policy
            if remote:  # (the version of the server's forward pass for this step)
                versions[t] = runner.version
            if act0:  # (one action leaf and no extras, as most policies: no call to record)
                act_t[0][...] = act_arrays[0]
            else:
                env_actions = record(act_t, extra_t, env_actions, act_arrays, extras, False)
            next0 = nxt[0]
            rew_l, term_l, trunc_l = observations([env.step(action) for env, action in zip(envs, env_actions)], next0)
            rews.append(rewards(rew_l))
            cur[0][...] = next0
            if True in term_l or True in trunc_l:  # (a look at the Python flags: cheaper than numpy's)
                flags(term_l, trunc_l, term_t, trunc_t)
                ended = term_t | trunc_t
                rows = ended.nonzero()[0]
                ends.append((t, rows))
                after_ends(rows, ended, None, [], nxt, cur)
                ep_start[rows] = self.steps + 1
            self.steps += 1
            if ahead and t + 1 < T:
                runner.ahead(cur)  # (worker_groups: computed while the other group steps)
            yield
        stage.rew[:] = rews
        self.timing = {"env": clock() - t_start - policy_time, "policy": policy_time}

    def _begin_batch(self, views: dict[Key, np.ndarray]) -> tuple[Staging, list[tuple]]:
        """Before a batch's first step: ``reset_at_each_iter``'s resets, the batch's staging and
        each step's views (returned), the carried observations into the first step's, and the
        rows' trajectories and env epochs told that the batch begins."""
        if self.cfg.reset_at_each_iter and self.batches > 0:
            self._reset_all()
            self.trajs.new_trajs(np.arange(self.rows), self.steps)
        stage = self._staging(views[("collector", "traj_ids")].shape[1])
        frames = stage.slot_steps(views, self.obs_leaves, self.act_leaves, self.extra_leaves) if stage.in_slot else stage.steps
        for dst, carried in zip(frames[0][0], self.cur_obs):
            dst[...] = carried
        first_step = self.steps
        self.trajs.begin_batch(first_step)
        self.env_epochs.begin(lambda: self.steps - first_step)
        return stage, frames

    def _random_extras(self, is_init: np.ndarray) -> list[np.ndarray]:
        """A random step of a recurrent policy: the extras stored for it (the policy's state is
        zeros still, and ``is_init`` is spent); but a replacement's first request to the server
        starts every row afresh (its rows there hold the state of the worker it replaces)."""
        extras = random_step_extras(self.extra_leaves, is_init)
        is_init[:] = bool(self.runner.remote and self.cfg.restart) and self.steps + 1 == self.random_calls
        return extras

    def _record_actions(
        self, act_t: list[np.ndarray], extra_t: list[np.ndarray], env_actions: Any, act_arrays: list[np.ndarray],
        extras: Any, random: bool,
    ) -> Any:
        """The step's actions (``act_arrays``) and the policy's extra outputs written into its
        frame; returns what the envs take: the runner's per-env actions (a vector env: the action
        arrays), checked (and clipped) by the guard unless random."""
        for dst, arr in zip(act_t, act_arrays):
            dst[...] = arr
        if self.takes_arrays:
            env_actions = act_arrays
        guard = self.guard
        if guard is not None and not random:
            env_actions = guard.apply(act_arrays, env_actions, self._action_step, self.stepping)
        if extra_t:
            for dst, arr in zip(extra_t, extras or [0] * len(extra_t)):
                dst[...] = arr
        return env_actions

    def _end_batch(
        self, views: dict[Key, np.ndarray], stage: Staging, versions: np.ndarray, ends: list[tuple[int, np.ndarray]],
        hb: Any,
    ) -> None:
        """After a batch's last step: the staged frames, the policy versions, env epochs and
        factories into the slot ``views``, and the trajectories' ids, step counts and episodes."""
        if hb is not None:
            hb.idle()
        stage.into_slot(views, self.obs_leaves, self.act_leaves + self.extra_leaves)
        views[("collector", "policy_version")][...] = versions
        self.env_epochs.write(views.get(("collector", "env_epoch")))
        fn_index = views.get(("collector", "env_fn_index"))
        if fn_index is not None:  # (a list of create_env_fn: each row's factory; a vector env's sub-envs share it)
            per_env = np.asarray(self.cfg.env_fn_index, np.int64)
            fn_index[...] = np.repeat(per_env, self.rows // len(per_env))[:, None]
        self.trajs.end_batch(views, stage, ends)
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
            cut = self.trajs.ep_start <= self.steps + 1 - max_len
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
            self.trajs.ep_start[rows] = self.steps + 1
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
        if single and hb is None:  # (no heartbeat to write between the envs' steps: they all step, then their values)
            self.values.write([env.step(action) for env, action in zip(self.envs, actions)], next0, rew_t, term_t, trunc_t)
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
        """The episodes that ended in the last batch, in the order they ended."""
        return self.trajs.episodes

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
        return self.trajs.counters

    def close(self) -> None:
        self._stage = None  # (its steps hold views on the slots: they must not keep them mapped)
        runner = getattr(self, "runner", None)
        if runner is not None and runner.remote:
            runner.close()
        close_envs(self.envs)
