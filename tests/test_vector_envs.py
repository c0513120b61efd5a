"""Vector envs in the workers: create_env_fn may return a gymnasium.vector.VectorEnv, stepped as
one batched env whose sub-envs are rows of the batch, with the same data as single envs give:
true final observations, terminated apart from truncated, one trajectory id per sub-env,
episode events per sub-env, no frame of a next-step env's "reset step", and the same data
whatever the number of workers."""

from __future__ import annotations

import os

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode

from aiocollect import Collector, ConfigError, SpecError
from aiocollect.events import EpisodeEnded, WorkerRestarted
from aiocollect.testing import CountingEnv

from test_collector import AlwaysOne, ArgmaxMLP

pytestmark = pytest.mark.timeout(60)

NEXT, SAME, DISABLED = AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED
LENGTHS = (3, 4, 6)  # episode lengths of the sub-envs of a counting vector env


def cartpole(num_envs: int = 4, **kwargs):
    return lambda: gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="vector_entry_point", **kwargs)


def counting(mode=NEXT, lengths=LENGTHS, truncate_last: bool = False, **kw):
    """A SyncVectorEnv of CountingEnvs whose episodes last ``lengths`` steps (the last one ends by
    truncation with ``truncate_last``)."""

    def make():
        fns = [
            (lambda L=L, tr=(truncate_last and i == len(lengths) - 1): CountingEnv(episode_length=L, truncate=tr, **kw))
            for i, L in enumerate(lengths)
        ]
        return gym.vector.SyncVectorEnv(fns, autoreset_mode=mode)

    return make


async def collect_all(*args, events: list | None = None, **kwargs):
    c = Collector(*args, **kwargs)
    if events is not None:
        c.on(EpisodeEnded, events.append)
    with anyio.fail_after(50):
        async with c:
            return [b async for b in c], c.state_dict()


def check_continuity(batch) -> None:
    """obs[t+1] is next_obs[t] within an episode; a trajectory id changes only after an end."""
    obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
    same = (obs[:, 1:] == nxt[:, :-1]).reshape(*done[:, :-1].shape, -1).all(-1)
    assert bool((same | done[:, :-1]).all()), "a frame breaks the env's dynamics"
    ids = batch["collector", "traj_ids"]
    assert bool(((ids[:, 1:] == ids[:, :-1]) | done[:, :-1]).all()), "a trajectory id changed without an episode end"
    assert bool((ids[:, 1:][done[:, :-1]] != ids[:, :-1][done[:, :-1]]).all()), "an episode end kept its trajectory id"


def check_episode_events(batches, events) -> None:
    """Each EpisodeEnded is an episode of the batches: its return is the sum of the rewards of its
    trajectory id's frames (across batch boundaries), its length their number; and every episode
    that ended in the batches has its event."""
    rewards: dict[int, list[float]] = {}
    ended = set()
    for b in batches:
        ids, rew = b["collector", "traj_ids"].flatten(), b["next", "reward"][..., 0].flatten()
        for i, r in zip(ids.tolist(), rew.tolist()):
            rewards.setdefault(i, []).append(r)
        ended.update(b["collector", "traj_ids"][b["next", "done"][..., 0]].tolist())
    assert sorted(e.traj_id for e in events) == sorted(ended)
    for e in events:
        assert e.length == len(rewards[e.traj_id]), f"episode {e.traj_id}: length {e.length}"
        assert e.ret == pytest.approx(sum(rewards[e.traj_id]), abs=1e-9), f"episode {e.traj_id}: return {e.ret}"


# -- layout -------------------------------------------------------------------------------------------


