"""Arguments for fuzzing (hypothesis strategies), shared by tests/test_fuzz.py and
benchmarks/fuzz_report.py (imported as a plain module: pytest puts tests/ on sys.path).

For every constructor (and for the methods that take user arguments), each argument has two
strategies: *valid* values (with the other arguments adjusted where they depend on it, e.g.
``frames_per_batch`` a multiple of ``envs_per_worker``) and *invalid* ones, where exactly one
argument (or one combination) is wrong and the rest valid. :func:`attempt` runs one drawn case and
classifies how it ended (:data:`GOOD` outcomes are the only acceptable ones); :data:`STATS` counts
them for the summary table.

The invalid values come from :func:`junk` (every kind of Python, numpy and torch value, filtered by
the argument's contract) plus values that are wrong only for that argument (out of range, huge,
misspelled, an impossible combination).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import math
import operator
import pathlib
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import anyio
import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv
import numpy as np
import torch
from hypothesis import strategies as st

from aiocollect import (
    AiocollectError,
    Collector,
    ConfigError,
    Evaluator,
    ProfileConfig,
    ReplayBuffer,
    SliceSampler,
    StalenessAwareSampler,
    UniformSampler,
)
from aiocollect._backends import child as _child
from aiocollect._backends.launcher import Launcher
from aiocollect._replay.samplers import Sampler

HANG_S = 5.0
"""A call that takes longer than this is reported as a hang (a generous bound, not a timing test)."""
SHORT_REPR = 40
"""A value whose repr is at most this long must appear in the error message."""
SEED_MAX = 2**64 - 1  # torch.manual_seed's largest seed; gymnasium wants seeds >= 0

# -- values of every kind ------------------------------------------------------------------------


class Opaque:
    """An object of no use to anyone."""


class Unpicklable:
    """A callable that cannot be pickled (it is data to a worker process, and not sendable)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return gym.make("CartPole-v1")

    def __reduce__(self) -> Any:
        raise TypeError("Unpicklable objects refuse to be pickled")


def make_cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def a_function(*args: Any, **kwargs: Any) -> Any:
    return None


def small_mlp() -> torch.nn.Module:
    """Pendulum's observations [B, 3] -> actions [B, 1] (float32 in the Box): pickles by reference
    to torch.nn, so no test module is imported in the workers."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def tensordict_module() -> Any:
    from tensordict.nn import TensorDictModule

    return TensorDictModule(small_mlp(), in_keys=["observation"], out_keys=["action"])


NUMPY_AND_TORCH = [
    np.int64(3), np.float32(1.5), np.bool_(True), np.array([1, 2]), np.array(3), np.array(["sync", "x"]),
    torch.tensor([1, 2]), torch.tensor(3), torch.tensor(1.5),
]
OBJECTS = [Opaque(), a_function, lambda: None, print, int, Ellipsis, Opaque, threading.Lock(), range(3)]


def junk() -> st.SearchStrategy[Any]:
    """Values of every kind: None, bools, ints of any size, floats (NaN, infinities), complex,
    strings, bytes, lists, tuples, dicts, sets, objects, functions, classes, numpy and torch."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(),
        st.complex_numbers(max_magnitude=10),
        st.text(max_size=12),
        st.binary(max_size=6),
        st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
        st.tuples(st.integers(min_value=-3, max_value=3)),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        st.frozensets(st.integers(min_value=0, max_value=3), max_size=2),
        st.sampled_from(OBJECTS),
        st.sampled_from(NUMPY_AND_TORCH),
    )


def is_int(v: Any) -> bool:
    """An ``int`` as the library documents it (bools are not ints here; numpy ints are not ``int``)."""
    return type(v) is int


def is_number(v: Any) -> bool:
    return type(v) in (int, float)


def is_seconds(v: Any, *, zero: bool) -> bool:
    return is_number(v) and math.isfinite(v) and (v >= 0 if zero else v > 0)


def not_(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: not ok(v)


def wrong(
    ok: Callable[[Any], bool], *specific: st.SearchStrategy[Any], unclear: Callable[[Any], bool] | None = None
) -> st.SearchStrategy[Any]:
    """Junk that ``ok`` refuses (leaving out what is ``unclear``: valid on some machines only),
    and the argument's own wrong values."""
    keep = not_(ok) if unclear is None else (lambda v: not ok(v) and not unclear(v))
    return st.one_of(junk().filter(keep), *specific)


def big_int(low: int) -> Callable[[Any], bool]:
    """Ints from ``low`` to 2**62: too large for memory on some machines, not on others."""
    return lambda v: is_int(v) and low < v < 2**62


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError, AttributeError, TypeError):
        return False


def bad_env_ids() -> st.SearchStrategy[str]:
    """Strings that are no env id: unregistered (misspelled, random) or ``module:EnvId`` whose
    module cannot be imported or which is malformed."""
    random_text = st.text(max_size=16).filter(lambda s: ":" not in s and s not in gym.registry)
    with_module = st.tuples(st.text(max_size=8), st.text(max_size=8)).map(":".join).filter(
        lambda s: not importable(s.split(":", 1)[0]) or s.count(":") > 1 or not s.split(":", 1)[1]
    )
    return st.one_of(
        random_text,
        with_module,
        st.sampled_from([
            "CartPole-v2", "cartpole-v1", "CartPole", "", " CartPole-v1", "no_such_module_xyz:Foo-v0",
            ":CartPole-v1", "gymnasium:", "gymnasium:a:b", "gymnasium.nope:X-v0",
        ]),
    )


def valid_env() -> st.SearchStrategy[Any]:
    return st.sampled_from([
        "CartPole-v1", "Pendulum-v1", "gymnasium.envs.classic_control:CartPole-v1", make_cartpole,
        lambda: gym.make("CartPole-v1"), CartPoleEnv,
    ])


def invalid_env() -> st.SearchStrategy[Any]:
    return wrong(lambda v: isinstance(v, str) or callable(v), bad_env_ids(), st.just(Unpicklable()))


