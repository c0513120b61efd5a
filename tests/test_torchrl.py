"""aiocollect beside TorchRL: our batches go straight into TorchRL's replay buffers, value
estimators and losses, and our StalenessAwareSampler gates frames as TorchRL's does.

Runs only where TorchRL is installed (it is not in the main venv: TorchRL 0.14 wants
tensordict<0.15); ``bash scripts/torchrl-compat.sh`` builds ``.venv-torchrl`` (TorchRL 0.14.1,
tensordict 0.14) and runs this module there. Importing torchrl, torchrl.data and
torchrl.objectives emits no warning with torch 2.13, so no warning filter is needed here. (TorchRL
0.14.1's C++ extension does not load with torch 2.13, an undefined symbol: it goes unreported at
import, and only its prioritized samplers, which this module does not use, fail when built.
``import torchrl.collectors``, also unused here, emits DeprecationWarnings.)

The policies are built from torch and tensordict classes only: workers unpickle them without
importing this module (and so without importing torchrl).
"""

from __future__ import annotations

import anyio
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import (
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
)

torchrl = pytest.importorskip("torchrl")

from torchrl.data import LazyTensorStorage, SliceSampler, TensorDictReplayBuffer  # noqa: E402
from torchrl.data import ReplayBuffer as TorchRLReplayBuffer  # noqa: E402
from torchrl.objectives import ClipPPOLoss  # noqa: E402
from torchrl.objectives.value import GAE  # noqa: E402
from torchrl.objectives.value.functional import vec_generalized_advantage_estimate  # noqa: E402

from aiocollect import Collector, ReplayBuffer, SamplingError, StalenessAwareSampler  # noqa: E402

try:  # TorchRL >= 0.14
    from torchrl.data.replay_buffers.samplers import StalenessAwareSampler as TorchRLStalenessAwareSampler
except ImportError:  # pragma: no cover
    TorchRLStalenessAwareSampler = None

VERSION = ("collector", "policy_version")
TRAJ = ("collector", "traj_ids")


