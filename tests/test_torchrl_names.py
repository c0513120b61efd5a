"""TorchRL's names and conventions, accepted: ``traj_format="padded"``, one-hot Discrete actions
(``categorical_action_encoding=False``), ``step_count`` with ``max_frames_per_traj``, and the
Evaluator's ``evaluate`` (blocking in synchronous code), ``trigger_eval``, ``wait``, ``shutdown``,
``log_prefix`` and metric names; ``backend="thread"`` refused with the fix. Runs without TorchRL
(``tests/test_torchrl.py`` compares the batches with TorchRL's own where it is installed)."""

from __future__ import annotations

import threading

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector, ConfigError, Evaluator, SpecError
from aiocollect.testing import CountingEnv


class OneHotPolicy(torch.nn.Module):
    """Pushes CartPole's pole back up, as a one-hot action (TorchRL GymEnv's default encoding)."""

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((obs[..., 2] > 0).long(), 2)


class IndexPolicy(torch.nn.Module):
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs[..., 2] > 0).long()


class NotOneHot(torch.nn.Module):
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.ones(obs.shape[0], 2, dtype=torch.long)


def td(module: torch.nn.Module) -> TensorDictModule:
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


# -- traj_format="padded" ----------------------------------------------------------------------


async def test_padded_is_torchrls_spelling_of_pad():
    async with Collector(lambda: CountingEnv(episode_length=5), frames_per_batch=10, total_frames=40, num_workers=0,
                         envs_per_worker=2, trajs_per_batch=2, traj_format="padded", seed=0) as c:
        assert c.config.traj_format == "pad"
        batch = await c.collect()
    assert batch.batch_size == torch.Size([2, 5]) and batch["collector", "mask"].all()
    with pytest.raises(ConfigError, match="'padded'"):
        Collector("CartPole-v1", frames_per_batch=10, num_workers=0, trajs_per_batch=2, traj_format="pads")


# -- step_count ----------------------------------------------------------------------------------


