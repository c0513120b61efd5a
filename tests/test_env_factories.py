"""One env factory per worker or per env (TorchRL's list of create_env_fn / create_env_kwargs):
each row's env is made by its own factory and says which in ("collector", "env_fn_index"), in
every delivery mode and layout, on every backend and across restarts; wrong lengths and envs
whose spaces differ are clear errors."""

from __future__ import annotations

import functools
import os

import anyio
import gymnasium as gym
import pytest
import torch

from aiocollect import AiocollectError, Collector, ConfigError
from aiocollect.events import WorkerRestarted
from aiocollect.testing import CountingEnv

from procs import local_ray

LENGTHS = (3, 4, 5, 7)  # episode lengths of the factories: a row's episodes tell which factory made its env
KEY = ("collector", "env_fn_index")


def counting(length: int):
    return functools.partial(CountingEnv, episode_length=length)


def check_rows(batch, lengths=LENGTHS) -> set[int]:
    """Every row's factory index is one per row, and its episodes have that factory's length
    (CountingEnv: the phase, observation % 100, restarts at 0 after ``length`` steps). Returns the
    indices seen."""
    seen = set()
    for index, obs, nxt in zip(batch[KEY], batch["observation"], batch["next", "observation"]):
        assert (index == index[0]).all()
        length = lengths[int(index[0])]
        phase = obs[:, 0].long() % 100
        ends = (nxt[:, 0].long() % 100) == length
        assert (phase < length).all() and bool(ends.any()), (int(index[0]), phase.tolist())
        seen.add(int(index[0]))
    return seen


async def collect(fns, batches: int = 2, **options) -> list:
    options.setdefault("frames_per_batch", 56)
    async with Collector(fns, total_frames=batches * options["frames_per_batch"], seed=5, **options) as c:
        return [batch async for batch in c]


async def test_one_factory_per_worker():
    """A list of num_workers factories: every env of worker w is made by factory w."""
    with anyio.fail_after(50):
        batches = await collect([counting(3), counting(4)], num_workers=2, envs_per_worker=2)
    for batch in batches:
        assert batch[KEY][:, 0].tolist() == [0, 0, 1, 1]
        check_rows(batch)


async def test_one_factory_per_env_with_the_local_backend_too():
    """A list of num_workers * envs_per_worker factories: env k is made by factory k; with
    num_workers=0, one per env of the collector's own process."""
    fns = [counting(n) for n in LENGTHS]
    with anyio.fail_after(50):
        process = await collect(fns, num_workers=2, envs_per_worker=2)
        local = await collect(fns, num_workers=0, envs_per_worker=4)
    for batch in process + local:
        assert batch[KEY][:, 0].tolist() == [0, 1, 2, 3]
        check_rows(batch)


async def test_a_list_of_kwargs_with_one_factory():
    """create_env_kwargs as a list (per env) with a single factory; the index is the kwargs' entry."""
    kwargs = [{"episode_length": n} for n in LENGTHS]
    with anyio.fail_after(50):
        batches = await collect(CountingEnv, create_env_kwargs=kwargs, num_workers=2, envs_per_worker=2)
    assert check_rows(batches[0]) == {0, 1, 2, 3}


async def test_gymnasium_ids_mixed_with_callables():
    """Ids and callables in one list: a CartPole capped at 10 steps beside a plain one."""
    fns = ["CartPole-v1", lambda: gym.make("CartPole-v1", max_episode_steps=10)]
    with anyio.fail_after(50):
        batches = await collect(fns, frames_per_batch=64, num_workers=2)
    for batch in batches:  # (a trajectory id per episode: none of factory 1's is longer than 10)
        assert batch[KEY][:, 0].tolist() == [0, 1]
        _, runs = torch.unique_consecutive(batch["collector", "traj_ids"][1], return_counts=True)
        assert int(runs.max()) <= 10


async def test_async_delivery_and_split_trajs_keep_the_index():
    """delivery="async" (a batch holds one worker's rows) and split_trajs (rows are
    trajectories) both carry each row's factory index."""
    with anyio.fail_after(50):
        batches = await collect([counting(3), counting(4)], batches=6, num_workers=2, envs_per_worker=2,
                                delivery="async", frames_per_batch=28)
        split = await collect([counting(3), counting(4)], num_workers=2, envs_per_worker=2, split_trajs=True)
    for batch in batches:  # (which worker is first ready is up to the machine: each batch is one worker's rows)
        assert len(check_rows(batch)) == 1 and batch.shape[0] == 2
    for batch in split:
        mask = batch["collector", "mask"]
        for index, valid, obs in zip(batch[KEY], mask, batch["observation"]):
            length = LENGTHS[int(index[valid][0])]
            assert (index[valid] == index[valid][0]).all() and int(valid.sum()) <= length
            assert ((obs[valid, 0].long() % 100) < length).all()


