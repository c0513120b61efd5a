"""The versioned weight store: policy parameters in shared memory, double-buffered, each buffer
guarded by a sequence number (a seqlock), so that a worker never applies half-written weights.

The collector writes a new version with one in-place copy into the buffer that is not the
latest, then makes it the latest. A worker, at a batch boundary only, copies the latest buffer
into its policy replica and checks that the buffer's sequence number did not move meanwhile
(else it retries with the newer latest). Imported by worker processes: numpy, and torch lazily.

Each buffer also records, per tensor, the version that last changed it. That makes partial
updates cheap and exact: publishing one submodule (``model_id="policy.actor"``) writes only
its tensors (plus those the other buffer changed since this one was written), and a worker
copies only the tensors changed since the version it has, so a tensor never published keeps
the value the worker built it with.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any, Iterator, Mapping

import numpy as np

from .._core.errors import ConfigError, WeightsMismatchError  # noqa: F401 - (its old import path)

_HEADER_WORDS = 8  # seq0, seq1, latest (-1: nothing yet), version0, version1, unused...
_ALIGN = 64
ROOT = "policy"  # the model id of a worker's whole policy; "policy.<path>" names a submodule


PART_BYTES = 1 << 18  # WeightStore.publish_in_parts: a tensor bigger than this is copied in slices of it


def _copy_in_parts(dest: Any, src: Any) -> Iterator[None]:
    """``dest.copy_(src)`` (``dest`` a contiguous view of a store), in slices of about
    ``PART_BYTES`` when both are contiguous and of the same shape, yielding after each."""
    nbytes = dest.numel() * dest.element_size()
    if nbytes <= PART_BYTES or src.shape != dest.shape or not src.is_contiguous():
        dest.copy_(src)  # (a small tensor, or one broadcast or strided: whole)
        yield
        return
    flat_dest, flat_src = dest.view(-1), src.reshape(-1)
    step = max(1, PART_BYTES // dest.element_size())
    for start in range(0, flat_dest.numel(), step):
        flat_dest[start:start + step].copy_(flat_src[start:start + step])
        yield


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


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
            pos = _aligned(pos)
            names.append(name)
            shapes.append(tuple(tensor.shape))
            dtypes.append(dtype.name)
            offsets.append(pos)
            pos += tensor.numel() * dtype.itemsize
        return cls(tuple(names), tuple(shapes), tuple(dtypes), tuple(offsets), _aligned(max(pos, 1)))

    @property
    def meta_nbytes(self) -> int:
        """Header words, then per buffer one int64 per tensor: the version that last changed it."""
        return _aligned(8 * (_HEADER_WORDS + 2 * len(self.names)))

    @property
    def nbytes(self) -> int:
        return self.meta_nbytes + 2 * self.buffer_nbytes

    @property
    def numel(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    def select(self, model_id: str) -> tuple[str, tuple[str, ...]]:
        """``(prefix, names)``: the tensors of model ``model_id``, ``"policy"`` (all of them) or
        ``"policy.<submodule path>"`` (those under that path, as ``get_submodule`` spells it;
        the ``module.`` of a TensorDictModule the workers unwrap may be left in or out)."""
        if not is_model_id(model_id):
            raise ConfigError(
                f"model_id={model_id!r}: a model is the workers' policy, 'policy', or one of its submodules, "
                f"'policy.<path>' (e.g. {self._examples()})"
            )
        if model_id == ROOT:
            return "", self.names
        path = model_id[len(ROOT) + 1:]
        candidates = [path]
        if path.startswith("module."):
            candidates.append(path[len("module."):])  # a TensorDictModule's path; the workers run its module
        for p in candidates:
            names = tuple(n for n in self.names if n.startswith(p + "."))
            if names:
                return p + ".", names
        raise ConfigError(
            f"model_id={model_id!r}: the workers' policy has no submodule {path!r} with weights; "
            f"its submodules with weights include {self._examples()}"
        )

    def _examples(self) -> list[str]:
        """Submodule paths with weights, outermost first (a few)."""
        paths: list[str] = []
        for n in self.names:
            parts = n.split(".")[:-1]
            for k in range(1, len(parts) + 1):
                p = f"{ROOT}." + ".".join(parts[:k])
                if p not in paths:
                    paths.append(p)
        paths.sort(key=lambda p: (p.count("."), self._first_use(p)))
        return paths[:8] or [ROOT]

    def _first_use(self, path: str) -> int:
        prefix = path[len(ROOT) + 1:] + "."
        return next(i for i, n in enumerate(self.names) if n.startswith(prefix))


def is_model_id(model_id: Any) -> bool:
    """``"policy"``, or ``"policy.<path>"`` with a path of non-empty names (as ``get_submodule`` takes)."""
    if not isinstance(model_id, str):
        return False
    return model_id == ROOT or (model_id.startswith(ROOT + ".") and all(model_id[len(ROOT) + 1:].split(".")))


class WeightStore:
    """One store: either side (the collector writes, workers read)."""

    def __init__(self, layout: WeightLayout, buffer: Any) -> None:
        self.fd: int | None = None  # the memfd of a store in shared memory (closed with the run)
        self.closed = False  # released: nothing is written into it any more
        self.layout = layout
        self.buffer = buffer
        self.index = {name: i for i, name in enumerate(layout.names)}
        self._map()

    def _map(self) -> None:
        """The views of the buffer: its header, change marks and each buffer's tensors."""
        import torch

        layout, buffer = self.layout, self.buffer
        n = len(layout.names)
        self.header = np.frombuffer(buffer, dtype=np.int64, count=_HEADER_WORDS)
        meta = np.frombuffer(buffer, dtype=np.int64, count=2 * n, offset=8 * _HEADER_WORDS)
        self.changed = (meta[:n], meta[n:])  # per buffer, per tensor: the version that last changed it
        self.views: list[list[Any]] = []
        for b in range(2):
            base = layout.meta_nbytes + b * layout.buffer_nbytes
            views = []
            for shape, dtype, off in zip(layout.shapes, layout.dtypes, layout.offsets):
                count = int(np.prod(shape, dtype=np.int64))
                arr = np.frombuffer(buffer, dtype=np.dtype(dtype), count=count, offset=base + off).reshape(shape)
                views.append(torch.from_numpy(arr))
            self.views.append(views)

    @classmethod
    def create(cls, layout: WeightLayout, buffer: Any) -> "WeightStore":
        store = cls(layout, buffer)
        store.header[:] = 0
        store.header[2] = -1
        store.changed[0][:] = 0
        store.changed[1][:] = 0
        return store

    # -- writer -------------------------------------------------------------------------------
    def publish(self, state: Mapping[str, Any], version: int) -> None:
        """Write ``state`` (all the layout's tensors, or some of them: a partial update) as
        ``version``, then make it the latest. One copy of what ``state`` holds, plus the tensors
        that changed in the latest buffer since this one was last written."""
        for _ in self.publish_in_parts(state, version):
            pass

    def publish_in_parts(self, state: Mapping[str, Any], version: int) -> Iterator[None]:
        """:meth:`publish`, one part at a time: yields after each tensor, or each ``PART_BYTES``
        of a bigger one, so that an async caller can let its loop run between parts (readers go
        on reading the latest buffer meanwhile). The version becomes the latest once the
        generator is exhausted; one closed before that publishes nothing."""
        h = self.header
        latest = int(h[2])
        b = 0 if latest != 0 else 1
        mine, views = self.changed[b], self.views[b]
        h[b] += 1  # odd: being written
        i = -1
        try:
            if latest >= 0 and len(state) < len(self.index):
                theirs, their_views = self.changed[latest], self.views[latest]
                for i in np.nonzero(theirs != mine)[0].tolist():  # carried over: unchanged by this version
                    yield from _copy_in_parts(views[i], their_views[i])
                    mine[i] = theirs[i]
            for name, value in state.items():
                i = self.index[name]
                yield from _copy_in_parts(views[i], value)
                mine[i] = version
            i = -1
        except BaseException:  # (GeneratorExit too: closed before the end)
            if i >= 0:
                mine[i] = -1  # half-written: marked unlike any version, so the next publish rewrites it
            h[b] += 1  # even again, but not the latest: readers never see it; the next publish
            raise  # carries over every tensor this one touched (their change marks differ)
        h[3 + b] = version
        h[b] += 1  # even: complete
        h[2] = b

    def release(self) -> bool:
        """Unmap a store in shared memory now (its memory is freed once no process maps it),
        whoever still refers to this object: a cancelled task's traceback keeps the frames of a
        write, and the cycle it is in lasts until the garbage collector runs. Not while a view
        of it is in use elsewhere (a write under way): then it stays as it is, unmapped with the
        last view (call it again then). Returns whether it was unmapped."""
        self.closed = True
        buffer = self.buffer
        if not isinstance(buffer, mmap.mmap) or buffer.closed:
            return False
        self.header = self.changed = self.views = None  # type: ignore[assignment]
        try:
            buffer.close()  # (also closes the mapping's own duplicate of the fd)
        except BufferError:  # exported: a view is in use
            self._map()
            return False
        return True

    @property
    def latest_version(self) -> int:
        b = int(self.header[2])
        return -1 if b < 0 else int(self.header[3 + b])

    # -- reader ---------------------------------------------------------------------------------
    def read_into(self, targets: list[Any], have: np.ndarray, seen: int) -> int | None:
        """If the latest version is newer than ``seen``, copy into ``targets`` (the model's
        tensors, in layout order) each tensor changed since the version ``have`` records for it,
        update ``have``, and return that version; else ``None``. Never returns with a torn copy."""
        h = self.header
        while True:
            b = int(h[2])
            if b < 0:
                return None
            version = int(h[3 + b])
            if version <= seen:
                return None
            seq = int(h[b])
            if seq & 1:
                continue  # being rewritten: the writer flips to it soon
            changed = self.changed[b].copy()
            todo = np.nonzero(changed > have)[0]
            views = self.views[b]
            for i in todo.tolist():
                targets[i].copy_(views[i])
            if int(h[b]) == seq and int(h[3 + b]) == version:
                have[todo] = changed[todo]
                return version