def values(name: str, strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[dict]:
    return strategy.map(lambda v: {name: v})


def one_of_strings(choices: tuple[str, ...]) -> st.SearchStrategy[Any]:
    """Anything but one of ``choices``: junk, random text, the choices in another case."""
    other_case = st.sampled_from([c.upper() for c in choices] + [c + " " for c in choices])
    return wrong(lambda v: isinstance(v, str) and v in choices, st.text(max_size=10).filter(lambda t: t not in choices), other_case)


def bools_only() -> st.SearchStrategy[Any]:
    return wrong(lambda v: type(v) is bool, st.sampled_from([0, 1, "True", np.bool_(True)]))


def str_key() -> st.SearchStrategy[Any]:
    return st.one_of(st.text(min_size=1, max_size=8), st.tuples(st.text(min_size=1, max_size=5)).map(tuple))


def bad_key() -> st.SearchStrategy[Any]:
    """Not an entry name: a str or a non-empty tuple of non-empty strs."""

    def ok(v: Any) -> bool:
        if isinstance(v, str):
            return bool(v)
        return isinstance(v, tuple) and bool(v) and all(isinstance(k, str) and k for k in v)

    return wrong(ok, st.sampled_from(["", (), ("collector", ""), ("a", 5), ("a", ("b",)), ["collector", "traj_ids"]]))


# -- the cases -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument: strategies of keyword overrides for valid calls and invalid ones."""

    name: str
    valid: st.SearchStrategy[dict]
    invalid: st.SearchStrategy[dict]


@dataclasses.dataclass(frozen=True)
class Target:
    """Something called with keyword arguments: a constructor, or a method of an object."""

    name: str
    call: Callable[[Any], Any]
    """Called with the keyword arguments (or, with ``takes_case``, with the whole :class:`Case`)."""
    base: dict
    args: tuple[Arg, ...]
    close: Callable[[Any], None] = lambda obj: None
    takes_case: bool = False


@dataclasses.dataclass(frozen=True)
class Case:
    target: Target
    argument: str
    kwargs: dict
    valid: bool

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        kind = "valid" if self.valid else "invalid"
        return f"Case({self.target.name}, {kind} {self.argument}, kwargs={self.kwargs!r})"


def cases(target: Target) -> st.SearchStrategy[Case]:
    """A valid or an invalid case for one argument of ``target``, the others as ``target.base``."""

    def for_arg(arg: Arg) -> st.SearchStrategy[Case]:
        def case(overrides: dict, valid: bool) -> Case:
            return Case(target, arg.name, {**target.base, **overrides}, valid)

        # half valid, half invalid (a plain one_of would flatten the invalid alternatives into
        # the same level as the valid ones, and draw a valid value rarely)
        return st.booleans().flatmap(
            lambda valid: (arg.valid if valid else arg.invalid).map(lambda o: case(o, valid))
        )

    return st.sampled_from(target.args).flatmap(for_arg)


# -- Collector --------------------------------------------------------------------------------------


def _collector(kwargs: dict) -> Collector:
    kwargs = dict(kwargs)
    return Collector(kwargs.pop("create_env_fn"), kwargs.pop("policy", None), **kwargs)


def _close_collector(c: Collector) -> None:
    c.close()  # never started: nothing to stop


def _positive(name: str, *, zero: bool = False) -> Arg:
    low = 0 if zero else 1
    ok = lambda v: is_int(v) and v >= low  # noqa: E731
    specific = [st.integers(max_value=low - 1)]
    return Arg(name, values(name, st.integers(min_value=low, max_value=2**70)), values(name, wrong(ok, *specific)))


def _optional_positive(name: str, *, zero: bool = False) -> Arg:
    low = 0 if zero else 1
    ok = lambda v: v is None or (is_int(v) and v >= low)  # noqa: E731
    return Arg(
        name,
        values(name, st.one_of(st.none(), st.integers(min_value=low, max_value=2**70))),
        values(name, wrong(ok, st.integers(max_value=low - 1))),
    )


def with_mode(arg: Arg, default: Any, mode: dict) -> Arg:
    """``arg``, an option that means something only under another setting (``mode``): its values
    are tried with that setting, and a value other than its ``default`` without it is invalid (a
    ConfigError naming the option and the setting it needs)."""
    alone = arg.valid.filter(lambda d: d[arg.name] != default)
    return Arg(arg.name, arg.valid.map(lambda d: {**d, **mode}),
               st.one_of(arg.invalid.map(lambda d: {**d, **mode}), alone))


def _torchrl_optional(name: str, *, zero: bool = False) -> Arg:
    """An optional count where ``None`` and TorchRL's ``-1`` both mean none."""
    low = 0 if zero else 1
    ok = lambda v: v is None or (is_int(v) and (v >= low or v == -1))  # noqa: E731
    return Arg(
        name,
        values(name, st.one_of(st.none(), st.just(-1), st.integers(min_value=low, max_value=2**70))),
        values(name, wrong(ok, st.integers(max_value=-2), *([st.just(0)] if not zero else []))),
    )


def _flag(name: str) -> Arg:
    return Arg(name, values(name, st.booleans()), values(name, bools_only()))


def _choice(name: str, choices: tuple[str, ...]) -> Arg:
    return Arg(name, values(name, st.sampled_from(choices)), values(name, one_of_strings(choices)))


def _callable_or_none(name: str) -> Arg:
    return Arg(
        name,
        values(name, st.sampled_from([None, a_function, lambda x: x, print])),
        values(name, wrong(lambda v: v is None or callable(v))),
    )


def _seconds(name: str, *, optional: bool, zero: bool, extra_invalid: tuple = ()) -> Arg:
    valid = st.one_of(
        st.floats(min_value=0.0 if zero else 1e-6, max_value=1e9), st.integers(min_value=0 if zero else 1, max_value=10**6)
    )
    if optional:
        valid = st.one_of(st.none(), valid)
    ok = lambda v: (optional and v is None) or is_seconds(v, zero=zero)  # noqa: E731
    specific = st.sampled_from([-1.0, -1e-9, math.nan, math.inf, -math.inf, True] + ([] if zero else [0, 0.0]))
    return Arg(name, values(name, valid), st.one_of(values(name, wrong(ok, specific)), *extra_invalid))


def exploration_types() -> Arg:
    from tensordict.nn import InteractionType

    names = ("random", "deterministic", "mode", "mean", "median")
    valid = st.sampled_from(list(names) + [n.upper() for n in names] + list(InteractionType))
    ok = lambda v: isinstance(v, (str, InteractionType)) and getattr(v, "value", v).lower() in names  # noqa: E731
    return Arg("exploration_type", values("exploration_type", valid), values("exploration_type", wrong(ok, st.text(max_size=10))))


RESTART = {"on_worker_failure": "restart"}


def collector_target() -> Target:
    """``Collector(CartPole-v1, frames_per_batch=8, num_workers=1)``, one argument varied."""
    workers_valid = st.integers(min_value=0, max_value=4).map(
        lambda n: {"num_workers": n, "frames_per_batch": 8 * max(n, 1)}
    )
    envs_valid = st.tuples(st.integers(min_value=1, max_value=64), st.integers(min_value=1, max_value=8)).map(
        lambda ek: {"envs_per_worker": ek[0], "frames_per_batch": ek[0] * ek[1]}
    )
    policies = st.sampled_from([None, "mlp", "td", a_function, lambda td: td]).map(
        lambda p: small_mlp() if p == "mlp" else (tensordict_module() if p == "td" else p)
    )
    factories = st.sampled_from([None, small_mlp, [small_mlp], (a_function,)])
    seed_max = SEED_MAX - 1  # env 0 gets seed, worker 0's torch generator seed + 1: both <= 2**64 - 1
    profile_bad = st.integers(min_value=1, max_value=2**40).map(lambda w: ProfileConfig(workers=[w]))
    args = (
        Arg("create_env_fn", values("create_env_fn", valid_env()), values("create_env_fn", invalid_env())),
        Arg(
            "policy",
            values("policy", policies),
            st.one_of(
                values("policy", wrong(lambda v: v is None or callable(v))),
                policies.filter(lambda p: p is not None).map(lambda p: {"policy": p, "policy_factory": small_mlp}),
            ),
        ),
        Arg(
            "frames_per_batch",
            values("frames_per_batch", st.integers(min_value=1, max_value=2**16)),
            st.one_of(
                values("frames_per_batch", wrong(lambda v: is_int(v) and v >= 1, st.integers(max_value=0), unclear=big_int(2**16))),
                values("frames_per_batch", st.integers(min_value=2**40, max_value=2**80)),  # no memory could hold its slots
                st.integers(min_value=0, max_value=1000).map(lambda k: {"frames_per_batch": 2 * k + 1, "envs_per_worker": 2}),
            ),
        ),
        Arg(
            "total_frames",
            # (not a multiple of frames_per_batch: rounded up with a warning, tests/test_torchrl_names.py)
            # (None: TorchRL's other spelling of -1)
            values("total_frames", st.one_of(st.just(-1), st.none(), st.integers(min_value=1, max_value=2**70).map(lambda k: 8 * k))),
            values("total_frames", wrong(
                lambda v: v is None or (is_int(v) and (v == -1 or v > 0)),
                st.integers(max_value=-2), st.just(0), st.just(8.0),
            )),
        ),
        Arg(
            "num_workers",
            workers_valid,
            values("num_workers", wrong(
                lambda v: is_int(v) and v >= 0,
                st.integers(max_value=-1),
                st.integers(min_value=2**23, max_value=2**70),  # more than any kernel.pid_max
            )),
        ),
        Arg(
            "envs_per_worker",
            envs_valid,
            values("envs_per_worker", wrong(
                lambda v: is_int(v) and v >= 1 and 8 % v == 0,
                st.integers(max_value=0),
                st.integers(min_value=3, max_value=2**40).filter(lambda e: 8 % e),  # 8 frames: not a multiple
            )),
        ),
        _choice("delivery", ("sync", "async")),
        _choice("inference", ("worker",)),
        Arg(
            "create_env_kwargs",
            values("create_env_kwargs", st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))),
            st.one_of(
                values("create_env_kwargs", wrong(
                    lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v)),
                    st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
                    st.just({"render_mode": None, 3: "x"}),
                )),
                st.just({"create_env_kwargs": {"lock": threading.Lock()}}),  # cannot reach the workers
            ),
        ),
        Arg(
            "policy_factory",
            values("policy_factory", factories),
            values("policy_factory", wrong(
                lambda v: v is None or callable(v) or (isinstance(v, (list, tuple)) and len(v) == 1 and callable(v[0])),
                st.sampled_from([[], [small_mlp, small_mlp], [3], (small_mlp, "x"), "small_mlp"]),
            )),
        ),
        _torchrl_optional("max_frames_per_traj"),
        _torchrl_optional("init_random_frames", zero=True),
        _flag("reset_at_each_iter"),
        _flag("split_trajs"),
        _flag("progress"),
        Arg(
            "update_at_each_batch",
            st.booleans().map(lambda b: {"update_at_each_batch": b, "policy": small_mlp()}),
            st.one_of(values("update_at_each_batch", bools_only()), st.just({"update_at_each_batch": True})),
        ),
        exploration_types(),
        Arg(
            "seed",
            values("seed", st.one_of(st.none(), st.integers(min_value=0, max_value=seed_max))),
            values("seed", wrong(
                lambda v: v is None or (is_int(v) and 0 <= v <= seed_max),
                st.integers(max_value=-1), st.integers(min_value=seed_max + 1, max_value=2**80),
            )),
        ),
        Arg(
            "prefetch",
            values("prefetch", st.integers(min_value=0, max_value=64)),
            values("prefetch", wrong(
                lambda v: is_int(v) and v >= 0,
                st.integers(max_value=-1), st.integers(min_value=2**40, max_value=2**80),
                unclear=big_int(64),
            )),
        ),
        _seconds("shutdown_timeout", optional=False, zero=True),
        _callable_or_none("postproc"),
        Arg(
            "trajs_per_batch",
            values("trajs_per_batch", st.one_of(st.none(), st.integers(min_value=1, max_value=10**6))),
            st.one_of(
                values("trajs_per_batch", wrong(lambda v: v is None or (is_int(v) and v >= 1), st.integers(max_value=0))),
                st.integers(min_value=1, max_value=100).map(lambda n: {"trajs_per_batch": n, "split_trajs": True}),
            ),
        ),
        with_mode(_choice("traj_format", ("pad", "cat")), "pad", {"trajs_per_batch": 2}),
        _choice("on_worker_failure", ("raise", "restart")),
        with_mode(_positive("max_restarts", zero=True), 3, RESTART),
        with_mode(_seconds("restart_window", optional=True, zero=False), 60.0, RESTART),
        _seconds(
            "step_timeout", optional=True, zero=False,
            extra_invalid=(st.floats(min_value=0.01, max_value=100).map(lambda t: {"step_timeout": t, "num_workers": 0}),),
        ),
        Arg(
            "profile",
            values("profile", st.sampled_from([None, ProfileConfig(), ProfileConfig(workers=[0], num_rollouts=3)])),
            values("profile", wrong(lambda v: v is None or isinstance(v, ProfileConfig), profile_bad)),
        ),
    )
    return Target(
        "Collector",
        _collector,
        {"create_env_fn": "CartPole-v1", "frames_per_batch": 8, "num_workers": 1},
        args,
        _close_collector,
    )


