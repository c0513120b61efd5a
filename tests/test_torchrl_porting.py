"""What a TorchRL user porting a script writes, as they would write it: ``batch.device`` (TorchRL's
collectors give ``device(type='cpu')``), ``batch.to(batch.device)``, ``data.device.type``, and a
buffer that takes its device from the first batch, in every way a batch is made (lent, copied,
``zero_copy``, ``split_trajs``, ``trajs_per_batch``, server inference, in-process); TorchRL's ``-1``
for "no limit", ``iterator()``, ``shutdown()``, ``update_policy_weights_(TensorDict.from_module(p))``;
TorchRL arguments and envs we do not take, refused with the fix. The TorchRL parts (its PPO
tutorial's loop with GAE and ClipPPOLoss, its ``GymEnv``, its collectors' signatures) run in
``.venv-torchrl`` and are skipped where TorchRL is absent."""

from __future__ import annotations

import pytest
import torch

from aiocollect import Collector, CollectorState, ConfigError, ReplayBuffer
from aiocollect.testing import CountingEnv

CPU = torch.device("cpu")


class Pole(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sign = torch.nn.Parameter(torch.ones(()))  # (weights to publish)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return (obs[..., 2] * self.sign > 0).long()


def check_on_cpu(batch) -> None:
    """Every sub-TensorDict says it is on the CPU, as TorchRL's batches do."""
    assert batch.device == CPU, f"batch.device is {batch.device!r}"
    for key in ("next", "collector"):
        assert batch[key].device == CPU, f"batch[{key!r}].device is {batch[key].device!r}"
    assert batch.device.type == "cpu"
    assert batch.to(batch.device) is not None


@pytest.mark.parametrize(
    "options",
    [
        dict(num_workers=0),
        dict(num_workers=2),
        dict(num_workers=2, zero_copy=True),
        dict(num_workers=2, delivery="async"),
        dict(num_workers=2, split_trajs=True),
        dict(num_workers=1, trajs_per_batch=3),
        dict(num_workers=2, inference="server"),
        dict(num_workers=2, storing_device="cpu"),
    ],
    ids=["local", "lent", "zero_copy", "async", "split_trajs", "trajs_per_batch", "server", "storing_cpu"],
)
async def test_cpu_batches_carry_device_cpu_as_torchrls_do(options):
    async with Collector(lambda: CountingEnv(episode_length=7), Pole(), frames_per_batch=32, total_frames=32 * 3,
                         envs_per_worker=2, seed=0, **options) as collector:
        batches = 0
        async for batch in collector:
            check_on_cpu(batch)
            batches += 1
    assert batches >= 1


async def test_a_buffer_fed_by_the_collector_samples_on_the_cpu():
    """The sink's storage takes its device from the first batch: cpu, as TorchRL's would be."""
    rb = ReplayBuffer(1000, batch_size=16)
    async with Collector(lambda: CountingEnv(episode_length=7), Pole(), frames_per_batch=32, total_frames=32 * 2,
                         num_workers=1, envs_per_worker=2, seed=0) as collector:
        async for batch in collector:
            rb.extend(batch)
    assert rb.device == CPU and rb.sample().device == CPU


# -- TorchRL's spellings of the defaults -----------------------------------------------------------


async def test_torchrls_minus_one_means_no_limit_and_no_random_frames():
    """TorchRL's scripts pass max_frames_per_traj=-1 and init_random_frames=-1 (its 'none')."""
    async with Collector(lambda: CountingEnv(episode_length=50), Pole(), frames_per_batch=40, total_frames=80,
                         num_workers=1, envs_per_worker=2, max_frames_per_traj=-1, init_random_frames=-1,
                         seed=0) as collector:
        assert collector.config.max_frames_per_traj is None and collector.config.init_random_frames is None
        batch = await collector.collect()
    assert "step_count" not in batch.keys()  # no StepCounter, as TorchRL with -1
    assert not batch["next", "truncated"].any()  # episodes of 50 frames, never cut


@pytest.mark.parametrize("name, value", [("max_frames_per_traj", 0), ("max_frames_per_traj", -2),
                                         ("init_random_frames", -3)])
def test_other_non_positive_limits_are_refused_with_the_way_to_say_none(name, value):
    with pytest.raises(ConfigError, match=rf"{name}={value}.*{name}=None \(or TorchRL's -1\)"):
        Collector("CartPole-v1", frames_per_batch=8, num_workers=0, **{name: value})


@pytest.mark.parametrize("name, value, fix", [
    ("reset_when_done", True, "always reset"),
    ("use_buffers", True, "preallocated"),
    ("trust_policy", True, "probed once"),
    ("num_threads", 4, "drop it"),
    ("replay_buffer", object(), r"start\(replay_buffer=rb\)"),
    ("set_truncated", True, "not marked truncated"),
    ("post_collect_hook", print, r"on\(AfterRollout"),
])
def test_torchrls_arguments_without_an_option_name_the_fix(name, value, fix):
    with pytest.raises(TypeError, match=rf"{name}=.*{fix}"):
        Collector("CartPole-v1", frames_per_batch=8, num_workers=0, **{name: value})


def test_a_blocking_script_with_iterator_and_shutdown():
    """TorchRL's loop: ``for data in collector.iterator()``, ``break``, ``collector.shutdown()``
    (twice is fine), with TorchRL's arguments spelt out."""
    collector = Collector(create_env_fn=lambda: CountingEnv(episode_length=100), policy=Pole(), frames_per_batch=16,
                          total_frames=-1, num_workers=1, envs_per_worker=2, device="cpu", storing_device="cpu",
                          env_device="cpu", policy_device="cpu", max_frames_per_traj=-1, init_random_frames=-1,
                          reset_at_each_iter=False, split_trajs=False, exploration_type="random")
    seen = []
    for i, data in enumerate(collector.iterator()):
        check_on_cpu(data)
        seen.append(data["collector", "traj_ids"].clone())
        collector.update_policy_weights_()
        if i == 2:
            break
    collector.shutdown()
    collector.shutdown(timeout=1.0)
    assert collector.state is CollectorState.CLOSED and len(seen) == 3
    # episodes of 100 frames, batches of 8 frames per env: each env keeps one trajectory id
    assert all(torch.equal(ids[:, :1].expand_as(ids), ids) for ids in seen)
    assert torch.equal(seen[0][:, 0], seen[2][:, 0])


async def test_shutdown_is_awaitable_in_async_code():
    collector = Collector(lambda: CountingEnv(episode_length=5), Pole(), frames_per_batch=8, total_frames=-1,
                          num_workers=1, envs_per_worker=2)
    await collector.start()
    await collector.collect()
    await collector.shutdown()
    await collector.shutdown()
    assert collector.state is CollectorState.CLOSED


# -- a TorchRL env as create_env_fn --------------------------------------------------------------


class FakeGymEnv:
    """Stands for TorchRL's ``GymEnv`` (its module and its ``env_name``), without TorchRL."""

    env_name = "CartPole-v1"


FakeGymEnv.__module__ = "torchrl.envs.libs.gym"
FakeGymEnv.__name__ = FakeGymEnv.__qualname__ = "GymEnv"


def test_a_torchrl_env_is_refused_with_the_gymnasium_way_to_say_it():
    from aiocollect._worker.envs import make_env

    with pytest.raises(TypeError, match=r"TorchRL's GymEnv.*create_env_fn='CartPole-v1'.*max_frames_per_traj"):
        make_env(FakeGymEnv, {})


def test_torchrls_own_gym_env_is_refused_by_a_running_collector():
    envs = pytest.importorskip("torchrl.envs")
    factory = lambda: envs.TransformedEnv(envs.GymEnv("CartPole-v1"), envs.StepCounter())  # noqa: E731
    with pytest.raises(TypeError, match=r"TorchRL's TransformedEnv.*create_env_fn='CartPole-v1'"):
        with Collector(factory, frames_per_batch=8, total_frames=16, num_workers=1) as collector:
            next(iter(collector))


# -- TorchRL's PPO tutorial loop, on aiocollect's batches ------------------------------------------


@pytest.mark.timeout(120)
def test_torchrls_ppo_tutorial_loop_runs_on_the_batches():
    """The loop of TorchRL's PPO tutorial as written there: a buffer whose storage is on
    ``tensordict_data.device``, GAE and ClipPPOLoss, ``update_policy_weights_()``, then ``break``
    (episodes longer than a batch) and ``shutdown()``."""
    pytest.importorskip("torchrl")
    from tensordict.nn import TensorDictModule
    from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
    from torchrl.envs.utils import ExplorationType
    from torchrl.modules import ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    policy_module = ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]), in_keys=["logits"],
        distribution_class=torch.distributions.Categorical, return_log_prob=True,
    )
    value_module = ValueOperator(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
                                 in_keys=["observation"])
    frames_per_batch = 32  # 16 frames per env: CartPole's episodes run across batches
    collector = Collector(create_env_fn="CartPole-v1", policy=policy_module, frames_per_batch=frames_per_batch,
                          total_frames=-1, split_trajs=False, device="cpu", max_frames_per_traj=-1,
                          exploration_type=ExplorationType.RANDOM, num_workers=1, envs_per_worker=2, prefetch=0,
                          seed=0)
    advantage_module = GAE(gamma=0.99, lmbda=0.95, value_network=value_module, average_gae=True)
    loss_module = ClipPPOLoss(actor_network=policy_module, critic_network=value_module, clip_epsilon=0.2)
    optim = torch.optim.Adam(loss_module.parameters(), 3e-4)
    versions = []
    for i, tensordict_data in enumerate(collector):
        replay_buffer = ReplayBuffer(storage=LazyTensorStorage(max_size=frames_per_batch,
                                                               device=tensordict_data.device),
                                     sampler=SamplerWithoutReplacement())
        advantage_module(tensordict_data)
        replay_buffer.extend(tensordict_data.reshape(-1).cpu())
        subdata = replay_buffer.sample(frames_per_batch // 2)
        loss_vals = loss_module(subdata.to(tensordict_data.device))
        (loss_vals["loss_objective"] + loss_vals["loss_critic"] + loss_vals["loss_entropy"]).backward()
        optim.step()
        optim.zero_grad()
        collector.update_policy_weights_()
        versions.append(tensordict_data["collector", "policy_version"].unique().tolist())
        if i == 3:
            break
    collector.shutdown()
    assert versions == [[0], [1], [2], [3]]  # prefetch=0: each batch with the weights published before it


def test_every_torchrl_collector_argument_is_taken_or_answered_with_the_fix():
    """Each argument of TorchRL 0.14.1's collectors is one of ours, or its error says what to write."""
    pytest.importorskip("torchrl")
    import inspect
    import warnings

    from aiocollect._collector.collector import OTHER_NAMES

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torchrl.collectors as tc
    ours = set(inspect.signature(Collector.__init__).parameters)
    theirs = set()
    for name in ("Collector", "MultiSyncCollector", "MultiAsyncCollector", "AsyncCollector", "AsyncBatchedCollector"):
        params = inspect.signature(getattr(tc, name).__init__).parameters.values()
        theirs |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"}
    assert not sorted(theirs - ours - set(OTHER_NAMES))


def test_torchrls_methods_we_lack_say_what_to_use_instead():
    """A ported script's ``collector.next()`` or ``collector.is_running()``: an AttributeError (so
    ``hasattr`` and ``getattr(c, name, default)`` still work) whose message is the answer."""
    from aiocollect._collector.torchrl_names import TORCHRL_ATTRIBUTES

    with Collector(lambda: CountingEnv(episode_length=7), frames_per_batch=8, total_frames=16) as collector:
        with pytest.raises(AttributeError, match=r"'next'.*use await collector\.collect\(\)"):
            collector.next()
        with pytest.raises(AttributeError, match=r"CollectorState\.RUNNING"):
            collector.is_running()
        for name, answer in TORCHRL_ATTRIBUTES.items():
            assert name not in dir(Collector), f"{name} is an attribute of Collector: drop it from the table"
            with pytest.raises(AttributeError) as info:
                getattr(collector, name)
            assert answer in str(info.value) and info.value.name == name
            assert not hasattr(collector, name) and getattr(collector, name, "default") == "default"
        with pytest.raises(AttributeError) as info:
            collector.no_such_thing
        assert "TorchRL" not in str(info.value)
        assert sum(batch.numel() for batch in collector) == 16  # the collector still works


def test_every_torchrl_collector_method_is_ours_or_answered():
    """Each public method and attribute of TorchRL 0.14.1's collectors is one of ours, or getting
    it says what to use instead."""
    pytest.importorskip("torchrl")
    import warnings

    from aiocollect._collector.torchrl_names import TORCHRL_ATTRIBUTES

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torchrl.collectors as tc
    theirs = set()
    for name in ("Collector", "MultiSyncCollector", "MultiAsyncCollector", "AsyncCollector", "AsyncBatchedCollector"):
        theirs |= {attr for attr in dir(getattr(tc, name)) if not attr.startswith("_")}
    theirs -= set(dir(torch.utils.data.IterableDataset))  # (the base class of both)
    assert not sorted(theirs - set(dir(Collector)) - set(TORCHRL_ATTRIBUTES))


def test_update_policy_weights_takes_the_tensordict_of_from_module():
    """TorchRL's way to publish: ``update_policy_weights_(TensorDict.from_module(policy))`` (also as
    ``policy_weights=``); the next batch is collected with them."""
    from tensordict import TensorDict

    policy = Pole()
    with Collector(lambda: CountingEnv(episode_length=7), policy, frames_per_batch=16, total_frames=-1,
                   num_workers=1, envs_per_worker=2, prefetch=0) as collector:
        for i, data in enumerate(collector):
            sign = 1.0 if i % 2 == 0 else -1.0
            expected = (data["observation"][..., 2] * sign > 0).long()
            assert torch.equal(data["action"], expected), f"batch {i} was not collected with gain {sign}"
            with torch.no_grad():
                policy.sign.fill_(-sign)
            weights = TensorDict.from_module(policy)
            version = (collector.update_policy_weights_(weights) if i % 2 == 0
                       else collector.update_policy_weights_(policy_weights=weights.data))
            assert version == i + 1
            if i == 3:
                break


def test_one_factory_per_worker_without_num_workers_says_how_many_workers():
    """TorchRL's ``MultiSyncCollector([make_env] * 4, ...)`` takes its workers from the list."""
    with pytest.raises(ConfigError, match=r"one per worker, as TorchRL's multi collectors: pass num_workers=4"):
        Collector([lambda: CountingEnv()] * 4, frames_per_batch=64)