async def test_cartpole_vector_entry_point_batch_has_a_row_per_sub_env_with_torchrl_layout():
    """2 workers x 2 copies of a natively vectorized CartPole of 4 sub-envs: a [16, T] batch with
    the keys, dtypes and dim names of single envs' batches."""
    (batch,), _ = await collect_all(cartpole(4), ArgmaxMLP(), frames_per_batch=16 * 8, total_frames=16 * 8,
                                    num_workers=2, envs_per_worker=2)
    assert batch.batch_size == torch.Size([16, 8]) and batch.names == [None, "time"]
    keys = {k if isinstance(k, str) else tuple(k) for k in batch.keys(include_nested=True, leaves_only=True)}
    assert keys == {
        "observation", "action", "done", "terminated", "truncated",
        ("next", "observation"), ("next", "reward"), ("next", "done"), ("next", "terminated"),
        ("next", "truncated"), ("collector", "traj_ids"), ("collector", "policy_version"),
        ("collector", "env_epoch"),
    }
    assert batch["observation"].shape == (16, 8, 4) and batch["observation"].dtype == torch.float32
    assert batch["action"].shape == (16, 8) and batch["action"].dtype == torch.int64
    assert batch["next", "reward"].shape == (16, 8, 1) and batch["next", "reward"].dtype == torch.float32
    for flag in ("terminated", "truncated", "done"):
        assert batch["next", flag].shape == (16, 8, 1) and batch["next", flag].dtype == torch.bool
    assert batch["collector", "traj_ids"][:, 0].tolist() == list(range(16))
    check_continuity(batch)


# -- autoreset modes: exact frames ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", [NEXT, SAME, DISABLED], ids=["next_step", "same_step", "disabled"])
async def test_counting_vector_env_gives_the_frames_of_single_envs_in_every_autoreset_mode(mode):
    """Sub-envs whose episodes last 3, 4 and 6 steps (the last truncated), 2 workers x 2 copies:
    every frame is a real step (obs counts 0..L-1, next obs 1..L, the final one L: never a reset
    step), obs at t+1 after an end is the reset obs, terminated and truncated are apart, ids are
    k * 12 + env, and each episode is one EpisodeEnded with its env, id, length and return."""
    events: list[EpisodeEnded] = []
    batches, state = await collect_all(
        counting(mode, truncate_last=True), frames_per_batch=12 * 10, total_frames=12 * 10 * 2, num_workers=2,
        envs_per_worker=2, seed=7, events=events,
    )
    n = len(LENGTHS)
    ends = {}
    for b in batches:
        check_continuity(b)
        obs, nxt = b["observation"][..., 0], b["next", "observation"][..., 0]
        for row in range(12):
            g = int(b["collector", "traj_ids"][row, 0]) % 12
            assert g == row, "rows are the global envs, in order"
            L, start = LENGTHS[g % n], (7 + g) % 1000
            steps = obs[row] - start * 100
            assert bool(((steps >= 0) & (steps < L)).all()), f"env {g}: an observation is not of its episode"
            assert bool((nxt[row] - obs[row] == 1).all()), f"env {g}: a frame is not a step (a reset step?)"
            done = b["next", "done"][row, :, 0]
            assert bool((done == (nxt[row] - start * 100 == L)).all()), f"env {g}: ends where the final obs is not L"
            term, trunc = b["next", "terminated"][row, :, 0], b["next", "truncated"][row, :, 0]
            last = g % n == n - 1
            assert bool((trunc == (done & last)).all()) and bool((term == (done & (not last))).all())
            assert bool((b["next", "reward"][row, :, 0] == b["action"][row] + 1).all())
            ends.setdefault(g, []).extend(b["collector", "traj_ids"][row][done].tolist())
    for g, ids in ends.items():
        assert ids == [k * 12 + g for k in range(len(ids))], f"env {g}: trajectory ids {ids}"
    assert sorted((e.env, e.traj_id) for e in events) == sorted((g, i) for g, ids in ends.items() for i in ids)
    for e in events:
        assert e.length == LENGTHS[e.env % n] and e.terminated == (e.env % n != n - 1)
        assert e.worker == e.env // 6
    check_episode_events(batches, events)
    assert len(state["traj_counters"]) == 12


