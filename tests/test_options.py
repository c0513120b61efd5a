"""The shared option validators (each message names the argument, the value and the way out) and
the tables of options that mean something only under another setting: every row, set without
its setting, is refused with a ConfigError naming both."""

from __future__ import annotations

import dataclasses
import math

import pytest

from aiocollect import Collector, ConfigError, Evaluator
from aiocollect._collector.config import MODE_OPTIONS, CollectorConfig
from aiocollect._evaluator.config import EVALUATOR_MODE_OPTIONS
from aiocollect._service.options import (
    Needs,
    check_bool,
    check_choice,
    check_int,
    check_needs,
    multiples_around,
    positive_int,
    positive_seconds,
)

# -- shared validators ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
def test_check_bool_names_the_argument_the_value_and_the_fix(value):
    with pytest.raises(ConfigError) as info:
        check_bool("split_trajs", value)
    assert str(info.value) == f"split_trajs={value!r} must be True or False; pass split_trajs=True or split_trajs=False"
    assert check_bool("split_trajs", True) is True and check_bool("split_trajs", False) is False


def test_check_bool_of_a_class_argument_says_who_and_what_it_got():
    with pytest.raises(ConfigError, match=r"^UniformSampler: replacement must be True or False, got 'no'; pass"):
        check_bool("replacement", "no", who="UniformSampler")


@pytest.mark.parametrize("value", [0, -3, True, 2.0, "4", None])
def test_positive_int_refuses_what_is_not_an_int_of_at_least_one(value):
    with pytest.raises(ConfigError) as info:
        positive_int("prefetch", value, fix="pass the number of batches ahead")
    assert str(info.value) == f"prefetch={value!r} must be an int >= 1; pass the number of batches ahead"


def test_positive_int_allows_zero_where_asked_and_returns_the_value():
    assert positive_int("prefetch", 0, allow_zero=True) == 0 and positive_int("prefetch", 5) == 5
    with pytest.raises(ConfigError, match=r"^prefetch=-1 must be an int >= 0$"):
        positive_int("prefetch", -1, allow_zero=True)
    with pytest.raises(ConfigError, match=r"^ReplayBuffer: capacity must be an int >= 1, got 0; it is"):
        positive_int("capacity", 0, who="ReplayBuffer", fix="it is the number of frames")


@pytest.mark.parametrize("value", [-1, 20, True, 1.5])
def test_check_int_with_a_range_names_both_ends(value):
    with pytest.raises(ConfigError) as info:
        check_int("nice", value, 0, 19, fix="0 is the trainer's own priority, 19 the lowest")
    assert str(info.value) == f"nice={value!r} must be an int from 0 to 19; 0 is the trainer's own priority, 19 the lowest"
    assert check_int("nice", 19, 0, 19) == 19


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "5", None])
def test_positive_seconds_names_the_argument_the_value_and_the_alternative(value):
    with pytest.raises(ConfigError) as info:
        positive_seconds("step_timeout", value, "or None to wait for ever")
    assert str(info.value) == (
        f"step_timeout={value!r} must be a positive, finite number of seconds, or None to wait for ever"
    )


def test_positive_seconds_may_allow_zero():
    assert positive_seconds("shutdown_timeout", 0, allow_zero=True) == 0
    assert positive_seconds("shutdown_timeout", 2.5) == 2.5
    with pytest.raises(ConfigError, match=r"^shutdown_timeout=-1 must be a finite number of seconds >= 0$"):
        positive_seconds("shutdown_timeout", -1, allow_zero=True)


def test_check_choice_lists_the_choices_and_the_closest_one():
    with pytest.raises(ConfigError) as info:
        check_choice("delivery", "snyc", ("sync", "async"))
    assert str(info.value) == "delivery='snyc' must be 'sync' or 'async'; did you mean 'sync'?"
    with pytest.raises(ConfigError) as info:
        check_choice("busy_policy", "nothing-like-it", ("skip", "error", "queue"))
    assert str(info.value) == "busy_policy='nothing-like-it' must be 'skip', 'error' or 'queue'"
    assert check_choice("backend", None, ("process", None)) is None


