"""The collector's geometry (workers, env copies, rows, frames per row, the seeds derived from
``seed``) is worked out and checked in one place: a frozen value that the config, the slot layout
and the vector envs' learning of their sub-envs all read."""

from __future__ import annotations

import dataclasses
import re

import pytest

from aiocollect import ConfigError, SpecError
from aiocollect._collector.config import CollectorConfig
from aiocollect._core.geometry import Geometry
from aiocollect._core.layout import Leaf, SlotLayout
from aiocollect._core.limits import SEED_MAX
from aiocollect._worker.vector import reported_sub_envs

# -- frames_per_batch splits over the rows of a batch ---------------------------------------------


def test_a_sync_batch_not_a_multiple_of_every_workers_envs_names_the_multiples_next_to_it():
    with pytest.raises(ConfigError, match=re.escape(
        "frames_per_batch=15 is not a multiple of the 4 envs that fill each batch (num_workers * envs_per_worker); "
        "use frames_per_batch=16 or 12"
    ) + "$"):
        Geometry(workers=2, envs_per_worker=2, frames_per_batch=15)


def test_an_async_batch_is_one_workers_envs_so_only_envs_per_worker_must_divide_it():
    g = Geometry(workers=3, envs_per_worker=2, frames_per_batch=10, sync=False)
    assert (g.rows_per_batch, g.frames_per_row, g.total_rows) == (2, 5, 6)
    with pytest.raises(ConfigError, match=r"multiple of the 2 envs that fill each batch \(envs_per_worker\)"):
        Geometry(workers=3, envs_per_worker=2, frames_per_batch=9, sync=False)


def test_a_batch_smaller_than_its_rows_is_offered_only_the_multiple_above():
    with pytest.raises(ConfigError, match=r"use frames_per_batch=4$"):
        Geometry(workers=1, envs_per_worker=4, frames_per_batch=3)


def test_learning_sub_envs_checks_again_that_the_batch_splits_over_the_rows():
    g = Geometry(workers=2, envs_per_worker=1, frames_per_batch=100)  # 2 single envs: fine
    with pytest.raises(ConfigError, match=re.escape(
        "frames_per_batch=100 is not a multiple of the 6 env rows that fill each batch (2 workers x 1 envs_per_worker "
        "x 3 sub-envs (num_envs): each sub-env of a vector env is a row of the batch); use frames_per_batch=102 or 96, "
        "or vector envs with another num_envs"
    )):
        g.with_sub_envs(3)


def test_the_geometry_is_a_frozen_value_and_learning_sub_envs_makes_a_new_one():
    g = Geometry(workers=2, envs_per_worker=3, frames_per_batch=48)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.sub_envs = 4  # type: ignore[misc]
    v = g.with_sub_envs(4)
    assert (g.sub_envs, v.sub_envs) == (1, 4)
    assert g.with_sub_envs(1) == g and v == Geometry(2, 3, 48, sub_envs=4)


@pytest.mark.parametrize("field, value", [("workers", 0), ("envs_per_worker", -1), ("frames_per_batch", 2.0),
                                          ("sub_envs", True)])
def test_each_count_is_a_positive_int(field, value):
    with pytest.raises(ConfigError, match=rf"{field}={value!r}"):
        Geometry(**{"workers": 1, "envs_per_worker": 1, "frames_per_batch": 4, field: value})


# -- rows ------------------------------------------------------------------------------------------


def test_each_sub_env_of_a_vector_env_is_a_row_of_the_batch():
    g = Geometry(workers=2, envs_per_worker=3, frames_per_batch=48).with_sub_envs(4)
    assert (g.total_envs, g.rows_per_worker, g.total_rows, g.rows_per_batch) == (6, 12, 24, 24)
    assert (g.frames_per_row, g.frames_per_copy) == (2, 8)  # a copy's 4 rows of 2 frames
    assert g.rows_per_batch * g.frames_per_row == g.frames_per_batch


def test_single_envs_are_one_row_each_and_a_copys_frames_are_its_rows_frames():
    g = Geometry(workers=2, envs_per_worker=3, frames_per_batch=48)
    assert (g.total_envs, g.rows_per_worker, g.total_rows) == (6, 3, 6)
    assert g.frames_per_row == g.frames_per_copy == 8


def test_random_frames_are_spread_over_the_copies_rounded_up():
    g = Geometry(workers=2, envs_per_worker=2, frames_per_batch=4)
    assert [g.per_copy(f) for f in (0, 1, 4, 10)] == [0, 1, 1, 3]