@pytest.mark.parametrize("num_workers", [0, 1], ids=["local", "process"])
async def test_cartpole_episode_ends_hold_the_true_final_observation(num_workers):
    """CartPole's vector entry point (next-step autoreset): where an episode terminates, the next
    obs is outside CartPole's bounds; where it is truncated (max_episode_steps=30), the episode
    lasted 30 steps; the obs after an end is a reset obs (every component within 0.05)."""
    events: list[EpisodeEnded] = []
    batches, _ = await collect_all(cartpole(8, max_episode_steps=30), ArgmaxMLP(), frames_per_batch=8 * 40,
                                   total_frames=8 * 40 * 2, num_workers=num_workers, seed=1, events=events)
    terminated = truncated = 0
    for b in batches:
        check_continuity(b)
        nxt, obs = b["next", "observation"], b["observation"]
        term, trunc = b["next", "terminated"][..., 0], b["next", "truncated"][..., 0]
        outside = (nxt[..., 0].abs() > 2.4) | (nxt[..., 2].abs() > 12 * 2 * np.pi / 360)
        assert bool((outside == term).all()), "terminated exactly where the final obs is out of bounds"
        after = (term | trunc)[:, :-1]
        assert bool((obs[:, 1:][after].abs() <= 0.05).all()), "the obs after an end is the reset obs"
        assert bool((nxt[term | trunc].abs() > 0.05).any(-1).all()), "the final obs is not a reset obs"
        assert bool((obs[..., 0].abs() <= 2.4).all()), "no observation at t is a final one"
        terminated += int(term.sum())
        truncated += int(trunc.sum())
    assert terminated and truncated
    assert all(e.length == 30 for e in events if not e.terminated)
    assert len(events) == int(sum(int((b["next", "done"]).sum()) for b in batches))


# -- determinism ------------------------------------------------------------------------------------


async def test_same_seed_same_data_with_1_2_or_4_workers():
    """4 vector envs (CartPole's native one, with the MLP; and counting SyncVectorEnvs with random
    actions) as 1 x 4, 2 x 2 and 4 x 1 workers x copies: the same data; the local backend too."""
    runs = {}
    for workers, copies in ((0, 4), (1, 4), (2, 2), (4, 1)):
        cart, _ = await collect_all(cartpole(3), ArgmaxMLP(), frames_per_batch=12 * 20, total_frames=12 * 20 * 2,
                                    num_workers=workers, envs_per_worker=copies, seed=11)
        count, _ = await collect_all(counting(SAME), frames_per_batch=12 * 5, total_frames=12 * 5 * 2,
                                     num_workers=workers, envs_per_worker=copies, seed=5, init_random_frames=10**6)
        runs[workers] = (cart, count)
    first = runs[0]
    for workers, (cart, count) in runs.items():
        for a, b in zip(cart + count, first[0] + first[1]):
            assert (a == b).all(), f"{workers} workers give other data than the local backend"
    ids = torch.cat([b["collector", "traj_ids"] for b in first[0]], 1)
    assert len(ids.unique()) > 12, "episodes ended"


# -- delivery, options -------------------------------------------------------------------------------


async def test_async_delivery_batches_hold_one_workers_sub_envs():
    """delivery='async': each batch holds the rows of one worker's vector envs (ids % 12 name them)."""
    batches, _ = await collect_all(counting(NEXT), frames_per_batch=6 * 5, total_frames=6 * 5 * 6, num_workers=2,
                                   envs_per_worker=2, delivery="async", seed=0)
    seen = set()
    for b in batches:
        assert b.batch_size == torch.Size([6, 5])
        envs = (b["collector", "traj_ids"][:, 0] % 12).tolist()
        assert envs in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11])
        seen.add(envs[0])
        check_continuity(b)
    # (which workers deliver is up to timing: async delivery takes whichever batch is ready first,
    # and on a loaded machine one worker may deliver all six while the other starts)
    assert seen <= {0, 6} and seen


