"""``split_trajectories`` turns an ``[envs, time]`` batch into padded trajectories."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorData, TensorDict

from aiocollect._collector.split import split_trajectories

MASK = ("collector", "mask")
IDS = ("collector", "traj_ids")


def make_batch(traj_ids, seed: int = 0) -> TensorDict:
    """A batch in the collector's layout, with nested keys, trailing dims and several dtypes."""
    traj_ids = torch.as_tensor(traj_ids, dtype=torch.int64)
    E, T = traj_ids.shape
    g = torch.Generator().manual_seed(seed)
    # End flags consistent with the ids: a frame is done when the next frame starts another id.
    ends = torch.zeros(E, T, 1, dtype=torch.bool)
    ends[:, :-1, 0] = traj_ids[:, 1:] != traj_ids[:, :-1]
    batch = TensorDict(
        {
            "observation": torch.randn(E, T, 3, generator=g),
            "action": torch.randint(0, 4, (E, T), generator=g),
            "done": torch.zeros(E, T, 1, dtype=torch.bool),
            "pixels": torch.randint(1, 256, (E, T, 2, 2), generator=g, dtype=torch.uint8),
            ("next", "observation"): torch.randn(E, T, 3, generator=g),
            ("next", "reward"): torch.rand(E, T, 1, generator=g) + 1.0,
            ("next", "done"): ends,
            ("next", "agents", "state"): torch.randn(E, T, 2, 3, generator=g, dtype=torch.float64),
            IDS: traj_ids,
            ("collector", "policy_version"): torch.full((E, T), 7, dtype=torch.int64),
        },
        batch_size=[E, T],
        names=[None, "time"],
    )
    return batch


def reference_split(td: TensorDict) -> TensorDict:
    """Frame-by-frame Python version of the documented semantics, to compare against."""
    E, T = td.batch_size
    ids = td[IDS].tolist()
    segments = []  # (row, first frame, end frame)
    for e in range(E):
        first = 0
        for t in range(1, T + 1):
            if t == T or ids[e][t] != ids[e][t - 1]:
                segments.append((e, first, t))
                first = t
    n = len(segments)
    L = max((end - first for _, first, end in segments), default=0)
    out = TensorDict(batch_size=[n, L])
    for key, value in td.items(include_nested=True, leaves_only=True):
        padded = torch.zeros((n, L, *value.shape[2:]), dtype=value.dtype)
        for i, (e, first, end) in enumerate(segments):
            for t in range(first, end):
                padded[i, t - first] = value[e, t]
        out.set(key, padded)
    mask = torch.zeros(n, L, dtype=torch.bool)
    for i, (_, first, end) in enumerate(segments):
        mask[i, : end - first] = True
    out.set(MASK, mask)
    return out


def assert_same(actual: TensorDict, expected: TensorDict) -> None:
    assert actual.batch_size == expected.batch_size
    assert set(actual.keys(True, True)) == set(expected.keys(True, True))
    for key, value in expected.items(True, True):
        got = actual.get(key)
        assert got.dtype == value.dtype, key
        assert torch.equal(got, value), key


def lengths(out: TensorDict) -> list[int]:
    return out[MASK].sum(-1).tolist()


def test_hand_computed_example():
    batch = TensorDict(
        {
            "observation": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
            ("next", "done"): torch.tensor([[[False], [True], [False]], [[True], [False], [True]]]),
            IDS: torch.tensor([[5, 5, 6], [7, 8, 8]]),
        },
        batch_size=[2, 3],
        names=[None, "time"],
    )
    out = split_trajectories(batch)
    assert out.batch_size == (4, 2)
    assert out.names == [None, "time"]
    expected_obs = torch.tensor([[1.0, 2.0], [3.0, 0.0], [4.0, 0.0], [5.0, 6.0]])
    assert torch.equal(out["observation"], expected_obs)
    assert torch.equal(out[IDS], torch.tensor([[5, 5], [6, 0], [7, 0], [8, 8]]))
    assert torch.equal(
        out["next", "done"],
        torch.tensor([[[False], [True]], [[False], [False]], [[True], [False]], [[False], [True]]]),
    )
    expected_mask = torch.tensor([[True, True], [True, False], [True, False], [True, True]])
    assert torch.equal(out[MASK], expected_mask)


def test_episodes_crossing_the_batch_start_and_end_keep_their_frames():
    """The first trajectory began in an earlier batch, the last goes on in the next one."""
    batch = make_batch([[3, 3, 4, 4, 4, 5], [9, 10, 10, 10, 10, 10]])
    out = split_trajectories(batch)
    assert lengths(out) == [2, 3, 1, 1, 5]
    assert out[IDS][:, 0].tolist() == [3, 4, 5, 9, 10]
    assert torch.equal(out["observation"][4], batch["observation"][1, 1:])
    assert torch.equal(out["observation"][0, :2], batch["observation"][0, :2])
    assert_same(out, reference_split(batch))


