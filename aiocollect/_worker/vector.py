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
it in its spec (``"num_envs"``, read back by :func:`reported_sub_envs`), and the collector's
:class:`~aiocollect._core.geometry.Geometry` becomes ``geometry.with_sub_envs(num_envs)``, from which
the batch layout and the counters are derived (:func:`reported_sub_envs`, then
:meth:`Geometry.with_sub_envs <aiocollect._core.geometry.Geometry.with_sub_envs>`). A
:class:`~aiocollect._worker.rollout.RolloutConfig` counts env *copies* (``total_envs``;
``random_frames`` in frames of each copy) and sub-envs only in ``traj_counters``.

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

from typing import TYPE_CHECKING, Any

import numpy as np

from .._core.datachecks import check_value, first_nonfinite, short
from .._core.errors import ConfigError, SpecError
from .._core.heartbeat import RESET, STEP
from .._core.layout import Leaf, is_bare, unflattener
from .._core.registry import install as install_registry
from .vecenv import _SAME, VecEnv, is_vector
if TYPE_CHECKING:
    from .groups import GroupedRollout
from .envs import close_envs, create_env, made_by, make_env
from .rollout import Rollout, RolloutConfig
from .policy_setup import action_guard
from .seeding import row_seeds, seeded_spaces

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
        return _replayed(VectorRollout(cfg, local_policy, env), cfg)
    try:
        env = make_env(cfg.env_fn, cfg.env_kwargs, env)
    except BaseException:
        close_envs([env])
        raise
    if cfg.worker_groups > 1:
        from .groups import GroupedRollout

        return _replayed(GroupedRollout(cfg, env), cfg)
    return _replayed(Rollout(cfg, local_policy, env), cfg)


def _replayed(rollout: Any, cfg: RolloutConfig) -> Any:
    """A replacement worker's rollout, with the env calls kept for it applied (``set_attr``,
    persisted calls: see :mod:`aiocollect._worker.env_calls`)."""
    if cfg.env_calls:
        from .env_calls import replay

        try:
            replay(rollout, cfg.env_calls)
        except BaseException:
            rollout.close()
            raise
    return rollout


def reported_sub_envs(specs: list[dict]) -> int | None:
    """The sub-envs of each env copy, as the workers' specs report them (a vector env's
    ``num_envs``, see :meth:`VectorRollout.spec`); ``None`` for single envs. Raises
    :class:`SpecError` when workers disagree."""
    counts = [int(s.get("num_envs", 1)) for s in specs]
    n = counts[0]
    for w, k in enumerate(counts):
        if k != n:
            raise SpecError(
                f"worker {w}'s envs have num_envs={k} sub-envs but worker 0's have {n}: every vector env must have "
                f"the same num_envs (and every worker's env must be of the same kind)"
            )
    return None if n == 1 and "num_envs" not in specs[0] else n


class _ArrayActions:
    """Stands in for a runner's per-env conversion: a vector env takes the action arrays."""

    def per_env(self, arrays: list[np.ndarray], num_envs: int) -> list[np.ndarray]:
        return arrays


# -- the rollout ---------------------------------------------------------------------------------