# -- Evaluator --------------------------------------------------------------------------------------


def _evaluator(kwargs: dict) -> Evaluator:
    kwargs = dict(kwargs)
    return Evaluator(kwargs.pop("env"), kwargs.pop("policy", None), **kwargs)


def evaluator_target() -> Target:
    """``Evaluator("Pendulum-v1", num_trajectories=10)``, one argument varied."""
    policies = st.sampled_from([None, "mlp", "td", a_function]).map(
        lambda p: small_mlp() if p == "mlp" else (tensordict_module() if p == "td" else p)
    )
    args = (
        Arg("env", values("env", valid_env()), values("env", invalid_env())),
        Arg(
            "policy",
            values("policy", policies),
            st.one_of(
                values("policy", wrong(lambda v: v is None or callable(v), st.just(Unpicklable()))),
                st.just({"policy": a_function, "policy_factory": small_mlp}),
            ),
        ),
        Arg(
            "policy_factory",
            values("policy_factory", st.sampled_from([None, small_mlp, a_function])),
            values("policy_factory", wrong(lambda v: v is None or callable(v), st.just(Unpicklable()))),
        ),
        _positive("num_trajectories"),
        _optional_positive("max_steps"),
        exploration_types(),
        _callable_or_none("metrics_fn"),
        _callable_or_none("on_result"),
        _choice("busy_policy", ("skip", "error", "queue")),
        with_mode(_positive("max_queued"), 4, {"busy_policy": "queue"}),
        Arg(
            "num_envs",
            values("num_envs", st.integers(min_value=1, max_value=10)),
            values("num_envs", wrong(lambda v: is_int(v) and 1 <= v <= 10, st.integers(min_value=11, max_value=2**70))),
        ),
        Arg(
            "env_kwargs",
            values("env_kwargs", st.one_of(st.none(), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))),
            values("env_kwargs", wrong(
                lambda v: v is None or (isinstance(v, dict) and all(isinstance(k, str) for k in v)),
                st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
                st.just({"lock": threading.Lock()}),
            )),
        ),
        Arg(
            "seed",
            values("seed", st.one_of(st.none(), st.integers(min_value=0, max_value=SEED_MAX))),
            values("seed", wrong(
                lambda v: v is None or (is_int(v) and 0 <= v <= SEED_MAX),
                st.integers(max_value=-1), st.integers(min_value=SEED_MAX + 1, max_value=2**80),
            )),
        ),
        _seconds("shutdown_timeout", optional=False, zero=True),
        Arg(
            "nice",
            values("nice", st.integers(min_value=0, max_value=19)),
            values("nice", wrong(lambda v: is_int(v) and 0 <= v <= 19, st.integers(max_value=-1), st.integers(min_value=20))),
        ),
    )
    return Target("Evaluator", _evaluator, {"env": "Pendulum-v1", "num_trajectories": 10}, args)


