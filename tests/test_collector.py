"""The collector's data: batch layout, episode ends, trajectory ids, determinism against a plain
gymnasium loop, spaces, policies and the options that shape a batch."""

from __future__ import annotations

import types

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictSequential

import aiocollect
from aiocollect import Collector
from aiocollect.testing import CountingEnv, SpacesEnv


class ArgmaxMLP(torch.nn.Module):
    """The 4-64-2 MLP of the benchmarks, acting greedily."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)


class AlwaysOne(torch.nn.Module):
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.ones(obs.shape[0], dtype=torch.int64)


async def collect_all(*args, **kwargs) -> list[TensorDict]:
    async with Collector(*args, **kwargs) as collector:
        return [batch async for batch in collector]


def counting(**kw):
    return lambda: CountingEnv(**kw)


# -- layout ---------------------------------------------------------------------------------------


async def test_batch_layout_matches_torchrl_collectors():
    """A CartPole batch is [E, T] with TorchRL's keys, dtypes and dim names."""
    (batch,) = await collect_all("CartPole-v1", frames_per_batch=64, total_frames=64, num_workers=2, envs_per_worker=2)
    assert batch.batch_size == torch.Size([4, 16])
    assert batch.names == [None, "time"]
    keys = {k if isinstance(k, str) else tuple(k) for k in batch.keys(include_nested=True, leaves_only=True)}
    assert keys == {
        "observation", "action", "done", "terminated", "truncated",
        ("next", "observation"), ("next", "reward"), ("next", "done"), ("next", "terminated"),
        ("next", "truncated"), ("collector", "traj_ids"), ("collector", "policy_version"),
        ("collector", "env_epoch"),
    }
    assert batch["observation"].shape == (4, 16, 4) and batch["observation"].dtype == torch.float32
    assert batch["action"].shape == (4, 16) and batch["action"].dtype == torch.int64
    assert batch["next", "reward"].shape == (4, 16, 1) and batch["next", "reward"].dtype == torch.float32
    for flag in ("done", "terminated", "truncated"):
        assert batch[flag].dtype == torch.bool and batch[flag].shape == (4, 16, 1)
        assert not batch[flag].any(), "observations at t are never terminal (envs reset at once)"
    assert (batch["collector", "policy_version"] == 0).all()


async def test_observation_follows_next_observation_except_after_episode_end():
    """obs[t+1] is next_obs[t] within a trajectory; after an episode end it is a reset obs."""
    batches = await collect_all(
        counting(episode_length=5), frames_per_batch=24, total_frames=48, num_workers=2, envs_per_worker=2, seed=3
    )
    for batch in batches:
        done = batch["next", "done"][:, :-1, 0]
        same = batch["observation"][:, 1:] == batch["next", "observation"][:, :-1]
        assert same.all(-1)[~done].all()
        assert (batch["observation"][:, 1:][done] % 100 == 0).all()


async def test_episode_end_keeps_true_final_observation_and_terminated_apart_from_truncated():
    """("next", "observation") at an episode end is the true final one; the next frame starts
    from the reset observation; terminated and truncated are kept apart."""
    for truncate in (False, True):
        (batch,) = await collect_all(
            counting(episode_length=4, truncate=truncate), frames_per_batch=12, total_frames=12, num_workers=1, seed=5
        )
        obs, nxt = batch["observation"][0, :, 0], batch["next", "observation"][0, :, 0]
        done = batch["next", "done"][0, :, 0]
        assert done.tolist() == [False, False, False, True] * 3
        assert (nxt[done] == 504).all(), "the final observation (step 4), not the reset one"
        assert (obs[torch.roll(done, 1)] == 500).all(), "each episode starts from the reset observation"
        assert batch["next", "terminated"][0, :, 0].tolist() == (done & (not truncate)).tolist()
        assert batch["next", "truncated"][0, :, 0].tolist() == (done & truncate).tolist()


