"""From an env's spaces to the batch layout: a flat list of leaves, each a nested key, a
per-frame shape and a dtype, and how each worker's batch slots sit in shared memory.

Imported by worker processes: numpy and gymnasium only.
"""

from __future__ import annotations

import dataclasses
import math
import functools
from typing import Any, Callable, Iterable

import numpy as np
from gymnasium import spaces

from .errors import SpecError
from .geometry import Geometry

#: a nested key of a batch, as a tuple (``("next", "reward")``; ``("action",)`` for a top-level one)
Key = tuple[str, ...]

#: keys the collector writes itself; a Dict observation space may not use them at its top level.
RESERVED_KEYS = frozenset({"action", "done", "terminated", "truncated", "next", "collector", "reward"})
_ALIGN = 64


def as_key(key: str | Iterable[str]) -> Key:
    """``key`` as a :data:`Key`: a str names a top-level entry (``"action"`` -> ``("action",)``),
    any other iterable of strs (a tuple, as tensordict's nested keys are) becomes a tuple.
    Nothing else is checked: callers that take a key from the user validate it themselves."""
    return (key,) if isinstance(key, str) else tuple(key)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One tensor of the batch: ``key`` (nested), per-frame ``shape``, numpy ``dtype`` name."""

    key: Key
    shape: tuple[int, ...]
    dtype: str

    @functools.cached_property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)  # cached: the per-step checks read it


def _space_name(space: spaces.Space) -> str:
    return repr(space)


def space_leaves(space: spaces.Space, prefix: Key, *, root_dict: bool = False) -> list[Leaf]:
    """The leaves of ``space`` under ``prefix``.

    With ``root_dict=True`` a top-level Dict puts its keys at the root of the batch (TorchRL's
    convention for Dict observations: ``"pixels"``, ``"state"`` ...), else under ``prefix``.
    """
    if isinstance(space, spaces.Box):
        return [Leaf(prefix, tuple(space.shape), np.dtype(space.dtype).name)]
    if isinstance(space, spaces.Discrete):
        return [Leaf(prefix, (), "int64")]
    if isinstance(space, spaces.MultiDiscrete):
        return [Leaf(prefix, tuple(space.shape), "int64")]
    if isinstance(space, spaces.MultiBinary):
        return [Leaf(prefix, tuple(space.shape), "int8")]
    if isinstance(space, spaces.Dict):
        out: list[Leaf] = []
        for name, sub in space.spaces.items():
            if not isinstance(name, str):
                raise SpecError(f"Dict space keys must be strings, got {name!r} in {_space_name(space)}")
            if root_dict and name in RESERVED_KEYS:
                raise SpecError(
                    f"the observation space is a Dict with a top-level key {name!r}, which the batch "
                    f"layout reserves ({sorted(RESERVED_KEYS)}); rename it with a gymnasium wrapper "
                    f"(for example gymnasium.wrappers.TransformObservation)"
                )
            out += space_leaves(sub, (name,) if root_dict else prefix + (name,))
        return out
    if isinstance(space, spaces.Tuple):
        out = []
        for i, sub in enumerate(space.spaces):
            out += space_leaves(sub, prefix + (str(i),))
        return out
    raise SpecError(
        f"unsupported space {_space_name(space)} at key {'.'.join(prefix) or '<root>'}: aiocollect "
        f"supports Box, Discrete, MultiDiscrete, MultiBinary and nested Dict/Tuple; flatten it with "
        f"a gymnasium wrapper (for example gymnasium.wrappers.FlattenObservation)"
    )


def observation_leaves(space: spaces.Space) -> list[Leaf]:
    return space_leaves(space, ("observation",), root_dict=True)


def action_leaves(space: spaces.Space, one_hot: bool = False) -> list[Leaf]:
    """The action's leaves; with ``one_hot`` (``categorical_action_encoding=False``, TorchRL
    GymEnv's default) a Discrete action space's action is stored one-hot: ``[n]`` int64."""
    if one_hot:
        if not isinstance(space, spaces.Discrete):
            raise SpecError(
                f"categorical_action_encoding=False stores a Discrete action one-hot, but the action space is "
                f"{_space_name(space)}; drop the option (it is for Discrete action spaces)"
            )
        return [Leaf(("action",), (int(space.n),), "int64")]
    return space_leaves(space, ("action",))


def is_bare(space: spaces.Space) -> bool:
    """Whether a value of ``space`` is its only leaf's value itself (a Box, Discrete ...), not a
    dict or tuple holding it: a one-leaf Dict or Tuple space has one leaf, but its values are
    still structured (``{"pixels": array}``) and go through :func:`flattener`/:func:`unflattener`."""
    return not isinstance(space, (spaces.Dict, spaces.Tuple))


def leaf_spaces(space: spaces.Space) -> list[spaces.Space]:
    """The space of each leaf of ``space``, in the order of :func:`space_leaves`."""
    if isinstance(space, spaces.Dict):
        return [s for sub in space.spaces.values() for s in leaf_spaces(sub)]
    if isinstance(space, spaces.Tuple):
        return [s for sub in space.spaces for s in leaf_spaces(sub)]
    return [space]


def flattener(space: spaces.Space, what: str) -> Callable[[Any], list[Any]]:
    """A function mapping a structured value of ``space`` to its leaf values, in leaf order."""
    if isinstance(space, spaces.Dict):
        subs = [(name, flattener(sub, f"{what}[{name!r}]")) for name, sub in space.spaces.items()]

        def flatten_dict(value: Any) -> list[Any]:
            out: list[Any] = []
            try:
                for name, sub in subs:
                    out += sub(value[name])
            except (KeyError, TypeError) as exc:
                raise SpecError(
                    f"{what} {value!r:.200} does not match {_space_name(space)}: {exc!r}"
                ) from None
            return out

        return flatten_dict
    if isinstance(space, spaces.Tuple):
        subs_t = [flattener(sub, f"{what}[{i}]") for i, sub in enumerate(space.spaces)]

        def flatten_tuple(value: Any) -> list[Any]:
            if len(value) != len(subs_t):
                raise SpecError(f"{what} has {len(value)} parts but {_space_name(space)} has {len(subs_t)}")
            out: list[Any] = []
            for sub, part in zip(subs_t, value):
                out += sub(part)
            return out

        return flatten_tuple
    return _single


def _single(value: Any) -> list[Any]:
    return [value]


def unflattener(space: spaces.Space) -> Callable[[list[Any]], Any]:
    """Inverse of :func:`flattener`: builds the env's structured action from leaf values."""
    count = len(space_leaves(space, ()))
    if isinstance(space, spaces.Dict):
        parts = []
        start = 0
        for name, sub in space.spaces.items():
            n = len(space_leaves(sub, ()))
            parts.append((name, unflattener(sub), start, start + n))
            start += n
        return lambda values: {name: fn(values[a:b]) for name, fn, a, b in parts}
    if isinstance(space, spaces.Tuple):
        parts_t = []
        start = 0
        for sub in space.spaces:
            n = len(space_leaves(sub, ()))
            parts_t.append((unflattener(sub), start, start + n))
            start += n
        return lambda values: tuple(fn(values[a:b]) for fn, a, b in parts_t)
    assert count == 1
    return _first


