"""One step's values of single envs, written by :class:`StepValues` (the worker's per-step
write): observations of the leaf's own dtype and shape go in by one stacking, any other is
checked env by env and stored by the documented rule or refused naming the env."""

from __future__ import annotations

import numpy as np
import pytest

from aiocollect import SpecError
from aiocollect._core.layout import Leaf
from aiocollect._worker.step_values import StepValues

from gymnasium import spaces

SPACE = spaces.Box(-10.0, 10.0, (3,), np.float32)


def _values(E: int = 3, leaf: Leaf = Leaf(("observation",), (3,), "float32"), space=SPACE) -> StepValues:
    return StepValues([leaf], [space], np.arange(10, 10 + E), lambda row, taken=False: "step 7")


def _write(values: StepValues, observations: list, E: int = 3, dtype=np.float32, shape=(3,)):
    nxt = np.zeros((E,) + shape, dtype)
    rew, term, trunc = np.zeros(E), np.zeros(E, bool), np.zeros(E, bool)
    results = [(obs, 1.0, False, i == 1, {}) for i, obs in enumerate(observations)]
    flags = values.write(results, nxt, rew, term, trunc)
    return nxt, rew, term, trunc, flags


def test_observations_of_the_leafs_dtype_are_stored_exactly_with_the_flags():
    obs = [np.array([i, i + 0.5, -i], np.float32) for i in range(3)]
    nxt, rew, term, trunc, flags = _write(_values(), obs)
    np.testing.assert_array_equal(nxt, np.stack(obs))
    assert rew.tolist() == [1.0] * 3 and term.tolist() == [False] * 3 and trunc.tolist() == [False, True, False]
    assert flags == ((False, False, False), (False, True, False))


@pytest.mark.parametrize("other", [
    np.array([0.1, 0.2, 0.3], np.float64),  # float64 for a float32 space: its float32 rounding
    [0.1, 0.2, 0.3],  # a Python list
    (np.float32(0.1), np.float32(0.2), np.float32(0.3)),  # a tuple of numpy scalars
])
def test_an_observation_of_another_type_among_them_is_stored_as_its_float32_rounding(other):
    obs = [np.zeros(3, np.float32), other, np.ones(3, np.float32)]
    nxt, *_ = _write(_values(), obs)
    np.testing.assert_array_equal(nxt[1], np.asarray(other, np.float64).astype(np.float32))
    np.testing.assert_array_equal(nxt[[0, 2]], [np.zeros(3), np.ones(3)])


@pytest.mark.parametrize("other, shown", [
    (np.zeros(4, np.float32), r"shape \(4,\)"),  # ragged: the stack fails
    (np.zeros((1, 3), np.float32), r"shape \(1, 3\)"),  # the same size, another shape
    ("abc", "shape"),  # not a number
])
def test_an_observation_of_another_shape_is_refused_naming_its_env(other, shown):
    obs = [np.zeros(3, np.float32), other, np.zeros(3, np.float32)]
    with pytest.raises(SpecError, match=rf"env 11's observation for key 'observation' has {shown}"):
        _write(_values(), obs)


def test_every_observation_of_another_shape_of_the_same_size_is_refused():
    """All of them (1, 3) for a (3,) leaf: the stack is [E, 1, 3], not the leaf's [E, 3]."""
    with pytest.raises(SpecError, match=r"env 10's observation .* has shape \(1, 3\)"):
        _write(_values(), [np.zeros((1, 3), np.float32)] * 3)


def test_python_ints_of_a_discrete_space_and_an_out_of_range_one():
    leaf, space = Leaf(("observation",), (), "int64"), spaces.Discrete(5)
    nxt, *_ = _write(_values(leaf=leaf, space=space), [3, np.int64(4), 0], dtype=np.int64, shape=())
    assert nxt.tolist() == [3, 4, 0]
    u8 = Leaf(("observation",), (), "uint8")
    with pytest.raises(SpecError, match="env 12's observation"):
        _write(_values(leaf=u8, space=spaces.Discrete(5)), [np.uint8(1), np.uint8(2), 300], dtype=np.uint8, shape=())


PIXELS = spaces.Box(0, 255, (64, 64, 3), np.uint8)  # (12 KB: written env by env, not stacked first)


def test_large_observations_are_written_env_by_env_exactly_and_checked_alike():
    leaf = Leaf(("pixels",), (64, 64, 3), "uint8")
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(3)]
    values = _values(leaf=leaf, space=PIXELS)
    assert not values.stack
    nxt, rew, term, trunc, flags = _write(values, frames, dtype=np.uint8, shape=(64, 64, 3))
    np.testing.assert_array_equal(nxt, np.stack(frames))
    assert trunc.tolist() == [False, True, False]
    # another dtype among them: stored by the leaf's rule; another shape: refused, naming the env
    nxt, *_ = _write(values, [frames[0], frames[1].astype(np.int64), frames[2]], dtype=np.uint8, shape=(64, 64, 3))
    np.testing.assert_array_equal(nxt[1], frames[1])
    with pytest.raises(SpecError, match=r"env 12's observation for key 'pixels' has shape \(64, 64\)"):
        _write(values, [frames[0], frames[1], frames[2][..., 0]], dtype=np.uint8, shape=(64, 64, 3))
