"""A worker whose env factory comes from a module that imports torch (a training script's
``envs.py``, a test module) imports torch when it unpickles that factory: the collector sees it
in the factory's pickle and forks such a worker from the launcher's torch template, where torch
is imported already (a second or more of CPU saved per worker). Workers whose envs need no torch
still come from the light template, without it."""

from __future__ import annotations

import pickle
import sys
import textwrap

import cloudpickle
import pytest
import torch

from aiocollect import Collector
from aiocollect._backends.launcher import get_launcher
from aiocollect._core import pickling
from aiocollect._core.imports import env_needs, heavy_imports, modules_named
from aiocollect.testing import CountingEnv
from procs import torch_template

TORCH_FREE = """
import math
import gymnasium

def make_env(length=20):
    return gymnasium.make("CartPole-v1", max_episode_steps=length)

class Maker:
    def __call__(self):
        return make_env()
"""

THROUGH_ANOTHER = """
from {helper} import scale  # a module that imports torch: this one imports it too

def make_env():
    import gymnasium
    return gymnasium.make("CartPole-v1")
"""

HELPER = """
import torch

def scale(x):
    return torch.as_tensor(x) * 2
"""


def pickle_needs(payload: bytes) -> tuple[str, ...]:
    return heavy_imports(modules_named(payload))


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Import-by-name modules written for the test (removed from sys.modules after it)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(name: str, source: str):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        made.append(name)
        __import__(name)
        return sys.modules[name]

    yield make
    for name in made:
        sys.modules.pop(name, None)


def counting_env():  # (a function of this module, which imports torch)
    return CountingEnv(episode_length=20)


def test_a_factory_of_a_module_that_imports_torch_needs_torch_and_others_do_not(modules):
    free = modules("aiocollect_test_free_envs", TORCH_FREE)
    modules("aiocollect_test_helper", HELPER)
    through = modules("aiocollect_test_through", THROUGH_ANOTHER.format(helper="aiocollect_test_helper"))

    assert pickle_needs(pickling.dumps(counting_env)) == ("torch",)  # this test module imports torch
    assert pickle_needs(pickling.dumps(free.make_env)) == ()
    assert pickle_needs(pickling.dumps(free.Maker())) == ()
    assert pickle_needs(pickling.dumps(through.make_env)) == ("torch",)  # two modules down
    assert pickle_needs(pickling.dumps("CartPole-v1")) == ()

    def by_value():  # (pickled by value, as a script's functions are: torch travels as a module to import)
        return torch.zeros(1)

    by_value.__module__ = "__main__"
    assert "torch" in modules_named(cloudpickle.dumps(by_value)) and pickle_needs(cloudpickle.dumps(by_value)) == ("torch",)
    # memoized strings (a module named twice is written once, then fetched from the memo)
    twice = pickle.dumps([free.make_env, free.Maker, counting_env, counting_env], protocol=4)
    assert {"aiocollect_test_free_envs", __name__} <= modules_named(twice)
    assert heavy_imports(["tensordict.nn", "numpy"]) == ("tensordict",)


def test_env_needs_reads_factories_lists_kwargs_and_gymnasium_entry_points(modules):
    free = modules("aiocollect_test_free_envs", TORCH_FREE)
    import gymnasium

    assert env_needs(free.make_env, {"length": 5}) == ()
    assert env_needs([free.make_env, counting_env], None) == ("torch",)
    assert env_needs(free.make_env, {"noise": torch.zeros(2)}) == ("torch",)
    assert env_needs("CartPole-v1", None) == ()
    gymnasium.register("AiocollectCounting-v0", entry_point=f"{__name__}:CountingEnv")
    try:
        assert env_needs("AiocollectCounting-v0", None) == ("torch",)
        assert env_needs(f"{__name__}:AiocollectCounting-v0", None) == ("torch",)
    finally:
        gymnasium.registry.pop("AiocollectCounting-v0")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(120)
async def test_workers_of_a_torch_importing_env_module_fork_from_the_torch_template(modules):
    """Random actions (no torch policy): the workers of this module's factory come from the torch
    template, those of a torch-free module's from the light one."""
    free = modules("aiocollect_test_free_envs", TORCH_FREE)
    parents = {}
    for name, fn in (("torch module", counting_env), ("torch-free module", free.make_env)):
        async with Collector(fn, frames_per_batch=8, total_frames=16, num_workers=2, envs_per_worker=2) as c:
            async for _ in c:
                parents[name] = {_parent(pid) for pid in c.worker_pids}
    light = get_launcher().pid
    template = torch_template(light)
    assert template is not None and parents == {"torch module": {template}, "torch-free module": {light}}
