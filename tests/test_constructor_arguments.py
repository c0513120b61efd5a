"""The constructors' arguments, as users outside the project pass them: an option given without
the mode it belongs to is refused (it would silently do nothing), a misspelt or foreign keyword
names the option meant, and every refused value is named with the way out. Nothing here starts
a process: each error is raised at construction, before any worker exists."""

from __future__ import annotations

import re

import warnings

import gymnasium as gym
import numpy as np
import pytest

from aiocollect import Collector, CollectorConfig, ConfigError, Evaluator, EvaluatorConfig
from aiocollect._collector.config import MODE_OPTIONS
from aiocollect._evaluator.config import EVALUATOR_MODE_OPTIONS

ENV = "CartPole-v1"


def collector_config(**kwargs) -> CollectorConfig:
    return CollectorConfig(ENV, **{"frames_per_batch": 16, "num_workers": 0} | kwargs)


def evaluator_config(**kwargs) -> EvaluatorConfig:
    return EvaluatorConfig(ENV, **kwargs)


def make_policy():
    """A recurrent TensorDict policy's stand-in, for a factory (never called at construction)."""
    raise AssertionError("not called")


# -- options without their mode ------------------------------------------------------------------

# (make, option=value given alone, what the message must say it needs, the fix's words)
WITHOUT_MODE = [
    (collector_config, dict(max_restarts=5), "needs on_worker_failure='restart', but on_worker_failure='raise'",
     "pass on_worker_failure='restart' too, or drop it"),
    (collector_config, dict(restart_window=None), "needs on_worker_failure='restart'", "or drop it"),
    (collector_config, dict(restart_window=10.0, max_restarts=3), "restart_window=10.0", "on_worker_failure='restart'"),
    (collector_config, dict(traj_format="cat"), "needs trajs_per_batch (not None), but trajs_per_batch=None",
     "pass trajs_per_batch=<episodes per batch> too, or drop traj_format"),
    (collector_config, dict(traj_format="padded", split_trajs=True), "traj_format='padded'", "split_trajs always pads"),
    (collector_config, dict(recurrent_state={"h": (1, 8)}), "needs policy (not None), but policy=None",
     "or drop recurrent_state"),
    (collector_config, dict(policy_out_keys=["action", "value"]), "needs policy (not None), but policy=None",
     "or drop policy_out_keys (random actions have no outputs to name)"),
    (collector_config, dict(max_decorrelation_steps=50, reset_at_each_iter=True),
     "needs reset_at_each_iter=False, but reset_at_each_iter=True", "all in step again: drop one of them"),
    (evaluator_config, dict(max_restarts=0), "max_restarts=0 bounds", "pass on_worker_failure='restart' too"),
    (evaluator_config, dict(restart_window=5.0), "restart_window=5.0", "on_worker_failure='restart'"),
    (evaluator_config, dict(max_queued=8), "needs busy_policy='queue', but busy_policy='skip'", "or drop max_queued"),
    (evaluator_config, dict(max_queued=8, busy_policy="error"), "but busy_policy='error'", "or drop max_queued"),
    (evaluator_config, dict(video_dir="videos"), "needs record_video=True, but record_video=False", "or drop video_dir"),
    (evaluator_config, dict(video_max_frames=50), "needs record_video=True", "or drop video_max_frames"),
    (evaluator_config, dict(video_max_frames=None), "video_max_frames=None", "record_video=True"),
    (evaluator_config, dict(record_video=True, video_fps=10), "needs video_dir (not None), but video_dir=None",
     "or drop video_fps"),
    (evaluator_config, dict(video_fps=10), "video_fps=10", "video_dir=<a folder>"),
    (evaluator_config, dict(record_video=True, video_prefix="run1"), "video_prefix='run1'", "or drop video_prefix"),
    (evaluator_config, dict(recurrent_state={"h": (1, 8)}), "needs policy (not None)", "or drop recurrent_state"),
]


@pytest.mark.parametrize("make, kwargs, needs, fix", WITHOUT_MODE,
                         ids=[f"{m.__name__[:9]}-{'-'.join(k)}" for m, k, _, _ in WITHOUT_MODE])
def test_an_option_without_its_mode_is_refused_naming_option_value_mode_and_fix(make, kwargs, needs, fix):
    with pytest.raises(ConfigError) as info:
        make(**kwargs)
    message = str(info.value)
    assert needs in message and fix in message, message
    option = next(row.option for row in (*MODE_OPTIONS, *EVALUATOR_MODE_OPTIONS) if message.startswith(row.option + "="))
    assert message.startswith(f"{option}={kwargs[option]!r} "), message