def test_the_slot_layout_has_the_geometrys_rows_and_frames_per_row():
    g = Geometry(workers=2, envs_per_worker=3, frames_per_batch=48).with_sub_envs(2)
    layout = SlotLayout.of(g, [Leaf(("observation",), (5,), "float32")], num_slots=2)
    assert (layout.workers, layout.rows, layout.frames_per_row) == (2, 6, 4)
    buffer = bytearray(layout.nbytes)
    assert layout.views(buffer, 1)[("observation",)].shape == (12, 4, 5)
    assert layout.views(buffer, 1, worker=1)[("observation",)].shape == (6, 4, 5)


# -- seeds -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sub_envs", [1, 3])
def test_row_k_gets_seed_plus_k_and_the_workers_torch_seeds_come_after_every_row(sub_envs):
    g = Geometry(workers=2, envs_per_worker=2, frames_per_batch=12).with_sub_envs(sub_envs)
    seed = 100
    rows = [g.row_seed(seed, k) for k in range(g.total_rows)]
    workers = [g.worker_seed(seed, w) for w in range(g.workers)]
    assert rows == list(range(seed, seed + g.total_rows))
    assert len(set(rows + workers)) == g.total_rows + g.workers, "every derived seed differs"
    assert max(rows + workers) == seed + g.seed_offset


def test_a_seed_must_leave_room_for_every_seed_derived_from_it():
    g = Geometry(workers=2, envs_per_worker=2, frames_per_batch=8)  # 4 rows, 2 workers: seeds up to seed + 5
    g.check_seed(SEED_MAX - 5)
    g.check_seed(None)
    with pytest.raises(ConfigError, match=r"seed=\d+ must be an int from 0 to \d+ .*seeds up to seed \+ 5"):
        g.check_seed(SEED_MAX - 4)
    with pytest.raises(ConfigError, match=r"seed=None"):
        g.check_seed(None, optional=False)
    with pytest.raises(ConfigError, match=r"seeds up to seed \+ 9"):  # vector envs of 2: 8 rows
        g.with_sub_envs(2).check_seed(SEED_MAX - 8)


def test_trajectory_counters_to_resume_from_are_one_per_row():
    g = Geometry(workers=2, envs_per_worker=1, frames_per_batch=6).with_sub_envs(3)
    g.check_counters(None)
    g.check_counters([0] * 6)
    with pytest.raises(ConfigError, match=r"trajectory counters for 2 envs, this collector has 6 \(2 vector envs of 3 "
                                          r"sub-envs\); resume with the same num_workers"):
        g.check_counters([0, 0])


# -- who reads it ----------------------------------------------------------------------------------


def test_the_configs_geometry_is_its_options_checked_at_construction():
    c = CollectorConfig("CartPole-v1", frames_per_batch=12, num_workers=2, envs_per_worker=3, delivery="async")
    assert c.geometry == Geometry(workers=2, envs_per_worker=3, frames_per_batch=12, sync=False)
    assert CollectorConfig("CartPole-v1", frames_per_batch=4, num_workers=0).geometry.workers == 1
    with pytest.raises(ConfigError, match=r"not a multiple of the 6 envs .*use frames_per_batch=18 or 12$"):
        CollectorConfig("CartPole-v1", frames_per_batch=16, num_workers=2, envs_per_worker=3)
    with pytest.raises(ConfigError, match=r"seeds up to seed \+ 7"):  # 6 envs, 2 workers
        CollectorConfig("CartPole-v1", frames_per_batch=12, num_workers=2, envs_per_worker=3, seed=SEED_MAX - 6)


def test_the_workers_specs_name_the_sub_envs_and_must_agree():
    assert reported_sub_envs([{"obs": []}, {"obs": []}]) is None  # single envs
    assert reported_sub_envs([{"num_envs": 1}]) == 1  # a vector env of one sub-env
    assert reported_sub_envs([{"num_envs": 4}, {"num_envs": 4}]) == 4
    with pytest.raises(SpecError, match=r"worker 1's envs have num_envs=3 sub-envs but worker 0's have 4"):
        reported_sub_envs([{"num_envs": 4}, {"num_envs": 3}])


def test_learned_sub_envs_are_checked_against_the_configs_geometry():
    """What the pool does once the workers reported vector envs: the config's geometry with
    their sub-envs, checked again (frames_per_batch over the rows, counters, seeds)."""
    c = CollectorConfig("CartPole-v1", frames_per_batch=100, num_workers=2)
    with pytest.raises(ConfigError, match=r"6 env rows .* use frames_per_batch=102 or 96"):
        c.geometry.with_sub_envs(3)
    g = c.geometry.with_sub_envs(5)
    assert (g.rows_per_worker, g.total_rows) == (5, 10)
    g.check_counters([0] * 10)
    g.check_seed(1)
    with pytest.raises(ConfigError, match=r"trajectory counters for 2 envs, this collector has 10"):
        g.check_counters([0, 0])
    with pytest.raises(ConfigError, match=r"seeds up to seed \+ 11"):
        g.check_seed(SEED_MAX - 10)