# -- ReplayBuffer and samplers -----------------------------------------------------------------------


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def replay_buffer_target() -> Target:
    """``ReplayBuffer(100)``, one argument varied."""
    n_cuda = _cuda_count()
    devices = [None, "cpu", torch.device("cpu"), "cpu:0"] + (["cuda", "cuda:0", torch.device("cuda", 0), 0] if n_cuda else [])
    bad_devices = ["bogus", "cpu:x", "gpu", "", "cuda:-1", f"cuda:{max(n_cuda, 1) * 16}", -1, 2**40] + ([] if n_cuda else ["cuda", "cuda:0", 0])
    samplers = st.sampled_from([None, "uniform", "stale", "slice"]).map(
        lambda s: {None: None, "uniform": UniformSampler(), "stale": StalenessAwareSampler(), "slice": SliceSampler(4)}[s]
    )
    args = (
        Arg(
            "capacity",
            values("capacity", st.integers(min_value=1, max_value=10**6)),
            values("capacity", wrong(
                lambda v: is_int(v) and v >= 1,
                st.integers(max_value=0), st.integers(min_value=2**62, max_value=2**80),  # 8 bytes a frame at least
                unclear=big_int(10**6),
            )),
        ),
        Arg(
            "sampler",
            values("sampler", samplers),
            values("sampler", wrong(
                lambda v: v is None or isinstance(v, Sampler), st.sampled_from([UniformSampler, SliceSampler, "uniform"])
            )),
        ),
        Arg(
            "batch_size",
            values("batch_size", st.one_of(st.none(), st.integers(min_value=1, max_value=10**6))),
            values("batch_size", wrong(
                lambda v: v is None or (is_int(v) and v >= 1),
                st.integers(max_value=0), st.integers(min_value=2**62, max_value=2**80),
                unclear=big_int(10**6),
            )),
        ),
        Arg(
            "device",
            values("device", st.sampled_from(devices)),
            values("device", st.one_of(
                junk().filter(lambda v: v is not None and not isinstance(v, (str, torch.device, int, np.integer))),
                st.sampled_from(bad_devices),
            )),
        ),
        Arg(
            "generator",
            values("generator", st.sampled_from([None, "cpu"]).map(lambda g: g and torch.Generator())),
            values("generator", wrong(lambda v: v is None, st.just(torch.Generator))),
        ),
    )
    return Target("ReplayBuffer", lambda kw: ReplayBuffer(**kw), {"capacity": 100}, args)


def uniform_sampler_target() -> Target:
    return Target("UniformSampler", lambda kw: UniformSampler(**kw), {}, (_flag("replacement"),))


def staleness_sampler_target() -> Target:
    args = (
        Arg(
            "max_staleness",
            values("max_staleness", st.integers(min_value=-1, max_value=2**70)),
            values("max_staleness", wrong(lambda v: is_int(v) and v >= -1, st.integers(max_value=-2))),
        ),
        _callable_or_none("staleness_weight_fn"),
        Arg("version_key", values("version_key", str_key()), values("version_key", bad_key())),
    )
    return Target("StalenessAwareSampler", lambda kw: StalenessAwareSampler(**kw), {}, args)