def test_every_new_row_of_both_tables_is_exercised_above():
    """Each row of the tables (besides the backend and server ones of test_options.py) has a
    case above, so that a row that cannot fail is noticed."""
    covered = {option for _, kwargs, _, _ in WITHOUT_MODE for option in kwargs}
    elsewhere = {"worker_groups", "env_batch_size", "server_priority", "server_weights", "compile_policy", "cudagraph_policy",
                 "ray_actor_options", "worker_cpus", "step_timeout", "cpus"}
    rows = {row.option for row in (*MODE_OPTIONS, *EVALUATOR_MODE_OPTIONS)}
    assert rows - elsewhere <= covered, rows - elsewhere - covered


@pytest.mark.parametrize("make, kwargs", [
    (collector_config, dict(on_worker_failure="restart", max_restarts=5, restart_window=None)),
    (collector_config, dict(trajs_per_batch=2, traj_format="cat")),
    (collector_config, dict(max_decorrelation_steps=50)),
    (collector_config, dict(policy_factory=make_policy, recurrent_state={"h": (1, 8)})),
    (evaluator_config, dict(on_worker_failure="restart", max_restarts=0, restart_window=5.0)),
    (evaluator_config, dict(busy_policy="queue", max_queued=8)),
    (evaluator_config, dict(record_video=True, video_max_frames=None)),
    (evaluator_config, dict(policy_factory=make_policy, recurrent_state={"h": (1, 8)})),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else v.__name__[:9])
def test_the_same_options_with_their_mode_are_accepted(make, kwargs):
    make(**kwargs)


def test_options_given_at_their_defaults_are_accepted_without_their_mode():
    """A program that spells out every default (docs/concepts.md lists them so) stays valid."""
    collector_config(on_worker_failure="raise", max_restarts=3, restart_window=60.0, trajs_per_batch=None,
                     traj_format="pad", recurrent_state=None)
    evaluator_config(on_worker_failure="raise", max_restarts=3, restart_window=60, busy_policy="skip", max_queued=4,
                     record_video=False, video_dir=None, video_fps=30, video_max_frames=1000, video_prefix="eval")


def test_torchrls_padded_is_still_taken_as_pad_with_trajs_per_batch():
    assert collector_config(trajs_per_batch=2, traj_format="padded").traj_format == "pad"


# -- keywords: misspelt, or another library's ----------------------------------------------------

KEYWORDS = [
    (Collector, dict(frames_per_batches=64), "did you mean frames_per_batch=64?"),
    (Collector, dict(frames_per_batch=64, total_frame=640), "did you mean total_frames=640?"),
    (Collector, dict(frames_per_batch=64, num_worker=2), "did you mean num_workers=2?"),
    (Collector, dict(frames_per_batch=64, envs_per_workers=2), "did you mean envs_per_worker=2?"),
    (Collector, dict(frames_per_batch=64, max_frames_per_episode=5), "did you mean max_frames_per_traj=5?"),
    (Collector, dict(frames_per_batch=64, num_envs=4), "envs_per_worker= sets the envs of each worker"),
    (Collector, dict(frames_per_batch=64, env_kwargs={}), "use create_env_kwargs="),
    (Collector, dict(frames_per_batch=64, sync=False), "delivery='async'"),
    (Collector, dict(frames_per_batch=64, return_same_td=True), "zero_copy=True"),
    (Collector, dict(frames_per_batch=64, colour="red"), "it is not one of Collector's options"),
    (Evaluator, dict(num_trajectory=3), "did you mean num_trajectories=3?"),
    (Evaluator, dict(num_episodes=3), "use num_trajectories="),
    (Evaluator, dict(create_env_kwargs={}), "use env_kwargs="),
    (Evaluator, dict(dump_video=True), "use record_video=True"),
]


@pytest.mark.parametrize("cls, kwargs, fragment", KEYWORDS, ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_an_unknown_keyword_names_itself_its_value_and_the_option_meant(cls, kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        cls(ENV, **kwargs)
    assert isinstance(info.value, TypeError)  # (what Python raises for it: `except TypeError` still works)
    message = str(info.value)
    unknown = next(k for k in kwargs if k != "frames_per_batch")
    assert message.startswith(f"{cls.__name__}() got an unexpected keyword argument {unknown}={kwargs[unknown]!r}; ")
    assert fragment in message and f"help(aiocollect.{cls.__name__}Config)" in message, message
    assert f"docs/options.md#{cls.__name__.lower()}" in message, message  # the options reference, by section


@pytest.mark.parametrize("cls, args, meant", [
    (Collector, (ENV, None, 64), "pass the others by name (in the order of the signature: frames_per_batch=64)"),
    (Collector, (ENV, None, 64, 640), "frames_per_batch=64, total_frames=640)"),
    (Evaluator, (ENV, None, None, 5), "policy_factory=None, num_trajectories=5)"),
])
def test_an_option_passed_by_position_is_named_with_its_keyword(cls, args, meant):
    with pytest.raises(ConfigError) as info:
        cls(*args)
    assert isinstance(info.value, TypeError)
    assert str(info.value).startswith(f"{cls.__name__}() takes ") and meant in str(info.value), str(info.value)


def test_positional_use_and_introspection_are_unchanged():
    import inspect

    assert list(inspect.signature(Collector).parameters)[:3] == ["create_env_fn", "policy", "frames_per_batch"]
    assert list(inspect.signature(Evaluator).parameters)[:2] == ["env", "policy"]
    with pytest.raises(TypeError, match="frames_per_batch"):  # Python's own message for a missing argument
        Collector(ENV)


@pytest.mark.parametrize("cls, config, positional", [
    (Collector, CollectorConfig, ["create_env_fn", "policy"]),
    (Evaluator, EvaluatorConfig, ["env", "policy"]),
])
def test_each_option_is_written_once_and_the_signature_is_the_configs(cls, config, positional):
    """Collector() and Evaluator() take their config's options, written once (type, default,
    docs): ``inspect.signature``, ``help()`` and notebooks show every one of them."""
    import inspect

    ours = list(inspect.signature(cls).parameters.values())
    assert ours == list(inspect.signature(config).parameters.values())
    assert [p.name for p in ours if p.kind is p.POSITIONAL_OR_KEYWORD] == positional


@pytest.mark.timeout(600)
def test_mypy_checks_every_option_of_a_constructor_call(tmp_path):
    import subprocess
    import sys
    import textwrap

    program = tmp_path / "uses.py"
    program.write_text(textwrap.dedent("""
        from aiocollect import Collector, Evaluator
        Collector("CartPole-v1", frames_per_batch=64, total_frames=None, delivery="async", seed=1)
        Collector("CartPole-v1", frames_per_batch="64")
        Collector("CartPole-v1", frames_per_batch=64, num_worker=2)
        Evaluator("CartPole-v1", num_trajectories=3, busy_policy="queue", action_bounds="clip")
        Evaluator("CartPole-v1", num_trajectories="3")
        Evaluator("CartPole-v1", num_trajectoris=3)
    """))
    import os
    from pathlib import Path

    import aiocollect

    # torch, tensordict, numpy, anyio and trio read as Any: the constructors' own annotations are what
    # is checked here (the package itself, against all of them, is mypy's run in the test command)
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n[mypy-torch.*,tensordict.*,numpy.*,anyio.*,trio.*]\nfollow_imports = skip\n")
    env = {**os.environ, "MYPYPATH": str(Path(aiocollect.__file__).parents[1])}  # (the package as the tests import it)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
                           "--config-file", str(config), str(program)],
                          capture_output=True, text=True, timeout=560, cwd=tmp_path, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("uses.py") and "error:" in line]
    assert len(lines) == 4, proc.stdout
    assert 'Argument "frames_per_batch" to "Collector" has incompatible type "str"; expected "int"' in lines[0]
    assert 'Unexpected keyword argument "num_worker" for "Collector"' in lines[1]
    assert 'Argument "num_trajectories" to "Evaluator" has incompatible type "str"; expected "int"' in lines[2]
    assert 'Unexpected keyword argument "num_trajectoris" for "Evaluator"' in lines[3]


# -- values at both ends, and of the wrong type --------------------------------------------------

VALUES = [
    (dict(frames_per_batch=64.0), "frames_per_batch=64.0 must be an int >= 1; pass frames_per_batch=64 (a Python int, not float)"),
    (dict(frames_per_batch="64"), "frames_per_batch='64' must be an int >= 1; pass frames_per_batch=64 (a Python int, not str)"),
    (dict(frames_per_batch=np.int64(64)), "frames_per_batch=np.int64(64) must be an int >= 1; pass frames_per_batch=64 (a Python int, not int64)"),
    (dict(frames_per_batch=0), "frames_per_batch=0 must be an int >= 1"),
    (dict(frames_per_batch=None), "frames_per_batch=None must be an int >= 1"),
    (dict(frames_per_batch=10**13), "use a smaller frames_per_batch or prefetch"),
    (dict(frames_per_batch=64, total_frames=1e6), "total_frames=1000000.0 must be an int (-1 or None for endless); pass total_frames=1000000"),
    (dict(frames_per_batch=64, total_frames=0), "total_frames=0 must be positive, or -1 (or None) to collect forever"),
    (dict(frames_per_batch=64, num_workers=2.0), "pass num_workers=2 (a Python int, not float)"),
    (dict(frames_per_batch=64, num_workers=-1), "num_workers=-1 must be an int >= 0"),
    (dict(frames_per_batch=64, envs_per_worker=0), "envs_per_worker=0 must be an int >= 1"),
    (dict(frames_per_batch=100, num_workers=2, envs_per_worker=3), "use frames_per_batch=102 or 96"),
    (dict(frames_per_batch=64, prefetch=-1), "prefetch=-1 must be an int >= 0"),
    (dict(frames_per_batch=64, delivery="SYNC"), "delivery='SYNC' must be 'sync' or 'async'; did you mean 'sync'?"),
    (dict(frames_per_batch=64, inference=" server"), "did you mean 'server'?"),
    (dict(frames_per_batch=64, seed=-1), "seed=-1 must be an int from 0"),
    (dict(frames_per_batch=64, max_frames_per_traj=0), "max_frames_per_traj=0 must be an int >= 1"),
    (dict(frames_per_batch=64, split_trajs=1), "split_trajs=1 must be True or False"),
    (dict(frames_per_batch=64, seed=np.int64(3)), "seed=np.int64(3) must be an int from 0"),
    (dict(frames_per_batch=64, seed=np.int64(3)), "pass seed=int(seed) (a Python int, not int64)"),
    # (found by fuzzing: a flag that is an array, a digit that int() does not read, an empty list)
    (dict(frames_per_batch=64, reset_at_each_iter=np.array([True, False])), "reset_at_each_iter=array([ True, False]) must be True or False"),
    (dict(frames_per_batch=64, max_frames_per_traj="\u00b3"), "max_frames_per_traj='\u00b3' must be an int >= 1"),
    (dict(frames_per_batch=64, create_env_kwargs=[]), "create_env_kwargs is a list of 0 entries ([])"),
]


@pytest.mark.parametrize("kwargs, fragment", VALUES, ids=lambda v: "-".join(f"{k}={v[k]!r:.12}" for k in v) if isinstance(v, dict) else None)
def test_a_bad_collector_value_is_named_with_the_way_out(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        CollectorConfig(ENV, **kwargs)
    assert fragment in str(info.value), str(info.value)


def test_an_empty_list_of_env_factories_is_shown_as_given():
    with pytest.raises(ConfigError, match=re.escape("create_env_fn is a list of 0 entries ([]); it must have as many")):
        CollectorConfig([], frames_per_batch=64)


EVALUATOR_VALUES = [
    (dict(num_trajectories=0), "num_trajectories=0 must be an int >= 1"),
    (dict(num_envs=20), "num_envs=20 is more than num_trajectories=10"),
    (dict(busy_policy="Queue"), "did you mean 'queue'?"),
    (dict(nice=20), "nice=20 must be an int from 0 to 19"),
    (dict(on_worker_failure="retry"), "did you mean 'restart'?"),
]


@pytest.mark.parametrize("kwargs, fragment", EVALUATOR_VALUES, ids=lambda v: "-".join(v) if isinstance(v, dict) else None)
def test_a_bad_evaluator_value_is_named_with_the_way_out(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        EvaluatorConfig(ENV, **kwargs)
    assert fragment in str(info.value), str(info.value)


def test_total_frames_none_collects_forever_as_torchrl():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = collector_config(total_frames=None)
    assert config.total_frames == -1 and config.total_batches is None


@pytest.mark.parametrize("make, argument", [(lambda env: CollectorConfig(env, frames_per_batch=16), "create_env_fn"),
                                            (lambda env: EvaluatorConfig(env), "env")])
def test_an_env_made_already_is_refused_with_its_id_as_the_fix(make, argument):
    env = gym.make(ENV)
    try:
        with pytest.raises(ConfigError) as info:
            make(env)
    finally:
        env.close()
    message = str(info.value)
    assert message.startswith(f"{argument}=<TimeLimit") and "each worker makes its own" in message, message
    assert "'CartPole-v1' or lambda: gymnasium.make('CartPole-v1')" in message