class VectorRollout(Rollout):
    """Steps ``envs_per_worker`` vector envs of ``n`` sub-envs each as ``envs_per_worker * n``
    rows, with :class:`~aiocollect._worker.rollout.Rollout`'s stepping loop; this class makes,
    steps and resets the vector envs."""

    serial = False  # steps written into time-major buffers, copied into the slot at the batch's end
    takes_arrays = True

    def __init__(self, cfg: RolloutConfig, local_policy: Any = None, env: Any = None) -> None:
        self.cfg = cfg
        self.envs: list[Any] = [] if env is None else [env]
        try:
            self.vecs: list[VecEnv] = []
            for c in range(cfg.envs_per_worker):
                if c >= len(self.envs):
                    self.envs.append(create_env(cfg.env_fn, cfg.env_kwargs, c))
                self.vecs.append(self._check(c, self.envs[c]))
            self._setup(local_policy)
        except BaseException:
            self.close()
            raise

    def _check(self, c: int, env: Any) -> VecEnv:
        who = f"env {c} of worker {self.cfg.worker}{made_by(self.cfg.env_fn_index, c)}"
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
                    f"{vec.mode}, but env 0{made_by(self.cfg.env_fn_index, 0)} has num_envs={first.n}, {first.obs_space}, "
                    f"{first.act_space}, {first.mode}: all vector envs must agree"
                )
        return vec

    def _setup(self, local_policy: Any) -> None:
        cfg = self.cfg
        n = self.n = self.vecs[0].n
        E = self.rows = cfg.envs_per_worker * n
        self.total_rows = cfg.total_envs * n  # (every worker's vector envs have n sub-envs)
        # init_random_frames: ``cfg.random_frames`` frames of each copy are ceil(./n) steps of it
        self.random_calls = -(-cfg.random_frames // n)
        self.obs_space, self.act_space = self.vecs[0].obs_space, self.vecs[0].act_space
        self.mode = self.vecs[0].mode
        self.same = self.mode == _SAME
        if cfg.one_hot_actions:
            raise ConfigError(
                "categorical_action_encoding=False (one-hot Discrete actions) is for single envs, and this worker's "
                "env is a vector env; drop the option (actions are stored as indices), or make single envs"
            )
        self._layout(cfg.check_finite, False)
        # the same leaves with the sub-envs' dimension in front: what one step of a copy returns
        self.batched_leaves = [Leaf(leaf.key, (n,) + leaf.shape, leaf.dtype) for leaf in self.obs_leaves]
        self.unflatten_act = unflattener(self.act_space)
        self.bare_act = is_bare(self.act_space)
        self.fast_obs = self.single_obs and not self.finite_obs
        counters = cfg.traj_counters
        if counters is not None and len(counters) != self.total_rows:
            raise ConfigError(
                f"the trajectory counters to resume from hold {len(counters)} envs, but this collector's "
                f"{cfg.total_envs} vector envs have {self.total_rows} sub-envs; resume with the same num_workers, "
                f"envs_per_worker and num_envs"
            )
        env_ids = np.arange(cfg.worker * E, (cfg.worker + 1) * E, dtype=np.int64)
        self._start_rows(env_ids, self.total_rows, [counters[g] for g in env_ids] if counters else [0] * E)
        seeds = row_seeds(cfg.seed, cfg.static_seed, cfg.restart, self.env_ids)
        self.action_spaces = seeded_spaces([self.act_space] * E, seeds)
        self.guard = action_guard(
            self.act_space, self.act_leaves, [f"env {g}" for g in self.env_ids], cfg.check_finite, cfg.action_bounds,
            per_env=lambda arrays: arrays,
        )
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
        self._build_policy(local_policy, self.total_rows)
        if hasattr(self.runner, "env_actions"):
            self.runner.env_actions = _ArrayActions()  # the env takes arrays: no per-env list
        self._decorrelate()

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
                    self.values.nonfinite_obs(k, c * n + row, dst[row], when)

    def _write_row(self, i: int, obs: Any, bufs: list[np.ndarray], when: str) -> None:
        """Write one sub-env's observation (unbatched: a final observation) into row ``i`` of
        ``bufs`` (``[E, ...]`` each)."""
        values = [obs] if self.single_obs else self.flatten_obs(obs)
        for k, (leaf, space, buf, value) in enumerate(zip(self.obs_leaves, self.obs_spaces, bufs, values)):
            value = check_value(value, leaf, f"env {int(self.env_ids[i])}'s observation {when}", space)
            buf[i] = value
            if k in self.finite_obs and not np.isfinite(buf[i]).all():
                self.values.nonfinite_obs(k, i, buf[i], when)

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

    def _step_envs(
        self, actions: Any, obs_t: list[np.ndarray], nxt: list[np.ndarray], rew_t: np.ndarray, term_t: np.ndarray,
        trunc_t: np.ndarray,
    ) -> list[tuple[int, dict]]:
        """One ``step`` of every vector env (see :meth:`Rollout._step_envs`); returns ``(copy, info)``
        of the same-step copies where episodes ended (their final observations are in the info)."""
        vecs, n, hb = self.vecs, self.n, self.heartbeat
        one = len(vecs) == 1
        dtype0, shape0 = self.batched_leaves[0].np_dtype, self.batched_leaves[0].shape
        finals: list[tuple[int, dict]] = []
        for c, vec in enumerate(vecs):
            if hb is not None:
                hb.begin(STEP, int(self.env_ids[c * n]))
            obs, rew, term, trunc, info = vec.step(self._actions(actions, c))
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
            if self.same and (term.any() or trunc.any()):
                finals.append((c, info))
            # the hot path: one observation leaf of the leaf's dtype and shape, no NaN check: written as is
            if self.fast_obs and type(obs) is np.ndarray and obs.dtype is dtype0 and obs.shape == shape0:
                if one:
                    nxt[0][...] = obs
                else:
                    nxt[0][c * n : (c + 1) * n] = obs
            else:
                self._write_obs(c, obs, nxt, None, "returned by step")
        return finals

    def _reset_all(self) -> None:
        hb = self.heartbeat
        for c, vec in enumerate(self.vecs):
            if hb is not None:
                hb.begin(RESET, int(self.env_ids[c * self.n]))
            obs = vec.reset([None] * self.n)
            self._write_obs(c, obs, self.cur_obs, None, "returned by reset")

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
                        self.values.nonfinite_obs(k, int(at[row]), d[at[row]], "returned by reset")