def expected_step_counts(done: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Per row: the frames of the trajectory before each step (``start`` at the batch's first)."""
    out = torch.empty(done.shape, dtype=torch.int64)
    for row in range(done.shape[0]):
        n = int(start[row])
        for t in range(done.shape[1]):
            out[row, t] = n
            n = 0 if done[row, t] else n + 1
    return out


@pytest.mark.parametrize("num_workers", [0, 1])
async def test_step_count_as_torchrls_step_counter(num_workers):
    async with Collector("CartPole-v1", frames_per_batch=24, total_frames=24 * 4, num_workers=num_workers,
                         envs_per_worker=2, max_frames_per_traj=5, seed=0) as c:
        batches = [b async for b in c]
    start = torch.zeros(2, dtype=torch.int64)
    for b in batches:
        sc, nsc = b["step_count"], b["next", "step_count"]
        assert sc.shape == nsc.shape == torch.Size([2, 12, 1]) and sc.dtype == nsc.dtype == torch.int64
        want = expected_step_counts(b["next", "done"][..., 0], start)
        assert torch.equal(sc[..., 0], want), (sc[..., 0], want)
        assert torch.equal(nsc, sc + 1)
        assert torch.equal(b["next", "truncated"][..., 0], (nsc[..., 0] == 5) & ~b["next", "terminated"][..., 0])
        start = torch.where(b["next", "done"][:, -1, 0], 0, nsc[:, -1, 0])
    assert int(batches[0]["step_count"][0, 0]) == 0  # 0 at a reset


async def test_no_step_count_without_max_frames_per_traj():
    async with Collector("CartPole-v1", frames_per_batch=8, total_frames=8, num_workers=0, seed=0) as c:
        batch = await c.collect()
    assert "step_count" not in batch.keys() and ("next", "step_count") not in batch.keys(True)


# -- one-hot Discrete actions ----------------------------------------------------------------------


@pytest.mark.parametrize("num_workers,inference", [(0, "worker"), (1, "worker"), (1, "server")])
async def test_one_hot_actions_reach_the_env_as_indices(num_workers, inference):
    common = dict(frames_per_batch=16, total_frames=32, num_workers=num_workers, envs_per_worker=2, seed=3,
                  inference=inference, init_random_frames=4)
    async with Collector("CartPole-v1", td(OneHotPolicy()), categorical_action_encoding=False, **common) as c:
        one_hot = [b async for b in c]
    async with Collector("CartPole-v1", td(IndexPolicy()), **common) as c:
        index = [b async for b in c]
    for a, b in zip(one_hot, index):
        assert a["action"].shape == torch.Size([2, 8, 2]) and a["action"].dtype == torch.int64
        assert (a["action"].sum(-1) == 1).all(), "random actions are stored one-hot too"
        assert torch.equal(a["action"].argmax(-1), b["action"]), "the env got the index"
        assert torch.equal(a["next", "observation"], b["next", "observation"])


async def test_a_row_that_is_not_one_hot_is_a_spec_error():
    with pytest.raises(SpecError, match="not one-hot"):
        async with Collector("CartPole-v1", td(NotOneHot()), frames_per_batch=8, total_frames=8, num_workers=0,
                             categorical_action_encoding=False) as c:
            await c.collect()


async def test_a_one_hot_policy_without_the_option_is_told_about_it():
    with pytest.raises(SpecError, match="categorical_action_encoding=False"):
        async with Collector("CartPole-v1", td(OneHotPolicy()), frames_per_batch=8, total_frames=8,
                             num_workers=0) as c:
            await c.collect()


async def test_one_hot_for_a_box_action_space_is_refused():
    with pytest.raises(SpecError, match="Discrete action spaces"):
        async with Collector("Pendulum-v1", frames_per_batch=8, total_frames=8, num_workers=0,
                             categorical_action_encoding=False) as c:
            await c.collect()


async def test_one_hot_for_vector_envs_is_refused():
    with pytest.raises(ConfigError, match="categorical_action_encoding=False .* vector env"):
        async with Collector(lambda: gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync"),
                             frames_per_batch=8, total_frames=8, num_workers=0,
                             categorical_action_encoding=False) as c:
            await c.collect()


@pytest.mark.timeout(90)
async def test_the_evaluator_takes_a_one_hot_policy():
    common = dict(num_trajectories=2, max_steps=30, seed=0)
    async with Evaluator("CartPole-v1", td(OneHotPolicy()), categorical_action_encoding=False, **common) as ev:
        one_hot = await ev.evaluate()
    async with Evaluator("CartPole-v1", td(IndexPolicy()), **common) as ev:
        index = await ev.evaluate()
    assert one_hot["return_mean"] == index["return_mean"] and one_hot["episode_length_mean"] == index["episode_length_mean"]


def test_categorical_action_encoding_must_be_a_bool():
    with pytest.raises(ConfigError, match="categorical_action_encoding"):
        Collector("CartPole-v1", frames_per_batch=8, num_workers=0, categorical_action_encoding="no")


# -- the Evaluator's TorchRL names ----------------------------------------------------------------


def test_backend_thread_names_what_to_use():
    with pytest.raises(ConfigError, match="backend='process'"):
        Evaluator("CartPole-v1", backend="thread")
    with pytest.raises(ConfigError, match="log_prefix"):
        Evaluator("CartPole-v1", log_prefix="")


@pytest.mark.timeout(90)
async def test_torchrl_names_and_metric_keys_in_async_code():
    async with Evaluator("CartPole-v1", None, num_trajectories=3, num_envs=1, seed=0, log_prefix="eval") as ev:
        m = await ev.evaluate()
        assert set(m) == {"eval/reward", "eval/reward_std", "eval/num_episodes", "eval/episode_length",
                          "eval/fps", "eval/step"}
        assert m["eval/step"] == 0 and m["eval/num_episodes"] == 3
        assert ev.trigger_eval(step=7) is True
        m2 = await ev.wait()
        assert m2["eval/step"] == 7 and m2["eval/reward"] == m["eval/reward"], "seeded: the same episodes"
        with pytest.raises(ConfigError, match="wait"):
            ev.poll(timeout=1)
        with pytest.raises(ConfigError, match="one model"):
            await ev.evaluate(weights_dict={"env.transform[0]": {}})
        await ev.shutdown()
    async with Evaluator("CartPole-v1", None, num_trajectories=3, seed=0) as ours:
        plain = await ours.evaluate(step=1)
    assert plain["return_mean"] == m["eval/reward"]
    assert m["eval/reward_std"] == pytest.approx(plain["return_std"] * np.sqrt(3 / 2)), "ddof=1, as TorchRL"


@pytest.mark.timeout(90)
def test_blocking_evaluate_in_synchronous_code():
    threads = threading.active_count()
    ev = Evaluator("CartPole-v1", None, num_trajectories=2, seed=0, log_prefix="eval")
    try:
        m = ev.evaluate(step=3)  # TorchRL's blocking call: the metrics, not a coroutine
        assert isinstance(m, dict) and m["eval/step"] == 3
        assert ev.trigger_eval() is True
        assert ev.wait()["eval/step"] == 0
    finally:
        ev.shutdown()
    assert ev.state.value == "closed" and threading.active_count() == threads


def test_gym_discrete_with_start_maps_one_hot_to_its_values():
    from aiocollect._core.layout import Leaf
    from aiocollect._worker.policy import EnvActions

    actions = EnvActions(gym.spaces.Discrete(3, start=-1), [Leaf(("action",), (3,), "int64")])
    assert actions.per_env([np.array([[0, 0, 1], [1, 0, 0]])], 2) == [1, -1]


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_total_frames_not_a_multiple_is_rounded_up_with_a_warning(num_workers):
    """TorchRL's `total_frames=1_000_000, frames_per_batch=2048`: a warning that names the line of
    the script, both numbers and what to pass instead; the run collects up to the next whole batch
    (489 batches there) and ends; `len(collector)` counts those batches."""
    with pytest.warns(UserWarning, match=r"total_frames=100 is not a multiple of frames_per_batch=16: collecting 112 "
                                         r"frames \(7 whole batches\), 12 more.*total_frames=112 \(or 96\)") as caught:
        collector = Collector(lambda: CountingEnv(episode_length=5), frames_per_batch=16, total_frames=100,
                              num_workers=num_workers, envs_per_worker=2)
    assert caught[0].filename == __file__
    frames = []
    async with collector as c:
        assert c.config.total_frames == 112 and len(c) == 7
        async for batch in c:
            frames.append(batch.numel())
    assert frames == [16] * 7


def test_torchrls_own_numbers_round_up_to_whole_batches():
    with pytest.warns(UserWarning, match=r"collecting 1001472 frames \(489 whole batches\)"):
        c = Collector("CartPole-v1", frames_per_batch=2048, total_frames=1_000_000, num_workers=1)
    assert len(c) == 489
    with pytest.warns(UserWarning, match=r"\(1 whole batch\), 11 more.*Pass total_frames=16 to silence"):  # (no "or 0")
        small = Collector("CartPole-v1", frames_per_batch=16, total_frames=5, num_workers=1)
    assert small.config.total_frames == 16 and len(small) == 1


def test_len_of_a_collector_without_a_number_of_batches_says_why():
    endless = Collector("CartPole-v1", frames_per_batch=16, num_workers=1)
    with pytest.raises(TypeError, match="total_frames=-1: it collects until you stop it"):
        len(endless)
    assert endless  # (truthy all the same)
    trajs = Collector("CartPole-v1", frames_per_batch=16, total_frames=64, trajs_per_batch=2, num_workers=1)
    with pytest.raises(TypeError, match="trajs_per_batch=2: how many batches"):
        len(trajs)
    assert len(Collector("CartPole-v1", frames_per_batch=16, total_frames=64, num_workers=1)) == 4