async def test_options_behave_as_with_single_envs():
    """max_frames_per_traj truncates (and resets) a sub-env, init_random_frames, reset_at_each_iter,
    trajs_per_batch and split_trajs work with vector envs."""
    for mode in (SAME, NEXT):
        events: list[EpisodeEnded] = []
        cut, _ = await collect_all(counting(mode, lengths=(50, 2)), frames_per_batch=4 * 10, total_frames=4 * 10 * 3,
                                   num_workers=1, envs_per_worker=2, max_frames_per_traj=4, seed=0, events=events)
        check_episode_events(cut, events)
        assert {e.length for e in events} == {2, 4} and {e.terminated for e in events} == {True, False}
    batches, _ = await collect_all(counting(SAME, lengths=(50, 2)), frames_per_batch=4 * 10, total_frames=4 * 10 * 2,
                                   num_workers=1, envs_per_worker=2, max_frames_per_traj=4, seed=0)
    for b in batches:
        check_continuity(b)
        lengths = b["observation"][..., 0] % 100
        assert int(lengths.max()) == 3
        assert bool(b["next", "truncated"][..., 0][lengths == 3].all())
    batches, _ = await collect_all(counting(NEXT), AlwaysOne(), frames_per_batch=6 * 4, total_frames=6 * 4 * 2,
                                   num_workers=1, envs_per_worker=2, reset_at_each_iter=True, seed=0)
    assert bool((batches[1]["observation"][:, 0, 0] % 100 == 0).all()), "every sub-env was reset"
    assert (batches[1]["collector", "traj_ids"][:, 0] >= 6).all()
    (b,), _ = await collect_all(counting(SAME), frames_per_batch=3 * 8, total_frames=3 * 8, split_trajs=True, seed=0)
    assert b["collector", "mask"].sum() == 24
    trajs, _ = await collect_all(counting(NEXT), frames_per_batch=3 * 4, total_frames=3 * 4 * 4, trajs_per_batch=3,
                                 seed=0)
    for t in trajs:
        done = t["next", "done"][..., 0] & t["collector", "mask"]
        assert (done.sum(1) == 1).all(), "each padded row is one complete episode"


async def test_a_restarted_worker_goes_on_with_fresh_trajectory_ids(tmp_path):
    """A sub-env that raises once: its worker is replaced, the run reaches total_frames and the
    replacement's sub-envs start trajectories with ids never used before."""
    flag = str(tmp_path / "flag")

    def make():
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            kw = {"fail_at_step": 5}
        except FileExistsError:
            kw = {}
        return gym.vector.SyncVectorEnv([lambda: CountingEnv(episode_length=7, **kw)] * 2, autoreset_mode=NEXT)

    c = Collector(make, frames_per_batch=4 * 6, total_frames=4 * 6 * 4, num_workers=2, on_worker_failure="restart",
                  seed=0)
    restarts = []
    c.on(WorkerRestarted, restarts.append)
    with anyio.fail_after(50):
        async with c:
            batches = [b async for b in c]
    assert len(batches) == 4 and len(restarts) == 1
    per_env: dict[int, list[int]] = {}
    for b in batches:
        check_continuity(b)
        for ids in b["collector", "traj_ids"]:
            per_env.setdefault(int(ids[0]) % 4, []).extend(ids.unique().tolist())
    for env, ids in per_env.items():
        assert ids == sorted(ids), f"env {env} reuses a trajectory id"


# -- the user program -------------------------------------------------------------------------------