def actor(seed: int = 0) -> ProbabilisticTensorDictSequential:
    """A small MLP acting through a Categorical: action, logits and its log-prob, as in PPO."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return ProbabilisticTensorDictSequential(
        TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]),
        ProbabilisticTensorDictModule(
            in_keys=["logits"], out_keys=["action"], distribution_class=torch.distributions.Categorical,
            return_log_prob=True,
        ),
    )


def critic(seed: int = 1) -> TensorDictModule:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return TensorDictModule(net, in_keys=["observation"], out_keys=["state_value"])


def check_frame_entries(td: TensorDict, frame_dims: tuple[int, ...]) -> None:
    """Our keys, with the shapes and dtypes of the batch layout, for ``frame_dims`` leading dims."""
    assert td["observation"].shape == (*frame_dims, 4) and td["observation"].dtype == torch.float32
    assert td["next", "observation"].shape == (*frame_dims, 4)
    assert td["action"].shape == frame_dims and td["action"].dtype == torch.int64
    assert td["next", "reward"].shape == (*frame_dims, 1) and td["next", "reward"].dtype == torch.float32
    for key in ("done", "terminated", "truncated"):
        assert td["next", key].shape == (*frame_dims, 1) and td["next", key].dtype == torch.bool
    for key in (VERSION, TRAJ):
        assert td[key].shape == frame_dims and td[key].dtype == torch.int64


# -- a TorchRL replay buffer as the background sink ----------------------------------------------


def _trajectory_slices_buffer():
    # ndim=2: extended along our "time" dim (stored time-major), len() counts frames
    return TensorDictReplayBuffer(
        storage=LazyTensorStorage(40_000, ndim=2),
        sampler=SliceSampler(slice_len=8, traj_key=TRAJ, strict_length=True),
    )


@pytest.mark.parametrize(
    "make_buffer, per_write",
    [
        # the default storage (ndim=1): each env's row of T frames is one element
        pytest.param(lambda: TorchRLReplayBuffer(storage=LazyTensorStorage(2_000)), "rows", id="ReplayBuffer"),
        pytest.param(_trajectory_slices_buffer, "frames", id="TensorDictReplayBuffer-ndim2-SliceSampler"),
    ],
)
async def test_torchrl_replay_buffer_is_a_background_sink(make_buffer, per_write):
    rb = make_buffer()
    E, T = 4, 32
    c = Collector(
        "CartPole-v1", actor(), frames_per_batch=E * T, total_frames=E * T * 200, num_workers=2,
        envs_per_worker=2, seed=0, exploration_type="random",
    )
    try:
        with anyio.fail_after(30):
            async with c.pause():  # paused from the start: the workers fill their slots, no write
                await c.start(replay_buffer=rb)
                await anyio.sleep(0.3)
                assert len(rb) == 0 and rb.write_count == 0
            while rb.write_count < 3 * (E if per_write == "rows" else T):
                await anyio.sleep(0.002)
            async with c.pause():  # and in the middle of the collection
                held = (len(rb), rb.write_count)
                await anyio.sleep(0.3)
                assert (len(rb), rb.write_count) == held, "a batch was written during the pause"
            while rb.write_count == held[1] and c.state.value == "running":
                await anyio.sleep(0.002)
            assert rb.write_count > held[1]
    finally:
        await c.aclose()
    # every delivered frame is in the buffer (the capacity holds them all)
    assert c.frames > 0 and len(rb) == (c.frames // T if per_write == "rows" else c.frames)

    if per_write == "rows":
        sample = rb.sample(8)
        check_frame_entries(sample, (8, T))
        return
    sample = rb.sample(32)
    assert sample.batch_size == (32,)
    check_frame_entries(sample, (32,))
    # TorchRL's SliceSampler cut 4 slices of 8 consecutive frames of one trajectory each, using
    # our traj_ids: our time dim was stored as time, each env's frames in order
    s = sample.reshape(4, 8)
    traj = s[TRAJ]
    assert (traj == traj[:, :1]).all()
    assert torch.equal(s["observation"][:, 1:], s["next", "observation"][:, :-1])
    assert not s["next", "done"][:, :-1].any()
    assert (s["index"][:, 1:, 0] - s["index"][:, :-1, 0] == 1).all()  # consecutive time rows
    assert (s["index"][..., 1] == s["index"][:, :1, 1]).all()  # of one env column


# -- batches straight into TorchRL's value estimators and losses --------------------------------


def reference_gae(batch: TensorDict, value: TensorDictModule, gamma: float, lmbda: float):
    """GAE by hand along the last batch dim (time): bootstrap unless terminated, cut the trace
    at done."""
    with torch.no_grad():
        v = value.module(batch["observation"]).double()
        nv = value.module(batch["next", "observation"]).double()
    r = batch["next", "reward"].double()
    not_term = (~batch["next", "terminated"]).double()
    not_done = (~batch["next", "done"]).double()
    adv = torch.zeros_like(v)
    last = torch.zeros_like(v[:, 0])
    for t in reversed(range(batch.shape[-1])):
        delta = r[:, t] + gamma * not_term[:, t] * nv[:, t] - v[:, t]
        last = delta + gamma * lmbda * not_done[:, t] * last
        adv[:, t] = last
    return adv, adv + v


async def test_a_batch_goes_straight_into_gae_and_ppo_loss():
    policy, value = actor(), critic()
    gamma, lmbda = 0.99, 0.95
    E, T = 4, 64
    async with Collector(
        "CartPole-v1", policy, frames_per_batch=E * T, total_frames=E * T * 2, num_workers=2,
        envs_per_worker=2, seed=0, exploration_type="random", max_frames_per_traj=20,
    ) as c:
        batches = [batch async for batch in c]
    assert len(batches) == 2
    for batch in batches:
        assert batch.batch_size == (E, T) and batch.names[-1] == "time"
        check_frame_entries(batch, (E, T))
        # episodes end inside the batch, by termination and by truncation (max_frames_per_traj):
        # the estimators must cut the trace at both, and bootstrap at truncations only
        assert batch["next", "terminated"].any() and batch["next", "truncated"].any()
        expected_adv, expected_target = reference_gae(batch, value, gamma, lmbda)

        # the TorchRL module: finds the time dim by its name, calls the value network itself
        out = GAE(gamma=gamma, lmbda=lmbda, value_network=value)(batch.clone())
        assert out["advantage"].shape == (E, T, 1) and out["value_target"].shape == (E, T, 1)
        torch.testing.assert_close(out["advantage"].double(), expected_adv, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out["value_target"].double(), expected_target, atol=1e-4, rtol=1e-4)

        # the functional form, on our tensors as they are ([E, T, 1], time at dim -2)
        with torch.no_grad():
            adv, target = vec_generalized_advantage_estimate(
                gamma, lmbda, value(batch.clone())["state_value"],
                value.module(batch["next", "observation"]), batch["next", "reward"],
                batch["next", "done"], batch["next", "terminated"],
            )
        torch.testing.assert_close(adv.double(), expected_adv, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(target.double(), expected_target, atol=1e-4, rtol=1e-4)

        # and PPO's loss: our action, logits and log-prob entries are the ones it reads
        loss_module = ClipPPOLoss(policy, value)
        assert loss_module.tensor_keys.sample_log_prob in batch.keys()
        losses = loss_module(out)
        total = losses["loss_objective"] + losses["loss_critic"] + losses["loss_entropy"]
        assert torch.isfinite(total)
        total.backward()
        assert all(p.grad is not None for p in policy.parameters())


# -- our StalenessAwareSampler against TorchRL's ---------------------------------------------------


@pytest.mark.skipif(TorchRLStalenessAwareSampler is None, reason="this TorchRL has no StalenessAwareSampler")
async def test_staleness_gate_and_weights_match_torchrl():
    policy = actor()
    ours = ReplayBuffer(10_000, StalenessAwareSampler(), generator=torch.Generator().manual_seed(0))
    theirs = TensorDictReplayBuffer(
        storage=LazyTensorStorage(10_000), sampler=TorchRLStalenessAwareSampler(version_key=VERSION)
    )
    async with Collector(
        "CartPole-v1", policy, frames_per_batch=64, num_workers=2, envs_per_worker=2, seed=0
    ) as c:
        for _ in range(6):
            batch = await c.collect()
            ours.extend(batch)
            theirs.extend(batch.reshape(-1))  # both store an [E, T] batch env by env
            await c.update_weights(policy)
    # (flat frames for TorchRL: its StalenessAwareSampler returns flat indices, which an ndim=2
    # storage rejects with an IndexError in 0.14.1; as a start(replay_buffer=...) sink it needs
    # postproc=lambda b: b.reshape(-1))
    versions = ours.storage[VERSION][: len(ours)]
    assert torch.equal(theirs[:][VERSION], versions), "the two buffers hold the frames in the same order"
    top = int(versions.max())
    assert len(versions.unique()) >= 3, f"too few policy versions to test a gate: {versions.unique()}"

    torch.manual_seed(0)  # TorchRL's sampler draws from the global generator
    draws = 20_000
    for consumer_version, max_staleness in [(top, -1), (top, 0), (top, 1), (top + 1, 2), (top + 2, 3)]:
        for buffer in (ours, theirs):
            buffer.sampler.consumer_version = consumer_version
            buffer.sampler.max_staleness = max_staleness
        staleness = consumer_version - versions
        eligible = set(range(len(versions))) if max_staleness < 0 else set(
            (staleness <= max_staleness).nonzero().squeeze(1).tolist()
        )
        assert eligible

        # the gate: the same frames, and only them, with the same staleness entries
        ours_sample = ours.sample(draws)
        theirs_sample = theirs.sample(draws)  # more than there are frames: with replacement
        assert set(ours_sample["index"].tolist()) == eligible
        assert set(theirs_sample["index"].tolist()) == eligible
        assert torch.equal(ours_sample["staleness"], staleness[ours_sample["index"]])
        assert torch.equal(theirs_sample["staleness"], staleness[theirs_sample["index"]].float())
        # exactly as many draws as eligible frames: TorchRL draws without replacement, every one
        exact = theirs.sample(len(eligible))["index"].tolist()
        assert sorted(exact) == sorted(eligible)

        # the weights: both default to 1 / (staleness + 1); draw frequencies per staleness level
        levels = staleness[sorted(eligible)]
        mass = {s: (levels == s).sum().item() / (s + 1) for s in levels.unique().tolist()}
        total = sum(mass.values())
        for sample in (ours_sample, theirs_sample):
            drawn = sample["staleness"].long()
            for s, m in mass.items():
                assert abs((drawn == s).float().mean().item() - m / total) < 0.02, (consumer_version, max_staleness, s)
        # ours also says how far from uniform each draw was: n_eligible * w / sum(w)
        w = 1.0 / (ours_sample["staleness"].double() + 1)
        torch.testing.assert_close(ours_sample["weight"].double(), len(eligible) * w / total, rtol=1e-5, atol=1e-6)

    # a gate that nothing passes: both refuse (ours with SamplingError, a RuntimeError)
    for buffer in (ours, theirs):
        buffer.sampler.consumer_version = top + 10
        buffer.sampler.max_staleness = 2
    with pytest.raises(SamplingError, match="max_staleness=2"):
        ours.sample(8)
    with pytest.raises(RuntimeError, match="max_staleness=2"):
        theirs.sample(8)


# -- step_count and one-hot actions against TorchRL's own collector ------------------------------


@pytest.mark.timeout(120)
async def test_step_count_and_one_hot_actions_match_torchrls_collector():
    """The same env (a single CartPole-v1), the same one-hot policy, ``max_frames_per_traj``: the
    keys, shapes, dtypes and step counts TorchRL's Collector stores, with our batch's env row
    (``[1, F]`` here, ``[F]`` there). The policy balances the pole, so every episode is cut by
    ``max_frames_per_traj`` in both, whatever the start states."""
    import warnings

    with warnings.catch_warnings():  # (``import torchrl.collectors`` emits DeprecationWarnings)
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchrl.collectors import Collector as TorchRLCollector
        from torchrl.envs import GymEnv

    def one_hot(obs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((obs[..., 2] > 0).long(), 2)

    policy = TensorDictModule(one_hot, in_keys=["observation"], out_keys=["action"])
    with warnings.catch_warnings():  # (and TorchRL's FutureWarning about transforms this policy does not need)
        warnings.simplefilter("ignore")
        theirs_collector = TorchRLCollector(lambda: GymEnv("CartPole-v1"), policy, frames_per_batch=40, total_frames=40,
                                            max_frames_per_traj=15)
        theirs_collector.set_seed(0)
        theirs = next(iter(theirs_collector))
        theirs_collector.shutdown()
    async with Collector("CartPole-v1", policy, frames_per_batch=40, total_frames=40, num_workers=0,
                         max_frames_per_traj=15, seed=0, categorical_action_encoding=False) as c:
        ours = (await c.collect()).clone()[0]  # (a copy: the batch's shared memory goes with the collector)
    assert not theirs["next", "terminated"].any() and not ours["next", "terminated"].any()
    for key in ("action", "step_count", ("next", "step_count"), ("next", "truncated"), ("next", "done")):
        assert ours[key].shape == theirs[key].shape and ours[key].dtype == theirs[key].dtype, key
    for key in ("step_count", ("next", "step_count"), ("next", "truncated"), ("next", "done")):
        assert torch.equal(ours[key], theirs[key]), key
    assert torch.equal(ours["action"].sum(-1), theirs["action"].sum(-1))  # one-hot rows, as TorchRL's
    assert torch.equal(ours["action"], one_hot(ours["observation"])), "the one-hot action the policy wrote"
