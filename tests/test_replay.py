"""``ReplayBuffer`` and its samplers: storage, wraparound, masks, checkpoints, sampling laws."""

from __future__ import annotations

import io
import math
from collections import Counter

import pytest
import torch
from tensordict import NonTensorData, TensorDict

from aiocollect._core.errors import AiocollectError, ConfigError, SpecError
from aiocollect._replay.buffer import ReplayBuffer
from aiocollect._replay.samplers import (
    SamplingError,
    SliceSampler,
    StalenessAwareSampler,
    UniformSampler,
)
from aiocollect._collector.split import split_trajectories

IDS = ("collector", "traj_ids")
VERSION = ("collector", "policy_version")
MASK = ("collector", "mask")


def make_batch(E: int, T: int, *, first: int = 0, version: int = 0, traj_ids=None) -> TensorDict:
    """A batch in the collector's layout. ``"frame"`` numbers the frames row-major from
    ``first``, so a stored frame can be traced back to the batch position it came from."""
    frame = torch.arange(first, first + E * T).view(E, T)
    if traj_ids is None:
        traj_ids = torch.arange(E)[:, None].expand(E, T) + first
    traj_ids = torch.as_tensor(traj_ids, dtype=torch.int64)
    return TensorDict(
        {
            "frame": frame,
            "observation": frame[..., None].float().expand(E, T, 3).clone(),
            "action": frame % 4,
            ("next", "observation"): frame[..., None].float().expand(E, T, 3) + 1,
            ("next", "reward"): frame[..., None].float() / 10,
            ("next", "done"): torch.zeros(E, T, 1, dtype=torch.bool),
            ("next", "terminated"): torch.zeros(E, T, 1, dtype=torch.bool),
            ("next", "truncated"): torch.zeros(E, T, 1, dtype=torch.bool),
            IDS: traj_ids.clone(),
            VERSION: torch.full((E, T), version, dtype=torch.int64),
        },
        batch_size=[E, T],
        names=[None, "time"],
    )


class Rollouts:
    """Batches of ``E`` envs x ``T`` steps whose episodes have random lengths and continue from
    one batch to the next, as the collector delivers them. Besides the usual entries each frame
    has ``"step"`` (its time step within its trajectory) and ``"row"`` (a number unique to the
    batch row it was written in), from which the contiguity of stored frames can be checked
    without looking inside the buffer."""

    def __init__(self, E: int, T: int, *, max_episode: int, seed: int = 0) -> None:
        self.E, self.T, self.max_episode = E, T, max_episode
        self.g = torch.Generator().manual_seed(seed)
        self.next_id = E
        self.ids = list(range(E))
        self.steps = [0] * E
        self.left = [self._length() for _ in range(E)]
        self.rows = 0
        self.frames = 0

    def _length(self) -> int:
        return int(torch.randint(1, self.max_episode + 1, (1,), generator=self.g))

    def __call__(self, version: int = 0) -> TensorDict:
        E, T = self.E, self.T
        ids = torch.empty(E, T, dtype=torch.int64)
        steps = torch.empty(E, T, dtype=torch.int64)
        for e in range(E):
            for t in range(T):
                ids[e, t], steps[e, t] = self.ids[e], self.steps[e]
                self.steps[e] += 1
                self.left[e] -= 1
                if self.left[e] == 0:
                    self.ids[e], self.next_id = self.next_id, self.next_id + 1
                    self.steps[e], self.left[e] = 0, self._length()
        batch = make_batch(E, T, first=self.frames, version=version, traj_ids=ids)
        batch["step"] = steps
        batch["row"] = (torch.arange(E) + self.rows)[:, None].expand(E, T).clone()
        self.rows += E
        self.frames += E * T
        return batch