def slice_sampler_target() -> Target:
    args = (
        _positive("slice_len"),
        Arg("traj_key", values("traj_key", str_key()), values("traj_key", bad_key())),
        _flag("strict_length"),
    )
    return Target("SliceSampler", lambda kw: SliceSampler(**kw), {"slice_len": 4}, args)


# -- ProfileConfig -----------------------------------------------------------------------------------


def profile_config_target() -> Target:
    collections_ = (list, tuple, set, frozenset, range)

    def ok_workers(v: Any) -> bool:
        if is_int(v):
            return v >= 0
        return isinstance(v, collections_) and all(is_int(w) and w >= 0 for w in v)

    args = (
        Arg(
            "workers",
            values("workers", st.one_of(
                st.integers(min_value=0, max_value=2**40), st.lists(st.integers(min_value=0, max_value=64), max_size=3)
            )),
            values("workers", wrong(ok_workers, st.sampled_from([[-1], [True], ["0"], [0.0], (None,), -3]))),
        ),
        Arg(
            "num_rollouts",
            values("num_rollouts", st.integers(min_value=2, max_value=2**40)),
            values("num_rollouts", wrong(lambda v: is_int(v) and v >= 2, st.integers(max_value=1))),
        ),
        Arg(
            "warmup_rollouts",
            values("warmup_rollouts", st.integers(min_value=0, max_value=4)),
            values("warmup_rollouts", wrong(lambda v: is_int(v) and 0 <= v <= 4, st.integers(min_value=5))),
        ),
        Arg(
            "save_path",
            values("save_path", st.sampled_from([
                "traces/worker_{worker_idx}.json", "/tmp/x_{worker_idx}", "{worker_idx}", "a{worker_idx}b{worker_idx}",
                pathlib.Path("traces/{worker_idx}.json"), "t/{worker_idx!r}.json", "{{literal}}{worker_idx}",
            ])),
            values("save_path", wrong(
                lambda v: False,
                st.sampled_from([
                    "trace.json", "{foo}_{worker_idx}.json", "{worker_idx}{", "{}_{worker_idx}", "{0}{worker_idx}",
                    "{worker_idx:03d}", "{worker_idx.real}", pathlib.Path("trace.json"),
                ]),
            ).filter(lambda v: not (isinstance(v, str) and "{worker_idx}" in v and _formats(v)))),
        ),
        Arg(
            "activities",
            values("activities", st.sampled_from(["cpu", "cuda", ("cpu",), ["cpu", "cuda"], ("cuda",)])),
            values("activities", wrong(
                lambda v: v in ("cpu", "cuda") if isinstance(v, str) else (
                    isinstance(v, collections_) and bool(v) and all(isinstance(a, str) and a in ("cpu", "cuda") for a in v)
                ),
                st.sampled_from([[], (), ["gpu"], ("cpu", 3), "CPU"]),
            )),
        ),
        _flag("record_shapes"),
        _flag("profile_memory"),
        _flag("with_stack"),
        _flag("with_flops"),
        Arg(
            "profile_collector",
            values("profile_collector", st.booleans()),
            values("profile_collector", bools_only()),
        ),
        _callable_or_none("on_trace_ready"),
    )
    return Target("ProfileConfig", lambda kw: ProfileConfig(**kw), {}, args)


def _formats(path: str) -> bool:
    try:
        path.format(worker_idx=0), path.format(worker_idx="collector")
        return True
    except (KeyError, ValueError, IndexError, AttributeError, TypeError):
        return False


def constructor_targets() -> list[Target]:
    return [
        collector_target(), evaluator_target(), replay_buffer_target(), uniform_sampler_target(),
        staleness_sampler_target(), slice_sampler_target(), profile_config_target(),
    ]


# -- methods of a collector that is not started ---------------------------------------------------------


def collector_method_targets(collector: Collector) -> list[Target]:
    """``set_seed``, ``load_state_dict``, ``enable_profile`` and ``subscribe`` of ``collector``
    (``Collector("CartPole-v1", frames_per_batch=8, num_workers=1)``, not started)."""
    from aiocollect.events import Event

    seed_max = SEED_MAX - 1
    seeds_ok = lambda v: is_int(v) and 0 <= v <= seed_max  # noqa: E731

    def good_state(draw: Any) -> dict:
        frames = draw(st.integers(min_value=0, max_value=10**9))
        seed = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=10**6)))
        return {
            "frames": frames, "batches": frames // 8, "collected_frames": frames,
            "traj_counters": [draw(st.integers(min_value=0, max_value=10**6))],
            "seed": seed, "static_seed": draw(st.booleans()), "next_seed": None if seed is None else seed + 1,
        }

    state_ok = {"frames": 8, "batches": 1, "collected_frames": 8, "traj_counters": [3], "seed": 0,
                "static_seed": False, "next_seed": 1}
    bad_states = st.one_of(
        junk().filter(lambda v: not isinstance(v, dict)),
        st.sampled_from(["frames", "traj_counters", "batches"]).map(lambda k: {x: v for x, v in state_ok.items() if x != k}),
        st.sampled_from([
            ("frames", -8), ("batches", -1), ("traj_counters", [-1]), ("traj_counters", [1, 2]), ("traj_counters", 5),
            ("traj_counters", "3"), ("next_seed", -1), ("next_seed", "x"), ("next_seed", 2**64), ("frames", "x"),
            ("collected_frames", -1), ("static_seed", "yes"), ("frames", None),
        ]).map(lambda kv: {**state_ok, kv[0]: kv[1]}),
    )
    profile_fields = {f.name for f in dataclasses.fields(ProfileConfig)}
    args_seed = (
        Arg("seed", values("seed", st.integers(min_value=0, max_value=seed_max)), values("seed", wrong(
            seeds_ok, st.integers(max_value=-1), st.integers(min_value=seed_max + 1, max_value=2**80)
        ))),
        Arg("static_seed", values("static_seed", st.booleans()), values("static_seed", bools_only())),
    )
    args_state = (Arg("state", values("state", st.composite(good_state)()), values("state", bad_states)),)
    args_profile = (
        Arg(
            "config",
            values("config", st.sampled_from([None, ProfileConfig(), ProfileConfig(workers=[0], num_rollouts=2)])),
            values("config", wrong(
                lambda v: v is None or isinstance(v, ProfileConfig),
                st.integers(min_value=1, max_value=99).map(lambda w: ProfileConfig(workers=[w])),
            )),
        ),
        Arg(
            "keywords",
            st.sampled_from([{}, {"num_rollouts": 3}, {"workers": 0}, {"activities": "cpu"}]).map(lambda kw: {"keywords": kw}),
            st.one_of(
                st.text(min_size=1, max_size=10).filter(lambda k: k not in profile_fields and k != "config").map(
                    lambda k: {"keywords": {k: 1}}
                ),
                st.sampled_from([{"workers": [7]}, {"num_rollouts": "x"}, {"bogus": 1}, {"save_path": 3}]).map(
                    lambda kw: {"keywords": kw}
                ),
            ),
        ),
    )
    args_subscribe = (
        Arg("max_buffer", values("max_buffer", st.integers(min_value=1, max_value=2**40)), values("max_buffer", wrong(
            lambda v: is_int(v) and v >= 1, st.integers(max_value=0)
        ))),
        Arg(
            "overflow",
            values("overflow", st.sampled_from(["drop_oldest", "drop_newest", "error"])),
            values("overflow", one_of_strings(("drop_oldest", "drop_newest", "error"))),
        ),
    )

    def enable_profile(kw: dict) -> Any:
        return collector.enable_profile(kw.get("config"), **kw.get("keywords", {}))

    def subscribe(kw: dict) -> Any:
        return collector.subscribe(Event, **kw)

    def state(kw: dict) -> Any:
        return collector.load_state_dict(kw["state"])

    return [
        Target("Collector.set_seed", lambda kw: collector.set_seed(**kw), {"seed": 0}, args_seed),
        Target("Collector.load_state_dict", state, {}, args_state),
        Target("Collector.enable_profile", enable_profile, {}, args_profile),
        Target("Collector.subscribe", subscribe, {}, args_subscribe, lambda sub: sub.close()),
    ]


