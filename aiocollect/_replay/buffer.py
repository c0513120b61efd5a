"""A circular replay buffer of frames, fed by the collector's batches."""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

import torch
from tensordict import TensorDict, TensorDictBase, is_leaf_nontensor, is_non_tensor

from .._core.errors import ConfigError, ConfigTypeError, SpecError
from .._core.layout import Key, as_key
from .._core.limits import check_fits_in_memory
from .._service.options import positive_int
from .samplers import Sampler, SamplingError, StoredFrames, UniformSampler
from .._core.public import public

__all__ = ["ReplayBuffer"]

_MASK: Key = ("collector", "mask")
_INDEX: Key = ("index",)


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    """Run ``method`` holding the buffer's :attr:`~ReplayBuffer.lock`."""

    @functools.wraps(method)
    def wrapper(self: "ReplayBuffer", *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _check_batch_size(value: Any, where: str) -> int:
    positive_int("batch_size", value, who=where)
    check_fits_in_memory(  # a sample's indices alone are int64
        8 * value, f"{where}: batch_size={value} (8 bytes per sampled frame for its index alone)",
        "sample fewer frames at a time",
    )
    return value


def _check_device(device: Any) -> torch.device | None:
    """``device`` as a :class:`torch.device`; one that is malformed or absent here is refused."""
    if device is None:
        return None
    fix = "pass None (the first batch's device), 'cpu', 'cuda', 'cuda:<index>' or a torch.device"
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise ConfigError(f"ReplayBuffer: device must be a torch.device or a str, got {device!r}; {fix}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(f"ReplayBuffer: device={device!r} is not a device ({exc}); {fix}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            have = f"{count} CUDA device(s)" if count else "no CUDA device"
            raise ConfigError(f"ReplayBuffer: device={device!r} is not available: this machine has {have}; {fix}")
    else:
        backend = getattr(torch, dev.type, None)  # torch.mps, torch.xpu ...
        available = getattr(backend, "is_available", None)
        if callable(available) and not available():
            raise ConfigError(f"ReplayBuffer: device={device!r} is not available on this machine; {fix}")
    return dev


def _batch_leaves(
    data: TensorDictBase
) -> tuple[list[tuple[Key, torch.Tensor]], torch.Tensor | None]:
    """The batch's tensor leaves to store, and its ('collector', 'mask') if any."""
    leaves: list[tuple[Key, torch.Tensor]] = []
    mask = None
    items = data.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)
    for name, item in items:
        key = as_key(name)
        value: Any = item  # (a tensor once the checks below passed)
        if is_non_tensor(value):
            raise SpecError(
                f"ReplayBuffer.extend: entry {key!r} holds non-tensor data, which the buffer "
                f"cannot store per frame; store it as a tensor or drop it "
                f"(batch.exclude({key!r}))"
            )
        if key == _MASK:
            if value.dtype != torch.bool or value.shape != data.batch_size:
                raise SpecError(
                    f"ReplayBuffer.extend: ('collector', 'mask') must be a bool tensor of the "
                    f"batch's shape {tuple(data.batch_size)}, got {value.dtype} of shape "
                    f"{tuple(value.shape)}"
                )
            mask = value
            continue
        leaves.append((key, value))
    return leaves, mask


def _check_layout(
    columns: dict[Key, torch.Tensor], leaves: list[tuple[Key, torch.Tensor]], batch_dims: int
) -> None:
    """A batch after the first must have the storage's entries, shapes and dtypes."""
    got = {key: value for key, value in leaves}
    for key, column in columns.items():
        value = got.get(key)
        if value is None:
            raise SpecError(
                f"ReplayBuffer.extend: the batch has no entry {key!r}, which the storage "
                f"holds (its layout was fixed by the first batch written); every batch must "
                f"have the same entries"
            )
        if value.shape[batch_dims:] != column.shape[1:] or value.dtype != column.dtype:
            raise SpecError(
                f"ReplayBuffer.extend: entry {key!r} has per-frame shape "
                f"{tuple(value.shape[batch_dims:])} and dtype {value.dtype}, but the storage "
                f"holds {tuple(column.shape[1:])} and {column.dtype} (fixed by the first "
                f"batch written)"
            )
    for key in got:
        if key not in columns:
            raise SpecError(
                f"ReplayBuffer.extend: the batch has an entry {key!r} that the storage does "
                f"not hold (its layout was fixed by the first batch written); drop it "
                f"(batch.exclude({key!r})) or write it from the first batch on"
            )


@public
class ReplayBuffer:
    """A fixed-capacity circular buffer of frames, with a pluggable :class:`Sampler`.

    Examples:
        >>> buffer = ReplayBuffer(100_000, batch_size=256)
        >>> async for batch in collector:                # doctest: +SKIP
        ...     buffer.extend(batch)                     # [E, T] batch -> E*T frames
        ...     sample = buffer.sample()                 # TensorDict [256]

    **Storage.** The first batch written fixes the layout: every tensor entry of it (nested ones
    included, ``("collector", "mask")`` excepted) gets a preallocated, zero-filled tensor of
    ``capacity`` frames, ``[capacity, *per-frame shape]``, on ``device`` (default: the first
    batch's device). Frames are stored flat: a batch of shape ``[E, T]`` is written row by row
    (env 0's ``T`` frames, then env 1's ...), a 1-D batch ``[N]`` as one row. When the batch
    holds ``("collector", "mask")`` (the padded ``[n_traj, max_len]`` layout), only frames where
    it is ``True`` are stored, in the same order. Writing starts at a cursor that wraps around
    at ``capacity``: once full, each new frame overwrites the oldest one.

    **Samples.** :meth:`sample` returns a new :class:`~tensordict.TensorDict` of shape
    ``[batch_size]`` (copies, never views of the storage) holding every stored entry plus:

    - ``"index"`` (int64): the storage index of each frame, to map priorities or any per-frame
      result back (``-1`` on padding positions, see :class:`SliceSampler`);
    - the sampler's own entries: ``"staleness"`` and ``"weight"`` for
      :class:`StalenessAwareSampler`, ``("collector", "mask")`` for a
      :class:`SliceSampler` with ``strict_length=False``.

    These keys cannot be entries of the written batches (a clear error says so).

    **Randomness.** Samplers draw from ``generator`` (a CPU :class:`torch.Generator`), or from
    torch's global generator when it is ``None``: after ``torch.manual_seed(s)`` (or seeding the
    generator), the same buffer state gives the same sample.

    **Cost.** :meth:`extend` and :meth:`sample` do O(batch) work plus O(number of entries) Python
    work, whatever the capacity. A sampler that derives something from the whole storage
    (:class:`StalenessAwareSampler`, :class:`SliceSampler`) does it in one vectorized pass after
    each write and caches it until the next.

    **Threads.** :meth:`extend`, :meth:`sample`, :meth:`state_dict` and :meth:`load_state_dict`
    each hold :attr:`lock` (a re-entrant lock), so a collector's background collection
    (``await collector.start(replay_buffer=buffer)``), which calls :meth:`extend` from the
    collector's own thread, and your training loop's :meth:`sample` never see each other half
    done. Hold ``buffer.lock`` yourself around several calls that must see the same contents
    (a sample and the priority update it leads to).

    Args:
        capacity: the number of frames the buffer holds.
        sampler: how frames are chosen; default :class:`UniformSampler` (uniform, with
            replacement).
        batch_size: the default size of :meth:`sample`.
        device: where the storage lives; default: the first batch's device (CPU if it has none).
        generator: a CPU generator for the sampler's random draws (saved by :meth:`state_dict`).

    Raises:
        ConfigError: an argument is invalid (``capacity <= 0``, a ``batch_size`` that is not a
            positive int, a sampler that is not a :class:`Sampler`, a non-CPU generator).
    """

    def __init__(
        self,
        capacity: int,
        sampler: Sampler | None = None,
        *,
        batch_size: int | None = None,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        positive_int("capacity", capacity, who="ReplayBuffer", fix="it is the number of frames the buffer holds")
        check_fits_in_memory(  # its bookkeeping alone takes 8 bytes per frame, on the CPU
            8 * capacity, f"ReplayBuffer: capacity={capacity} (8 bytes per frame before any data)",
            "use a smaller capacity",
        )
        if sampler is None:
            sampler = UniformSampler()
        elif not isinstance(sampler, Sampler):
            raise ConfigError(
                f"ReplayBuffer: sampler must be a Sampler (UniformSampler, "
                f"StalenessAwareSampler, SliceSampler ...), got {sampler!r}"
            )
        if batch_size is not None:
            _check_batch_size(batch_size, "ReplayBuffer")
        if generator is not None and (
            not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
        ):
            raise ConfigError(
                f"ReplayBuffer: generator must be a CPU torch.Generator (samplers draw on the "
                f"CPU), got {generator!r}"
            )
        self._capacity = capacity
        self._sampler = sampler
        self.batch_size: int | None = batch_size
        """Default number of frames :meth:`sample` returns."""
        self._device = _check_device(device)
        self._generator = generator
        self._storage: TensorDict | None = None
        self._columns: dict[Key, torch.Tensor] = {}
        self._segments = torch.zeros(0, dtype=torch.int64)
        self._next_segment = 0
        self._cursor = 0
        self._size = 0
        self._write_count = 0
        self._token = object()
        self.lock = threading.RLock()
        """Held by :meth:`extend`, :meth:`sample`, :meth:`state_dict` and :meth:`load_state_dict`."""

    # -- what it holds --------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The most frames the buffer holds."""
        return self._capacity

    @property
    def sampler(self) -> Sampler:
        """The sampler given at construction (or the default :class:`UniformSampler`)."""
        return self._sampler

    @property
    def device(self) -> torch.device | None:
        """Where the storage lives; ``None`` until the first write when no device was given."""
        return self._device

    @property
    def write_count(self) -> int:
        """Frames written since the buffer was built (or since the state it was loaded from was
        built), overwritten ones included; masked-out frames are not counted."""
        return self._write_count

    @property
    def storage(self) -> TensorDict | None:
        """The preallocated storage, ``[capacity]`` (``None`` before the first write).

        The buffer's own tensors, not a copy: read it, do not modify it (samplers cache what
        they derive from it until the next :meth:`extend`). Indices at or past ``len(self)``
        hold zeros until written.
        """
        return self._storage

    def __len__(self) -> int:
        """Frames stored: ``min(write_count, capacity)``."""
        return self._size

    def __repr__(self) -> str:
        return (
            f"ReplayBuffer(capacity={self._capacity}, len={self._size}, "
            f"write_count={self._write_count}, sampler={self._sampler!r}, "
            f"batch_size={self.batch_size}, device={self._device})"
        )

    # -- writing --------------------------------------------------------------------------------
    @_locked
    def extend(self, data: TensorDictBase) -> torch.Tensor:
        """Copy the frames of ``data`` into the buffer; returns the storage indices written.

        ``data`` is a batch of shape ``[E, T]`` (written row by row) or ``[N]``; with a
        ``("collector", "mask")`` entry only the frames where it is ``True`` are written. The
        data is copied: the batch may be reused or modified afterwards. When one call brings
        more than ``capacity`` frames, only the last ``capacity`` of them are kept.

        Returns:
            int64 ``[n]`` on the storage's device: the storage index of each frame kept, in the
            order they were taken from the batch (row-major, masked-out frames skipped); ``n``
            is the number of frames written, at most ``capacity``.

        Raises:
            ConfigTypeError: (a ``TypeError``) ``data`` is not a TensorDict.
            SpecError: ``data`` does not fit the storage (an entry missing, extra, or of another
                per-frame shape or dtype than in the first batch; the message names the entry),
                has a batch shape other than ``[E, T]`` or ``[N]``, a mask that is not bool of
                the batch's shape, per-frame non-tensor data, an entry named like a sample key
                (``"index"`` ...), or lacks an entry the sampler reads. Nothing is written then.
        """
        if not isinstance(data, TensorDictBase):
            raise ConfigTypeError(
                f"ReplayBuffer.extend: expected a TensorDict batch, got {type(data).__name__}; pass "
                "a batch the collector delivered, or a TensorDict of shape [envs, time] or [frames]"
            )
        if data.batch_dims not in (1, 2):
            raise SpecError(
                f"ReplayBuffer.extend: expected a batch of shape [envs, time] or [frames], got "
                f"batch_size {tuple(data.batch_size)}"
            )
        batch_dims = data.batch_dims
        num = data.batch_size.numel()
        leaves, mask = _batch_leaves(data)
        if self._storage is None:
            self._allocate(data, leaves)
        else:
            _check_layout(self._columns, leaves, batch_dims)

        starts = torch.zeros(num, dtype=torch.bool)
        if num:
            starts[:: data.batch_size[-1]] = True
        selected: torch.Tensor | None = None
        if mask is not None:
            valid = mask.reshape(num).cpu()
            starts[1:] |= ~valid[:-1]  # a masked-out frame breaks the row into two pieces
            selected = valid.nonzero().squeeze(1)
            starts = starts[selected]
        n = starts.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=self._device)

        segments = starts.cumsum(0) + (self._next_segment - 1)
        self._next_segment += int(starts.sum())
        cap = self._capacity
        drop = max(0, n - cap)
        kept = n - drop
        first = (self._cursor + drop) % cap
        head = min(kept, cap - first)  # frames before the end of the storage array; rest at 0

        def write(dest: torch.Tensor, src: torch.Tensor) -> None:
            dest[first : first + head].copy_(src[:head])
            if kept > head:
                dest[: kept - head].copy_(src[head:])

        for key, value in leaves:
            flat = value.reshape(num, *value.shape[batch_dims:])
            if selected is not None:
                flat = flat[selected.to(flat.device)]
            write(self._columns[key], flat[drop:])
        write(self._segments, segments[drop:])

        self._cursor = (self._cursor + n) % cap
        self._size = min(self._size + n, cap)
        self._write_count += n
        self._token = object()
        return (torch.arange(first, first + kept, device=self._device)) % cap

    def _allocate(self, data: TensorDictBase, leaves: list[tuple[Key, torch.Tensor]]) -> None:
        reserved = [_INDEX, *map(as_key, self._sampler.sample_keys)]
        for key, _ in leaves:
            if key in reserved:
                raise SpecError(
                    f"ReplayBuffer.extend: the batch has an entry {key!r}, a name the buffer's "
                    f"samples use for their own data; rename or drop it (batch.exclude({key!r}))"
                )
        if not leaves:
            raise SpecError("ReplayBuffer.extend: the batch has no tensor entry to store")
        if self._device is None:
            self._device = data.device if data.device is not None else leaves[0][1].device
        storage = TensorDict(batch_size=[self._capacity], device=self._device)
        bd = data.batch_dims
        for key, value in leaves:
            storage.set(
                key,
                torch.zeros(
                    (self._capacity, *value.shape[bd:]), dtype=value.dtype, device=self._device
                ),
            )
        self._sampler.check_storage(storage)
        self._set_storage(storage)
        self._segments = torch.zeros(self._capacity, dtype=torch.int64)

    def _set_storage(self, storage: TensorDict) -> None:
        self._storage = storage
        self._columns = {
            as_key(k): v for k, v in storage.items(include_nested=True, leaves_only=True)  # type: ignore[misc]
        }

    # -- sampling -------------------------------------------------------------------------------
    @_locked
    def sample(self, batch_size: int | None = None) -> TensorDict:
        """Draw a sample of ``batch_size`` frames (default: the buffer's ``batch_size``).

        Returns:
            A new TensorDict ``[batch_size]`` on the storage's device: the chosen frames (copies)
            with ``"index"`` and the sampler's entries (see the class docstring). Which frames,
            and in which order, is the sampler's definition.

        Raises:
            ConfigError: no ``batch_size`` here nor at construction, or not a positive int (or
                not one the sampler accepts, e.g. a multiple of ``slice_len``).
            SamplingError: the buffer is empty, or the sampler finds nothing to sample (the
                message says why).
        """
        if batch_size is None:
            batch_size = self.batch_size
            if batch_size is None:
                raise ConfigError(
                    "ReplayBuffer.sample: batch_size is missing; pass sample(batch_size=...) or "
                    "build the buffer with ReplayBuffer(capacity, batch_size=...)"
                )
        _check_batch_size(batch_size, "ReplayBuffer.sample")
        if self._size == 0:
            raise SamplingError(
                "ReplayBuffer.sample: the buffer is empty; extend() it before sampling"
            )
        index, extras = self._sampler.sample(self._frames(), batch_size, self._generator)
        padding = index < 0
        padded = bool(padding.any())
        rows = index.clamp(min=0) if padded else index
        assert self._storage is not None  # (the size check above: something was stored)
        out = self._storage[rows.to(self._device)]
        if padded:
            out.masked_fill_(padding.to(self._device), 0)
        out.set(_INDEX, index.to(self._device))
        for key, value in extras.items():
            out.set(key, value.to(self._device))
        return out

    def _frames(self) -> StoredFrames:
        assert self._storage is not None
        return StoredFrames(
            storage=self._storage[: self._size],
            size=self._size,
            cursor=self._cursor,
            segments=self._segments[: self._size],
            token=self._token,
        )

    # -- checkpoints ----------------------------------------------------------------------------
    @_locked
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the buffer, as plain Python values and tensors.

        Keys: ``capacity``, ``cursor``, ``size``, ``write_count``, ``storage`` (a nested dict of
        the storage's tensors, or ``None`` before the first write), ``segments`` and
        ``next_segment`` (which stored frames were consecutive in the written batches),
        ``sampler`` (the sampler's :meth:`~Sampler.state_dict`) and ``generator`` (the state of
        the buffer's generator, or ``None``). The tensors are the buffer's own, not copies (as
        :meth:`torch.nn.Module.state_dict`): save it before writing again. It loads with
        ``torch.load(..., weights_only=True)``.
        """
        return {
            "capacity": self._capacity,
            "cursor": self._cursor,
            "size": self._size,
            "write_count": self._write_count,
            "storage": None if self._storage is None else self._storage.to_dict(),
            "segments": self._segments,
            "next_segment": self._next_segment,
            "sampler": self._sampler.state_dict(),
            "generator": None if self._generator is None else self._generator.get_state(),
        }

    @_locked
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (copying its tensors to this buffer's device).

        The buffer must have the same capacity and the same kind of sampler; the generator's
        state is restored when both this buffer and the saved one have a generator.

        Raises:
            ConfigError: the state does not fit this buffer (another capacity, missing keys,
                inconsistent sizes, another sampler's state).
        """
        expected = {
            "capacity", "cursor", "size", "write_count", "storage", "segments", "next_segment",
            "sampler", "generator",
        }
        if not isinstance(state, dict) or set(state) != expected:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ConfigError(
                f"ReplayBuffer.load_state_dict: expected a dict with keys {sorted(expected)}, got "
                f"{got}"
            )
        cap = self._capacity
        if state["capacity"] != cap:
            raise ConfigError(
                f"ReplayBuffer.load_state_dict: the state is of a buffer of capacity "
                f"{state['capacity']}, this one has capacity {cap}; build the buffer with "
                f"capacity={state['capacity']}"
            )
        size, cursor = int(state["size"]), int(state["cursor"])
        if not (0 <= size <= cap and 0 <= cursor < cap and (size == cap or cursor == size)):
            raise ConfigError(
                f"ReplayBuffer.load_state_dict: inconsistent state: size={size}, cursor={cursor} "
                f"for capacity {cap}"
            )
        storage = None
        if state["storage"] is not None:
            device = self._device
            try:
                storage = TensorDict(state["storage"], batch_size=[cap]).to(
                    device if device is not None else "cpu"
                ).clone()
            except RuntimeError as exc:
                raise ConfigError(
                    f"ReplayBuffer.load_state_dict: the stored tensors do not form a storage of "
                    f"{cap} frames: {exc}"
                ) from exc
            self._sampler.check_storage(storage)
        elif size:
            raise ConfigError(
                f"ReplayBuffer.load_state_dict: inconsistent state: size={size} but no storage"
            )
        segments = torch.as_tensor(state["segments"], dtype=torch.int64).cpu().clone()
        if segments.shape != ((cap,) if storage is not None else (0,)):
            raise ConfigError(
                f"ReplayBuffer.load_state_dict: segments has shape {tuple(segments.shape)}, "
                f"expected ({cap},)"
            )
        self._sampler.load_state_dict(state["sampler"])
        if storage is None:
            self._storage, self._columns = None, {}
        else:
            self._set_storage(storage)
            self._device = storage.device
        self._segments = segments
        self._next_segment = int(state["next_segment"])
        self._cursor, self._size = cursor, size
        self._write_count = int(state["write_count"])
        if self._generator is not None and state["generator"] is not None:
            self._generator.set_state(state["generator"])
        self._token = object()
