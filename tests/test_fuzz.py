"""Bad input, fuzzed with hypothesis (issue 8).

Every constructor argument of Collector, Evaluator, ReplayBuffer, the samplers and ProfileConfig,
the arguments of the collector's set_seed / load_state_dict / enable_profile / subscribe, of
update_weights (on a running collector, and on one never started) and of the Evaluator's
evaluate / trigger: an invalid value gets a ConfigError naming the argument (and the value, when
its repr is short), within a few seconds, and no process is started for it; a valid value is
accepted. The strategies live in tests/fuzz_cases.py (benchmarks/fuzz_report.py runs them with
more examples and prints the counts); this module prints the same table at its end.

Hypothesis is derandomized here (the same examples on every run: CI stays deterministic); the
report script draws new ones on each run.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import fuzz_cases as fc
from aiocollect import Collector, ConfigError, Evaluator, ReplayBuffer, StalenessAwareSampler
from aiocollect._backends import child as _child
from aiocollect.events import Event

EXAMPLES = 150
"""Examples per constructor or method (each takes a few milliseconds)."""
RUNNING_EXAMPLES = 60
"""Examples per method of a running collector / evaluator, per event loop."""


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


def _fuzz(target: fc.Target, examples: int) -> None:
    @_settings(examples)
    @given(case=fc.cases(target))
    def check(case: fc.Case) -> None:
        outcome, detail = fc.attempt(case)
        assert outcome in fc.GOOD, f"{case!r}: {outcome}: {detail}"

    check()


@pytest.fixture(scope="module", autouse=True)
def fuzz_summary(request):
    """At the end of the module: how many inputs were fuzzed, and how they ended."""
    yield
    plugins = request.config.pluginmanager
    reporter, capture = plugins.getplugin("terminalreporter"), plugins.getplugin("capturemanager")
    if reporter is None or not fc.STATS:
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        reporter.write_line("")
        reporter.write_sep("-", "fuzzed inputs, and how they ended (tests/test_fuzz.py)")
        reporter.write_line(fc.table())


@pytest.mark.parametrize("target", fc.constructor_targets(), ids=lambda t: t.name)
def test_a_bad_constructor_argument_gets_a_config_error_naming_it_and_starts_nothing(target):
    """One argument wrong (type, range, size, combination), the others valid: ConfigError naming
    the argument and its value, at once, no process started; valid values are accepted."""
    _fuzz(target, EXAMPLES)


METHODS = ["Collector.set_seed", "Collector.load_state_dict", "Collector.enable_profile", "Collector.subscribe"]


@pytest.mark.parametrize("name", METHODS)
def test_a_bad_argument_of_a_collector_method_gets_a_config_error_naming_it(name):
    """set_seed, load_state_dict, enable_profile and subscribe on a collector not started: the
    same contract as the constructors."""
    collector = Collector("CartPole-v1", frames_per_batch=8, num_workers=1)
    try:
        target = {t.name: t for t in fc.collector_method_targets(collector)}[name]
        _fuzz(target, EXAMPLES)
    finally:
        collector.close()


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_bad_update_weights_and_evaluator_requests_are_refused_and_leave_them_usable(use_uvloop):
    """update_weights with a wrong model_id, worker_ids, weights_dict, wait, or weights of the
    wrong type, keys, shape or dtype: ConfigError naming the argument, nothing published; on a
    collector never started, what can be told without its workers is refused without starting it.
    evaluate / trigger with a wrong step or weights: refused before the evaluator starts. Valid
    calls work, and afterwards the collector still updates and collects, the evaluator evaluates.

    One started collector and evaluator serve every example: they run in an anyio blocking
    portal's event loop (asyncio or uvloop), and hypothesis drives the examples from this thread
    through ``portal.call``."""
    with fc.RunningFuzz(use_uvloop) as fuzz:
        for target in fuzz.targets():
            _fuzz(target, RUNNING_EXAMPLES)
        fuzz.still_usable()


# -- what the fuzzing found, kept as plain examples ------------------------------------------------


def _collector(**kwargs):
    kwargs.setdefault("frames_per_batch", 8)
    return Collector(kwargs.pop("create_env_fn", "CartPole-v1"), **kwargs)


FOUND = [
    pytest.param(lambda: _collector(create_env_fn="no_such_module_xyz:Foo-v0"), r"create_env_fn='no_such_module_xyz:Foo-v0'.*no module", id="env-id-of-a-missing-module"),
    pytest.param(lambda: _collector(create_env_fn="gymnasium:a:b"), r"create_env_fn='gymnasium:a:b' is not 'module:EnvId'", id="env-id-malformed"),
    pytest.param(lambda: _collector(create_env_fn=fc.Unpicklable()), r"create_env_fn=.*cannot be sent to the worker processes", id="env-fn-unpicklable"),
    pytest.param(lambda: _collector(create_env_kwargs={"lock": fc.threading.Lock()}), r"create_env_kwargs=.*cannot be sent", id="env-kwargs-unpicklable"),
    pytest.param(lambda: _collector(create_env_kwargs={3: "x"}), r"create_env_kwargs=\{3: 'x'\} has the key 3", id="env-kwargs-int-key"),
    pytest.param(lambda: _collector(frames_per_batch=2**40), r"frames_per_batch=1099511627776 with prefetch=0 .* needs at least .* GiB", id="frames-beyond-memory"),
    pytest.param(lambda: _collector(prefetch=2**40), r"prefetch=1099511627776 .* needs at least", id="prefetch-beyond-memory"),
    pytest.param(lambda: _collector(num_workers=2**23, frames_per_batch=2**23), r"num_workers=8388608 is more worker processes than this machine allows", id="workers-beyond-pid-max"),
    pytest.param(lambda: _collector(delivery=np.array(["sync", "x"])), r"delivery=array", id="delivery-numpy-array"),
    pytest.param(lambda: _collector(on_worker_failure=np.array([1, 2])), r"on_worker_failure=array", id="on-worker-failure-numpy-array"),
    pytest.param(lambda: _collector(seed=-1), r"seed=-1 must be an int from 0 to", id="seed-negative"),
    pytest.param(lambda: _collector(seed=2**64 - 1), r"seed=18446744073709551615 must be an int from 0 to 18446744073709551614", id="seed-beyond-torch"),
    pytest.param(lambda: _collector(shutdown_timeout=True), r"shutdown_timeout=True", id="shutdown-timeout-bool"),
    pytest.param(lambda: _collector(update_at_each_batch="yes"), r"update_at_each_batch='yes' must be True or False", id="update-at-each-batch-str"),
    pytest.param(lambda: _collector(trajs_per_batch=4, split_trajs=True), r"trajs_per_batch=4 and split_trajs=True", id="trajs-with-split"),
    pytest.param(lambda: Evaluator("CartPole-v1", seed=-3), r"seed=-3", id="evaluator-seed-negative"),
    pytest.param(lambda: Evaluator("CartPole-v1", env_kwargs={1: 2}), r"env_kwargs=\{1: 2\} has the key 1", id="evaluator-kwargs-int-key"),
    pytest.param(lambda: ReplayBuffer(10, device="bogus"), r"device='bogus' is not a device", id="buffer-device-malformed"),
    pytest.param(lambda: ReplayBuffer(10, device=[]), r"device must be a torch.device or a str, got \[\]", id="buffer-device-list"),
    pytest.param(lambda: ReplayBuffer(2**62), r"capacity=4611686018427387904 .* needs at least", id="buffer-capacity-beyond-memory"),
    pytest.param(lambda: StalenessAwareSampler(version_key=5), r"version_key must name an entry .* got 5", id="sampler-key-int"),
    pytest.param(lambda: fc.UniformSampler(replacement="no"), r"replacement must be True or False, got 'no'", id="sampler-flag-str"),
    pytest.param(lambda: fc.ProfileConfig(save_path=3.5), r"save_path=3.5 must be a str", id="profile-path-float"),
    pytest.param(lambda: fc.ProfileConfig(save_path="{foo}_{worker_idx}"), r"save_path='\{foo\}_\{worker_idx\}' is not a format string", id="profile-path-unknown-field"),
    pytest.param(lambda: fc.ProfileConfig(activities=None), r"activities=None", id="profile-activities-none"),
    pytest.param(lambda: fc.ProfileConfig(workers=[True]), r"workers=\[True\]", id="profile-workers-bool"),
    pytest.param(lambda: fc.ProfileConfig(with_stack="yes"), r"with_stack='yes' must be True or False", id="profile-flag-str"),
]


@pytest.mark.parametrize(("make", "match"), FOUND)
def test_what_the_fuzzing_found_is_refused_at_construction(make, match):
    """Each value here passed construction (or raised a raw TypeError/ValueError/RuntimeError from
    inside) before the fuzzing found it."""
    pids = len(_child.started_pids)
    with fc.no_spawn() as asked, pytest.raises(ConfigError, match=match):
        make()
    assert not asked and len(_child.started_pids) == pids


def test_methods_found_by_the_fuzzing():
    """Collector methods that raised a raw error, or accepted a wrong value, before."""
    c = Collector("CartPole-v1", frames_per_batch=8, num_workers=1)
    try:
        with pytest.raises(ConfigError, match=r"enable_profile\(\) got the keyword bogus=1"):
            c.enable_profile(bogus=1)  # was a TypeError from the dataclass
        with pytest.raises(ConfigError, match=r"config='x' must be a ProfileConfig"):
            c.enable_profile("x")  # was an AttributeError
        with pytest.raises(ConfigError, match=r"static_seed='yes'"):
            c.set_seed(0, static_seed="yes")
        with pytest.raises(ConfigError, match=r"state has frames=-8, below 0"):
            c.load_state_dict({"frames": -8, "batches": 0, "traj_counters": [0]})
        with pytest.raises(ConfigError, match=r"state=.* is a Tensor"):
            c.load_state_dict(fc.torch.tensor(3))  # was an IndexError
        with pytest.raises(ConfigError, match=r"max_buffer='4' must be an int >= 1"):
            c.subscribe(Event, max_buffer="4")  # was a TypeError
    finally:
        c.close()