# -- update_weights, and the Evaluator's requests, on running objects -----------------------------------


def _ok_worker_ids(v: Any, n: int = 1) -> bool:
    """The contract of ``worker_ids``: None, an index, or a non-empty collection of indices < n
    (bools, strs, bytes and mappings are none of those)."""

    def index(w: Any) -> int | None:
        if isinstance(w, (bool, np.bool_)):
            return None
        try:
            return operator.index(w)
        except Exception:  # noqa: BLE001
            return None

    if v is None:
        return True
    if index(v) is not None:
        return 0 <= index(v) < n
    if isinstance(v, (str, bytes, bytearray, Mapping)) or not hasattr(v, "__iter__"):
        return False
    try:
        ids = [index(w) for w in v]
    except TypeError:  # a 0-d array or tensor
        return False
    return bool(ids) and all(i is not None and 0 <= i < n for i in ids)


def update_weights_args(policy: torch.nn.Module, *, layout_checks: bool) -> tuple[Arg, ...]:
    """Arguments of ``update_weights`` for a collector whose workers run ``small_mlp()`` (tensors
    ``0.weight [8, 3]``, ``0.bias``, ``2.weight [1, 8]``, ``2.bias``; model ids ``policy``,
    ``policy.0``, ``policy.2``). Without ``layout_checks``, only the invalid values that are told
    without the workers' policy (the collector need not be started to refuse them)."""
    from tensordict import TensorDict

    state = {k: v.detach().clone() for k, v in policy.state_dict().items()}

    def changed(**edits: Any) -> dict:
        out = dict(state)
        for k, v in edits.items():
            if v is None:
                out.pop(k)
            else:
                out[k] = v
        return out

    model_ids = ("policy", "policy.0", "policy.2")
    good_weights = st.sampled_from([
        "module", "state", "td", "double", "extra", "none", "tdmodule",
    ]).map(lambda k: {
        "module": lambda: {"policy_or_weights": small_mlp()},
        "state": lambda: {"policy_or_weights": dict(state)},
        "td": lambda: {"policy_or_weights": TensorDict.from_module(policy)},
        "double": lambda: {"policy_or_weights": {n: t.double() for n, t in state.items()}},
        "extra": lambda: {"policy_or_weights": changed(**{"unused.weight": torch.zeros(2)})},
        "none": lambda: {},
        "tdmodule": lambda: {"policy_or_weights": tensordict_module()},
    }[k]())
    castable = [torch.float16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64, torch.bool]
    random_weights = st.tuples(
        st.floats(min_value=-10, max_value=10, width=32), st.sampled_from(castable), st.sampled_from(model_ids),
    ).map(lambda f: {
        "policy_or_weights": {
            (k if f[2] == "policy" else k.split(".", 1)[1]): torch.full_like(v, f[0]).to(f[1])
            for k, v in state.items() if f[2] == "policy" or k.startswith(f[2][len("policy."):] + ".")
        },
        "model_id": f[2],
    })
    good_weights = st.one_of(good_weights, random_weights)
    early_bad_weights = st.one_of(
        wrong(lambda v: v is None or isinstance(v, (torch.nn.Module, Mapping)) or hasattr(v, "batch_size")).filter(
            lambda v: not isinstance(v, Mapping)
        ),
        st.just({3: torch.zeros(3)}),
        st.just({("0", "weight"): torch.zeros(8, 3)}),
    )
    late_bad_weights = st.sampled_from([
        "missing", "shape", "complex", "list", "meta", "sparse", "other_module", "junk_dict", "empty",
    ]).map(lambda k: {
        "missing": lambda: changed(**{"2.bias": None}),
        "shape": lambda: changed(**{"0.weight": torch.zeros(3, 8)}),
        "complex": lambda: changed(**{"0.bias": torch.zeros(8, dtype=torch.complex64)}),
        "list": lambda: changed(**{"0.bias": [0.0] * 8}),
        "meta": lambda: changed(**{"0.bias": torch.zeros(8, device="meta")}),
        "sparse": lambda: changed(**{"0.bias": torch.zeros(8).to_sparse()}),
        "other_module": lambda: torch.nn.Linear(3, 3),
        "junk_dict": lambda: {"": 1},
        "empty": lambda: {},
    }[k]())
    bad_model_ids = st.one_of(
        wrong(lambda v: isinstance(v, str)),
        st.text(max_size=10).filter(lambda t: t != "policy" and not t.startswith("policy.")),
        st.sampled_from(["Policy", "policy.", "policies", " policy", "policy..0", "policy.0."]),
    )
    late_bad_model_ids = st.sampled_from(["policy.nope", "policy.1", "policy.0.weight", "policy.3", "policy.module.9"])
    bad_dicts = st.one_of(
        wrong(lambda v: isinstance(v, Mapping) and bool(v)).filter(lambda v: v is not None),
        st.sampled_from([{}, {"nope": policy}, {"policy": 5}, {"policy.0": "x"}, {3: policy}]),
    )
    late_bad_dicts = st.sampled_from(["overlap", "shape", "missing"]).map(lambda k: {
        "overlap": lambda: {"policy": policy, "policy.0": policy[0]},
        "shape": lambda: {"policy.0": policy[2]},
        "missing": lambda: {"policy.2": {"weight": state["2.weight"]}},
    }[k]())
    args = [
        Arg(
            "policy_or_weights",
            good_weights,
            st.one_of(
                values("policy_or_weights", early_bad_weights),
                *( [values("policy_or_weights", late_bad_weights)] if layout_checks else [] ),
            ),
        ),
        Arg(
            "model_id",
            st.sampled_from(model_ids).map(lambda m: {"model_id": m}),
            st.one_of(
                values("model_id", bad_model_ids),
                *( [values("model_id", late_bad_model_ids)] if layout_checks else [] ),
            ),
        ),
        Arg(
            "worker_ids",
            values("worker_ids", st.sampled_from([None, 0, [0], (0,), [0, 0], np.int64(0), range(1), torch.tensor(0)])),
            values("worker_ids", st.one_of(
                junk().filter(lambda v: not _ok_worker_ids(v)),
                st.sampled_from([[1], 5, [], "0", True, [0, 1], -1, [True], b"\x00", {0: 1}, np.array([0, 1])]),
            )),
        ),
        Arg(
            "weights_dict",
            st.sampled_from(["one", "two", "none"]).map(lambda k: {"weights_dict": {
                "one": {"policy": policy},
                "two": {"policy.0": policy[0], "policy.2": policy[2].state_dict()},
                "none": {"policy.2": None},
            }[k]}),
            st.one_of(
                values("weights_dict", bad_dicts),
                st.just({"weights_dict": {"policy": policy}, "policy_or_weights": policy}),
                st.just({"weights_dict": {"policy": policy}, "model_id": "policy.0"}),
                *( [values("weights_dict", late_bad_dicts)] if layout_checks else [] ),
            ),
        ),
        Arg("wait", values("wait", st.booleans()), values("wait", bools_only())),
    ]
    return tuple(args)