def test_one_env():
    batch = make_batch([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    out = split_trajectories(batch)
    assert out.batch_size == (3, 4)
    assert lengths(out) == [3, 2, 4]
    assert_same(out, reference_split(batch))


def test_many_short_episodes_give_one_frame_each():
    batch = make_batch(torch.arange(12).view(3, 4))
    out = split_trajectories(batch)
    assert out.batch_size == (12, 1)
    assert out[MASK].all()
    assert torch.equal(out["observation"][:, 0], batch["observation"].reshape(12, 3))
    assert_same(out, reference_split(batch))


def test_one_trajectory_per_row_keeps_the_layout():
    batch = make_batch([[4, 4, 4], [8, 8, 8]])
    out = split_trajectories(batch)
    assert out.batch_size == batch.batch_size
    assert out[MASK].all()
    for key, value in batch.items(True, True):
        assert torch.equal(out[key], value)


def test_equal_ids_in_two_rows_or_apart_in_one_row_are_separate_trajectories():
    """Segments are split at every row start and every id change, never merged by id."""
    batch = make_batch([[1, 1, 2, 1], [1, 1, 1, 1]])
    out = split_trajectories(batch)
    assert lengths(out) == [2, 1, 1, 4]
    assert out[IDS][:, 0].tolist() == [1, 2, 1, 1]
    assert_same(out, reference_split(batch))


def test_every_key_is_carried_with_its_dtype_and_padded_with_zeros():
    batch = make_batch([[0, 0, 0, 1], [2, 3, 3, 3]])
    out = split_trajectories(batch)
    leaves = set(batch.keys(True, True))
    assert set(out.keys(True, True)) == leaves | {MASK}
    pad = ~out[MASK]
    assert pad.any()
    for key in leaves:
        value = out[key]
        assert value.dtype == batch[key].dtype, key
        assert value.shape[2:] == batch[key].shape[2:], key
        assert not value[pad].any(), key  # zeros, False for bool
    # Real frames are all nonzero in these keys, so the zeros above are padding only.
    assert (out["pixels"][out[MASK]] > 0).all()
    assert out["next", "agents", "state"].dtype == torch.float64
    assert out["next"].batch_size == out.batch_size
    assert out[MASK].dtype == torch.bool


def test_output_is_a_copy_and_the_input_is_unchanged():
    batch = make_batch([[0, 0, 1], [2, 2, 2]])
    before = batch.clone()
    out = split_trajectories(batch)
    out["observation"].fill_(123.0)
    out["next", "agents", "state"].zero_()
    assert_same(batch, before)
    assert MASK not in batch.keys(True)


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_python_reference_on_random_batches(seed):
    g = torch.Generator().manual_seed(seed)
    E = int(torch.randint(1, 6, (), generator=g))
    T = int(torch.randint(1, 30, (), generator=g))
    # Random episode boundaries; ids increase along each row and are unique across rows,
    # except that some rows deliberately reuse the previous row's last id.
    new_traj = torch.rand(E, T, generator=g) < 0.25
    ids = new_traj.long().cumsum(1)
    offset = 0
    for e in range(E):
        if e and torch.rand((), generator=g) < 0.3:
            offset -= 1 + int(ids[e, 0])
        ids[e] += offset
        offset = int(ids[e, -1]) + 1
    batch = make_batch(ids, seed=seed)
    assert_same(split_trajectories(batch), reference_split(batch))


def test_without_traj_ids_trajectories_end_at_done():
    batch = make_batch([[0, 0, 1, 1, 1], [2, 3, 3, 4, 4]])
    expected = reference_split(batch).exclude(IDS)
    out = split_trajectories(batch.exclude(IDS))
    assert_same(out, expected)


def test_a_one_dimensional_batch_is_one_row():
    batch = make_batch([[0, 0, 1, 1, 1]])[0]
    out = split_trajectories(batch)
    assert lengths(out) == [2, 3]
    assert_same(out, reference_split(make_batch([[0, 0, 1, 1, 1]])))


@pytest.mark.parametrize("shape", [(0, 4), (3, 0)])
def test_an_empty_batch_gives_an_empty_result(shape):
    batch = make_batch(torch.zeros(shape, dtype=torch.int64))
    out = split_trajectories(batch)
    assert out.batch_size == (0, 0)
    assert out[MASK].shape == (0, 0)
    assert out["observation"].shape == (0, 0, 3)


def test_constant_non_tensor_data_is_carried():
    batch = make_batch([[0, 1]])
    batch.set(("meta", "env_name"), "CountingEnv")
    out = split_trajectories(batch)
    assert out.get_non_tensor(("meta", "env_name")) == "CountingEnv"


def test_per_frame_non_tensor_data_is_refused():
    rows = [TensorDict({"note": NonTensorData(str(t)), IDS: torch.tensor(0)}, []) for t in range(3)]
    batch = torch.stack(rows).unsqueeze(0)
    with pytest.raises(TypeError, match="note"):
        split_trajectories(batch)


def test_an_already_split_batch_is_refused():
    out = split_trajectories(make_batch([[0, 1]]))
    with pytest.raises(ValueError, match="already split"):
        split_trajectories(out)


def test_more_than_two_batch_dims_is_refused():
    batch = TensorDict({IDS: torch.zeros(2, 2, 2, dtype=torch.int64)}, batch_size=[2, 2, 2])
    with pytest.raises(ValueError, match=r"\[envs, time\]"):
        split_trajectories(batch)


def test_a_batch_without_ids_or_done_is_refused():
    batch = TensorDict({"observation": torch.zeros(2, 3)}, batch_size=[2, 3])
    with pytest.raises(ValueError, match="traj_ids"):
        split_trajectories(batch)