@pytest.mark.parametrize("value", [None, 3, b"sync", ["sync"]])
def test_check_choice_refuses_what_is_not_a_str_without_comparing_it(value):
    with pytest.raises(ConfigError, match=r"must be 'sync' or 'async'$"):
        check_choice("delivery", value, ("sync", "async"))


def test_check_choice_refuses_a_numpy_array_with_our_error_not_numpys():
    np = pytest.importorskip("numpy")
    with pytest.raises(ConfigError, match=r"^delivery=array"):
        check_choice("delivery", np.array(["sync", "async"]), ("sync", "async"))


def test_check_choice_may_describe_the_choices_in_words():
    with pytest.raises(ConfigError, match=r"^traj_format='pads' must be 'pad' \(or TorchRL's 'padded'\) or 'cat'; did you mean"):
        check_choice("traj_format", "pads", ("pad", "padded", "cat"), "'pad' (or TorchRL's 'padded') or 'cat'")


@pytest.mark.parametrize("value, step, expected", [(16, 4, (16, 16)), (15, 4, (12, 16)), (3, 4, (0, 4)), (1, 1, (1, 1))])
def test_multiples_around(value, step, expected):
    assert multiples_around(value, step) == expected


def test_frames_per_batch_arithmetic_lives_on_the_configs_geometry():
    c = CollectorConfig("CartPole-v1", frames_per_batch=48, num_workers=2, envs_per_worker=3)
    g = c.geometry
    assert (g.frames_per_copy, g.with_sub_envs(2).frames_per_row, g.with_sub_envs(4).frames_per_row) == (8, 4, 2)
    assert g.fix(5) == "use frames_per_batch=50 or 45"
    assert g.fix(64) == "use frames_per_batch=64"
    with pytest.raises(ConfigError, match=r"not a multiple of the 4 envs .*; use frames_per_batch=16 or 12$"):
        CollectorConfig("CartPole-v1", frames_per_batch=15, num_workers=2, envs_per_worker=2)


# -- the "needs" tables --------------------------------------------------------------------------

# a value that sets each option of the tables (any value but its default)
SET_VALUES = {
    "worker_groups": 2,
    "env_batch_size": 2,
    "server_priority": "idle",
    "server_weights": "shared",
    "policy_out_keys": ["action", "value"],
    "compile_policy": True,
    "cudagraph_policy": True,
    "ray_actor_options": {"num_cpus": 1},
    "worker_cpus": [0],
    "step_timeout": 5.0,
    "cpus": {0},
    "max_restarts": 5,
    "restart_window": None,
    "traj_format": "cat",
    "recurrent_state": {"h": (1, 4)},
    "max_decorrelation_steps": 5,
}

# settings (valid on their own) under which each row's setting is not what the option needs
COLLECTOR_WITHOUT = {
    "inference": [{"inference": "worker", "num_workers": 2}],
    "backend_name": [{"num_workers": 0}, {"num_workers": 2}, {"num_workers": 2, "backend": "ray"}],
    "on_worker_failure": [{"on_worker_failure": "raise", "num_workers": 0}],
    "trajs_per_batch": [{"trajs_per_batch": None, "split_trajs": True, "num_workers": 0}],
    "policy_or_factory": [{"policy": None, "num_workers": 0}],
    "reset_at_each_iter": [{"reset_at_each_iter": True, "num_workers": 0}],
}


def _without(row: Needs) -> list[dict]:
    """Each setting (among ours) that leaves ``row``'s option without what it needs."""
    return [kw for kw in COLLECTOR_WITHOUT[row.setting] if not row.holds(_Probe(row, kw))]