class RunningFuzz:
    """Objects that must be running (or deliberately not), in an anyio blocking portal's event
    loop, so that hypothesis (in the calling thread) drives many examples against one start-up:

    - ``live``: ``Collector("Pendulum-v1", small_mlp(), frames_per_batch=8, num_workers=1)``, started;
    - ``idle``: the same, never started: the invalid arguments that are told without the workers'
      policy must be refused without starting it;
    - ``evaluator`` (started) and ``idle_evaluator`` (never started): ``evaluate`` / ``trigger``.

    Use it as a context manager: ``with RunningFuzz(use_uvloop) as fuzz: ...``.
    """

    def __init__(self, use_uvloop: bool = False) -> None:
        self.use_uvloop = use_uvloop
        self.policy = small_mlp()

    def __enter__(self) -> "RunningFuzz":
        from anyio.from_thread import start_blocking_portal

        self._cm = start_blocking_portal("asyncio", {"use_uvloop": True} if self.use_uvloop else {})
        self.portal = self._cm.__enter__()
        try:
            self.portal.call(self._start)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if getattr(self, "live", None) is not None:
                self.portal.call(self._close)
        finally:
            self._cm.__exit__(None, None, None)

    async def _start(self) -> None:
        self.live = self.idle = self.evaluator = self.idle_evaluator = None
        make = lambda: Collector("Pendulum-v1", small_mlp(), frames_per_batch=8, num_workers=1)  # noqa: E731
        self.live, self.idle = make(), make()
        self.evaluator = Evaluator("Pendulum-v1", small_mlp(), num_trajectories=1, max_steps=2)
        self.idle_evaluator = Evaluator("Pendulum-v1", small_mlp(), num_trajectories=1, max_steps=2)
        await self.live.start()
        await self.evaluator.start()

    async def _close(self) -> None:
        for obj in (self.live, self.idle, self.evaluator, self.idle_evaluator):
            if obj is not None:
                await obj.aclose()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def bounded() -> Any:
            with anyio.fail_after(HANG_S + 1):
                return await fn(*args)

        return self.portal.call(bounded)

    # -- the calls -------------------------------------------------------------------------------
    async def _update(self, c: Collector, kw: dict) -> int:
        """``c.update_weights(**kw)``: a refused update publishes nothing and leaves ``c`` in its
        state; an accepted one returns the next version, applied by the workers if ``wait``."""
        before, state = c.policy_version, c.state
        try:
            version = await c.update_weights(**kw)
        except Exception:
            assert c.policy_version == before, "an update that was refused was published"
            assert c.state is state, f"the collector went from {state} to {c.state} on a refused update"
            raise
        assert version == before + 1, f"update_weights returned {version} after version {before}"
        if kw.get("wait", True):
            assert min(c.worker_versions) >= version, f"wait=True returned before the workers applied {version}"
        return version

    async def _collect(self) -> Any:
        return await self.live.collect()

    async def _request(self, ev: Evaluator, method: str, kw: dict) -> Any:
        state = ev.state
        try:
            if method == "evaluate":
                return await ev.evaluate(**kw)
            result = ev.trigger(**kw)
            await ev.wait()
            return result
        except Exception:
            assert ev.state is state, f"the evaluator went from {state} to {ev.state} on a refused request"
            raise

    def targets(self) -> list[Target]:
        ev_args = (
            Arg(
                "step",
                values("step", st.one_of(st.none(), st.integers(min_value=-(2**70), max_value=2**70))),
                values("step", wrong(lambda v: v is None or is_int(v))),
            ),
            Arg(
                "weights",
                values("weights", st.sampled_from([None, "module", "state"]).map(
                    lambda k: {None: None, "module": self.policy, "state": self.policy.state_dict()}[k]
                )),
                values("weights", st.one_of(
                    wrong(lambda v: v is None or isinstance(v, (torch.nn.Module, Mapping))).filter(lambda v: v is not None),
                    st.just({3: torch.zeros(3)}),
                )),
            ),
        )
        # valid requests go to the started evaluator; invalid ones to the one never started
        def request(method: str) -> Callable[[Case], Any]:
            return lambda case: self._call(
                self._request, self.evaluator if case.valid else self.idle_evaluator, method, case.kwargs
            )

        return [
            Target(
                "update_weights (started)",
                lambda case: self._call(self._update, self.live, case.kwargs),
                {}, update_weights_args(self.policy, layout_checks=True), takes_case=True,
            ),
            Target(
                "update_weights (not started)",
                lambda case: self._call(self._update, self.live if case.valid else self.idle, case.kwargs),
                {}, update_weights_args(self.policy, layout_checks=False), takes_case=True,
            ),
            Target("Evaluator.evaluate", request("evaluate"), {}, ev_args, takes_case=True),
            Target("Evaluator.trigger", request("trigger"), {}, ev_args, takes_case=True),
        ]

    def still_usable(self) -> None:
        """After the fuzzing: a valid update and a collect still work, on the started ones."""
        version = self._call(self._update, self.live, {"policy_or_weights": small_mlp()})
        batch = self._call(self._collect)
        assert batch.batch_size == torch.Size([1, 8]), batch.batch_size
        assert int(batch["collector", "policy_version"].max()) <= version
        assert self.idle.state.value == "created", "the collector that was never started was started"
        metrics = self._call(self._request, self.evaluator, "evaluate", {"step": 7})
        assert metrics["step"] == 7 and self.idle_evaluator.state.value == "created"