def valid_windows(buffer: ReplayBuffer, L: int) -> set[tuple[int, ...]]:
    """Reference: every run of L storage indices i..i+L-1 (no wrap) whose frames are one
    trajectory's consecutive steps, written from one batch row."""
    s = buffer.storage[: len(buffer)]
    ids, steps, rows = s[IDS].tolist(), s["step"].tolist(), s["row"].tolist()
    out = set()
    for i in range(len(buffer) - L + 1):
        j = range(i, i + L)
        if (
            len({ids[k] for k in j}) == 1
            and len({rows[k] for k in j}) == 1
            and all(steps[k + 1] == steps[k] + 1 for k in j[:-1])
        ):
            out.add(tuple(j))
    return out


def tally(values: torch.Tensor) -> Counter:
    """How many times each value occurs (vectorized: samples here are large)."""
    unique, counts = values.unique(return_counts=True)
    return Counter(dict(zip(unique.tolist(), counts.tolist())))


def chi_square(counts: Counter, probs: dict) -> float:
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"sampled outside the support: {set(counts) - set(probs)}"
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())


# -- storage ------------------------------------------------------------------------------------
def test_storage_is_preallocated_from_the_first_batch():
    """The first extend allocates [capacity] tensors for every entry (per-frame shape and dtype
    kept, zero-filled) and writes the frames row by row from index 0."""
    buffer = ReplayBuffer(20)
    assert buffer.storage is None and len(buffer) == 0 and buffer.write_count == 0
    batch = make_batch(2, 3)
    index = buffer.extend(batch)
    storage = buffer.storage
    assert storage.batch_size == torch.Size([20])
    for key, value in batch.items(include_nested=True, leaves_only=True):
        assert storage[key].shape == (20, *value.shape[2:]), key
        assert storage[key].dtype == value.dtype, key
    assert index.tolist() == list(range(6))
    assert storage["frame"][:6].tolist() == batch["frame"].reshape(-1).tolist()  # row-major
    assert storage["frame"][6:].eq(0).all() and storage["observation"][6:].eq(0).all()
    assert len(buffer) == 6 and buffer.write_count == 6
    # Later writes reuse the same tensors: no reallocation.
    before = storage["observation"].data_ptr()
    buffer.extend(make_batch(1, 4, first=6))
    assert buffer.storage["observation"].data_ptr() == before
    assert buffer.storage["frame"][:10].tolist() == list(range(10))


def test_extend_copies_the_batch():
    """The buffer keeps its own copy: changing the batch afterwards changes nothing stored."""
    buffer = ReplayBuffer(8)
    batch = make_batch(2, 2)
    buffer.extend(batch)
    batch["observation"].fill_(-1)
    assert buffer.storage["observation"][:4].ge(0).all()


def test_writes_wrap_around_at_capacity():
    """Once full, each new frame overwrites the oldest; len stays at capacity while write_count
    keeps counting, and extend returns the indices written, wrapped."""
    buffer = ReplayBuffer(10)
    assert buffer.extend(make_batch(2, 3, first=0)).tolist() == [0, 1, 2, 3, 4, 5]
    assert buffer.extend(make_batch(2, 3, first=6)).tolist() == [6, 7, 8, 9, 0, 1]
    assert len(buffer) == 10 and buffer.write_count == 12
    assert buffer.storage["frame"].tolist() == [10, 11, 2, 3, 4, 5, 6, 7, 8, 9]
    assert buffer.extend(make_batch(1, 3, first=12)).tolist() == [2, 3, 4]
    assert buffer.storage["frame"].tolist() == [10, 11, 12, 13, 14, 5, 6, 7, 8, 9]


def test_a_batch_larger_than_capacity_keeps_its_last_frames():
    buffer = ReplayBuffer(5)
    buffer.extend(make_batch(1, 3))
    index = buffer.extend(make_batch(3, 4, first=3))  # 12 frames into 5 slots
    assert buffer.write_count == 15 and len(buffer) == 5
    assert index.tolist() == [0, 1, 2, 3, 4]
    assert buffer.storage["frame"][index].tolist() == [10, 11, 12, 13, 14]
    assert buffer.extend(make_batch(1, 1, first=15)).tolist() == [0]  # cursor: 15 % 5