async def test_user_program_with_cartpole_make_vec_runs_to_its_end():
    """The program a user writes: gym.make_vec's CartPole in 2 workers, a policy, update_weights
    after each batch, to total_frames; then the data checks."""
    policy = ArgmaxMLP()
    seen = []
    with anyio.fail_after(50):
        async with Collector(
            lambda: gym.make_vec("CartPole-v1", num_envs=8, vectorization_mode="vector_entry_point"),
            policy, frames_per_batch=16 * 32, total_frames=16 * 32 * 4, num_workers=2, seed=3,
        ) as c:
            async for batch in c:
                seen.append(batch)
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(0.01)
                await c.update_weights(policy)
    assert c.frames == 16 * 32 * 4 and len(seen) == 4
    for b in seen:
        assert b.batch_size == torch.Size([16, 32])
        check_continuity(b)
    versions = [int(b["collector", "policy_version"].max()) for b in seen]
    assert versions == sorted(versions) and versions[-1] >= 1
    ids = torch.cat([b["collector", "traj_ids"].flatten() for b in seen])
    assert set((ids % 16).tolist()) == set(range(16))


# -- errors -----------------------------------------------------------------------------------------


async def test_frames_per_batch_must_split_over_the_sub_envs():
    """frames_per_batch=100 with 2 workers x vector envs of 3: a ConfigError naming the 6 rows
    and the nearest valid sizes."""
    with pytest.raises(ConfigError, match=r"frames_per_batch=100 .* 6 env rows .*2 workers x 1 envs_per_worker x 3 "
                                          r"sub-envs.* use frames_per_batch=102 or 96"):
        await collect_all(cartpole(3), frames_per_batch=100, total_frames=100, num_workers=2)


class _NoMode(gym.vector.VectorEnv):
    """A custom vector env that does not declare its autoreset mode."""

    metadata: dict = {}

    def __init__(self) -> None:
        self.num_envs = 2
        self.single_observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, 2)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, 2)

    def reset(self, *, seed=None, options=None):
        return np.zeros((2, 2), np.float32), {}

    def step(self, actions):
        return np.zeros((2, 2), np.float32), np.zeros(2), np.zeros(2, bool), np.zeros(2, bool), {}


@pytest.mark.parametrize(
    "make, match",
    [
        (_NoMode, r"metadata\['autoreset_mode'\] is None.*AutoresetMode"),
        (lambda: gym.wrappers.vector.RecordEpisodeStatistics(cartpole(2)()),
         r"autoreset mode NextStep, and it cannot reset some sub-envs.*SAME_STEP.*vectorization_mode='sync'"),
    ],
    ids=["no_mode", "next_step_without_partial_reset"],
)
async def test_vector_envs_that_cannot_give_exact_frames_are_refused_with_the_fix(make, match):
    with pytest.raises(SpecError, match=match):
        await collect_all(make, frames_per_batch=8, total_frames=8, num_workers=0)


async def test_vector_envs_that_disagree_are_refused():
    """Copies of a worker with other num_envs: a SpecError naming both."""
    sizes = iter([2, 3])
    with pytest.raises(SpecError, match=r"env 1 of worker 0 has num_envs=3.*env 0 has num_envs=2"):
        await collect_all(lambda: cartpole(next(sizes))(), frames_per_batch=12, total_frames=12, num_workers=0,
                          envs_per_worker=2)


async def test_check_finite_names_the_sub_env_and_step_timeout_the_vector_env():
    """check_finite=True: a NaN observation of a sub-env is a SpecError naming its key and step;
    a sub-env's step that hangs is a WorkerTimeoutError naming the vector env's first sub-env."""
    from aiocollect import WorkerTimeoutError

    with pytest.raises(SpecError, match=r"observation.*'observation' returned by step.*not finite"):
        await collect_all(counting(NEXT, nan_at_step=3), frames_per_batch=12, total_frames=24, num_workers=0,
                          check_finite=True)
    with pytest.raises(WorkerTimeoutError, match=r"worker [01] .*is hung: env [03]'s step\(\)"):
        await collect_all(lambda: gym.vector.SyncVectorEnv([lambda: CountingEnv(hang_at_step=2)] * 3),
                          frames_per_batch=6 * 4, total_frames=6 * 4, num_workers=2, step_timeout=0.5)