def _first(values: list[Any]) -> Any:
    return values[0]


# -- slots ------------------------------------------------------------------------------------


def frame_leaves(
    obs: list[Leaf], act: list[Leaf], extras: list[Leaf], step_count: bool = False, env_fn_index: bool = False
) -> list[Leaf]:
    """Every leaf a worker writes into a slot, in a fixed order. (``("next", "done")`` is not
    stored: the collector computes it once per batch from terminated and truncated.)
    ``step_count``: also ``step_count`` and ``("next", "step_count")`` (``max_frames_per_traj``,
    as TorchRL's ``StepCounter``). ``env_fn_index``: also ``("collector", "env_fn_index")``, the
    index of the factory that made each row's env (a list of ``create_env_fn``)."""
    leaves = list(obs) + list(act) + list(extras)
    if step_count:
        taken = [leaf.key for leaf in leaves if leaf.key[0] == "step_count"]
        if taken:
            raise SpecError(
                f"max_frames_per_traj adds the key 'step_count' to the batch (as TorchRL's StepCounter), but the "
                f"env's observations or the policy's outputs have {'.'.join(taken[0])!r} already; rename that key"
            )
        leaves += [Leaf(("step_count",), (1,), "int64"), Leaf(("next", "step_count"), (1,), "int64")]
    leaves += [Leaf(("next",) + leaf.key, leaf.shape, leaf.dtype) for leaf in obs]
    leaves += [
        Leaf(("next", "reward"), (1,), "float32"),
        Leaf(("next", "terminated"), (1,), "bool"),
        Leaf(("next", "truncated"), (1,), "bool"),
        Leaf(("collector", "traj_ids"), (), "int64"),
        Leaf(("collector", "policy_version"), (), "int64"),
        Leaf(("collector", "env_epoch"), (), "int64"),
    ]
    if env_fn_index:
        leaves.append(Leaf(("collector", "env_fn_index"), (), "int64"))
    return leaves


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where each leaf of the batch slots lives in the workers' shared-memory segment.

    One segment holds ``num_slots`` slots for all ``workers``; in a slot, each leaf is one array of
    ``workers * rows`` env rows of ``frames_per_row`` frames, worker ``w`` writing rows
    ``w * rows`` to ``(w + 1) * rows``. So the parts of a sync batch that sit in the same slot of
    every worker are one contiguous array per leaf: the batch is a view (``zero_copy``) or one
    copy per leaf. (Rows and frames mean what they mean in :class:`~aiocollect._core.geometry.Geometry`:
    a row is a single env or one sub-env of a vector env.)
    """

    leaves: tuple[Leaf, ...]
    rows: int  # of each worker (Geometry.rows_per_worker)
    frames_per_row: int  # T (Geometry.frames_per_row)
    num_slots: int
    offsets: tuple[int, ...]
    slot_nbytes: int
    workers: int = 1

    @classmethod
    def build(cls, leaves: list[Leaf], rows: int, frames_per_row: int, num_slots: int, workers: int = 1) -> "SlotLayout":
        """The layout of ``num_slots`` slots of ``workers`` workers' ``rows`` rows each of
        ``frames_per_row`` frames of ``leaves``."""
        offsets = []
        pos = 0
        for leaf in leaves:
            nbytes = workers * rows * frames_per_row * math.prod(leaf.shape) * leaf.np_dtype.itemsize
            pos = -(-pos // _ALIGN) * _ALIGN
            offsets.append(pos)
            pos += nbytes
        slot_nbytes = -(-max(pos, 1) // 4096) * 4096  # page-aligned: a slot can be mapped alone
        return cls(tuple(leaves), rows, frames_per_row, num_slots, tuple(offsets), slot_nbytes, workers)

    @classmethod
    def of(cls, geometry: Geometry, leaves: list[Leaf], num_slots: int) -> "SlotLayout":
        """The layout of ``num_slots`` slots of ``geometry``'s workers, rows and frames per row."""
        return cls.build(leaves, geometry.rows_per_worker, geometry.frames_per_row, num_slots, geometry.workers)

    @property
    def nbytes(self) -> int:
        return self.slot_nbytes * self.num_slots

    def slot_array(self, buffer: Any, slot: int) -> np.ndarray:
        """A new uint8 array over slot ``slot``'s bytes of ``buffer``: the views that
        :meth:`views` makes of it (``mapped_slot=True``) refer to it, so its reference count says
        whether any of them is still alive."""
        return np.frombuffer(buffer, np.uint8, count=self.slot_nbytes, offset=slot * self.slot_nbytes)

    def views(self, buffer: Any, slot: int, worker: int | None = None, *, mapped_slot: bool = False) -> dict[Key, np.ndarray]:
        """numpy views of one slot over ``buffer`` (a mapping of the segment, or with
        ``mapped_slot`` of that slot alone): worker ``worker``'s rows, or every worker's."""
        base = 0 if mapped_slot else slot * self.slot_nbytes
        rows = self.rows * self.workers
        out = {}
        for leaf, off in zip(self.leaves, self.offsets):
            shape = (rows, self.frames_per_row) + leaf.shape
            count = math.prod(shape)  # (of Python ints: a tenth of np.prod's cost, once a leaf a batch)
            array = np.frombuffer(buffer, dtype=leaf.np_dtype, count=count, offset=base + off).reshape(shape)
            if worker is not None:
                array = array[worker * self.rows : (worker + 1) * self.rows]
            out[leaf.key] = array
        return out
