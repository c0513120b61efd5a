"""One step's values of a rollout's rows (:class:`StepValues`): what single envs' ``step``
returned, written into the step's views (observations, rewards, flags) with one numpy call each
where they are of the batch's own types, else env by env, checked; and ``check_finite``'s checks,
with errors that name the env, the step and the key.

Imported by worker processes: numpy only.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Sequence

import numpy as np

from .._core.datachecks import check_reward, check_value, first_nonfinite, short
from .._core.errors import SpecError
from .._core.layout import Leaf


_STACK_BELOW_BYTES = 4096  # an observation of this size or more is not stacked (see StepValues.observations)


class StepValues:
    """Writes and checks one step's values of the rows ``env_ids`` (global env ids, in row
    order), whose observation leaves are ``obs_leaves`` (of the spaces ``obs_spaces``).
    ``step_text(row, taken=False)`` names a row's current step in messages (the rollout's
    count of steps)."""

    def __init__(
        self, obs_leaves: list[Leaf], obs_spaces: list[Any], env_ids: np.ndarray, step_text: Callable[..., str],
    ) -> None:
        self.obs_leaves, self.env_ids, self.step_text = obs_leaves, env_ids, step_text
        self.leaf0, self.space0 = obs_leaves[0], obs_spaces[0]
        self.dtype0, self.shape0 = self.leaf0.np_dtype, self.leaf0.shape
        self.rows_shape0 = (len(env_ids),) + tuple(self.shape0)  # (one step's observations, stacked)
        # large observations (pixels) go in env by env: a stack first would copy each frame twice
        self.stack = self.dtype0.itemsize * int(np.prod(self.shape0, dtype=np.int64)) < _STACK_BELOW_BYTES

    def write(
        self, results: list[tuple], next0: np.ndarray, rew_t: np.ndarray, term_t: np.ndarray, trunc_t: np.ndarray,
    ) -> tuple[tuple, tuple]:
        """Single envs of one observation leaf: one step's ``results`` (what each env's ``step``
        returned) into ``next0``, ``rew_t``, ``term_t`` and ``trunc_t``, with one numpy call each
        where they are of the batch's own types (a numpy write per env and value costs more than
        the Python list it is written from), else env by env, each checked. Returns the flags, as
        the envs returned them (see :meth:`observations`, :meth:`rewards` and :meth:`flags`)."""
        rew_l, term_l, trunc_l = self.observations(results, next0)
        rew_t[:] = self.rewards(rew_l)
        self.flags(term_l, trunc_l, term_t, trunc_t)
        return term_l, trunc_l

    def observations(self, results: list[tuple], next0: np.ndarray) -> tuple[tuple, tuple, tuple]:
        """One step's ``results`` (what each env's ``step`` returned): the observations into
        ``next0``; returns the rewards and both flags, as the envs returned them.

        Small observations are stacked by one ``np.array`` call and written as they are where the
        stack has the leaf's own dtype and shape: then no value was cast, so none needs a check
        (a look at each env's array costs more than the stacking). Large ones (from
        ``_STACK_BELOW_BYTES``) are written env by env, each looked at: the copy is the cost there."""
        obs_l, rew_l, term_l, trunc_l, _ = zip(*results)
        dtype0, shape0 = self.dtype0, self.shape0
        stacked = None
        if self.stack:
            try:
                stacked = np.array(obs_l)
            except (TypeError, ValueError, OverflowError):  # (ragged, or not numbers: each checked below, with its message)
                pass
        if stacked is not None and stacked.dtype is dtype0 and stacked.shape == self.rows_shape0:
            next0[...] = stacked
        else:
            ids, leaf0, space0 = self.env_ids, self.leaf0, self.space0
            for i, obs in enumerate(obs_l):
                if getattr(obs, "dtype", None) is not dtype0 or obs.shape != shape0:
                    obs = check_value(obs, leaf0, f"env {ids[i]}'s observation", space0)
                next0[i] = obs
        return rew_l, term_l, trunc_l

    def rewards(self, rew_l: Sequence[Any]) -> Sequence[Any]:
        """One step's rewards, as the envs returned them: as they are where each is a Python
        float (what most envs return; numpy stores those exactly), else each checked and
        converted (an error names the env and its step)."""
        if all(reward.__class__ is float for reward in rew_l):
            return rew_l
        return [
            reward if isinstance(reward, (float, int)) else
            check_reward(reward, f"env {self.env_ids[i]}'s reward at {self.step_text(i)}")
            for i, reward in enumerate(rew_l)
        ]

    @staticmethod
    def flags(term_l: Sequence[Any], trunc_l: Sequence[Any], term_t: np.ndarray, trunc_t: np.ndarray) -> None:
        """One step's flags, as the envs returned them, into ``term_t`` and ``trunc_t``."""
        try:  # (numpy reads bools, numpy bools and ints alike)
            term_t[:] = term_l
            trunc_t[:] = trunc_l
        except (TypeError, ValueError):  # (a flag numpy does not take as one value: one at a time)
            for i, (terminated, truncated) in enumerate(zip(term_l, trunc_l)):
                term_t[i] = terminated
                trunc_t[i] = truncated

    def nonfinite_obs(self, k: int, i: int, value: np.ndarray, when: str) -> NoReturn:
        """``check_finite``: row ``i``'s observation leaf ``k`` (``value``), returned ``when``, is not finite."""
        leaf = self.obs_leaves[k]
        raise SpecError(
            f"env {self.env_ids[i]}'s observation for key {'.'.join(leaf.key)!r} {when} is "
            f"{short(value)}: not finite (check_finite=True; a float64 value beyond the range of "
            f"{leaf.dtype} is stored as inf too)"
        )

    def check_finite(self, next_obs: Sequence[np.ndarray], rewards: np.ndarray, finite_obs: Sequence[int]) -> None:
        """``check_finite``: the float observation leaves ``finite_obs`` of ``next_obs`` (none: checked
        elsewhere) and the ``rewards`` of the step just taken."""
        for k in finite_obs if len(next_obs) else ():
            row = first_nonfinite(next_obs[k])
            if row is not None:
                self.nonfinite_obs(k, row, next_obs[k][row], f"returned by {self.step_text(row, taken=True)}")
        if not np.isfinite(rewards).all():
            row = int(np.flatnonzero(~np.isfinite(rewards))[0])
            raise SpecError(
                f"env {int(self.env_ids[row])}'s reward returned by {self.step_text(row, taken=True)} is "
                f"{float(rewards[row])!r}: not finite (check_finite=True)"
            )


__all__ = ["StepValues"]
