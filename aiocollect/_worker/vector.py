"""Vector envs in the workers: a ``gymnasium.vector.VectorEnv`` (or an EnvPool env) stepped as
one batched env, each of its ``num_envs`` sub-envs a row of the batch.

:func:`open_rollout` makes a worker's first env and picks the rollout that fits it:
:class:`~aiocollect._worker.rollout.Rollout` for a ``gymnasium.Env``, :class:`VectorRollout` for a vector
env. A worker with ``envs_per_worker`` copies of a vector env of ``num_envs`` sub-envs has
``envs_per_worker * num_envs`` rows; row ``i`` of worker ``w`` is global env
``w * envs_per_worker * num_envs + i``, exactly as ``envs_per_worker * num_envs`` single envs
would be numbered, so seeds, trajectory ids and episode events follow the single-env scheme.

The number of sub-envs is known only once a worker made its env: the worker derives its own counts
from it (every worker's vector env has the same ``num_envs``, which the collector checks), reports
it in its spec (``"num_envs"``), and the collector derives the batch layout and its counters from
it (:func:`learn_sub_envs`). A :class:`~aiocollect._worker.rollout.RolloutConfig` counts env *copies*
(``total_envs``; ``random_steps`` in frames of each copy) and sub-envs only in ``traj_counters``.

**Autoreset.** A frame of the batch is always a real transition, as with single envs: at an
episode end ``("next", obs)`` is the true final observation and ``obs`` at ``t + 1`` the reset
observation. How the reset observation is had depends on the env's
``metadata["autoreset_mode"]``:

- ``SAME_STEP``: the env resets the sub-env within the step that ends its episode; the returned
  observation is the reset one and the final one is in ``info["final_obs"]``.
- ``NEXT_STEP`` (gymnasium's default) and ``DISABLED``: the worker resets the ended sub-envs
  itself right after the step (a *partial reset*), so that the env never takes the "reset step"
  whose action it would ignore. A partial reset is ``reset(options={"reset_mask": mask})`` for
  gymnasium's ``SyncVectorEnv``/``AsyncVectorEnv``, ``reset(env_id)`` for EnvPool, and a few
  lines for gymnasium's native ``CartPoleVectorEnv`` (which has none of its own).

A vector env in next-step mode without a partial reset cannot give such batches: its reset step
costs every sub-env that ended an extra call, which the other sub-envs spend on real steps, so
rows would need different numbers of calls for the same number of frames. It is refused with a
:class:`SpecError` saying what to use instead.

One vector env behind one interface (seeding, partial resets, EnvPool's row order) is
:class:`~aiocollect._worker.vecenv.VecEnv`.

Imported by worker processes: numpy and gymnasium only (torch through the policy runner).
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from .._core.datachecks import ActionGuard, check_value, first_nonfinite, short
from .._core.errors import ConfigError, SpecError
from .._core.heartbeat import POLICY, RESET, STEP
from .._core.limits import check_seed
from .._core.layout import Key, Leaf, action_leaves, flattener, is_bare, leaf_spaces, observation_leaves, unflattener
from .._core.registry import install as install_registry
from .vecenv import _SAME, VecEnv, is_vector
from .._core.wire import NO_EPISODES, Episodes
if TYPE_CHECKING:
    from .groups import GroupedRollout
from .envs import close_envs, create_env, make_env
from .rollout import Rollout, RolloutConfig, derived_seed, write_step_counts, write_traj_ids

def open_rollout(cfg: RolloutConfig, local_policy: Any = None) -> "Rollout | GroupedRollout":
    """The rollout of one worker: its first env decides whether it steps single envs or vector
    envs (every copy must then be of the same kind)."""
    install_registry(cfg.registry)  # ids registered in the user's process can be made here
    env = create_env(cfg.env_fn, cfg.env_kwargs)
    if is_vector(env):
        if cfg.worker_groups > 1:
            close_envs([env])
            raise ConfigError(
                f"worker_groups={cfg.worker_groups} splits a worker's envs into groups that step in turn; a vector env "
                f"steps all its sub-envs at once: use worker_groups=1 with vector envs"
            )
        return VectorRollout(cfg, local_policy, env)
    try:
        env = make_env(cfg.env_fn, cfg.env_kwargs, env)
    except BaseException:
        close_envs([env])
        raise
    if cfg.worker_groups > 1:
        from .groups import GroupedRollout

        return GroupedRollout(cfg, env)
    return Rollout(cfg, local_policy, env)


def learn_sub_envs(specs: list[dict], config: Any, start_counters: list[int] | None, seed: int | None) -> int:
    """Collector side, once the workers reported their specs: the sub-envs of each of their envs
    (a vector env's ``num_envs``; 1 for single envs). Raises :class:`SpecError` when workers
    disagree, :class:`ConfigError` when ``frames_per_batch`` does not split evenly over the env
    rows, or the trajectory counters to resume from or the seed do not fit their number."""
    counts = [int(s.get("num_envs", 1)) for s in specs]
    n = counts[0]
    for w, k in enumerate(counts):
        if k != n:
            raise SpecError(
                f"worker {w}'s envs have num_envs={k} sub-envs but worker 0's have {n}: every vector env must have "
                f"the same num_envs (and every worker's env must be of the same kind)"
            )
    if n == 1 and "num_envs" not in specs[0]:
        return 1  # single envs: the config checked all this at construction
    c = config
    rows = c.envs_per_batch * n
    if c.frames_per_batch % rows:
        who = f"{c.envs_per_worker} envs_per_worker x {n} sub-envs (num_envs)"
        if c.delivery == "sync" and c.workers > 1:
            who = f"{c.workers} workers x {who}"
        lower = c.frames_per_batch // rows * rows
        raise ConfigError(
            f"frames_per_batch={c.frames_per_batch} is not a multiple of the {rows} env rows that fill each batch "
            f"({who}: each sub-env of a vector env is a row of the batch); use frames_per_batch={lower + rows}"
            + (f" or {lower}" if lower else "") + ", or vector envs with another num_envs"
        )
    total = c.total_envs * n
    if start_counters is not None and len(start_counters) != total:
        raise ConfigError(
            f"the state loaded with load_state_dict() has trajectory counters for {len(start_counters)} envs, this "
            f"collector has {total} ({c.total_envs} vector envs of {n} sub-envs); resume with the same num_workers, "
            f"envs_per_worker and num_envs"
        )
    check_seed(seed, offset=total + c.workers - 1)
    return n


class _ArrayActions:
    """Stands in for a runner's per-env conversion: a vector env takes the action arrays."""

    def per_env(self, arrays: list[np.ndarray], num_envs: int) -> list[np.ndarray]:
        return arrays


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


class _Staging:
    """Time-major buffers for one batch of ``T`` steps of ``E`` rows (``[T, E, ...]``: each step
    writes contiguous rows, and the batch goes into the slot in one copy per key at its end), and
    each step's views of them, made once (not per step)."""

    def __init__(
        self, T: int, E: int, obs: list[Leaf], act: list[Leaf], extras: list[Leaf], carried: list[np.ndarray]
    ) -> None:
        def bufs(leaves: list[Leaf]) -> list[np.ndarray]:
            return [np.zeros((T, E) + leaf.shape, leaf.np_dtype) for leaf in leaves]

        self.T = T
        self.obs, self.next, self.act, self.extras = bufs(obs), bufs(obs), bufs(act), bufs(extras)
        self.rew = np.zeros((T, E), np.float32)
        self.term = np.zeros((T, E), bool)
        self.trunc = np.zeros((T, E), bool)
        self.done = np.zeros((T, E), bool)  # terminated | truncated (with max_frames_per_traj's cuts)
        self.sums = np.zeros((T, E), np.float64)  # running sums of the rewards (episode returns)
        # per step: obs, actions, extras, next obs, the obs of the step after (after the last step:
        # ``carried``, the rollout's carried obs), reward, terminated, truncated, done
        self.steps = [
            (
                [b[t] for b in self.obs], [b[t] for b in self.act], [b[t] for b in self.extras],
                [b[t] for b in self.next], [b[t + 1] for b in self.obs] if t + 1 < T else carried,
                self.rew[t], self.term[t], self.trunc[t], self.done[t],
            )
            for t in range(T)
        ]


# -- the rollout ---------------------------------------------------------------------------------


class VectorRollout(Rollout):
    """Steps ``envs_per_worker`` vector envs of ``n`` sub-envs each as ``envs_per_worker * n``
    rows; same interface as :class:`~aiocollect._worker.rollout.Rollout`."""

    def __init__(self, cfg: RolloutConfig, local_policy: Any = None, env: Any = None) -> None:
        self.cfg = cfg
        self.envs: list[Any] = [] if env is None else [env]
        try:
            self.vecs: list[VecEnv] = []
            for c in range(cfg.envs_per_worker):
                if c >= len(self.envs):
                    self.envs.append(create_env(cfg.env_fn, cfg.env_kwargs))
                self.vecs.append(self._check(c, self.envs[c]))
            self._setup(local_policy)
        except BaseException:
            self.close()
            raise

    def _check(self, c: int, env: Any) -> VecEnv:
        who = f"env {c} of worker {self.cfg.worker}"
        if not is_vector(env):
            raise SpecError(
                f"create_env_fn returned a vector env for env 0 of worker {self.cfg.worker} but {type(env).__name__} "
                f"for {who}: every env must be of the same kind"
            )
        vec = VecEnv(env, who)
        if self.vecs:
            first = self.vecs[0]
            if (vec.n, vec.obs_space, vec.act_space, vec.mode) != (first.n, first.obs_space, first.act_space, first.mode):
                raise SpecError(
                    f"{who} has num_envs={vec.n}, spaces {vec.obs_space}, {vec.act_space} and autoreset mode "
                    f"{vec.mode}, but env 0 has num_envs={first.n}, {first.obs_space}, {first.act_space}, "
                    f"{first.mode}: all vector envs must agree"
                )
        return vec

    def _setup(self, local_policy: Any) -> None:
        cfg = self.cfg
        n = self.n = self.vecs[0].n
        E = self.rows = cfg.envs_per_worker * n
        self.total_rows = cfg.total_envs * n  # (every worker's vector envs have n sub-envs)
        # init_random_frames: ``cfg.random_steps`` frames of each copy are ceil(./n) steps of it
        self.random_calls = -(-cfg.random_steps // n)
        self.obs_space, self.act_space = self.vecs[0].obs_space, self.vecs[0].act_space
        self.mode = self.vecs[0].mode
        self.obs_leaves: list[Leaf] = observation_leaves(self.obs_space)
        if cfg.one_hot_actions:
            raise ConfigError(
                "categorical_action_encoding=False (one-hot Discrete actions) is for single envs, and this worker's "
                "env is a vector env; drop the option (actions are stored as indices), or make single envs"
            )
        self.act_leaves: list[Leaf] = action_leaves(self.act_space)
        self.obs_spaces = leaf_spaces(self.obs_space)
        self.flatten_obs = flattener(self.obs_space, "observation")
        self.single_obs = is_bare(self.obs_space)  # (a one-leaf Dict/Tuple obs is a dict/tuple: flattened)
        self.obs_dtype0 = self.obs_leaves[0].np_dtype
        # the same leaves with the sub-envs' dimension in front: what one step of a copy returns
        self.batched_leaves = [Leaf(leaf.key, (n,) + leaf.shape, leaf.dtype) for leaf in self.obs_leaves]
        self.unflatten_act = unflattener(self.act_space)
        self.bare_act = is_bare(self.act_space)
        self.env_ids = np.arange(cfg.worker * E, (cfg.worker + 1) * E, dtype=np.int64)  # type: ignore[assignment]  # (an array here)
        self.finite_obs = [k for k, leaf in enumerate(self.obs_leaves) if leaf.np_dtype.kind == "f"] if cfg.check_finite else []
        self.steps = 0
        self._ends: tuple[np.ndarray, ...] | None = None  # the last batch's episodes: rows, ids, returns, ...
        counters = cfg.traj_counters
        if counters is not None and len(counters) != self.total_rows:
            raise ConfigError(
                f"the trajectory counters to resume from hold {len(counters)} envs, but this collector's "
                f"{cfg.total_envs} vector envs have {self.total_rows} sub-envs; resume with the same num_workers, "
                f"envs_per_worker and num_envs"
            )
        seeds = self._seeds()
        self.action_spaces = []
        for seed in seeds:
            space = copy.deepcopy(self.act_space)
            space.seed(seed)
            self.action_spaces.append(space)
        traj_k = np.array([counters[g] for g in self.env_ids] if counters else [0] * E, dtype=np.int64)
        # each row's trajectory id, traj_k * total_rows + env_ids: a new one adds total_rows
        self.cur_traj = traj_k * self.total_rows + self.env_ids
        self.cur_obs = [np.zeros((E,) + leaf.shape, leaf.np_dtype) for leaf in self.obs_leaves]
        # per row: the reward of its episode before this batch, and the step its episode began at
        # (episode returns and lengths are worked out once per batch, from the batch's rewards and ends)
        self.ep_ret = np.zeros(E, np.float64)  # type: ignore[assignment]  # (an array here)
        self.ep_start = np.zeros(E, np.int64)
        guard = ActionGuard(
            self.act_space, self.act_leaves, [f"env {g}" for g in self.env_ids], lambda arrays: arrays,
            check_finite=cfg.check_finite, action_bounds=cfg.action_bounds,
        )
        self.guard = guard if guard.active else None
        self.partial = all(v.partial for v in self.vecs)
        # the common case of _after_ends, in one call: one next-step vector env writing its reset
        # rows into the next step's observation itself (gymnasium's CartPole), nothing to check
        self.reset_in_place = (
            len(self.vecs) == 1 and self.mode != _SAME and self.single_obs and self.vecs[0].writes_rows
            and not self.finite_obs
        )
        if cfg.max_frames_per_traj is not None and not self.partial:
            raise ConfigError(
                f"max_frames_per_traj={cfg.max_frames_per_traj} needs to reset a sub-env whose episode it truncates, "
                f"and {type(self.envs[0]).__name__} cannot reset some sub-envs on their own; limit the episodes in "
                f"the env instead (gymnasium's TimeLimit on each sub-env, or the env's max_episode_steps)"
            )
        for c, vec in enumerate(self.vecs):
            obs = vec.reset(seeds[c * n : (c + 1) * n])
            self._write_obs(c, obs, self.cur_obs, None, "returned by reset")
        self._build_policy(local_policy, E, self.total_rows)
        if hasattr(self.runner, "env_actions"):
            self.runner.env_actions = _ArrayActions()  # the env takes arrays: no per-env list

    def _seeds(self) -> list[int | None]:
        cfg = self.cfg
        if cfg.seed is None:
            return [None] * self.rows
        if cfg.static_seed:
            return [cfg.seed] * self.rows
        if cfg.restart:
            return [derived_seed(cfg.seed, int(g), cfg.restart) for g in self.env_ids]
        return [cfg.seed + int(g) for g in self.env_ids]

    def spec(self) -> dict[str, Any]:
        return {**super().spec(), "num_envs": self.n}

    # -- observations -----------------------------------------------------------------------------
    def _what(self, c: int) -> str:
        g = int(self.env_ids[c * self.n])
        return f"vector env {c} of worker {self.cfg.worker} (envs {g} to {g + self.n - 1})"

    def _write_obs(
        self, c: int, obs: Any, bufs: list[np.ndarray], t: int | None, when: str, rows: slice | None = None
    ) -> None:
        """Write copy ``c``'s batched observation into ``rows`` of ``bufs`` (default: the copy's
        own rows), at time ``t`` (``None``: ``bufs`` have no time dimension), checked against the
        leaves as single envs' observations are."""
        n = self.n
        if rows is None:
            rows = slice(c * n, (c + 1) * n)
        values = [obs] if self.single_obs else self.flatten_obs(obs)
        for k, (leaf, space, buf, value) in enumerate(zip(self.batched_leaves, self.obs_spaces, bufs, values)):
            if getattr(value, "dtype", None) is not leaf.np_dtype or value.shape != leaf.shape:
                value = check_value(value, leaf, f"{self._what(c)}'s observation {when}", space)
            dst = buf[rows] if t is None else buf[rows, t]
            dst[...] = value
            if k in self.finite_obs:
                row = first_nonfinite(dst)
                if row is not None:
                    self._nonfinite_obs(k, c * n + row, dst[row], when)

    def _write_row(self, i: int, obs: Any, bufs: list[np.ndarray], when: str) -> None:
        """Write one sub-env's observation (unbatched: a final observation) into row ``i`` of
        ``bufs`` (``[E, ...]`` each)."""
        values = [obs] if self.single_obs else self.flatten_obs(obs)
        for k, (leaf, space, buf, value) in enumerate(zip(self.obs_leaves, self.obs_spaces, bufs, values)):
            value = check_value(value, leaf, f"env {int(self.env_ids[i])}'s observation {when}", space)
            buf[i] = value
            if k in self.finite_obs and not np.isfinite(buf[i]).all():
                self._nonfinite_obs(k, i, buf[i], when)

    def _staging(self, T: int) -> _Staging:
        stage = getattr(self, "_stage", None)
        if stage is None or stage.T != T:
            stage = self._stage = _Staging(T, self.rows, self.obs_leaves, self.act_leaves, self.extra_leaves, self.cur_obs)
        return stage

    # -- stepping -------------------------------------------------------------------------------------
    def _actions(self, arrays: list[np.ndarray], c: int) -> Any:
        rows = slice(c * self.n, (c + 1) * self.n)
        if self.bare_act:
            return arrays[0][rows] if len(self.vecs) > 1 else arrays[0]
        return self.unflatten_act([a[rows] for a in arrays])

    def _check_step(self, c: int, rew: Any, term: Any, trunc: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = self.n
        if (
            type(rew) is np.ndarray and type(term) is np.ndarray and type(trunc) is np.ndarray
            and rew.shape == term.shape == trunc.shape == (n,) and term.dtype == trunc.dtype == np.bool_
            and rew.dtype.kind in "fiu"
        ):
            return rew, term, trunc  # the hot path: what gymnasium's vector envs return
        out = []
        for name, value, kinds in (("rewards", rew, "biuf"), ("terminated", term, "b"), ("truncated", trunc, "b")):
            arr = np.asarray(value)
            if arr.shape != (n,) or arr.dtype.kind not in kinds:
                raise SpecError(
                    f"{self._what(c)} returned {name} {short(value)} (dtype {arr.dtype}, shape {arr.shape}) from step "
                    f"{self.steps + 1}; a vector env of {n} sub-envs returns "
                    + ("real numbers" if name == "rewards" else "booleans") + f" of shape ({n},)"
                )
            out.append(arr)
        return out[0], out[1], out[2]

    def fill(self, views: dict[Key, np.ndarray], version: int = 0) -> Iterator[None]:
        """Write one batch into ``views`` (see :meth:`Rollout.fill`): each step of the policy is one
        ``step`` of every vector env; ended sub-envs are reset before the next step. Steps are
        written into time-major buffers of this process (a step's rows are contiguous there) and
        copied into the slot once, at the end of the batch."""
        cfg = self.cfg
        vecs, n = self.vecs, self.n
        hb = self.heartbeat
        if cfg.reset_at_each_iter and self.batches > 0:
            for c, vec in enumerate(vecs):
                if hb is not None:
                    hb.begin(RESET, int(self.env_ids[c * n]))
                obs = vec.reset([None] * n)
                self._write_obs(c, obs, self.cur_obs, None, "returned by reset")
            self._new_trajs(np.arange(self.rows))
        traj_buf = views[("collector", "traj_ids")]
        T = traj_buf.shape[1]
        stage = self._staging(T)
        for st, carried in zip(stage.obs, self.cur_obs):
            st[0] = carried
        first_traj = self.cur_traj.copy()
        first_step, first_start = self.steps, self.ep_start.copy()
        versions = np.full(T, version, np.int64)  # per step (server inference: per forward pass)
        guard = self.guard
        same = self.mode == _SAME
        check_finite = cfg.check_finite
        max_len = cfg.max_frames_per_traj
        ends: list[tuple[int, np.ndarray]] = []  # (step of the batch, rows) for each step where episodes ended
        ep_start = self.ep_start
        one = len(vecs) == 1
        # the hot path: one observation leaf of the leaf's dtype and shape, no NaN check: written as is
        fast_obs = self.single_obs and not self.finite_obs
        dtype0, shape0 = self.batched_leaves[0].np_dtype, self.batched_leaves[0].shape
        clock = time.perf_counter
        policy_time = env_time = 0.0
        t_env = clock()
        for t, (obs_t, act_t, extra_t, nxt, cur, rew_t, term_t, trunc_t, done_t) in enumerate(stage.steps):
            random = self.steps < self.random_calls
            runner = self.random_runner if random else self.runner
            t_policy = clock()
            env_time += t_policy - t_env
            if hb is not None:
                hb.begin(POLICY)
            _, act_arrays, extras = runner.act(obs_t)
            t_env = clock()
            policy_time += t_env - t_policy
            if runner.remote:  # the version of the server's forward pass for this step
                versions[t] = runner.version
            for dst, arr in zip(act_t, act_arrays):
                dst[...] = arr
            env_arrays = act_arrays
            if guard is not None and not random:
                env_arrays = guard.apply(act_arrays, act_arrays, self._action_step)
            if extra_t:
                for dst, arr in zip(extra_t, extras or [0] * len(extra_t)):
                    dst[...] = arr
            finals: list[tuple[int, dict]] = []  # (copy, info) of same-step copies where episodes ended
            for c, vec in enumerate(vecs):
                if hb is not None:
                    hb.begin(STEP, int(self.env_ids[c * n]))
                obs, rew, term, trunc, info = vec.step(self._actions(env_arrays, c))
                rew, term, trunc = self._check_step(c, rew, term, trunc)
                if one:
                    rew_t[...] = rew
                    term_t[...] = term
                    trunc_t[...] = trunc
                else:
                    rows = slice(c * n, (c + 1) * n)
                    rew_t[rows] = rew
                    term_t[rows] = term
                    trunc_t[rows] = trunc
                if same and (term.any() or trunc.any()):
                    finals.append((c, info))
                if fast_obs and type(obs) is np.ndarray and obs.dtype is dtype0 and obs.shape == shape0:
                    if one:
                        nxt[0][...] = obs
                    else:
                        nxt[0][c * n : (c + 1) * n] = obs
                else:
                    self._write_obs(c, obs, nxt, None, "returned by step")
            ended = env_ended = np.logical_or(term_t, trunc_t, out=done_t)
            cut = None
            if max_len is not None:  # (an episode's length after this step: steps + 1 - its start)
                cut = ep_start <= self.steps + 1 - max_len
                cut &= ~env_ended
                if cut.any():
                    trunc_t |= cut
                    env_ended = ended.copy()
                    ended |= cut
            if check_finite and not np.isfinite(rew_t).all():
                row = int(np.flatnonzero(~np.isfinite(rew_t))[0])
                raise SpecError(
                    f"env {int(self.env_ids[row])}'s reward returned by {self._step_text(row, taken=True)} is "
                    f"{float(rew[row - (row // n) * n])!r}: not finite (check_finite=True)"
                )
            # the next observation of every row: its next obs, or its reset obs after an episode end
            for dst, src in zip(cur, nxt):
                dst[...] = src
            rows = ended.nonzero()[0]
            if len(rows):
                ends.append((t, rows))  # (their episodes are worked out once, at the end of the batch)
                self._after_ends(rows, env_ended, cut, finals, nxt, cur)
                ep_start[rows] = self.steps + 1
            self.steps += 1
            yield
        env_time += clock() - t_env
        if hb is not None:
            hb.idle()
        self.timing = {"env": env_time, "policy": policy_time}
        # into the slot: one copy per key ([T, E, ...] -> [E, T, ...])
        for leaf, st in zip(self.obs_leaves, stage.obs):
            _copy_transposed(views[leaf.key], st)
        for leaf, st in zip(self.obs_leaves, stage.next):
            _copy_transposed(views[("next",) + leaf.key], st)
        for leaf, st in zip(self.act_leaves + self.extra_leaves, stage.act + stage.extras):
            _copy_transposed(views[leaf.key], st)
        views[("next", "reward")][..., 0] = stage.rew.T
        views[("next", "terminated")][..., 0] = stage.term.T
        views[("next", "truncated")][..., 0] = stage.trunc.T
        views[("collector", "policy_version")][...] = versions
        write_traj_ids(traj_buf, stage.done.T, first_traj, self.total_rows)
        write_step_counts(views, stage.done.T, first_step - first_start)
        self.cur_traj += self.total_rows * np.count_nonzero(stage.done, axis=0)
        self._ends = self._tally(ends, stage, traj_buf, first_step, first_start)
        self.batches += 1

    @property
    def episodes(self) -> Episodes:  # type: ignore[override]
        """The episodes that ended in the last batch, in the order they ended, made from the
        arrays kept per step (a 256-sub-env CartPole ends about a thousand episodes per batch: no
        object per episode)."""
        if self._ends is None:
            return NO_EPISODES
        rows, ids, rets, lens, terms = self._ends
        return Episodes(np.asarray(self.env_ids)[rows], ids, rets, lens, terms)

    def _tally(
        self, ends: list[tuple[int, np.ndarray]], stage: _Staging, traj_buf: np.ndarray, first_step: int,
        first_start: np.ndarray,
    ) -> tuple[np.ndarray, ...] | None:
        """At the end of a batch: the episodes that ended in it (``ends``: the rows that ended at
        each step, in order) as columns -- rows, trajectory ids, returns, lengths, terminated, in the
        order they ended -- and each row's reward carried into the next batch (:attr:`ep_ret`).
        Worked out from the batch's rewards with a few whole-batch operations rather than per step:
        a row's return is the difference of its running sum of rewards (``float64``) at its end and
        at its previous end in this batch, or, for its first end, that sum plus what it carried in;
        its length likewise from steps (``first_start``: each row's episode start at the batch's
        first step, ``first_step``)."""
        sums = stage.sums  # [T, E]: each row's reward up to each step (a step at a time: faster than np.cumsum here)
        np.copyto(sums, stage.rew)
        for t in range(1, len(sums)):
            np.add(sums[t - 1], sums[t], out=sums[t])
        carried = self.ep_ret
        if not ends:
            carried += sums[-1]
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
        rets = sums[et, er] - sums[prev, er]
        lens = et - prev
        rets[first] = sums[et[first], er[first]] + carried[er[first]]
        lens[first] = first_step + et[first] + 1 - first_start[er[first]]
        carried += sums[-1]
        last = np.append(first[1:], True)  # the row's last end in this batch
        r_last = er[last]
        carried[r_last] = sums[-1, r_last] - sums[et[last], r_last]
        back = np.empty_like(order)  # back into the order the episodes ended in
        back[order] = np.arange(len(order))
        return rows, traj_buf[rows, ts], rets[back], lens[back], stage.term[ts, rows]

    def _after_ends(
        self, rows: np.ndarray, env_ended: np.ndarray, cut: np.ndarray | None, finals: list[tuple[int, dict]],
        next_bufs: list[np.ndarray], cur: list[np.ndarray],
    ) -> None:
        """The rows ``rows`` ended their episode in this step (``env_ended``: by the env, ``cut``:
        by ``max_frames_per_traj``), and ``cur`` (the next step's obs) holds what the step
        returned: make ``next_bufs`` (this step's next obs) hold their true final observation and
        ``cur`` their reset observation."""
        hb = self.heartbeat
        if self.reset_in_place:
            if hb is not None:
                hb.begin(RESET, int(self.env_ids[rows[0]]))
            self.vecs[0].reset_rows(rows, cur[0])
            return
        n = self.n
        for c, info in finals:  # same-step: the step returned the reset obs, the final one is in info
            final_obs = info.get("final_obs") if isinstance(info, dict) else None
            if final_obs is None:
                raise SpecError(
                    f"{self._what(c)} (autoreset mode SameStep) ended episodes at step {self.steps + 1} but its info "
                    f"has no 'final_obs': a same-step vector env returns the final observations there"
                )
            for r in np.flatnonzero(env_ended[c * n : (c + 1) * n]).tolist():
                self._write_row(c * n + r, final_obs[r], next_bufs, f"(final) returned by step {self.steps + 1}")
        # the rows the env does not reset itself: all in next-step mode, else those cut short
        if self.mode == _SAME:
            if cut is None or not cut.any():
                return
            rows = np.flatnonzero(cut)
        one = len(self.vecs) == 1
        for c, vec in enumerate(self.vecs):
            mine = rows if one else rows[(rows >= c * n) & (rows < (c + 1) * n)] - c * n
            if not len(mine):
                continue
            if hb is not None:
                hb.begin(RESET, int(self.env_ids[c * n + mine[0]]))
            # (one copy of one leaf: the env may write the reset rows into the next step's obs itself)
            into = cur[0] if one and self.single_obs and vec.writes_rows else None
            obs = vec.reset_rows(mine, into)
            at = mine if one else mine + c * n
            values = [obs] if self.single_obs else self.flatten_obs(obs)
            for k, (leaf, space, d, value) in enumerate(zip(self.batched_leaves, self.obs_spaces, cur, values)):
                if value is d:
                    pass  # written in place
                elif type(value) is not np.ndarray or value.dtype is not leaf.np_dtype or value.shape != leaf.shape:
                    d[at] = check_value(value, leaf, f"{self._what(c)}'s observation returned by reset", space)[mine]
                else:
                    d[at] = value[mine]
                if k in self.finite_obs:
                    row = first_nonfinite(d[at])
                    if row is not None:
                        self._nonfinite_obs(k, int(at[row]), d[at[row]], "returned by reset")

    @property
    def traj_counters(self) -> list[int]:
        """Per env row of this worker: the number of the trajectory it is in now."""
        return ((self.cur_traj - self.env_ids) // self.total_rows).tolist()

    def _new_trajs(self, rows: np.ndarray) -> None:
        """The rows ``rows`` start a new trajectory (between batches)."""
        self.cur_traj[rows] += self.total_rows
        self.ep_ret[rows] = 0.0
        self.ep_start[rows] = self.steps

    def _step_text(self, i: int, taken: bool = False) -> str:
        # (during a step: the episode's count of it is the same whether it is taken or not)
        return f"step {self.steps + 1} (step {self.steps + 1 - int(self.ep_start[i])} of its episode)"
