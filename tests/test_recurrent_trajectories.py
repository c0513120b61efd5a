"""Recurrent policies as people outside the project use them: an LSTM wrapped by hand in a
``TensorDictModule`` (TorchRL's key names, ``recurrent_state=`` declared), episodes much longer
than a batch, ``split_trajs`` and ``trajs_per_batch``, ``max_frames_per_traj`` cuts,
``reset_at_each_iter``, ``init_random_frames``, weight updates, ``break`` then ``aclose()``, a
worker killed with ``on_worker_failure="restart"``, the smallest sizes, states of shape ``()``,
``(1,)`` and ``(2, 3)`` in float64, and Dict observations.

Every frame is checked against its trajectory (by trajectory id, so across batches too):
``is_init`` is True exactly at a trajectory's first frame, the state read there is zero, and
elsewhere it is the state written at the trajectory's frame before."""

from __future__ import annotations

import os
import signal

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict.nn import TensorDictModule, TensorDictSequential

from aiocollect import Collector, SpecError
from aiocollect.events import WorkerRestarted

pytestmark = pytest.mark.timeout(120)
H, C = "recurrent_state_h", "recurrent_state_c"
HIDDEN = 8


class LongEnv(gym.Env):
    """Episodes of ``length`` steps (truncated), or ``terminated`` at a random step in the second
    half of that; observations float32 ``[3]`` (``dict_obs``: a Dict of two leaves)."""

    action_space = spaces.Discrete(2)

    def __init__(self, length: int = 500, dict_obs: bool = False, random_ends: bool = False) -> None:
        self.length, self.dict_obs, self.random_ends = length, dict_obs, random_ends
        box = spaces.Box(-1, 1, (3,), np.float32)
        self.observation_space = spaces.Dict({"pos": box, "tick": spaces.Box(0, 1e6, (1,), np.float32)}) if dict_obs else box

    def _obs(self):
        pos = self.np_random.uniform(-1, 1, 3).astype(np.float32)
        return {"pos": pos, "tick": np.array([self.t], np.float32)} if self.dict_obs else pos

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.end = int(self.np_random.integers(self.length // 2, self.length + 1)) if self.random_ends else self.length
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), 1.0, self.random_ends and self.t >= self.end, self.t >= self.length, {}


class HandLSTM(torch.nn.Module):
    """An ``nn.LSTM`` stepped one frame at a time, as a TorchRL script ported by hand does: the
    state keys hold ``[num_layers, hidden]`` per env; it checks is_init's promise itself."""

    def __init__(self, obs_dim: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = torch.nn.LSTM(obs_dim, HIDDEN, batch_first=True)
        self.head = torch.nn.Linear(HIDDEN, 2)

    def forward(self, observation, is_init, h, c):
        assert is_init.dtype == torch.bool and is_init.shape == (len(observation), 1)
        assert not h[is_init[:, 0]].any() and not c[is_init[:, 0]].any(), "a state at an episode's start is not zero"
        out, (h2, c2) = self.lstm(observation[:, None], (h.transpose(0, 1).contiguous(), c.transpose(0, 1).contiguous()))
        return self.head(out[:, 0]).argmax(-1), h2.transpose(0, 1), c2.transpose(0, 1)


def lstm_policy(obs_key="observation") -> TensorDictModule:
    return TensorDictModule(HandLSTM(), in_keys=[obs_key, "is_init", H, C], out_keys=["action", ("next", H), ("next", C)])


LSTM_STATE = {H: (1, HIDDEN), C: (1, HIDDEN)}


class Trajectories:
    """Checks batches frame by frame: is_init exactly at trajectory starts, zero states there,
    elsewhere the state written at the trajectory's frame before."""

    def __init__(self, keys=(H, C)) -> None:
        self.keys = keys
        self.last_next: dict[int, dict[str, torch.Tensor]] = {}
        self.frames = self.starts = 0

    def check(self, batch) -> None:
        ids = batch["collector", "traj_ids"]
        mask = batch.get(("collector", "mask"), None)
        init = batch["is_init"][..., 0]
        assert batch["is_init"].dtype == torch.bool
        for e in range(ids.shape[0]):
            for t in range(ids.shape[1]):
                if mask is not None and not mask[e, t]:
                    continue
                traj = int(ids[e, t])
                first = traj not in self.last_next
                where = f"trajectory {traj}, frame [{e}, {t}] ({self.frames} frames checked)"
                assert bool(init[e, t]) == first, f"is_init is {bool(init[e, t])} at {where}"
                for key in self.keys:
                    if first:
                        assert not batch[key][e, t].any(), f"{key} not zero at the start of {where}"
                    else:
                        assert torch.equal(batch[key][e, t], self.last_next[traj][key]), f"{key} not carried at {where}"
                self.last_next[traj] = {key: batch["next", key][e, t].clone() for key in self.keys}
                self.frames += 1
                self.starts += first


async def check_run(env, policy, batches: int, after=None, checker=None, **options) -> Trajectories:
    checker = checker or Trajectories()
    with anyio.fail_after(100):
        async with Collector(env, policy, **options) as c:
            n = 0
            async for batch in c:
                checker.check(batch)
                if after is not None:
                    await after(c, n)
                n += 1
                if n == batches:
                    break
    return checker


RANDOM_FRAMES_MODES = {
    "local": dict(num_workers=0),
    "process": dict(num_workers=1),
    "server": dict(num_workers=1, inference="server"),
    "server-groups": dict(num_workers=1, envs_per_worker=4, inference="server", worker_groups=2),
    "vector": dict(num_workers=1, envs_per_worker=1, env=lambda: gym.vector.SyncVectorEnv([lambda: LongEnv(length=7)] * 2)),
}


@pytest.mark.parametrize("mode", RANDOM_FRAMES_MODES)
async def test_init_random_frames_store_is_init_at_trajectory_starts(mode):
    """init_random_frames (random actions, the policy does not run): is_init is still True at each
    trajectory's first frame, the states there are zeros, and the first frames the policy acts on
    carry on from them."""
    options = dict(envs_per_worker=2, env=lambda: LongEnv(length=7)) | RANDOM_FRAMES_MODES[mode]
    checker = await check_run(options.pop("env"), lstm_policy(), batches=4, frames_per_batch=24, init_random_frames=40,
                              seed=1, recurrent_state=LSTM_STATE, **options)
    assert checker.starts >= 4 * 24 // 7


@pytest.mark.parametrize("layout", ["split_trajs", "trajs_per_batch", "plain"])
async def test_episodes_much_longer_than_a_batch(layout):
    """500-step episodes, 32-frame batches: is_init only at trajectory starts, the state carried
    across every batch boundary (and across split_trajs / trajs_per_batch layouts)."""
    options = dict(frames_per_batch=32, num_workers=1, envs_per_worker=2, seed=3, recurrent_state=LSTM_STATE)
    batches = 20
    if layout == "split_trajs":
        options["split_trajs"] = True
    elif layout == "trajs_per_batch":
        options["trajs_per_batch"] = 2
        batches = 2
    env = lambda: LongEnv(length=300, random_ends=True)  # noqa: E731
    checker = await check_run(env, lstm_policy(), batches=batches, **options)
    assert checker.starts >= 2


async def test_max_frames_per_traj_cuts_start_from_zero_state():
    checker = await check_run(LongEnv, lstm_policy(), batches=6, frames_per_batch=20, num_workers=1, envs_per_worker=2,
                              max_frames_per_traj=7, seed=2, recurrent_state=LSTM_STATE)
    assert checker.starts >= 2 * 6 * 10 // 7


async def test_reset_at_each_iter_starts_every_batch_afresh():
    async with Collector(LongEnv, lstm_policy(), frames_per_batch=16, num_workers=1, envs_per_worker=2,
                         reset_at_each_iter=True, seed=2, recurrent_state=LSTM_STATE) as c:
        checker = Trajectories()
        for _ in range(3):
            batch = await c.collect()
            checker.check(batch)
            assert batch["is_init"][:, 0].all() and not batch["is_init"][:, 1:].any()


async def test_update_weights_then_break_then_aclose():
    policy = lstm_policy()

    async def update(c, n):
        with torch.no_grad():
            policy.module.head.bias.add_(0.5)
        await c.update_weights(policy)

    await check_run(lambda: LongEnv(length=30), policy, batches=5, after=update, frames_per_batch=24, num_workers=2,
                    envs_per_worker=2, seed=4, recurrent_state=LSTM_STATE)


async def test_a_killed_worker_restarts_its_trajectories_from_zero_state():
    async def kill(c, n):
        if n == 1:
            os.kill(c.worker_pids[0], signal.SIGKILL)

    await check_run(lambda: LongEnv(length=40), lstm_policy(), batches=6, after=kill, frames_per_batch=24,
                    num_workers=2, envs_per_worker=2, seed=4, recurrent_state=LSTM_STATE, on_worker_failure="restart",
                    delivery="async")


class AnyShape(torch.nn.Module):
    """States of shape () / (1,) / (2, 3), float64: the next state is the state plus the
    observation's first entry (so a state that is not carried shows)."""

    def forward(self, observation, is_init, a, b, d):
        step = observation[:, 0].double()
        assert not (a[is_init[:, 0]].any() or b[is_init[:, 0]].any() or d[is_init[:, 0]].any())
        return (torch.zeros(len(observation), dtype=torch.long), a + step, b + step[:, None],
                d + step[:, None, None])


@pytest.mark.parametrize("sizes", [dict(num_workers=1, envs_per_worker=1, frames_per_batch=1),
                                   dict(num_workers=0, envs_per_worker=1, frames_per_batch=1)], ids=["process", "local"])
async def test_the_smallest_sizes_and_states_of_any_shape_and_dtype(sizes):
    state = {"a": ((), torch.float64), "b": ((1,), "float64"), "d": ((2, 3), np.float64)}
    policy = TensorDictModule(AnyShape(), in_keys=["observation", "is_init", "a", "b", "d"],
                              out_keys=["action", ("next", "a"), ("next", "b"), ("next", "d")])
    checker = Trajectories(keys=("a", "b", "d"))
    with anyio.fail_after(100):
        async with Collector(lambda: LongEnv(length=4), policy, seed=0, recurrent_state=state, **sizes) as c:
            for _ in range(10):
                batch = await c.collect()
                assert batch["a"].shape == (1, 1) and batch["d"].shape == (1, 1, 2, 3)
                assert batch["a"].dtype == batch["next", "d"].dtype == torch.float64
                checker.check(batch)
    assert checker.starts == 3


async def test_dict_observations():
    policy = TensorDictModule(HandLSTM(), in_keys=["pos", "is_init", H, C],
                              out_keys=["action", ("next", H), ("next", C)])
    await check_run(lambda: LongEnv(length=9, dict_obs=True), policy, batches=4, frames_per_batch=20, num_workers=1,
                    envs_per_worker=2, seed=5, recurrent_state=LSTM_STATE)


@pytest.mark.parametrize("sequential", [False, True], ids=["module", "sequential"])
async def test_a_recurrent_policy_without_recurrent_state_is_told_to_declare_it(sequential):
    """A TorchRL script ported by hand, whose env had a primer transform giving the state keys:
    the error says to declare recurrent_state with the keys it reads, not to wrap the module."""
    policy = lstm_policy()
    if sequential:
        policy = TensorDictSequential(policy, TensorDictModule(torch.nn.Identity(), in_keys=["action"], out_keys=["action"]))
    with pytest.raises(SpecError, match=r"reads .*'recurrent_state_h'.*pass recurrent_state=\{'recurrent_state_h': "):
        async with Collector(LongEnv, policy, frames_per_batch=8, num_workers=0, envs_per_worker=2) as c:
            await c.collect()



async def test_server_inference_long_episodes_split_and_a_weight_update():
    """inference="server" (one state row per env on the server), episodes longer than a batch,
    split_trajs, a weight update between batches."""
    policy = lstm_policy()

    async def update(c, n):
        if n == 2:
            await c.update_weights(policy)

    await check_run(lambda: LongEnv(length=60, random_ends=True), policy, batches=8, after=update, frames_per_batch=24,
                    num_workers=2, envs_per_worker=2, inference="server", split_trajs=True, seed=6,
                    recurrent_state=LSTM_STATE)


async def test_a_frozen_worker_is_replaced_and_its_envs_start_from_zero_state():
    """SIGSTOP a worker (found hung from outside after step_timeout): the replacement's envs
    start new trajectories, is_init True and zero states; the others carry on."""
    stopped, restarted = [], []

    async def freeze(c, n):
        if n == 0:
            c.on(WorkerRestarted, restarted.append)
        if n == 1:
            stopped.append(c.worker_pids[1])
            os.kill(stopped[0], signal.SIGSTOP)
        if n == 5 and not restarted:  # (the frozen worker holds no slot: wait until it is found)
            with anyio.fail_after(60):
                while not restarted:
                    await anyio.sleep(0.05)

    try:
        checker = await check_run(lambda: LongEnv(length=40), lstm_policy(), batches=8, after=freeze,
                                  frames_per_batch=24, num_workers=2, envs_per_worker=2, seed=7,
                                  recurrent_state=LSTM_STATE, on_worker_failure="restart", step_timeout=2,
                                  delivery="async")
    finally:
        for pid in stopped:  # (the collector killed it; still stopped only if the test failed early)
            if os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "T":
                os.kill(pid, signal.SIGCONT)
    assert restarted and checker.frames == 8 * 24


@pytest.mark.parametrize("after_s", [0.0, 0.3, 1.5])
async def test_cancelled_at_any_moment(after_s):
    """The consumer cancelled while a recurrent collector starts or runs: it stops, leaving nothing."""
    checker = Trajectories()
    with anyio.move_on_after(after_s):
        async with Collector(lambda: LongEnv(length=30), lstm_policy(), frames_per_batch=16, num_workers=2,
                             envs_per_worker=1, recurrent_state=LSTM_STATE) as c:
            async for batch in c:
                checker.check(batch)


async def test_slices_from_the_replay_buffer_replay_from_the_stored_state():
    """A recurrent trainer's way: batches into a ReplayBuffer, SliceSampler slices of one
    trajectory; in each slice the state read at a frame is the state written at the frame before,
    so a sequence re-run from its first stored state sees what the policy saw."""
    from aiocollect import ReplayBuffer, SliceSampler

    rb = ReplayBuffer(2000, sampler=SliceSampler(slice_len=8), batch_size=64)
    async with Collector(lambda: LongEnv(length=50, random_ends=True), lstm_policy(), frames_per_batch=48,
                         num_workers=1, envs_per_worker=3, seed=8, recurrent_state=LSTM_STATE) as c:
        for _ in range(6):
            rb.extend(await c.collect())
    sample = rb.sample().reshape(8, 8)
    ids = sample["collector", "traj_ids"]
    assert (ids == ids[:, :1]).all()
    for key in (H, C):
        assert torch.equal(sample[key][:, 1:], sample["next", key][:, :-1])
        assert not sample[key][sample["is_init"][..., 0]].any()
    assert not sample["is_init"][:, 1:].any()


async def test_same_seed_same_data_whatever_the_number_of_workers():
    """Random frames then the LSTM, episodes across batches: the batches (states included) are the
    same with 1 worker of 4 envs, 2 of 2, and in the collector's process."""
    runs = []
    for layout in (dict(num_workers=1, envs_per_worker=4), dict(num_workers=2, envs_per_worker=2),
                   dict(num_workers=0, envs_per_worker=4)):
        async with Collector(lambda: LongEnv(length=20, random_ends=True), lstm_policy(), frames_per_batch=32, seed=9,
                             init_random_frames=40, recurrent_state=LSTM_STATE, **layout) as c:
            runs.append([(await c.collect()).clone() for _ in range(3)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            for key in ("observation", "action", "is_init", H, ("next", C), ("collector", "traj_ids")):
                assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("inference", ["worker", "server"])
async def test_a_worker_replaced_during_random_frames_marks_only_trajectory_starts(inference):
    """A worker killed while init_random_frames last: its replacement's random frames store is_init
    at trajectory starts only (with inference="server" too, whose rows of the dead worker's envs
    still hold their states)."""
    async def kill(c, n):
        if n == 0:
            os.kill(c.worker_pids[1], signal.SIGKILL)

    checker = await check_run(lambda: LongEnv(length=6), lstm_policy(), batches=6, after=kill, frames_per_batch=24,
                              num_workers=2, envs_per_worker=2, inference=inference, init_random_frames=100_000,
                              seed=4, recurrent_state=LSTM_STATE, on_worker_failure="restart", delivery="async")
    assert checker.frames == 6 * 24


class NestedState(torch.nn.Module):
    def forward(self, observation, is_init, h):
        assert not h[is_init[:, 0]].any()
        return torch.ones(len(observation), dtype=torch.long), h + 1


@pytest.mark.parametrize("cut", [dict(max_frames_per_traj=1), dict(env_length=1)], ids=["max_frames_per_traj=1", "1-step episodes"])
async def test_one_frame_trajectories_and_a_nested_state_key(cut):
    """Every frame starts a trajectory (cut after one frame, or an env whose episodes last one
    step): is_init everywhere, every state read zero; the state key is nested (("rnn", "h"))."""
    key = ("rnn", "h")
    policy = TensorDictModule(NestedState(), in_keys=["observation", "is_init", key], out_keys=["action", ("next", *key)])
    cut = dict(cut)  # (the parameter is shared by the loops' runs)
    length = cut.pop("env_length", 50)
    checker = Trajectories(keys=(key,))
    async with Collector(lambda: LongEnv(length=length), policy, frames_per_batch=4, num_workers=1, envs_per_worker=2,
                         seed=1, recurrent_state={key: (2,)}, **cut) as c:
        for _ in range(3):
            batch = await c.collect()
            checker.check(batch)
            assert batch["is_init"].all() and (batch["next", "rnn", "h"] == 1).all()
    assert checker.starts == 12


async def test_a_resumed_run_starts_new_trajectories_from_zero_state():
    """state_dict() / load_state_dict() mid-episode (and mid init_random_frames): the resumed run's
    envs start new trajectories (new ids), is_init True and zero states there."""
    checker = Trajectories()
    options = dict(frames_per_batch=16, num_workers=1, envs_per_worker=2, seed=3, recurrent_state=LSTM_STATE,
                   init_random_frames=40)
    async with Collector(lambda: LongEnv(length=50), lstm_policy(), **options) as c:
        for _ in range(2):
            checker.check(await c.collect())
        saved = c.state_dict()
    resumed = Collector(lambda: LongEnv(length=50), lstm_policy(), **options)
    resumed.load_state_dict(saved)
    async with resumed:
        for _ in range(3):
            checker.check(await resumed.collect())
    assert checker.starts == 4


async def test_a_policy_reading_another_missing_key_is_not_sent_to_recurrent_state():
    policy = TensorDictModule(torch.nn.Linear(3, 2), in_keys=["pixels"], out_keys=["action"])
    with pytest.raises(SpecError, match=r"reads \['pixels'\].*matching in_keys") as caught:
        async with Collector(LongEnv, policy, frames_per_batch=8, num_workers=0, envs_per_worker=2) as c:
            await c.collect()
    assert "recurrent_state" not in str(caught.value)