# -- running one case --------------------------------------------------------------------------------

ACCEPTED = "valid: accepted"
REJECTED = "invalid: rejected with our error naming it"
GOOD = (ACCEPTED, REJECTED)
STATS: collections.Counter[tuple[str, str]] = collections.Counter()
"""(target name, outcome) -> count, over every case run in this process."""


class _Spawned(AssertionError):
    pass


@contextlib.contextmanager
def no_spawn() -> Iterator[list[str]]:
    """The launcher refuses to fork a process meanwhile; yields the list of the requests it
    refused (the library may wrap the refusal in an error of its own: the list still tells)."""
    original = Launcher.spawn
    asked: list[str] = []

    def refuse(self: Launcher, fd: int, needs: Any, entry: str = "aiocollect._worker.main:serve") -> None:
        asked.append(entry)
        raise _Spawned(f"the launcher was asked to start a process ({entry})")

    Launcher.spawn = refuse  # type: ignore[method-assign]
    try:
        yield asked
    finally:
        Launcher.spawn = original  # type: ignore[method-assign]


def message_names(exc: BaseException, case: Case) -> str | None:
    """Why the message of ``exc`` does not name the argument (and its value, if short); None if it does."""
    msg = str(exc)
    argument = case.argument
    if argument == "keywords":  # enable_profile(**keywords): the keyword is the argument
        argument = next(iter(case.kwargs["keywords"]), "keywords")
    if argument not in msg:
        return f"the message does not name {argument!r}"
    if f"{argument}[" in msg:  # names the very item of it that is wrong
        return None
    value = case.kwargs.get(argument, case.kwargs.get("keywords", {}).get(argument))
    text = repr(value)
    if argument in case.kwargs and len(text) <= SHORT_REPR and text not in msg:
        return f"the message does not show the value {text}"
    return None


def classify(case: Case, result: Any, error: BaseException | None, seconds: float, spawned: bool) -> tuple[str, str]:
    """``(outcome, detail)`` of one call."""
    if spawned:
        return "PROCESS STARTED", repr(error)
    if seconds > HANG_S:
        return "HANG (slower than 5 s)", f"{seconds:.1f} s"
    if case.valid:
        if error is None:
            return ACCEPTED, ""
        return "VALID VALUE REFUSED", f"{type(error).__name__}: {error}"
    if error is None:
        return "INVALID VALUE ACCEPTED", repr(result)[:200]
    if not isinstance(error, AiocollectError):
        return f"RAW {type(error).__name__}", str(error)[:300]
    if not isinstance(error, ConfigError):
        return f"NOT A ConfigError ({type(error).__name__})", str(error)[:300]
    why = message_names(error, case)
    if why is not None:
        return "MESSAGE LACKS ARGUMENT/VALUE", f"{why}: {error}"
    return REJECTED, ""


def attempt(case: Case) -> tuple[str, str]:
    """Call ``case.target`` with ``case.kwargs`` (no process may be started meanwhile) and
    classify how it ended; counted in :data:`STATS`."""
    pids = len(_child.started_pids)
    result = error = None
    t0 = time.monotonic()
    with no_spawn() as asked:
        try:
            result = case.target.call(case if case.target.takes_case else dict(case.kwargs))
        except Exception as exc:  # noqa: BLE001 - classified below
            error = exc
    seconds = time.monotonic() - t0
    spawned = bool(asked) or len(_child.started_pids) != pids
    if error is None and result is not None:
        case.target.close(result)
    outcome = classify(case, result, error, seconds, spawned)
    STATS[(case.target.name, outcome[0])] += 1
    return outcome


def table(stats: Mapping[tuple[str, str], int] | None = None) -> str:
    """The counts as a text table: per target, how many cases ended how."""
    stats = STATS if stats is None else stats
    targets = list(dict.fromkeys(t for t, _ in stats))
    outcomes = [ACCEPTED, REJECTED] + sorted({o for _, o in stats} - set(GOOD))
    head = ["target", *outcomes, "total"]
    rows = []
    for t in targets:
        counts = [stats.get((t, o), 0) for o in outcomes]
        rows.append([t, *map(str, counts), str(sum(counts))])
    totals = [sum(stats.get((t, o), 0) for t in targets) for o in outcomes]
    rows.append(["all", *map(str, totals), str(sum(totals))])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


__all__ = [
    "ACCEPTED", "GOOD", "REJECTED", "STATS", "Arg", "Case", "Target", "attempt", "cases", "collector_method_targets",
    "RunningFuzz", "constructor_targets", "junk", "no_spawn", "table",
]
