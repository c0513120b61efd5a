"""The versioned weight store: policy parameters in shared memory, double-buffered, each buffer
guarded by a sequence number (a seqlock), so that a worker never applies half-written weights.

The collector writes a new version with one in-place copy into the buffer that is not the
latest, then makes it the latest. A worker, at a batch boundary only, copies the latest buffer
into its policy replica and checks that the buffer's sequence number did not move meanwhile
(else it retries with the newer latest). Imported by worker processes: numpy, and torch lazily.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any, Mapping

import numpy as np

_HEADER_WORDS = 8  # seq0, seq1, latest (-1: nothing yet), version0, version1, unused...
_HEADER_BYTES = _HEADER_WORDS * 8
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """Names, shapes and dtypes of a model's state dict, and where each lies in a buffer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]  # numpy dtype names
    offsets: tuple[int, ...]
    buffer_nbytes: int

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> "WeightLayout":
        import torch

        names, shapes, dtypes, offsets = [], [], [], []
        pos = 0
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
            pos = -(-pos // _ALIGN) * _ALIGN
            names.append(name)
            shapes.append(tuple(tensor.shape))
            dtypes.append(dtype.name)
            offsets.append(pos)
            pos += tensor.numel() * dtype.itemsize
        return cls(tuple(names), tuple(shapes), tuple(dtypes), tuple(offsets), -(-max(pos, 1) // _ALIGN) * _ALIGN)

    @property
    def nbytes(self) -> int:
        return _HEADER_BYTES + 2 * self.buffer_nbytes

    @property
    def numel(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)


class WeightStore:
    """One store: either side (``writer=True`` in the collector, ``False`` in a worker)."""

    def __init__(self, layout: WeightLayout, buffer: Any) -> None:
        import torch

        self.layout = layout
        self.buffer = buffer
        self.header = np.frombuffer(buffer, dtype=np.int64, count=_HEADER_WORDS)
        self.views: list[dict[str, Any]] = []
        for b in range(2):
            base = _HEADER_BYTES + b * layout.buffer_nbytes
            views = {}
            for name, shape, dtype, off in zip(layout.names, layout.shapes, layout.dtypes, layout.offsets):
                count = int(np.prod(shape, dtype=np.int64))
                arr = np.frombuffer(buffer, dtype=np.dtype(dtype), count=count, offset=base + off).reshape(shape)
                views[name] = torch.from_numpy(arr)
            self.views.append(views)

    @classmethod
    def create(cls, layout: WeightLayout, buffer: Any) -> "WeightStore":
        store = cls(layout, buffer)
        store.header[:] = 0
        store.header[2] = -1
        return store

    # -- writer -------------------------------------------------------------------------------
    def publish(self, state: Mapping[str, Any], version: int) -> None:
        """Write ``state`` as ``version`` (one copy), then make it the latest."""
        h = self.header
        b = 0 if h[2] != 0 else 1
        h[b] += 1  # odd: being written
        views = self.views[b]
        for name in self.layout.names:
            views[name].copy_(state[name])
        h[3 + b] = version
        h[b] += 1  # even: complete
        h[2] = b

    @property
    def latest_version(self) -> int:
        b = int(self.header[2])
        return -1 if b < 0 else int(self.header[3 + b])

    # -- reader ---------------------------------------------------------------------------------
    def read_into(self, targets: Mapping[str, Any], current: int) -> int | None:
        """Copy the latest version into ``targets`` if it is newer than ``current``; returns the
        version applied, or ``None``. Never returns with a torn copy."""
        h = self.header
        while True:
            b = int(h[2])
            if b < 0:
                return None
            version = int(h[3 + b])
            if version <= current:
                return None
            seq = int(h[b])
            if seq & 1:
                continue  # being rewritten: the writer flips to it soon
            views = self.views[b]
            for name in self.layout.names:
                targets[name].copy_(views[name])
            if int(h[b]) == seq and int(h[3 + b]) == version:
                return version


def map_store(fd: int, layout: WeightLayout) -> WeightStore:
    """Worker side: map a store the collector created."""
    return WeightStore(layout, mmap.mmap(fd, layout.nbytes))


def state_of(obj: Any) -> dict[str, Any]:
    """A name -> tensor mapping from what a user passes to ``update_weights``: an ``nn.Module``
    (or ``TensorDictModule``, unwrapped as the workers unwrap it), a ``TensorDict`` of
    parameters (``TensorDict.from_module``) or a state dict."""
    import torch

    from ._policy import classify

    if isinstance(obj, torch.nn.Module):
        kind, fn, _, _ = classify(obj)
        module = fn if isinstance(fn, torch.nn.Module) else obj
        return dict(module.state_dict())
    flatten = getattr(obj, "flatten_keys", None)
    if flatten is not None and hasattr(obj, "batch_size"):  # a TensorDict
        return dict(obj.flatten_keys(".").items())
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(
        f"update_weights() takes an nn.Module, a TensorDict of parameters or a state dict, "
        f"not {type(obj).__name__}"
    )


def match_state(state: Mapping[str, Any], layout: WeightLayout) -> dict[str, Any]:
    """``state`` keyed as the workers' models are (a ``module.`` prefix, as a TensorDictModule's
    own state dict has, is dropped when that makes the names match)."""
    want = set(layout.names)
    if set(state) >= want:
        return {n: state[n] for n in layout.names}
    stripped = {k.split(".", 1)[1]: v for k, v in state.items() if k.startswith("module.")}
    if set(stripped) >= want:
        return {n: stripped[n] for n in layout.names}
    missing = sorted(want - set(state))
    raise KeyError(
        f"the weights given lack {missing[:5]}{' ...' if len(missing) > 5 else ''} of the workers' "
        f"policy (it has {len(want)} tensors: {sorted(want)[:5]}...); pass the policy module, "
        f"TensorDict.from_module(policy) or policy.state_dict()"
    )
