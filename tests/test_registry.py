"""Env ids registered in the user's process work in the worker processes and in the evaluator's
worker: whether the user passes the id or a factory that calls ``gymnasium.make(id)`` itself, with
an entry point that is a class of a module, a closure (sent by value), a class of a script's
``__main__``, or a plugin's string entry point; the whole spec travels (kwargs,
``max_episode_steps``), an id nobody registered still fails at construction, and a spec that
cannot travel costs only its own id, with an error that names it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import anyio
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from procs import child_env

from aiocollect import Collector, ConfigError, Evaluator
from aiocollect._core import registry as _registry
from aiocollect._backends.launcher import get_launcher
from aiocollect.testing import CountingEnv

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module", autouse=True)
def launcher_with_this_modules_imports():
    """Workers unpickle this module's env classes by importing this module: have the launcher
    import its imports once, rather than every worker."""
    get_launcher().ensure_started(("pytest", "anyio"))


@pytest.fixture
def register():
    """``register(id, **kwargs)``: ``gymnasium.register`` for this test only (the registry is
    restored afterwards, so later tests do not send these specs to their workers)."""
    before = dict(gym.registry)

    def _register(env_id: str, **kwargs) -> None:
        gym.register(env_id, **kwargs)

    yield _register
    gym.registry.clear()
    gym.registry.update(before)


class UserEnv(CountingEnv):
    """A user's env class, registered from this test module (pickled by reference)."""


def _counting_frames(seed: int, start_step: int, steps: int, episode_length: int) -> list[float]:
    """The observations CountingEnv(episode_length) seeded ``seed`` shows from step ``start_step``
    of its life on (episodes restart at ``seed * 100``)."""
    return [float(seed * 100 + k % episode_length) for k in range(start_step, start_step + steps)]


async def _collect(env_fn, batches: int = 2, **kwargs) -> list:
    kwargs = {"frames_per_batch": 8, "num_workers": 2, "seed": 0, **kwargs}
    out = []
    async with Collector(env_fn, total_frames=kwargs["frames_per_batch"] * batches, **kwargs) as c:
        with anyio.fail_after(60):
            async for batch in c:
                out.append(batch)
    return out


def _assert_counting(batches: list, episode_length: int) -> None:
    """Two workers, one env each, seeds 0 and 1, 4 frames per env and batch."""
    for b, batch in enumerate(batches):
        obs = batch["observation"][..., 0].tolist()
        assert obs == [_counting_frames(g, 4 * b, 4, episode_length) for g in (0, 1)], obs


# ---- ids registered in the user's process, made in the workers --------------------------------


@pytest.mark.parametrize("how", ["id", "factory"])
async def test_id_registered_with_a_class_of_a_test_module_is_made_in_every_worker(register, how):
    """``gym.register("UserCounting-v0", entry_point=UserEnv, kwargs=...)`` in this process: two
    workers make it, by id or through ``lambda: gym.make(id)``, with the registered kwargs."""
    register("UserCounting-v0", entry_point=UserEnv, kwargs={"episode_length": 3})
    env_fn = "UserCounting-v0" if how == "id" else (lambda: gym.make("UserCounting-v0"))
    _assert_counting(await _collect(env_fn), episode_length=3)


@pytest.mark.parametrize("how", ["id", "factory"])
async def test_closure_entry_point_is_sent_by_value(register, how):
    """An entry point that is a closure over a local variable (no module could import it) is
    pickled by value: the workers make the env it builds."""
    length = 5

    register("ClosureCounting-v0", entry_point=lambda: CountingEnv(episode_length=length))
    env_fn = "ClosureCounting-v0" if how == "id" else (lambda: gym.make("ClosureCounting-v0"))
    _assert_counting(await _collect(env_fn), episode_length=5)