@dataclasses.dataclass
class _Probe:
    """Stands for a config: the row's option set, the settings of ``kwargs`` (with the collector's
    ``backend_name`` worked out from them as the config does)."""

    row: Needs
    kwargs: dict

    def __getattr__(self, name):
        if name == self.row.option:
            return SET_VALUES[name]
        if name == "policy_or_factory":
            return self.kwargs.get("policy")
        if name == "backend_name":
            return self.kwargs.get("backend") or ("local" if self.kwargs["num_workers"] == 0 else "process")
        return self.kwargs[name]


def _cases(table):
    return [pytest.param(row, kw, id=f"{row.option}-{'-'.join(f'{k}={v}' for k, v in kw.items())}")
            for row in table for kw in _without(row)]


def test_every_row_of_the_collectors_table_can_fail():
    """A row that no setting of ours breaks would be a check that never runs."""
    for row in MODE_OPTIONS:
        assert row.option in SET_VALUES, f"{row.option}: no value to set it in this test"
        assert _without(row), f"{row.option}: no setting leaves it without {row.setting}"
        assert row.is_set(SET_VALUES[row.option]) and not row.is_set(row.default)


@pytest.mark.parametrize("row, kwargs", _cases(MODE_OPTIONS))
def test_a_collector_option_set_without_its_setting_is_refused_naming_both(row, kwargs):
    value = SET_VALUES[row.option]
    with pytest.raises(ConfigError) as info:
        Collector("CartPole-v1", frames_per_batch=16, **kwargs, **{row.option: value})
    message = str(info.value)
    label = row.label or row.setting
    need = f"{label} (not None)" if row.allowed is None else f"{label}="
    assert message.startswith(f"{row.option}={value!r} {row.does}, so it needs {need}"), message
    assert f"but {label}=" in message


BACKEND_ROWS = [row for row in EVALUATOR_MODE_OPTIONS if row.setting == "backend"]  # (the others: test_constructor_arguments.py)


def test_every_row_of_the_evaluators_table_can_fail():
    for row in BACKEND_ROWS:
        other = "process" if row.allowed == ("ray",) else "ray"
        assert other not in row.allowed and row.is_set(SET_VALUES[row.option])


@pytest.mark.parametrize("row", BACKEND_ROWS, ids=lambda r: r.option)
def test_an_evaluator_option_set_without_its_backend_is_refused_naming_both(row):
    backend = "process" if row.allowed == ("ray",) else "ray"
    with pytest.raises(ConfigError) as info:
        Evaluator("CartPole-v1", backend=backend, **{row.option: SET_VALUES[row.option]})
    assert str(info.value).startswith(
        f"{row.option}={SET_VALUES[row.option]!r} {row.does}, so it needs backend={row.allowed[0]!r}, but backend={backend!r}; "
    )


def test_a_row_is_checked_only_when_its_option_is_set_and_may_give_its_fix_by_setting():
    row = Needs("opt", None, "mode", ("a",), "does a thing", {"b": "fix for b", "c": "fix for c"})

    @dataclasses.dataclass
    class Config:
        opt: object = None
        mode: str = "b"

    check_needs(Config(), (row,))  # not set: nothing needed
    check_needs(Config(opt=1, mode="a"), (row,))
    with pytest.raises(ConfigError, match=r"^opt=1 does a thing, so it needs mode='a', but mode='c'; fix for c$"):
        check_needs(Config(opt=1, mode="c"), (row,))
    given = Needs("opt", None, "mode", None, "does a thing", "give mode")
    with pytest.raises(ConfigError, match=r"^opt=1 does a thing, so it needs mode \(not None\), but mode=None; give mode$"):
        check_needs(Config(opt=1, mode=None), (given,))


@pytest.mark.parametrize("default, same, other", [
    (1, [1, 1.0], [2, True, "1"]),
    (False, [False], [0, True, {}]),
    (60.0, [60, 60.0], [None, 61]),
    (None, [None], [0, False, ""]),
    ("normal", ["normal"], ["idle"]),
])
def test_is_set_compares_numbers_by_value_and_bools_by_identity(default, same, other):
    row = Needs("opt", default, "mode", ("a",), "does", "fix")
    assert not any(row.is_set(v) for v in same)
    assert all(row.is_set(v) for v in other)
