"""Recurrent policies: the state a policy carries from step to step, one row per env.

A policy is recurrent when its state is declared (``recurrent_state=``: key -> per-env shape) or
when it, or one of its submodules, has TorchRL's ``make_tensordict_primer()`` (``LSTMModule``,
``GRUModule``: duck-typed, torchrl is never imported). Each step the policy's input TensorDict
holds ``"is_init"`` (``[E, 1]`` bool: the first step of an episode) and each state key (the state
carried from the step before, zeros where ``is_init``); the policy writes ``("next", key)``, which
:class:`RecurrentMemory` carries into the next step's input. The inputs and outputs are policy
outputs like any other, so the batch stores them (TorchRL's layout: ``is_init``, the state read and
the state written).

Imported by worker processes: numpy only (torch through the runner).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from .._core.errors import SpecError
from .._core.layout import Key, Leaf, as_key

IS_INIT: Key = ("is_init",)


def dtype_name(dtype: Any) -> str:
    """A torch or numpy dtype's (``np.float64`` or ``np.dtype("float64")`` too), or a dtype name's,
    numpy name (``torch.float32`` -> ``"float32"``); ``TypeError`` for anything else."""
    text = str(dtype)
    if dtype is None or text.startswith("torch."):
        dtype = text.removeprefix("torch.")  # (None: "None", refused below, not numpy's float64)
    found = np.dtype(dtype)
    if found.kind not in "biufc":  # (np.dtype takes any Python class too: object)
        raise TypeError(f"{dtype!r} is not a numeric dtype")
    return found.name


def _primers(policy: Any) -> list[Callable[[], Any]]:
    """The ``make_tensordict_primer`` methods of the policy and its submodules."""
    modules = policy.modules() if callable(getattr(policy, "modules", None)) else [policy]
    makers = [getattr(module, "make_tensordict_primer", None) for module in modules]
    return [make for make in makers if callable(make)]


def primer_leaves(policy: Any) -> tuple[Leaf, ...]:
    """The state a policy declares TorchRL's way: each of its modules' ``make_tensordict_primer()``
    specs (key, per-env shape, dtype); ``()`` for a policy without one."""
    leaves: dict[Key, Leaf] = {}
    for make in _primers(policy):
        specs = getattr(make(), "primers", None)
        if specs is None:
            continue
        for key in specs.keys(True, True):
            spec = specs[key]
            leaves.setdefault(as_key(key), Leaf(as_key(key), tuple(spec.shape), dtype_name(spec.dtype)))
    return tuple(leaves.values())


def has_primer(policy: Any) -> bool:
    return bool(_primers(policy))


def declared_leaves(declared: dict | None) -> tuple[Leaf, ...]:
    """``recurrent_state`` (checked already: key -> ``(shape, dtype name)``) as leaves."""
    return tuple(Leaf(as_key(key), shape, dtype) for key, (shape, dtype) in (declared or {}).items())


def undeclared_state_fix(missing: Iterable[Key], out_keys: Iterable[Key]) -> str | None:
    """The fix for a policy that reads keys the observations lack, where it looks recurrent (it reads
    ``is_init``, or a key it writes under ``"next"``) but declares no state: ``recurrent_state=``
    (TorchRL's primer transform has no place here); None where it does not look recurrent."""
    written = {key[1:] for key in out_keys if key[:1] == ("next",)}
    state = [key for key in missing if key in written]
    if not state and IS_INIT not in missing:
        return None
    example = ", ".join(f"{'.'.join(key)!r}: <shape of one env's state>" for key in state) or "'recurrent_state': (1, 64)"
    return (
        f"a recurrent policy declares its state: pass recurrent_state={{{example}}} (the collector then gives the "
        f"policy 'is_init' and the state it wrote at the step before, zeros where an episode starts; no primer "
        f"transform needed), or use TorchRL's LSTMModule/GRUModule, which declare theirs"
    )


def random_step_extras(leaves: Iterable[Leaf], is_init: np.ndarray) -> list[np.ndarray]:
    """The policy outputs (``leaves``) stored for a step whose actions were random
    (``init_random_frames``: the policy does not run): ``is_init`` (``[n]``: the rows that start a
    trajectory), and zeros for everything else, the state read and written included (the policy has
    not run yet, so its state is still the zeros it starts from)."""
    return [
        is_init[:, None].copy() if leaf.key == IS_INIT else np.zeros((len(is_init),) + leaf.shape, leaf.np_dtype)
        for leaf in leaves
    ]


class RecurrentMemory:
    """The carried state of ``rows`` env rows (a worker's envs, or every env the inference server
    serves), and each row's ``is_init`` flag (True until the policy has acted on the row's first
    step of an episode). ``rows`` selects some of them (the server's pass: its seats' rows)."""

    def __init__(self, leaves: Iterable[Leaf], rows: int) -> None:
        self.leaves = list(leaves)
        self.state = [np.zeros((rows,) + leaf.shape, leaf.np_dtype) for leaf in self.leaves]
        self.is_init = np.ones(rows, bool)  # (a worker's rollout sets rows that start an episode)

    def inputs(self, rows: Any = None, is_init: np.ndarray | None = None) -> list[tuple[Key, np.ndarray]]:
        """The policy's extra inputs, new arrays (the batch stores them): ``is_init`` (``[n, 1]``)
        and each state key, zero where ``is_init``; ``is_init`` defaults to the rows' own flags."""
        init = (self.is_init if rows is None else self.is_init[rows]) if is_init is None else is_init
        out = [(IS_INIT, init[:, None].copy())]
        for leaf, state in zip(self.leaves, self.state):
            carried = state if rows is None else state[rows]
            zeroed = np.where(init.reshape((-1,) + (1,) * len(leaf.shape)), 0, carried)
            out.append((leaf.key, zeroed.astype(leaf.np_dtype, copy=False)))
        return out

    def carry(self, outputs: dict[Key, Any], rows: Any = None, to_numpy: Callable[[Any], np.ndarray] = np.asarray) -> None:
        """Keep the policy's ``("next", key)`` outputs (``[n, *shape]``, made numpy arrays by
        ``to_numpy``) for the next step; the rows' ``is_init`` flags are spent."""
        for leaf, state in zip(self.leaves, self.state):
            value = outputs.get(("next",) + leaf.key)
            n = len(state) if rows is None else len(rows)
            want = (n,) + leaf.shape
            if value is None:
                raise SpecError(
                    f"the policy wrote no {('next',) + leaf.key!r}: a recurrent policy writes the state it carries to the "
                    f"next step under ('next', {'.'.join(leaf.key)!r}) (shape {want}); add it to the policy's out_keys, "
                    f"or drop {'.'.join(leaf.key)!r} from recurrent_state (it wrote {sorted('.'.join(k) for k in outputs)})"
                )
            if tuple(value.shape) != want:
                raise SpecError(
                    f"the policy wrote {('next',) + leaf.key!r} with shape {tuple(value.shape)}, but its recurrent "
                    f"state {'.'.join(leaf.key)!r} is {leaf.shape} per env (shape {want} for {n} envs); write the "
                    f"state with that shape, or declare the shape it has in recurrent_state"
                )
            if rows is None:
                state[...] = to_numpy(value)
            else:
                state[rows] = to_numpy(value)
        if rows is None:
            self.is_init[:] = False
        else:
            self.is_init[rows] = False

    def saved(self) -> tuple[list[np.ndarray], np.ndarray]:
        return [s.copy() for s in self.state], self.is_init.copy()

    def restore(self, saved: tuple[list[np.ndarray], np.ndarray]) -> None:
        for state, kept in zip(self.state, saved[0]):
            state[...] = kept
        self.is_init[...] = saved[1]


__all__ = [
    "IS_INIT", "RecurrentMemory", "declared_leaves", "dtype_name", "has_primer", "primer_leaves", "random_step_extras",
    "undeclared_state_fix",
]
