"""Samplers for :class:`~aiocollect._replay.buffer.ReplayBuffer`: which stored frames a sample holds.

A sampler turns the buffer's stored frames into storage indices. It never copies frame data
(the buffer gathers the frames), and it keeps whatever it derives from the storage (eligible
frames, slice windows) cached until the next write, so sampling again between two writes costs
O(batch) plus a binary search.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from tensordict import TensorDictBase

from .._core.errors import ConfigError, SamplingError, SpecError
from .._core.layout import Key, as_key
from .._core.public import public
from .._service.options import check_bool, positive_int

__all__ = [
    "Sampler",
    "SamplingError",
    "SliceSampler",
    "StalenessAwareSampler",
    "StoredFrames",
    "UniformSampler",
    "inverse_staleness",
]

_MASK: Key = ("collector", "mask")


class StoredFrames(NamedTuple):
    """What a sampler sees of a :class:`ReplayBuffer` (read-only, no copies)."""

    storage: TensorDictBase
    """The stored frames, ``storage[:size]`` of the preallocated storage (a view)."""
    size: int
    """Number of frames stored: ``len(buffer)``."""
    cursor: int
    """Storage index the next frame goes to. Once the buffer is full this is the oldest frame,
    and ``cursor - 1`` (modulo capacity) the newest one."""
    segments: torch.Tensor
    """int64 ``[size]`` on the CPU: the input piece each frame came from. Two frames share a
    piece id exactly when one ``extend`` call wrote them from the same row of its batch, with no
    masked-out frame between them; ids only grow, so frames from different calls never share one."""
    token: object
    """Replaced by a new object on every write: a sampler may cache what it derives from the
    storage for as long as the token is the same object."""


def _entry_key(key: Any, who: str, name: str) -> Key:
    """An entry name given by the user: a str or a non-empty tuple of non-empty strs."""
    parts = as_key(key) if isinstance(key, (str, tuple)) else ()
    if not parts or not all(isinstance(k, str) and k for k in parts):
        raise ConfigError(
            f"{who}: {name} must name an entry of the batches, a str or a tuple of strs "
            f"(e.g. ('collector', 'traj_ids')), got {key!r}"
        )
    return parts


def _check_scalar_entry(storage: TensorDictBase, key: Key, who: str, role: str) -> None:
    """The sampler reads ``key`` as one number per frame; say clearly when it cannot."""
    value = storage.get(key, None)
    if value is None or not isinstance(value, torch.Tensor):
        raise SpecError(
            f"{who} reads the {role} from entry {key!r}, but the batch written to the buffer has "
            f"no such tensor entry; write batches that hold it, or pass the right key to {who}"
        )
    if value[0].numel() != 1:
        raise SpecError(
            f"{who} reads the {role} from entry {key!r}, which must hold one number per frame "
            f"(shape [frames] or [frames, 1]), but it has per-frame shape {tuple(value.shape[1:])}"
        )


def _per_frame(storage: TensorDictBase, key: Key, size: int) -> torch.Tensor:
    """Entry ``key`` of the stored frames as a flat CPU tensor ``[size]``."""
    return storage.get(key)[:size].reshape(size).cpu()


@public
class Sampler(abc.ABC):
    """Base class of the replay buffer's samplers.

    A subclass implements :meth:`sample`; it may add entries to each sample (named in
    :attr:`sample_keys`, which the buffer keeps out of its storage), check the storage layout
    once when the buffer allocates it (:meth:`check_storage`), and keep state across
    checkpoints (:meth:`state_dict` / :meth:`load_state_dict`).
    """

    sample_keys: tuple[Key, ...] = ()
    """Entries this sampler adds to every sample, besides ``"index"``."""

    def check_storage(self, storage: TensorDictBase) -> None:
        """Called once when the buffer allocates its storage from the first batch; raises
        :class:`SpecError` if the sampler cannot work with that layout."""

    @abc.abstractmethod
    def sample(
        self, frames: StoredFrames, batch_size: int, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, dict[Key, torch.Tensor]]:
        """Choose ``batch_size`` frames among the ``frames.size >= 1`` stored ones.

        Returns the storage indices (int64 ``[batch_size]`` on the CPU; ``-1`` marks a padding
        position, which the buffer fills with zeros) and the extra entries of the sample, each
        ``[batch_size, ...]``. Random numbers come from ``generator`` (``None``: torch's
        global generator) and from nothing else, so a seed reproduces a sample.
        """

    def state_dict(self) -> dict[str, Any]:
        """The sampler's mutable state (not its constructor arguments), as plain Python values."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if state:
            raise ConfigError(
                f"{type(self).__name__}.load_state_dict: expected an empty state, got keys "
                f"{sorted(state)}; was the state saved from another kind of sampler?"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@public
class UniformSampler(Sampler):
    """Every stored frame is equally likely.

    Definition: with ``replacement=True`` (the default), each of the ``batch_size`` draws is
    independent and picks each of the ``len(buffer)`` stored frames with probability
    ``1 / len(buffer)``. With ``replacement=False`` the sample is a uniformly random subset of
    ``batch_size`` distinct frames (in random order), and asking for more frames than are
    stored raises :class:`SamplingError`.

    Cost: O(batch) with replacement; without replacement, one ``torch.randperm`` over the stored
    frames (vectorized, no Python loop).
    """

    def __init__(self, replacement: bool = True) -> None:
        self.replacement = check_bool("replacement", replacement, who="UniformSampler")

    def sample(self, frames, batch_size, generator):
        n = frames.size
        if self.replacement:
            return torch.randint(n, (batch_size,), generator=generator), {}
        if batch_size > n:
            raise SamplingError(
                f"UniformSampler(replacement=False): asked for {batch_size} distinct frames but "
                f"the buffer holds {n}; sample fewer, write more first, or use replacement=True"
            )
        return torch.randperm(n, generator=generator)[:batch_size], {}

    def __repr__(self) -> str:
        return f"UniformSampler(replacement={self.replacement})"


def inverse_staleness(staleness: torch.Tensor) -> torch.Tensor:
    """The default staleness weight: ``1 / (staleness + 1)`` (1 for the freshest frames)."""
    return 1.0 / (staleness.to(torch.float64) + 1.0)


@public
class StalenessAwareSampler(Sampler):
    """Prefers frames collected with recent weights, and never returns too old ones.

    Definitions (as TorchRL's ``StalenessAwareSampler``):

    - the **staleness** of a stored frame is ``consumer_version - v``, with ``v`` the frame's
      ``version_key`` entry (the version of the weights that chose its action) and
      :attr:`consumer_version` the version the learner is at;
    - the **gate**: when ``max_staleness >= 0``, frames with ``staleness > max_staleness`` are
      never sampled (``-1``: no gate);
    - each draw picks an eligible frame ``i`` with probability
      ``w_i / sum_j w_j``, where ``w = staleness_weight_fn(staleness)`` over the eligible
      frames (default :func:`inverse_staleness`, ``1 / (staleness + 1)``). Draws are
      independent (with replacement), so frequencies follow the weights exactly; TorchRL
      instead draws without replacement when the batch is small enough, which flattens the
      distribution.

    Each sample carries two entries besides ``"index"``:

    - ``"staleness"``: the staleness of each sampled frame, at the ``consumer_version`` it was
      sampled with (same dtype as the version entry, int64 for the collector's batches);
    - ``"weight"`` (float32): the frame's sampling probability relative to uniform sampling of
      the eligible frames, ``n_eligible * w_i / sum_j w_j``. Its mean over the eligible frames is
      1, and ``1 / weight`` is the importance weight that undoes the preference for fresh data,
      for a loss that wants an unbiased estimate.

    Staleness is negative for a frame newer than ``consumer_version``; that usually means
    ``consumer_version`` is not kept at the learner's weight version. Such frames pass the gate;
    the default weight is infinite at staleness -1 and negative below, which raises
    :class:`ConfigError` (weights must be finite and non-negative, and not all zero).

    Keep :attr:`consumer_version` equal to the version of the weights the learner trains (set
    it, or call :meth:`increment_consumer_version` after each weight update). It is saved by
    :meth:`state_dict`, with :attr:`max_staleness`.

    Cost: after each write or change of ``consumer_version``/``max_staleness``, one vectorized
    pass over the stored versions (no Python loop); between those, a sample is O(batch log n).

    Examples:
        >>> sampler = StalenessAwareSampler(max_staleness=4)
        >>> buffer = ReplayBuffer(10_000, sampler, batch_size=256)     # doctest: +SKIP
        >>> buffer.extend(batch); sampler.consumer_version = collector.policy_version  # doctest: +SKIP
        >>> sample = buffer.sample()                                    # doctest: +SKIP
    """

    sample_keys = (("staleness",), ("weight",))

    def __init__(
        self,
        max_staleness: int = -1,
        staleness_weight_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        version_key: str | tuple[str, ...] = ("collector", "policy_version"),
    ) -> None:
        self.max_staleness = max_staleness
        if staleness_weight_fn is not None and not callable(staleness_weight_fn):
            raise ConfigError(
                f"StalenessAwareSampler: staleness_weight_fn must be callable (staleness tensor "
                f"-> weight tensor), got {staleness_weight_fn!r}"
            )
        self._weight_fn = staleness_weight_fn or inverse_staleness
        self._version_key = _entry_key(version_key, "StalenessAwareSampler", "version_key")
        self._consumer_version = 0
        self._cache: tuple[Any, ...] | None = None
        self._versions_cache: tuple[object, torch.Tensor] | None = None

    @property
    def consumer_version(self) -> int:
        """The learner's weight version; staleness is measured from it."""
        return self._consumer_version

    @consumer_version.setter
    def consumer_version(self, value: int) -> None:
        self._consumer_version = int(value)

    def increment_consumer_version(self) -> int:
        """Add one to :attr:`consumer_version` (after a weight update); returns the new value."""
        self._consumer_version += 1
        return self._consumer_version

    @property
    def max_staleness(self) -> int:
        """Frames staler than this are never sampled; ``-1``: no limit."""
        return self._max_staleness

    @max_staleness.setter
    def max_staleness(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ConfigError(
                f"StalenessAwareSampler: max_staleness must be an int >= 0, or -1 for no limit; "
                f"got {value!r}"
            )
        self._max_staleness = value

    @property
    def staleness_weight_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Maps a staleness tensor to non-negative weights (read-only: weights are cached)."""
        return self._weight_fn

    @property
    def version_key(self) -> Key:
        """The entry holding each frame's policy version."""
        return self._version_key

    def check_storage(self, storage):
        _check_scalar_entry(storage, self._version_key, "StalenessAwareSampler", "policy version")

    def _versions(self, frames: StoredFrames) -> torch.Tensor:
        if self._versions_cache is None or self._versions_cache[0] is not frames.token:
            versions = _per_frame(frames.storage, self._version_key, frames.size)
            self._versions_cache = (frames.token, versions)
        return self._versions_cache[1]

    def _eligible(self, frames: StoredFrames):
        """(eligible indices, their weights, cumulative weights), cached per write and setting."""
        cache = self._cache
        if (
            cache is not None
            and cache[0] is frames.token
            and cache[1:3] == (self._consumer_version, self._max_staleness)
        ):
            return cache[3:]
        versions = self._versions(frames)
        staleness = self._consumer_version - versions
        if self._max_staleness >= 0:
            eligible = (staleness <= self._max_staleness).nonzero().squeeze(1)
            if eligible.numel() == 0:
                freshest = versions.max().item()
                raise SamplingError(
                    f"StalenessAwareSampler: no stored frame passes the staleness gate: "
                    f"max_staleness={self._max_staleness}, consumer_version="
                    f"{self._consumer_version}, and the freshest of the {frames.size} frames "
                    f"stored has {self._version_key!r} = {freshest} (staleness "
                    f"{self._consumer_version - freshest}); write "
                    "fresher data, raise max_staleness, or check that consumer_version is the "
                    "learner's weight version"
                )
        else:
            eligible = torch.arange(frames.size)
        eligible_staleness = staleness[eligible]
        weights = self._weights(eligible_staleness)
        cdf = weights.cumsum(0)
        self._cache = (
            frames.token, self._consumer_version, self._max_staleness, eligible, weights, cdf
        )
        return eligible, weights, cdf

    def _weights(self, staleness: torch.Tensor) -> torch.Tensor:
        name = getattr(self._weight_fn, "__name__", repr(self._weight_fn))
        raw = self._weight_fn(staleness)
        try:
            weights = torch.broadcast_to(torch.as_tensor(raw, dtype=torch.float64), staleness.shape)
        except (TypeError, RuntimeError) as exc:
            raise ConfigError(
                f"StalenessAwareSampler: staleness_weight_fn {name} must return a tensor of the "
                f"staleness tensor's shape {tuple(staleness.shape)}; got {raw!r:.200}"
            ) from exc
        bad = ~torch.isfinite(weights) | (weights < 0)
        if bad.any() or not weights.sum() > 0:
            at = staleness[bad.nonzero()[0, 0]].item() if bad.any() else None
            what = (
                f"weight {weights[bad][0].item()} at staleness {at}" if at is not None
                else "only zero weights"
            )
            hint = ""
            if (staleness < 0).any():
                hint = (
                    f" Some frames have negative staleness (newer than consumer_version="
                    f"{self._consumer_version}, down to {staleness.min().item()}): keep "
                    "consumer_version at the learner's weight version."
                )
            raise ConfigError(
                f"StalenessAwareSampler: staleness_weight_fn {name} gave {what}; weights must be "
                f"finite, non-negative and not all zero over the eligible frames.{hint}"
            )
        return weights

    def sample(self, frames, batch_size, generator):
        eligible, weights, cdf = self._eligible(frames)
        total = cdf[-1]
        # Inverse-CDF draws: no category limit (torch.multinomial stops at 2**24), O(b log n).
        u = torch.rand(batch_size, generator=generator, dtype=torch.float64) * total
        pos = torch.searchsorted(cdf, u, right=True).clamp_(max=eligible.numel() - 1)
        index = eligible[pos]
        staleness = self._consumer_version - self._versions(frames)[index]
        weight = (weights[pos] * (eligible.numel() / total)).to(torch.float32)
        return index, {("staleness",): staleness, ("weight",): weight}

    def state_dict(self) -> dict[str, Any]:
        return {"consumer_version": self._consumer_version, "max_staleness": self._max_staleness}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"consumer_version", "max_staleness"}:
            raise ConfigError(
                "StalenessAwareSampler.load_state_dict: expected keys consumer_version and "
                f"max_staleness, got {sorted(state)}; was the state saved from another sampler?"
            )
        self.consumer_version = int(state["consumer_version"])
        self.max_staleness = int(state["max_staleness"])

    def __repr__(self) -> str:
        return (
            f"StalenessAwareSampler(max_staleness={self._max_staleness}, consumer_version="
            f"{self._consumer_version}, version_key={self._version_key!r})"
        )


@public
class SliceSampler(Sampler):
    """Samples contiguous pieces of trajectories, ``slice_len`` consecutive frames each.

    Definitions:

    - A **run** is a maximal group of stored frames with consecutive storage indices that were
      consecutive in time: same ``traj_key`` id, written by the same ``extend`` call from the
      same row of its batch with no masked-out frame between them, and not separated by the
      end of the storage array (index ``capacity - 1`` to ``0``) nor by the write cursor (the
      boundary between the newest and the oldest frame once the buffer is full). A trajectory
      that continues in a later batch, or that wraps around the end of the storage array, is
      thus several runs; slices never join them.
    - A **window** is ``slice_len`` consecutive storage indices inside one run. Each slice is a
      window drawn uniformly among all windows of all runs (with replacement): every frame
      sequence of that length that the buffer holds is equally likely, whatever the length of
      its trajectory. (TorchRL draws a trajectory first, then a start, which favours frames of
      short trajectories.)
    - With ``strict_length=False``, a run shorter than ``slice_len`` counts as one window too:
      the whole run, padded at the end to ``slice_len``. Padding positions have ``"index"`` -1
      and all-zero entries (``False`` for booleans), and the sample carries
      ``("collector", "mask")`` (bool), ``False`` on padding, as the collector's padded layout.
      With ``strict_length=True`` (the default) shorter runs are never sampled and no mask is
      added.

    Layout (as TorchRL's): a sample is flat, ``[batch_size]``, with ``batch_size // slice_len``
    slices one after the other, each in time order: frames ``k * slice_len`` to
    ``(k + 1) * slice_len - 1`` are slice ``k``. ``sample.view(-1, slice_len)`` gives
    ``[num_slices, slice_len]``. ``batch_size`` must be a multiple of ``slice_len``.

    Raises :class:`SamplingError` when no window exists (no run of ``slice_len`` frames).

    Cost: after each write, one vectorized pass over the stored ids (no Python loop); between
    writes, a sample is O(batch log runs).
    """

    def __init__(
        self,
        slice_len: int,
        *,
        traj_key: str | tuple[str, ...] = ("collector", "traj_ids"),
        strict_length: bool = True,
    ) -> None:
        self.slice_len = positive_int("slice_len", slice_len, who="SliceSampler")
        self.traj_key = _entry_key(traj_key, "SliceSampler", "traj_key")
        self.strict_length = check_bool("strict_length", strict_length, who="SliceSampler")
        self.sample_keys = () if self.strict_length else (_MASK,)
        self._cache: tuple[object, tuple[torch.Tensor, ...]] | None = None

    def check_storage(self, storage):
        _check_scalar_entry(storage, self.traj_key, "SliceSampler", "trajectory id")

    def _windows(self, frames: StoredFrames) -> tuple[torch.Tensor, ...]:
        """(run starts, run lengths, windows per run, cumulative windows) of runs with windows."""
        if self._cache is not None and self._cache[0] is frames.token:
            return self._cache[1]
        size = frames.size
        traj = _per_frame(frames.storage, self.traj_key, size)
        seg = frames.segments
        boundary = torch.ones(size, dtype=torch.bool)
        boundary[1:] = (seg[1:] != seg[:-1]) | (traj[1:] != traj[:-1])
        if frames.cursor < size:
            boundary[frames.cursor] = True
        starts = boundary.nonzero().squeeze(1)
        lengths = torch.diff(starts, append=starts.new_tensor([size]))
        windows = (lengths - self.slice_len + 1).clamp_(min=0)
        if not self.strict_length:
            windows.clamp_(min=1)
        keep = windows > 0
        result = (starts[keep], lengths[keep], windows[keep], windows[keep].cumsum(0), lengths)
        self._cache = (frames.token, result)
        return result

    def sample(self, frames, batch_size, generator):
        L = self.slice_len
        if batch_size % L:
            raise ConfigError(
                f"SliceSampler: batch_size {batch_size} is not a multiple of slice_len {L}; a "
                f"sample holds whole slices (for example batch_size={max(L, batch_size // L * L)})"
            )
        starts, lengths, windows, cum, all_lengths = self._windows(frames)
        if starts.numel() == 0:
            raise SamplingError(
                f"SliceSampler: no stored run has slice_len={L} frames (the longest run of "
                f"consecutive frames of one trajectory is {int(all_lengths.max())}, among "
                f"{frames.size} frames); write longer rows, sample shorter slices, or pass "
                "strict_length=False to allow padded short slices"
            )
        num_slices = batch_size // L
        u = torch.randint(int(cum[-1]), (num_slices,), generator=generator)
        run = torch.searchsorted(cum, u, right=True)
        first = starts[run] + (u - (cum[run] - windows[run]))
        steps = torch.arange(L)
        index = first[:, None] + steps
        if self.strict_length:
            return index.reshape(-1), {}
        mask = steps < lengths[run, None]
        return index.masked_fill_(~mask, -1).reshape(-1), {_MASK: mask.reshape(-1)}

    def __repr__(self) -> str:
        return (
            f"SliceSampler(slice_len={self.slice_len}, traj_key={self.traj_key!r}, "
            f"strict_length={self.strict_length})"
        )