async def test_max_frames_per_traj_truncates():
    (batch,) = await collect_all(counting(episode_length=50), frames_per_batch=9, total_frames=9, max_frames_per_traj=3, num_workers=0, seed=1)
    assert batch["next", "truncated"][0, :, 0].tolist() == [False, False, True] * 3
    assert not batch["next", "terminated"].any()
    assert batch["next", "observation"][0, 2, 0] == 103


async def test_traj_ids_unique_across_workers_and_batches_and_kept_across_batch_boundary():
    batches = await collect_all(
        counting(episode_length=7), frames_per_batch=20, total_frames=100, num_workers=2, envs_per_worker=2, seed=0
    )
    seen: dict[int, tuple[int, int]] = {}  # traj id -> (env row, start value)
    for b, batch in enumerate(batches):
        ids = batch["collector", "traj_ids"]
        start = (batch["observation"][..., 0] // 100).to(torch.int64)
        for row in range(4):
            for t in range(5):
                tid = int(ids[row, t])
                if tid in seen:
                    assert seen[tid] == (row, int(start[row, t])), "a trajectory id is reused by another env"
                seen[tid] = (row, int(start[row, t]))
        if b:  # the episode in progress at the end of batch b-1 keeps its id in batch b
            prev = batches[b - 1]
            cont = ~prev["next", "done"][:, -1, 0]
            assert (prev["collector", "traj_ids"][:, -1][cont] == ids[:, 0][cont]).all()
    # each trajectory id is one episode: ids change exactly where episodes end
    for batch in batches:
        ids = batch["collector", "traj_ids"]
        changed = ids[:, 1:] != ids[:, :-1]
        assert torch.equal(changed, batch["next", "done"][:, :-1, 0])


# -- determinism ----------------------------------------------------------------------------------


def gym_reference(env_id: str, seed: int, actions: torch.Tensor) -> dict[str, np.ndarray]:
    """A plain gymnasium loop stepping envs seeded seed+k with the given actions [E, T]."""
    E, T = actions.shape
    out = {"obs": np.zeros((E, T, 4), np.float32), "next": np.zeros((E, T, 4), np.float32),
           "reward": np.zeros((E, T), np.float32), "term": np.zeros((E, T), bool), "trunc": np.zeros((E, T), bool)}
    for k in range(E):
        env = gym.make(env_id)
        obs, _ = env.reset(seed=seed + k)
        for t in range(T):
            out["obs"][k, t] = obs
            obs, r, term, trunc, _ = env.step(int(actions[k, t]))
            out["next"][k, t], out["reward"][k, t], out["term"][k, t], out["trunc"][k, t] = obs, r, term, trunc
            if term or trunc:
                obs, _ = env.reset()
        env.close()
    return out


@pytest.mark.parametrize("policy", ["random", "mlp"])
async def test_same_seed_same_data_whatever_the_number_of_workers(policy):
    """Local backend, 1, 2 and 4 workers: identical data, equal to a plain gymnasium loop."""
    results = []
    for num_workers, epw in [(0, 4), (1, 4), (2, 2), (4, 1)]:
        batches = await collect_all(
            "CartPole-v1", None if policy == "random" else ArgmaxMLP(), frames_per_batch=64, total_frames=256,
            num_workers=num_workers, envs_per_worker=epw, seed=11,
        )
        results.append(torch.cat(batches, dim=1))
    for other in results[1:]:
        assert (other == results[0]).all()
    data = results[0]
    ref = gym_reference("CartPole-v1", 11, data["action"])
    np.testing.assert_array_equal(data["observation"].numpy(), ref["obs"])
    np.testing.assert_array_equal(data["next", "observation"].numpy(), ref["next"])
    np.testing.assert_array_equal(data["next", "reward"][..., 0].numpy(), ref["reward"])
    np.testing.assert_array_equal(data["next", "terminated"][..., 0].numpy(), ref["term"])
    np.testing.assert_array_equal(data["next", "truncated"][..., 0].numpy(), ref["trunc"])
    assert data["next", "done"].any(), "the run should cross episode ends"
    if policy == "mlp":
        assert torch.equal(data["action"], ArgmaxMLP()(data["observation"]))
    else:
        assert len(data["action"].unique()) == 2


async def test_set_seed_returns_next_seed_and_static_seed_seeds_all_envs_alike():
    c = Collector("CartPole-v1", frames_per_batch=8, total_frames=8, num_workers=2, envs_per_worker=2)
    assert c.set_seed(100) == 104
    assert c.set_seed(100, static_seed=True) == 100
    async with c:
        batch = await c.collect()
    first = batch["observation"][:, 0]
    assert (first == first[0]).all()


async def test_state_dict_resumes_counters_and_trajectory_ids_stay_unique():
    kw = dict(frames_per_batch=16, total_frames=64, num_workers=2, envs_per_worker=2)
    async with Collector(counting(episode_length=3), seed=0, **kw) as c:
        first = [await c.collect(), await c.collect()]
        state = c.state_dict()
    assert state["frames"] == 32 and state["batches"] == 2 and state["seed"] == 0 and state["next_seed"] == 4
    resumed = Collector(counting(episode_length=3), **kw)
    resumed.load_state_dict(state)
    async with resumed:
        rest = [b async for b in resumed]
    assert len(rest) == 2 and resumed.frames == 64
    old = set(torch.cat([b["collector", "traj_ids"].flatten() for b in first]).tolist())
    new = set(torch.cat([b["collector", "traj_ids"].flatten() for b in rest]).tolist())
    assert not old & new
    assert rest[0]["observation"][:, 0, 0].tolist() == [400.0, 500.0, 600.0, 700.0], "seeded with next_seed"


# -- delivery and options -------------------------------------------------------------------------


async def test_async_delivery_gives_single_worker_batches_from_every_worker():
    # a step cost, so that neither worker can deliver every batch before the other's first one
    batches = await collect_all(
        counting(episode_length=90, step_sleep=0.002), frames_per_batch=16, total_frames=320, num_workers=2,
        envs_per_worker=2, delivery="async", seed=0,
    )
    assert all(b.batch_size == torch.Size([2, 8]) for b in batches)
    starts = {tuple((b["observation"][:, 0, 0] // 100).tolist()) for b in batches}
    assert starts == {(0.0, 1.0), (2.0, 3.0)}


async def test_batches_are_copies_that_stay_valid():
    async with Collector(counting(episode_length=90), frames_per_batch=8, num_workers=1, envs_per_worker=2, seed=0) as c:
        first = await c.collect()
        kept = first.clone()
        first["observation"].add_(1000)
        second, third = await c.collect(), await c.collect()
    assert (first["observation"] - 1000 == kept["observation"]).all()
    assert second["observation"][0, 0, 0] == 4 and third["observation"][0, 0, 0] == 8


async def test_split_trajs_pads_trajectories_with_a_mask():
    (batch,) = await collect_all(counting(episode_length=3), frames_per_batch=16, total_frames=16, num_workers=2, envs_per_worker=2, split_trajs=True, seed=0)
    mask = batch["collector", "mask"]
    assert batch.batch_size[1] == 3 and mask.sum() == 16
    ids = batch["collector", "traj_ids"]
    for row in range(batch.batch_size[0]):
        assert len(ids[row][mask[row]].unique()) == 1


async def test_init_random_frames_uses_random_actions_first():
    batches = await collect_all("CartPole-v1", AlwaysOne(), frames_per_batch=64, total_frames=192, num_workers=2, envs_per_worker=2, init_random_frames=64, seed=0)
    assert (batches[0]["action"] == 0).any()
    assert (batches[1]["action"] == 1).all() and (batches[2]["action"] == 1).all()


async def test_reset_at_each_iter_starts_every_batch_with_new_episodes():
    batches = await collect_all(counting(episode_length=50), frames_per_batch=10, total_frames=30, num_workers=1, envs_per_worker=2, reset_at_each_iter=True, seed=0)
    ids = [set(b["collector", "traj_ids"][:, 0].tolist()) for b in batches]
    assert all((b["observation"][:, 0, 0] % 100 == 0).all() for b in batches)
    assert not ids[0] & ids[1] and not ids[1] & ids[2]


# -- spaces ---------------------------------------------------------------------------------------

OBS_SPACE = spaces.Dict({
    "pos": spaces.Box(-1, 1, (2,), np.float64),
    "cell": spaces.Discrete(3),
    "sub": spaces.Dict({"bits": spaces.MultiBinary(3), "counts": spaces.MultiDiscrete([2, 5])}),
    "pair": spaces.Tuple((spaces.Box(0, 1, (1,), np.float32), spaces.Discrete(2))),
})

ACTION_SPACES = {
    "box": (spaces.Box(-1, 1, (2,), np.float32), {("action",): ((2,), torch.float32)}),
    "discrete": (spaces.Discrete(3), {("action",): ((), torch.int64)}),
    "multidiscrete": (spaces.MultiDiscrete([2, 3]), {("action",): ((2,), torch.int64)}),
    "multibinary": (spaces.MultiBinary(4), {("action",): ((4,), torch.int8)}),
    "dict": (spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Box(0, 1, (1,), np.float32)}),
             {("action", "a"): ((), torch.int64), ("action", "b"): ((1,), torch.float32)}),
    "tuple": (spaces.Tuple((spaces.Discrete(2), spaces.MultiBinary(2))),
              {("action", "0"): ((), torch.int64), ("action", "1"): ((2,), torch.int8)}),
}


@pytest.mark.parametrize("action", list(ACTION_SPACES))
async def test_spaces_map_to_the_batch_layout(action):
    """Nested Dict/Tuple observations and every action space; the env checks each action it
    gets with action_space.contains, so a wrong conversion fails the run."""
    act_space, expected = ACTION_SPACES[action]
    (batch,) = await collect_all(
        lambda: SpacesEnv(OBS_SPACE, act_space), frames_per_batch=8, total_frames=8,
        num_workers=1 if action in ("dict", "box") else 0, envs_per_worker=2, seed=0,
    )
    obs_expected = {
        ("pos",): ((2,), torch.float64), ("cell",): ((), torch.int64),
        ("sub", "bits"): ((3,), torch.int8), ("sub", "counts"): ((2,), torch.int64),
        ("pair", "0"): ((1,), torch.float32), ("pair", "1"): ((), torch.int64),
    }
    for key, (shape, dtype) in {**obs_expected, **{("next",) + k: v for k, v in obs_expected.items()}, **expected}.items():
        value = batch.get(key)
        assert value.shape == (2, 4) + shape and value.dtype == dtype, key
    for key in expected:
        flat = batch.get(key).reshape(8, -1).numpy()
        sub = act_space if len(key) == 1 else act_space[key[1] if isinstance(act_space, spaces.Dict) else int(key[1])]
        assert all(sub.contains(v.reshape(sub.shape).astype(sub.dtype)) for v in flat)


async def test_top_level_tuple_observation_goes_under_observation():
    space = spaces.Tuple((spaces.Discrete(4), spaces.Box(0, 1, (3,), np.float32)))
    (batch,) = await collect_all(lambda: SpacesEnv(space, spaces.Discrete(2)), frames_per_batch=4, total_frames=4, num_workers=0)
    assert batch["observation", "0"].shape == (1, 4) and batch["observation", "1"].shape == (1, 4, 3)


# -- policies -------------------------------------------------------------------------------------


def _logits_actor(seed: int = 0) -> TensorDictSequential:
    torch.manual_seed(seed)
    net = TensorDictModule(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)), in_keys=["observation"], out_keys=["logits"])
    pick = TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"])
    return TensorDictSequential(net, pick)


