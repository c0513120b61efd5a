"""What an env may return and a policy may write: the rules that keep the batch exact.

A value is stored in a leaf of the batch (whose dtype the space fixes) only if that keeps its
meaning:

- **same dtype**: stored as is (the hot path: no check at all);
- **same kind, other width** is a documented cast: floats are rounded to the leaf's float dtype
  (float64 -> float32; a value beyond its range becomes +-inf, which ``check_finite`` reports),
  integers are stored exactly and must fit the leaf's dtype (300 into uint8 is an error, never
  wrapped to 44); booleans fit any integer leaf;
- **another kind** (a float into an integer or boolean space, an integer into a float space,
  anything non-numeric) is a :class:`SpecError` naming the value, its dtype and the space.

Also here: the reward rule (a real scalar, stored as float32), the opt-in check for NaN/inf
(``check_finite``) and what happens to Box actions outside their bounds (``action_bounds``).

Imported by worker processes: numpy and gymnasium only.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import numpy as np
from gymnasium import spaces

from .errors import SpecError
from .layout import Key, Leaf, leaf_spaces

ActionBounds = Literal["pass", "clip", "error"]
ACTION_BOUNDS = ("pass", "clip", "error")

_KIND = {"b": "booleans", "i": "integers", "u": "integers", "f": "floats"}


def short(value: Any, width: int = 80) -> str:
    """A one-line repr of ``value`` of at most about ``width`` characters."""
    if isinstance(value, np.ndarray) and value.ndim > 0:
        if value.size <= 8:
            text = repr(value.tolist())
        else:
            text = np.array2string(value, threshold=8, edgeitems=2, separator=", ", max_line_width=10_000)
            text = " ".join(text.split())
    else:
        text = repr(value.item() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= width else text[: width - 3] + "..."


def key_name(key: Key) -> str:
    return ".".join(key)


def dtype_problem(arr: np.ndarray, want: np.dtype, describe: Callable[[], str]) -> tuple[str, str] | None:
    """Why ``arr`` cannot be stored in a leaf of dtype ``want``, as ``(phrase, kind)``; ``None``
    when it can (see the module docstring).

    ``phrase`` completes a sentence whose subject is the value ("has dtype int64, but <space>
    holds floats (float32)"), where ``describe()`` names the space (called only for a problem: a
    space's repr is slow); ``kind`` is ``"kind"`` (another kind of number, or no number) or
    ``"range"`` (an integer that does not fit).
    """
    src = arr.dtype
    if src == want:
        return None
    have, need = src.kind, want.kind
    if have == need == "f" or (need in "iu" and (have == "b" or (have in "iu" and np.can_cast(src, want)))):
        return None
    if need in "iu" and have in "iu":  # a narrower integer type: the values must fit
        if arr.size == 0:
            return None
        info = np.iinfo(want)
        low, high = int(arr.min()), int(arr.max())
        if low >= info.min and high <= info.max:
            return None
        bad = low if low < info.min else high
        where = "" if arr.ndim == 0 else f" (at index {tuple(int(i) for i in np.argwhere(arr == bad)[0])})"
        return (
            f"holds {bad}{where}, outside the range of the dtype {want} ({info.min} to {info.max}) "
            f"of {describe()}: it would be stored wrapped",
            "range",
        )
    holds = f"{describe()} holds {_KIND.get(need, 'values')} ({want})"
    if have not in "biuf":
        return f"has dtype {src}, which is not a real number type ({holds})", "kind"
    return f"has dtype {src}, but {holds}", "kind"


def _space_text(space: spaces.Space | None, leaf: Leaf) -> str:
    return repr(space) if space is not None else f"shape {leaf.shape}, dtype {leaf.dtype}"


def check_value(value: Any, leaf: Leaf, what: str, space: spaces.Space | None = None) -> np.ndarray:
    """``value`` (an env's observation leaf) as an array that can be written into the leaf, or a
    :class:`SpecError` naming ``what`` (e.g. "env 3's observation"), the key, the value, its
    dtype, the space and the fix. Python scalars and lists are fine (a Discrete observation may
    be a Python int); see the module docstring for the dtype rules."""
    arr = np.asarray(value)
    if arr.shape != leaf.shape:
        raise SpecError(
            f"{what} for key {key_name(leaf.key)!r} has shape {arr.shape}, but its space declares "
            f"{leaf.shape} ({_space_text(space, leaf)}); fix the env (or wrap it) so that its values "
            f"match its declared space"
        )
    want = leaf.np_dtype
    if arr.dtype.kind == "f" and want.kind == "f":  # the common cast (float64 for float32): no value check
        return arr
    problem = dtype_problem(arr, want, lambda: f"its space {_space_text(space, leaf)}")
    if problem is not None:
        phrase, kind = problem
        if kind == "range":
            fix = "clip it in the env to the dtype's range, or declare a wider dtype in the space"
        elif arr.dtype.kind not in "biuf":
            fix = f"return numbers ({want})"
        elif want.kind == "f":
            fix = (
                f"return {want} values (e.g. obs.astype(np.{want})), or wrap the env in "
                f"gymnasium.wrappers.DtypeObservation(env, np.{want})"
            )
        else:
            fix = (
                f"round (and clip) them in the env and return {want}, or declare a float space (for a "
                f"Box, Discrete, MultiDiscrete or MultiBinary space, wrapping the env in "
                f"gymnasium.wrappers.DtypeObservation(env, np.float32) does that)"
            )
        raise SpecError(f"{what} for key {key_name(leaf.key)!r} {phrase} (value: {short(arr)}); {fix}")
    return arr


def check_reward(reward: Any, what: str) -> float:
    """``reward`` as a Python float, or a :class:`SpecError`: a reward must be a real scalar (a
    Python or numpy int or float, or a 0-d array of one); it is stored as float32."""
    try:
        arr = np.asarray(reward)
    except Exception:  # noqa: BLE001 - any object numpy cannot take is the same mistake
        arr = np.asarray(None)
    if arr.shape != () or arr.dtype.kind not in "biuf":
        hint = " (return float(reward) for a one-element array)" if arr.size == 1 and arr.dtype.kind in "biuf" else ""
        raise SpecError(
            f"{what} is {short(reward)} ({type(reward).__name__}"
            + (f", dtype {arr.dtype}, shape {arr.shape}" if arr.dtype.kind != "O" else "")
            + f"): a reward must be a real scalar, a Python or numpy int or float{hint}"
        )
    return float(arr)


def first_nonfinite(rows: np.ndarray) -> int | None:
    """Index of the first row of ``rows`` (``[E, ...]``, floats) holding NaN or +-inf, or None."""
    ok = np.isfinite(rows)
    if ok.all():
        return None
    return int(np.argwhere(~ok)[0][0])


class ActionGuard:
    """Checks a policy's actions before they reach the envs: NaN/inf (``check_finite``) and Box
    leaves outside their bounds (``action_bounds``). Random actions (sampled from the space)
    need no guard.

    :meth:`apply` returns what each env's ``step`` gets: the policy's actions, or with
    ``"clip"`` the actions clipped to the bounds (the arrays the batch stores are never changed).
    """

    def __init__(
        self,
        act_space: spaces.Space,
        act_leaves: list[Leaf],
        env_names: Sequence[str],
        per_env: Callable[[list[np.ndarray]], Sequence[Any]],
        *,
        check_finite: bool,
        action_bounds: ActionBounds,
    ) -> None:
        self.act_space = act_space
        self.leaves = act_leaves
        self.env_names = list(env_names)
        self.per_env = per_env
        self.finite = [j for j, leaf in enumerate(act_leaves) if leaf.np_dtype.kind == "f"] if check_finite else []
        self.mode = action_bounds
        # (leaf index, space, low, high) of each Box leaf with at least one finite bound
        self.bounded: list[tuple[int, spaces.Box, np.ndarray, np.ndarray]] = []
        if action_bounds != "pass":
            for j, sub in enumerate(leaf_spaces(act_space)):
                if isinstance(sub, spaces.Box) and (np.isfinite(sub.low).any() or np.isfinite(sub.high).any()):
                    dtype = act_leaves[j].np_dtype
                    self.bounded.append((j, sub, sub.low.astype(dtype), sub.high.astype(dtype)))

    @property
    def active(self) -> bool:
        """False when there is nothing to check (the fill loop then skips the guard)."""
        return bool(self.finite or self.bounded)

    def apply(
        self,
        arrays: list[np.ndarray],
        env_actions: Sequence[Any],
        when: Callable[[int], str],
        rows: list[int] | None = None,
    ) -> Sequence[Any]:
        """Raise :class:`SpecError` for a NaN/inf action (``check_finite``) or one outside its
        Box's bounds (``"error"``); return the actions for the envs (clipped with ``"clip"``).
        ``when(row)`` says when env ``row`` takes it, for the message (e.g. "at step 12");
        ``rows``: the only rows to check (default: all)."""
        for j in self.finite:
            arr = arrays[j] if rows is None else arrays[j][rows]
            row = first_nonfinite(arr)
            if row is not None:
                row = row if rows is None else rows[row]
                raise SpecError(
                    f"the policy's action for {self.env_names[row]} {when(row)} is not finite: key "
                    f"{key_name(self.leaves[j].key)!r} is {short(arrays[j][row])} (check_finite=True)"
                )
        if not self.bounded:
            return env_actions
        if self.mode == "clip":
            clipped = list(arrays)
            for j, _, low, high in self.bounded:
                clipped[j] = np.clip(arrays[j], low, high)
            return self.per_env(clipped)
        for j, space, low, high in self.bounded:
            arr = arrays[j] if rows is None else arrays[j][rows]
            inside = (arr >= low) & (arr <= high)  # NaN is outside too
            if not inside.all():
                row = int(np.argwhere(~inside)[0][0])
                row = row if rows is None else rows[row]
                raise SpecError(
                    f"the policy's action for {self.env_names[row]} {when(row)} is outside its bounds: "
                    f"key {key_name(self.leaves[j].key)!r} is {short(arrays[j][row])}, but {space} has "
                    f"low={short(space.low)}, high={short(space.high)} (action_bounds='error'; 'clip' "
                    f"would clip it for the env, 'pass' would hand it over as it is)"
                )
        return env_actions