async def test_vector_env_factories_per_worker():
    """Factories that return vector envs: all sub-envs of a worker carry its factory's index."""

    def vec(length: int):
        return lambda: gym.vector.SyncVectorEnv([counting(length)] * 2)

    with anyio.fail_after(50):
        batches = await collect([vec(3), vec(4)], num_workers=2)
    assert batches[0][KEY][:, 0].tolist() == [0, 0, 1, 1]
    check_rows(batches[0])


def fail_once(flag: str, length: int):
    def make():
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            return CountingEnv(episode_length=length, fail_at_step=20)
        except FileExistsError:
            return CountingEnv(episode_length=length)

    return make


@pytest.mark.timeout(90)
async def test_a_replaced_worker_is_rebuilt_with_its_own_factory(tmp_path):
    """Worker 1's env fails once; its replacement is made by worker 1's factory again."""
    restarted: list[WorkerRestarted] = []
    with anyio.fail_after(80):
        c = Collector([counting(3), fail_once(str(tmp_path / "flag"), 4)], frames_per_batch=16, total_frames=160,
                      num_workers=2, envs_per_worker=2, seed=5, on_worker_failure="restart")
        c.on(WorkerRestarted, restarted.append)
        async with c:
            async for batch in c:
                assert batch[KEY][:, 0].tolist() == [0, 0, 1, 1]
                for index, obs in zip(batch[KEY], batch["observation"]):
                    assert ((obs[:, 0].long() % 100) < LENGTHS[int(index[0])]).all()
    assert [e.worker for e in restarted] == [1]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"create_env_fn": [CountingEnv] * 3, "num_workers": 2, "envs_per_worker": 2},
         r"create_env_fn is a list of 3 entries.*num_workers=2 \(one per worker\) or the 4 envs"),
        ({"create_env_fn": [CountingEnv] * 2, "num_workers": 0, "envs_per_worker": 4},
         r"create_env_fn is a list of 2 entries.*envs_per_worker=4"),
        ({"create_env_fn": CountingEnv, "create_env_kwargs": [{}] * 3, "num_workers": 2},
         r"create_env_kwargs is a list of 3 entries"),
        ({"create_env_fn": [CountingEnv] * 2, "create_env_kwargs": [{}] * 4, "num_workers": 2, "envs_per_worker": 2},
         r"create_env_kwargs is a list of 4 dicts but create_env_fn a list of 2"),
        ({"create_env_fn": [CountingEnv, 3], "num_workers": 2}, r"create_env_fn\[1\]=3 is neither"),
        ({"create_env_fn": [CountingEnv, "CartPole-v99"], "num_workers": 2}, r"create_env_fn\[1\]"),
        ({"create_env_fn": [CountingEnv] * 2, "create_env_kwargs": [{}, 5], "num_workers": 2},
         r"create_env_kwargs=\[\{\}, 5\] is a list, so each entry must be a dict.*create_env_kwargs\[1\]=5 is not"),
    ],
)
def test_wrong_lists_are_refused_naming_the_lengths(options, match):
    with pytest.raises(ConfigError, match=match):
        Collector(frames_per_batch=8, **options)


@pytest.mark.parametrize("per", ["worker", "env"])
async def test_factories_whose_spaces_differ_are_refused_at_start(per):
    """Envs of two factories with other spaces (across workers, or within a worker) fail the start
    with an error naming both factories and their spaces."""
    fns = [CountingEnv, functools.partial(CountingEnv, obs_shape=(2,))]
    layout = {"num_workers": 2} if per == "worker" else {"num_workers": 1, "envs_per_worker": 2}
    with anyio.fail_after(50):
        with pytest.raises(AiocollectError) as info:
            async with Collector(fns, frames_per_batch=8, **layout):
                pass
    text = str(info.value) + str(info.value.__cause__)
    assert "create_env_fn[0]" in text and "create_env_fn[1]" in text and "(2,)" in text and "(3,)" in text


@pytest.fixture
def ray_instance():
    pytest.importorskip("ray")
    with local_ray():
        yield


@pytest.mark.timeout(150)
@pytest.mark.loops("asyncio")
async def test_ray_workers_get_their_own_factories_and_decorrelate(ray_instance):
    """backend="ray": each actor makes its envs with its own factory, and decorrelates them."""
    with anyio.fail_after(140):
        batches = await collect([counting(5), counting(7)], backend="ray", num_workers=2, envs_per_worker=2,
                                max_decorrelation_steps=20, frames_per_batch=40)
    assert batches[0][KEY][:, 0].tolist() == [0, 0, 1, 1]
    check_rows(batches[0], (5, 7))
    assert len({int(v) % 100 for v in batches[0]["observation"][:, 0, 0]}) > 1