def test_script_registering_a_class_of_its_main_module_collects_with_it():
    """A script registers a class defined in its ``__main__`` (also as the string
    ``"__main__:MyEnv"``) and imports a plugin package: two workers collect from each id, by id
    and through a factory, and the evaluator runs it; no worker says NameNotFound, nor warns
    that an id is overridden when the plugin registers its ids again in the worker."""
    env = child_env(TESTS.parent, TESTS)
    proc = subprocess.run(
        [sys.executable, str(TESTS / "scripts" / "registry_main.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(TESTS.parent),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "NameNotFound" not in proc.stderr and "Overriding environment" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = [[_counting_frames(g, 4 * b, 4, 3) for g in (0, 1)] for b in (0, 1)]
    assert out["id"] == expected
    assert out["factory"] == expected
    assert out["main_string_entry_point"] == expected
    assert out["plugin"] == [[_counting_frames(g, 4 * b, 4, 4) for g in (0, 1)] for b in (0, 1)]
    assert out["evaluation_length_mean"] == 3.0


async def test_plugin_ids_registered_by_an_import_are_made_in_the_workers(register):
    """Importing a plugin package (here ``fake_plugin``, like ``ale_py``) registers ids with
    string entry points into it: the workers, which never imported it, make them."""
    if "fake_plugin" in sys.modules:  # imported by an earlier run: the fixture removed its ids
        importlib.reload(sys.modules["fake_plugin"])
    else:
        import fake_plugin  # noqa: F401 - registers FakePlugin/Counting-v0
    _assert_counting(await _collect(lambda: gym.make("FakePlugin/Counting-v0")), episode_length=4)


async def test_registered_cartpole_matches_a_plain_gymnasium_loop_in_the_workers(register):
    """``CartPoleEnv`` registered under a new id with ``max_episode_steps=8``: each worker's frames
    are those of a plain gymnasium loop on ``gym.make(id)`` with the same seed and actions (so the
    whole spec travelled: episodes are truncated after 8 steps), and the ``next`` observation of
    frame t is the observation of frame t+1 unless the episode ended there."""
    register("ShortCartPole-v0", entry_point=CartPoleEnv, max_episode_steps=8)
    batches = await _collect("ShortCartPole-v0", frames_per_batch=64, batches=2)
    assert all(batch.batch_size == (2, 32) for batch in batches)
    truncations = 0
    for g in (0, 1):
        env = gym.make("ShortCartPole-v0")
        obs, _ = env.reset(seed=g)
        for batch in batches:
            row = batch[g]
            done = row["next", "done"][:, 0]
            for t in range(row.batch_size[0]):
                np.testing.assert_array_equal(row["observation"][t].numpy(), obs)
                obs, reward, terminated, truncated, _ = env.step(int(row["action"][t]))
                np.testing.assert_array_equal(row["next", "observation"][t].numpy(), obs)
                assert float(row["next", "reward"][t, 0]) == reward
                assert bool(row["next", "terminated"][t, 0]) is terminated
                assert bool(row["next", "truncated"][t, 0]) is truncated
                truncations += truncated
                if terminated or truncated:
                    obs, _ = env.reset()
                elif t + 1 < row.batch_size[0]:
                    assert not done[t]
                    assert (row["next", "observation"][t] == row["observation"][t + 1]).all()
        env.close()
    assert truncations > 0, "no episode reached max_episode_steps=8: the spec's limit was not tested"


@pytest.mark.parametrize("how", ["id", "factory"])
async def test_evaluator_makes_an_id_registered_in_this_process(register, how):
    """The evaluator's worker makes a user-registered id (by id or through a factory) with the
    registered kwargs: every episode has the registered length."""
    register("EvalCounting-v0", entry_point=UserEnv, kwargs={"episode_length": 6})
    env = "EvalCounting-v0" if how == "id" else (lambda: gym.make("EvalCounting-v0"))
    async with Evaluator(env, num_trajectories=3, seed=0) as evaluator:
        with anyio.fail_after(60):
            metrics = await evaluator.evaluate()
    assert metrics["episode_length_mean"] == 6.0 and metrics["num_trajectories"] == 3


# ---- ids that cannot be made -------------------------------------------------------------------


def test_id_nobody_registered_fails_at_construction_with_config_error():
    """An id that is not in this process's registry is refused by the constructors of the
    collector and the evaluator (with close matches), as before."""
    with pytest.raises(ConfigError, match=r"create_env_fn='NeverRegistered-v0' is not a registered"):
        Collector("NeverRegistered-v0", frames_per_batch=8, num_workers=1)
    with pytest.raises(ConfigError, match=r"env='CartPol-v1' is not a registered.*'CartPole-v1'"):
        Evaluator("CartPol-v1")


def _unpicklable_entry_point():
    lock = threading.Lock()  # a closure over a lock: cloudpickle cannot send it

    def make(**kwargs):
        with lock:
            return CountingEnv(**kwargs)

    return make


def test_id_whose_spec_cannot_be_pickled_is_refused_at_construction_naming_the_cause(register):
    """The id the user asks for has an entry point that cannot be pickled: the collector (with
    workers) and the evaluator refuse it at construction, naming the id and the pickling error; the
    local backend, which needs no pickling, accepts it."""
    register("Unpicklable-v0", entry_point=_unpicklable_entry_point())
    with pytest.raises(ConfigError, match=r"create_env_fn='Unpicklable-v0'.*could not be pickled.*lock"):
        Collector("Unpicklable-v0", frames_per_batch=8, num_workers=1)
    with pytest.raises(ConfigError, match=r"env='Unpicklable-v0'.*could not be pickled.*lock"):
        Evaluator("Unpicklable-v0")
    Collector("Unpicklable-v0", frames_per_batch=8, num_workers=0)


async def test_unpicklable_spec_costs_only_its_own_id_which_fails_clearly_in_the_worker(register):
    """One registered spec cannot be pickled: another user id still works in the workers, and a
    factory that makes the unpicklable id gets a ConfigError from the worker naming the id and
    the pickling error."""
    register("Unpicklable-v0", entry_point=_unpicklable_entry_point())
    register("Picklable-v0", entry_point=UserEnv, kwargs={"episode_length": 3})
    _assert_counting(await _collect("Picklable-v0"), episode_length=3)
    c = Collector(lambda: gym.make("Unpicklable-v0"), frames_per_batch=8, num_workers=1)
    try:
        with anyio.fail_after(60), pytest.raises(ConfigError) as info:
            await c.start()
    finally:
        await c.aclose()
    msg = str(info.value)
    assert "'Unpicklable-v0'" in msg and "could not be pickled" in msg and "lock" in msg, msg


def _refuse_to_unpickle(pickled_in: int):
    if os.getpid() != pickled_in:
        raise RuntimeError("this entry point refuses to be unpickled in another process")
    return _FailsToUnpickle()


class _FailsToUnpickle:
    """An entry point that pickles here but raises when another process unpickles it."""

    def __reduce__(self):
        return (_refuse_to_unpickle, (os.getpid(),))

    def __call__(self, **kwargs):
        return CountingEnv(**kwargs)


async def test_spec_that_fails_to_unpickle_in_the_worker_costs_only_its_own_id(register):
    """A spec whose unpickling raises in the worker: another user id still works there, and
    making the broken id raises a ConfigError naming it and the unpickling error."""
    register("UnpicklableThere-v0", entry_point=_FailsToUnpickle())
    register("Picklable-v0", entry_point=UserEnv, kwargs={"episode_length": 3})
    _assert_counting(await _collect(lambda: gym.make("Picklable-v0")), episode_length=3)
    c = Collector("UnpicklableThere-v0", frames_per_batch=8, num_workers=1)
    try:
        with anyio.fail_after(60), pytest.raises(ConfigError) as info:
            await c.start()
    finally:
        await c.aclose()
    msg = str(info.value)
    assert "'UnpicklableThere-v0'" in msg and "could not be unpickled" in msg, msg
    assert "refuses to be unpickled" in msg, msg


# ---- the snapshot and its installation (in this process) ---------------------------------------


def test_snapshot_packs_plain_specs_together_and_each_user_callable_alone(register):
    """String entry points (gymnasium's own ids, a plugin's) travel in one blob; each spec with a
    callable entry point of the user's travels in its own, so that it can fail alone."""
    register("StringEntry-v0", entry_point="aiocollect.testing:CountingEnv")
    register("ClassEntry-v0", entry_point=UserEnv)
    register("LambdaEntry-v0", entry_point=lambda: CountingEnv())
    snap = _registry.snapshot()
    plain = [p for p in snap if p.plain]
    assert len(plain) == 1 and {"CartPole-v1", "StringEntry-v0"} <= set(plain[0].ids)
    alone = {p.ids[0] for p in snap if not p.plain}
    assert {"ClassEntry-v0", "LambdaEntry-v0"} <= alone
    assert all(len(p.ids) == 1 for p in snap if not p.plain)
    assert set(gym.registry) == {i for p in snap for i in p.ids}


def test_install_registers_missing_ids_and_their_registration_again_is_silent(register):
    """``install`` puts back an id this process lacks; registering it again afterwards (a plugin
    imported by the entry point, a factory that registers) raises no "Overriding environment"
    warning (warnings are errors here); other ids still warn."""
    register("Installed-v0", entry_point=UserEnv, kwargs={"episode_length": 2})
    register("NotInstalled-v0", entry_point=UserEnv)
    snap = _registry.snapshot()
    spec = gym.registry.pop("Installed-v0")
    with warnings.catch_warnings():  # install's filter is undone with the rest of the test's
        _registry.install(snap)
        assert gym.registry["Installed-v0"] == spec
        assert gym.make("Installed-v0").unwrapped.episode_length == 2
        gym.register("Installed-v0", entry_point=UserEnv, kwargs={"episode_length": 2})
        with pytest.raises(UserWarning, match="Overriding environment NotInstalled-v0"):
            gym.register("NotInstalled-v0", entry_point=UserEnv)


def test_install_replaces_a_stock_id_the_user_registered_differently(register):
    """A stock id registered again in the user's process (here ``CartPole-v1`` with
    ``max_episode_steps=7``) replaces the worker's own spec; equal specs are left alone."""
    stock = gym.registry["CartPole-v1"]
    gym.registry["CartPole-v1"] = gym.envs.registration.EnvSpec(
        "CartPole-v1", entry_point=stock.entry_point, max_episode_steps=7
    )
    acrobot = gym.registry["Acrobot-v1"]
    snap = _registry.snapshot()
    gym.registry["CartPole-v1"] = stock  # this process plays the worker, with its stock spec
    with warnings.catch_warnings():
        _registry.install(snap)
    assert gym.registry["CartPole-v1"].max_episode_steps == 7
    assert gym.registry["Acrobot-v1"] is acrobot
