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
    """A torch or numpy dtype's (or a dtype name's) numpy name (``torch.float32`` -> ``"float32"``);
    ``TypeError`` for anything else."""
    return np.dtype(str(dtype).removeprefix("torch.")).name


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


__all__ = ["IS_INIT", "RecurrentMemory", "declared_leaves", "dtype_name", "has_primer", "primer_leaves"]