def map_store(fd: int, layout: WeightLayout) -> WeightStore:
    """Worker side: map a store the collector created."""
    return WeightStore(layout, mmap.mmap(fd, layout.nbytes))


class WeightReader:
    """Worker side: a model's tensors and the stores it reads (the shared one, and its own once
    the collector gives it one for per-worker updates)."""

    def __init__(self, model: Any) -> None:
        state = dict(model.state_dict()) if model is not None else {}
        self.layout = WeightLayout.of(state) if state else None
        self.targets = [state[n] for n in self.layout.names] if self.layout is not None else []
        self.have = np.zeros(len(self.targets), dtype=np.int64)
        self.stores: list[WeightStore] = []
        self.seen: list[int] = []
        self.version = 0  # the newest version applied

    def add(self, store: WeightStore) -> None:
        self.stores.append(store)
        self.seen.append(0)

    def apply(self) -> int | None:
        """At a batch boundary: take the newest complete version of every store (per tensor, the
        newest change wins); returns the new version if anything was applied."""
        applied = None
        for k, store in enumerate(self.stores):
            version = store.read_into(self.targets, self.have, self.seen[k])
            if version is not None:
                self.seen[k] = version
                if version > self.version:
                    self.version = applied = version
        return applied


def named(argument: str, value: Any) -> str:
    """``argument=value`` for a message, or ``argument`` alone when the value's repr is long."""
    text = repr(value)
    return f"{argument}={text}" if len(text) <= 60 and "\n" not in text else argument