def test_one_dimensional_batches_are_frames():
    buffer = ReplayBuffer(10)
    flat = make_batch(2, 3).reshape(-1)
    assert buffer.extend(flat).tolist() == list(range(6))
    assert buffer.storage["frame"][:6].tolist() == list(range(6))
    buffer.extend(make_batch(2, 2, first=6))  # [E, T] after [N]: same per-frame layout
    assert buffer.storage["frame"].tolist() == list(range(10))


def test_only_frames_the_mask_marks_valid_are_stored():
    """A padded batch ([n_traj, max_len] with ("collector", "mask")) writes only its valid
    frames, in row-major order; the mask itself is not stored and write_count counts only valid
    frames, so masked and unmasked batches can be mixed."""
    batch = make_batch(3, 4, traj_ids=[[0, 0, 1, 1], [2, 2, 2, 2], [3, 4, 4, 4]])
    padded = split_trajectories(batch)  # rows: ids 0, 1, 2, 3, 4
    assert padded.batch_size == torch.Size([5, 4])
    buffer = ReplayBuffer(16)
    index = buffer.extend(padded)
    assert index.tolist() == list(range(12)) and buffer.write_count == 12
    assert buffer.storage["frame"][:12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert buffer.storage[IDS][:12].tolist() == [0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4, 4]
    assert MASK not in buffer.storage.keys(include_nested=True)
    # An arbitrary mask, on an [E, T] batch, then an unmasked batch.
    batch = make_batch(2, 3, first=100)
    batch[MASK] = torch.tensor([[True, False, True], [False, False, True]])
    assert buffer.extend(batch).tolist() == [12, 13, 14]
    assert buffer.storage["frame"][12:15].tolist() == [100, 102, 105]
    buffer.extend(make_batch(1, 2, first=200))
    assert buffer.write_count == 17 and len(buffer) == 16
    assert buffer.storage["frame"][[15, 0]].tolist() == [200, 201]
    # A batch with nothing valid writes nothing.
    empty = make_batch(1, 2)
    empty[MASK] = torch.zeros(1, 2, dtype=torch.bool)
    assert buffer.extend(empty).tolist() == [] and buffer.write_count == 17


# -- errors -------------------------------------------------------------------------------------
def test_capacity_must_be_a_positive_int():
    for capacity in [0, -5, 2.5, True, "10", None]:
        with pytest.raises(ConfigError, match="capacity must be an int >= 1"):
            ReplayBuffer(capacity)


def test_constructor_checks_its_arguments():
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1, got 0"):
        ReplayBuffer(10, batch_size=0)
    with pytest.raises(ConfigError, match="sampler must be a Sampler"):
        ReplayBuffer(10, sampler="uniform")
    with pytest.raises(ConfigError, match="slice_len must be an int >= 1"):
        SliceSampler(0)
    with pytest.raises(ConfigError, match="max_staleness must be an int >= 0, or -1"):
        StalenessAwareSampler(max_staleness=-2)
    with pytest.raises(ConfigError, match="staleness_weight_fn must be callable"):
        StalenessAwareSampler(staleness_weight_fn=2.0)


def test_sample_without_a_batch_size_says_how_to_give_one():
    buffer = ReplayBuffer(10)
    buffer.extend(make_batch(1, 4))
    missing = r"batch_size is missing; pass sample\(batch_size=\.\.\.\)"
    with pytest.raises(ConfigError, match=missing):
        buffer.sample()
    assert buffer.sample(3).batch_size == torch.Size([3])
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1, got -1"):
        buffer.sample(-1)


def test_sampling_an_empty_buffer_is_an_error():
    buffer = ReplayBuffer(10, batch_size=2)
    with pytest.raises(SamplingError, match="the buffer is empty"):
        buffer.sample()
    assert issubclass(SamplingError, AiocollectError)


MISFITS = {
    "missing": (lambda b: b.exclude(("next", "reward")), r"no entry \('next', 'reward'\)"),
    "extra": (
        lambda b: b.set("extra", torch.zeros(b.shape)), r"entry \('extra',\) that the storage"
    ),
    "shape": (
        lambda b: b.set("observation", torch.zeros(*b.shape, 4)),
        r"entry \('observation',\) has per-frame shape \(4,\).*holds \(3,\)",
    ),
    "dtype": (
        lambda b: b.set(("next", "reward"), b["next", "reward"].double()),
        r"entry \('next', 'reward'\) has .*torch.float64.*torch.float32",
    ),
}


def test_a_batch_that_does_not_fit_the_storage_names_the_entry():
    """A missing or extra entry, or one of another per-frame shape or dtype: the error names the
    entry, and nothing is written."""
    buffer = ReplayBuffer(10)
    buffer.extend(make_batch(1, 2))
    for name, (change, message) in MISFITS.items():
        with pytest.raises(SpecError, match=message):
            buffer.extend(change(make_batch(1, 3, first=2)))
        assert buffer.write_count == 2 and buffer.storage["frame"][2:].eq(0).all(), name


def test_bad_batches_are_refused_with_a_clear_error():
    buffer = ReplayBuffer(10)
    with pytest.raises(TypeError, match="expected a TensorDict"):
        buffer.extend({"observation": torch.zeros(3)})
    wrong_dims = r"shape \[envs, time\] or \[frames\], got batch_size \(1, 2, 3\)"
    with pytest.raises(SpecError, match=wrong_dims):
        buffer.extend(TensorDict({"x": torch.zeros(1, 2, 3)}, batch_size=[1, 2, 3]))
    with pytest.raises(SpecError, match=r"entry \('index',\).*samples use"):
        buffer.extend(TensorDict({"index": torch.zeros(3)}, batch_size=[3]))
    batch = make_batch(1, 2)
    batch["note"] = NonTensorData("hello", batch_size=[1, 2])
    with pytest.raises(SpecError, match=r"entry \('note',\) holds non-tensor data"):
        buffer.extend(batch)
    batch = make_batch(1, 2)
    batch[MASK] = torch.ones(1, 2)
    with pytest.raises(SpecError, match="mask.*must be a bool tensor"):
        buffer.extend(batch)
    assert buffer.storage is None  # nothing was allocated by a refused batch
    with pytest.raises(SpecError, match="no tensor entry"):
        buffer.extend(TensorDict(batch_size=[3]))


# -- checkpoints --------------------------------------------------------------------------------
def roundtrip(state: dict) -> dict:
    """Through torch.save / torch.load(weights_only=True), as a checkpoint would go."""
    f = io.BytesIO()
    torch.save(state, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


SAMPLERS = {
    "uniform": UniformSampler,
    "staleness": lambda: StalenessAwareSampler(max_staleness=3),
    "slice": lambda: SliceSampler(3),
}


def test_state_dict_round_trip_gives_the_same_samples():
    """A buffer loaded from another's state_dict holds the same frames, writes at the same
    cursor and, with the same torch seed, draws the same samples."""
    for make_sampler in SAMPLERS.values():
        rollouts = Rollouts(3, 5, max_episode=6)
        buffer = ReplayBuffer(40, make_sampler(), batch_size=12)
        for version in range(4):  # 60 frames: wrapped once
            buffer.extend(rollouts(version))
        if isinstance(buffer.sampler, StalenessAwareSampler):
            buffer.sampler.consumer_version = 4
        state = roundtrip(buffer.state_dict())
        other = ReplayBuffer(40, make_sampler(), batch_size=12)
        other.load_state_dict(state)
        assert len(other) == 40 and other.write_count == 60
        assert (other.storage == buffer.storage).all()
        assert repr(other.sampler) == repr(buffer.sampler)
        torch.manual_seed(7)
        a = buffer.sample()
        torch.manual_seed(7)
        b = other.sample()
        assert (a == b).all()
        more = rollouts(4)
        assert buffer.extend(more.clone()).tolist() == other.extend(more).tolist()
        torch.manual_seed(8)
        a = buffer.sample()
        torch.manual_seed(8)
        assert (a == other.sample()).all()
        # The loaded storage is a copy: the two buffers share no tensor.
        assert other.storage["observation"].data_ptr() != buffer.storage["observation"].data_ptr()


def test_state_dict_carries_the_generator_state():
    """With its own generator, a reloaded buffer continues the same random stream."""
    buffer = ReplayBuffer(20, batch_size=5, generator=torch.Generator().manual_seed(3))
    buffer.extend(make_batch(4, 5))
    buffer.sample()
    other = ReplayBuffer(20, batch_size=5, generator=torch.Generator())
    other.load_state_dict(roundtrip(buffer.state_dict()))
    assert buffer.sample()["index"].tolist() == other.sample()["index"].tolist()


def test_state_dict_of_an_empty_buffer_and_mismatched_states():
    empty = ReplayBuffer(10)
    other = ReplayBuffer(10)
    other.load_state_dict(roundtrip(empty.state_dict()))
    assert other.storage is None and len(other) == 0
    with pytest.raises(ConfigError, match="capacity 10, this one has capacity 12"):
        ReplayBuffer(12).load_state_dict(empty.state_dict())
    with pytest.raises(ConfigError, match="another sampler"):
        ReplayBuffer(10, StalenessAwareSampler()).load_state_dict(empty.state_dict())


def test_repr_says_what_the_buffer_holds():
    buffer = ReplayBuffer(10, SliceSampler(2), batch_size=4)
    buffer.extend(make_batch(1, 3))
    text = repr(buffer)
    for part in ("capacity=10", "len=3", "write_count=3", "SliceSampler(slice_len=2", "size=4"):
        assert part in text


# -- UniformSampler -----------------------------------------------------------------------------
def test_uniform_sampling_is_uniform_over_stored_frames():
    """Frequencies of 200k draws over 50 stored frames (after wraparound, capacity 64 partly
    reused) pass a chi-square test; nothing outside the stored frames is drawn."""
    buffer = ReplayBuffer(50, generator=torch.Generator().manual_seed(0))
    buffer.extend(make_batch(6, 10))  # 60 frames into 50 slots
    counts = tally(buffer.sample(200_000)["index"])
    chi2 = chi_square(counts, {i: 1 / 50 for i in range(50)})
    assert chi2 < 49 + 6 * math.sqrt(2 * 49), chi2  # 49 dof: 6 standard deviations
    partly = ReplayBuffer(100, generator=torch.Generator().manual_seed(1))
    partly.extend(make_batch(2, 10))
    sample = partly.sample(20_000)
    assert set(sample["index"].tolist()) == set(range(20))
    assert (sample["frame"] == sample["index"]).all()  # the data is that of the index


def test_sampled_frames_are_the_stored_ones():
    buffer = ReplayBuffer(30, batch_size=64)
    buffer.extend(make_batch(4, 10))
    sample = buffer.sample()
    assert sample.batch_size == torch.Size([64])
    assert (sample.exclude("index") == buffer.storage[sample["index"]]).all()
    assert sample["index"].dtype == torch.int64


def test_uniform_sampling_without_replacement_gives_distinct_frames():
    buffer = ReplayBuffer(20, UniformSampler(replacement=False))
    buffer.extend(make_batch(2, 5))
    assert sorted(buffer.sample(10)["index"].tolist()) == list(range(10))
    assert len(set(buffer.sample(7)["index"].tolist())) == 7
    with pytest.raises(SamplingError, match="asked for 11 distinct frames but the buffer holds 10"):
        buffer.sample(11)


# -- StalenessAwareSampler ----------------------------------------------------------------------
def versioned_buffer(sampler, versions=range(6), frames_per_version=10) -> ReplayBuffer:
    buffer = ReplayBuffer(1000, sampler, generator=torch.Generator().manual_seed(0))
    for v in versions:
        buffer.extend(make_batch(1, frames_per_version, first=100 * v, version=v))
    return buffer


def test_staleness_gate_excludes_exactly_the_frames_over_max_staleness():
    """consumer_version 5, max_staleness 2: frames of versions 3, 4, 5 (staleness 0..2) are
    sampled, every one of them, and no frame of versions 0..2."""
    sampler = StalenessAwareSampler(max_staleness=2)
    sampler.consumer_version = 5
    buffer = versioned_buffer(sampler)
    sample = buffer.sample(20_000)
    eligible = (buffer.storage[VERSION][: len(buffer)] >= 3).nonzero().squeeze(1)
    assert set(sample["index"].tolist()) == set(eligible.tolist())
    assert set(sample[VERSION].tolist()) == {3, 4, 5}
    assert (sample["staleness"] == 5 - sample[VERSION]).all()
    sampler.max_staleness = 0
    assert set(buffer.sample(1000)[VERSION].tolist()) == {5}
    sampler.max_staleness = -1  # no gate
    assert set(buffer.sample(20_000)[VERSION].tolist()) == set(range(6))


def test_staleness_sampling_frequencies_follow_inverse_staleness():
    """With equal numbers of frames per version, version v is drawn with probability
    proportional to 1 / (staleness + 1) = 1 / (consumer_version - v + 1); the "weight" entry
    is n_eligible times the frame's probability."""
    sampler = StalenessAwareSampler()
    sampler.consumer_version = 5
    buffer = versioned_buffer(sampler)
    sample = buffer.sample(200_000)
    w = {v: 1 / (5 - v + 1) for v in range(6)}
    total = sum(w.values())
    probs = {v: w[v] / total for v in w}
    counts = tally(sample[VERSION])
    for v, p in probs.items():
        assert counts[v] / 200_000 == pytest.approx(p, rel=0.03), (v, counts[v])
    assert chi_square(counts, probs) < 5 + 6 * math.sqrt(10)
    assert sample["weight"].dtype == torch.float32
    weight_of_version = torch.tensor([60 * probs[v] / 10 for v in range(6)], dtype=torch.float32)
    torch.testing.assert_close(sample["weight"], weight_of_version[sample[VERSION]])


def test_increment_consumer_version_shifts_staleness():
    sampler = StalenessAwareSampler()
    buffer = versioned_buffer(sampler, versions=[0, 1, 2])
    sampler.consumer_version = 2
    torch.manual_seed(0)
    before = buffer.sample(500)
    assert sampler.increment_consumer_version() == 3 and sampler.consumer_version == 3
    after = buffer.sample(500)
    assert (before["staleness"] == 2 - before[VERSION]).all()
    assert (after["staleness"] == 3 - after[VERSION]).all()
    assert after["staleness"].min() == 1
    # The preference follows: with versions 0..2 at consumer 3, version 2 is 3/2 as likely as 1.
    counts = tally(buffer.sample(100_000)[VERSION])
    assert counts[2] / counts[1] == pytest.approx((1 / 2) / (1 / 3), rel=0.05)


def test_a_custom_staleness_weight_fn_sets_the_frequencies():
    sampler = StalenessAwareSampler(staleness_weight_fn=lambda s: 0.5 ** s.double())
    sampler.consumer_version = 3
    buffer = versioned_buffer(sampler, versions=[0, 1, 2, 3])
    counts = tally(buffer.sample(100_000)[VERSION])
    total = sum(0.5**s for s in range(4))
    for v in range(4):
        assert counts[v] / 100_000 == pytest.approx(0.5 ** (3 - v) / total, rel=0.05)
    # A weight of zero is a soft gate: those frames are never drawn.
    only_fresh = StalenessAwareSampler(staleness_weight_fn=lambda s: (s == 0).double())
    only_fresh.consumer_version = 3
    buffer = versioned_buffer(only_fresh, versions=[0, 1, 2, 3])
    assert set(buffer.sample(5000)[VERSION].tolist()) == {3}


def test_nothing_passing_the_gate_is_a_clear_error():
    sampler = StalenessAwareSampler(max_staleness=1)
    buffer = versioned_buffer(sampler, versions=[0, 1, 2])
    sampler.consumer_version = 7
    with pytest.raises(
        SamplingError,
        match=r"no stored frame passes the staleness gate: max_staleness=1, consumer_version=7, "
        r"and the freshest of the 30 frames stored has \('collector', 'policy_version'\) = 2 "
        r"\(staleness 5\)",
    ):
        buffer.sample(4)
    sampler.consumer_version = 3  # the gate opens again for version 2
    assert set(buffer.sample(100)[VERSION].tolist()) == {2}


def test_invalid_weights_are_an_error_naming_negative_staleness():
    """Frames newer than consumer_version (negative staleness) give the default weight an
    infinite or negative value: refused, with the likely cause."""
    sampler = StalenessAwareSampler()
    buffer = versioned_buffer(sampler, versions=[0, 1, 2])
    sampler.consumer_version = 1
    with pytest.raises(ConfigError, match="must be finite, non-negative.*negative staleness"):
        buffer.sample(4)
    zero = StalenessAwareSampler(staleness_weight_fn=lambda s: torch.zeros_like(s))
    with pytest.raises(ConfigError, match="only zero weights"):
        versioned_buffer(zero, versions=[0]).sample(4)


def test_staleness_sampler_needs_the_version_entry():
    buffer = ReplayBuffer(10, StalenessAwareSampler())
    with pytest.raises(SpecError, match=r"version from entry \('collector', 'policy_version'\)"):
        buffer.extend(make_batch(1, 3).exclude(VERSION))
    custom = ReplayBuffer(10, StalenessAwareSampler(version_key="v"))
    custom.extend(TensorDict({"v": torch.tensor([0, 1, 1]), "x": torch.zeros(3)}, batch_size=[3]))
    custom.sampler.consumer_version = 1
    assert set(custom.sample(100)["x"].tolist()) == {0.0}


# -- SliceSampler -------------------------------------------------------------------------------
def test_slices_are_contiguous_pieces_of_one_trajectory():
    """Every sampled slice is slice_len consecutive storage indices holding one trajectory's
    consecutive steps from one batch row, and every such window is sampled: slices never cross
    a trajectory boundary, a batch boundary, the end of the storage array or the write cursor.
    The sample is flat, slices one after the other."""
    L = 4
    rollouts = Rollouts(3, 7, max_episode=9, seed=1)
    buffer = ReplayBuffer(50, SliceSampler(L), generator=torch.Generator().manual_seed(2))
    for version in range(4):  # 84 frames into 50: wrapped, cursor mid-storage
        buffer.extend(rollouts(version))
    sample = buffer.sample(4000 * L)
    assert sample.batch_size == torch.Size([4000 * L])
    slices = sample.view(-1, L)
    index = slices["index"]
    assert (index.diff(dim=1) == 1).all()  # consecutive storage indices, no wrap
    assert (slices[IDS] == slices[IDS][:, :1]).all()  # one trajectory
    assert (slices["step"].diff(dim=1) == 1).all()  # consecutive in time
    assert (slices["row"] == slices["row"][:, :1]).all()  # one batch row
    sampled = {tuple(row) for row in index.tolist()}
    assert sampled == valid_windows(buffer, L)
    assert MASK not in sample.keys(include_nested=True)


def test_slices_are_uniform_over_windows():
    """Each window (a valid start) is equally likely, whatever its trajectory's length."""
    buffer = ReplayBuffer(100, SliceSampler(2), generator=torch.Generator().manual_seed(0))
    buffer.extend(make_batch(1, 10, traj_ids=[[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]]))  # 1 + 7 windows
    starts = tally(buffer.sample(2 * 80_000)["index"].view(-1, 2)[:, 0])
    assert chi_square(starts, {s: 1 / 8 for s in [0, 2, 3, 4, 5, 6, 7, 8]}) < 7 + 6 * math.sqrt(14)


def test_a_trajectory_continuing_across_batches_is_not_joined():
    """One env, one long episode over two batches: adjacent in storage, same id, consecutive
    steps, but written by two extend calls, so no slice spans the two."""
    rollouts = Rollouts(1, 5, max_episode=1000)
    buffer = ReplayBuffer(100, SliceSampler(3))
    buffer.extend(rollouts())
    buffer.extend(rollouts())
    starts = set(buffer.sample(3 * 2000)["index"].view(-1, 3)[:, 0].tolist())
    assert starts == {0, 1, 2, 5, 6, 7}


def test_no_slice_crosses_the_write_cursor():
    """A single row longer than the free space wraps around: the newest frame (just before the
    cursor) and the oldest (at the cursor) are adjacent, of the same trajectory and of the same
    write, yet no slice joins them; nor does one join the array's end to its start."""
    rollouts = Rollouts(1, 10, max_episode=1000)
    buffer = ReplayBuffer(10, SliceSampler(2))
    first = make_batch(1, 3, traj_ids=[[-1, -1, -1]])
    first["step"], first["row"] = torch.tensor([[7, 8, 9]]), torch.full((1, 3), -1)
    buffer.extend(first)
    buffer.extend(rollouts())  # steps 0..9 to indices 3..9, 0..2; cursor 3
    assert buffer.storage["step"].tolist() == [7, 8, 9, 0, 1, 2, 3, 4, 5, 6]
    starts = set(buffer.sample(2 * 2000)["index"].view(-1, 2)[:, 0].tolist())
    assert starts == {0, 1, 3, 4, 5, 6, 7, 8}  # not 2 (cursor), not 9 (array end)


def test_masked_gaps_split_runs():
    """Valid frames on both sides of a masked-out frame were not consecutive in time: a slice
    never joins them."""
    batch = make_batch(1, 6, traj_ids=[[1] * 6])
    batch[MASK] = torch.tensor([[True, True, False, True, True, True]])
    buffer = ReplayBuffer(10, SliceSampler(2))
    buffer.extend(batch)  # frames 0, 1 | 3, 4, 5 to indices 0..4
    starts = set(buffer.sample(2 * 1000)["index"].view(-1, 2)[:, 0].tolist())
    assert starts == {0, 2, 3}


def test_short_runs_are_padded_when_strict_length_is_false():
    """strict_length=False: a run shorter than slice_len is one more window, the whole run
    padded at the end: index -1, zeros, and ("collector", "mask") False on padding."""
    buffer = ReplayBuffer(20, SliceSampler(3, strict_length=False))
    buffer.extend(make_batch(1, 6, first=10, traj_ids=[[0, 0, 0, 0, 1, 1]]))
    slices = buffer.sample(3 * 2000).view(-1, 3)
    windows = Counter(tuple(row) for row in slices["index"].tolist())
    assert set(windows) == {(0, 1, 2), (1, 2, 3), (4, 5, -1)}
    short = slices[slices["index"][:, 2] == -1]
    assert short[MASK].tolist()[0] == [True, True, False]
    assert short["frame"].tolist()[0] == [14, 15, 0]
    assert (short["observation"][:, 2] == 0).all() and not short["next", "done"][:, 2].any()
    full = slices[slices["index"][:, 2] != -1]
    assert full[MASK].all()
    strict = ReplayBuffer(20, SliceSampler(3))
    strict.extend(make_batch(1, 6, traj_ids=[[0, 0, 0, 0, 1, 1]]))
    assert set(strict.sample(3 * 500)["index"].view(-1, 3)[:, 0].tolist()) == {0, 1}


def test_slice_sampler_errors():
    buffer = ReplayBuffer(20, SliceSampler(4))
    buffer.extend(make_batch(3, 3))  # three runs of 3 frames
    with pytest.raises(ConfigError, match="batch_size 10 is not a multiple of slice_len 4"):
        buffer.sample(10)
    with pytest.raises(SamplingError, match="no stored run has slice_len=4.*longest run .* is 3"):
        buffer.sample(8)
    with pytest.raises(SpecError, match=r"trajectory id from entry \('collector', 'traj_ids'\)"):
        ReplayBuffer(20, SliceSampler(2)).extend(make_batch(1, 3).exclude(IDS))