@pytest.mark.parametrize("num_workers", [0, 1])
async def test_tensordict_policy_extra_outputs_land_in_the_batch(num_workers):
    policy = _logits_actor()
    (batch,) = await collect_all("CartPole-v1", policy, frames_per_batch=16, total_frames=16, num_workers=num_workers, envs_per_worker=2, seed=0)
    assert batch["logits"].shape == (2, 8, 2)
    assert torch.equal(batch["action"], batch["logits"].argmax(-1))
    with torch.no_grad():
        assert torch.allclose(policy(batch.select("observation").clone())["logits"], batch["logits"])


def _probabilistic_actor():
    from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential

    torch.manual_seed(0)
    net = TensorDictModule(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
    dist = ProbabilisticTensorDictModule(
        in_keys=["logits"], out_keys=["action"], distribution_class=torch.distributions.Categorical,
        return_log_prob=True, log_prob_key="sample_log_prob",
    )
    return ProbabilisticTensorDictSequential(net, dist)


@pytest.mark.parametrize("exploration_type", ["deterministic", "random"])
async def test_exploration_type_sets_the_interaction_type(exploration_type):
    (batch,) = await collect_all(
        "CartPole-v1", _probabilistic_actor(), frames_per_batch=128, total_frames=128, num_workers=1,
        envs_per_worker=4, exploration_type=exploration_type, seed=0,
    )
    greedy = batch["logits"].argmax(-1)
    if exploration_type == "deterministic":
        assert torch.equal(batch["action"], greedy)
    else:
        assert not torch.equal(batch["action"], greedy)
        logp = torch.distributions.Categorical(logits=batch["logits"]).log_prob(batch["action"])
        assert torch.allclose(batch["sample_log_prob"], logp)


async def test_simple_tensordict_module_and_policy_factory():
    net = ArgmaxMLP()
    module = TensorDictModule(net, in_keys=["observation"], out_keys=["action"])
    for kwargs in ({"policy": module}, {"policy_factory": lambda: ArgmaxMLP()}):
        (batch,) = await collect_all("CartPole-v1", frames_per_batch=32, total_frames=32, num_workers=1, envs_per_worker=2, seed=0, **kwargs)
        assert torch.equal(batch["action"], net(batch["observation"]))


async def test_plain_callable_on_tensordicts_is_a_policy():
    def policy(td):
        td["action"] = (td["observation"][:, 2] > 0).long()
        return td

    (batch,) = await collect_all("CartPole-v1", policy, frames_per_batch=32, total_frames=32, num_workers=1, envs_per_worker=2, seed=0)
    assert torch.equal(batch["action"], (batch["observation"][..., 2] > 0).long())


def test_public_names():
    assert set(aiocollect.__all__) == {
        "AiocollectError", "BrokenWorkerError", "Collector", "CollectorClosedError", "CollectorConfig",
        "ConfigError", "EndOfCollection", "SpecError", "State", "CollectorState", "WorkerError", "WorkerTimeoutError", "__version__",
        "shutdown_launcher", "split_trajectories", "CollectorStats", "Subscription",
        "SubscriptionOverflowError", "events", "testing", "ProfileConfig", "ReplayBuffer", "Sampler",
        "UniformSampler", "StalenessAwareSampler", "SliceSampler", "SamplingError", "Evaluator",
        "EvaluatorConfig", "EvaluatorState", "EvaluatorBusyError", "EvaluatorClosedError",
        *aiocollect.events.__all__,  # the event types, also at the top (`from aiocollect import EpisodeEnded`)
    }
    for name in aiocollect.events.__all__:  # the same classes, documented under aiocollect.events
        assert getattr(aiocollect, name) is getattr(aiocollect.events, name), name
    for name in aiocollect.__all__:
        obj = getattr(aiocollect, name)
        if isinstance(obj, types.ModuleType):
            assert obj.__name__ == f"aiocollect.{name}", name
        elif name == "__version__":
            assert isinstance(obj, str) and obj, name
        else:  # defined in the package, under its own name (State: CollectorState's other name)
            assert obj.__module__.startswith("aiocollect"), name
            assert obj.__name__ == ("CollectorState" if name == "State" else name), name
    assert aiocollect.State is aiocollect.CollectorState, "State: the name CollectorState had first"
