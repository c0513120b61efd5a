"""EnvPool in the workers, end to end (skipped where ``envpool`` does not import: it is not a
dependency, and its wheels with their assets weigh about 700 MB; `bash scripts/run.sh
envpool-test` makes a venv with it and runs this file).

EnvPool's gymnasium API autoresets in next-step mode and is a ``gymnasium.Env`` by class: the
worker recognises it, resets the ended rows itself with ``reset(env_id)`` right after the step
that ended them, and puts EnvPool's answers in the order of its rows (``info["env_id"]``).
"""

from __future__ import annotations

import functools

import anyio
import pytest
import torch

from aiocollect import Collector
from aiocollect.events import EpisodeEnded

from test_collector import ArgmaxMLP
from test_vector_envs import check_continuity

envpool = pytest.importorskip("envpool")

pytestmark = pytest.mark.timeout(120)

SUB_ENVS, T = 8, 32
# CartPole's termination bounds: a final observation lies outside them, a reset one well inside
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * 3.141592653589793 / 360


def make_pool(seed: int = 0):
    return envpool.make_gymnasium("CartPole-v1", num_envs=SUB_ENVS, batch_size=SUB_ENVS, num_threads=1, seed=seed)


async def _run(policy, update: bool = True, **kw):
    events: list[EpisodeEnded] = []
    c = Collector(functools.partial(make_pool, 7), policy, frames_per_batch=2 * SUB_ENVS * T,
                  total_frames=2 * SUB_ENVS * T * 6, num_workers=2, envs_per_worker=1, seed=3, **kw)
    c.on(EpisodeEnded, events.append)
    batches, versions = [], []
    with anyio.fail_after(90):
        async with c:
            async for batch in c:  # the loop users write: train, then publish the new weights
                batches.append(batch.clone())
                if update:
                    with torch.no_grad():
                        policy.net[0].bias.add_(0.01)
                    versions.append(await c.update_weights(policy))
            state = c.state_dict()
    return batches, events, versions, state


@pytest.mark.parametrize("zero_copy", [False, True])
async def test_envpool_cartpole_user_program(zero_copy):
    batches, events, versions, state = await _run(ArgmaxMLP(), zero_copy=zero_copy)
    assert len(batches) == 6 and versions == list(range(1, 7))
    done_frames = 0
    for b in batches:
        assert b.batch_size == torch.Size([2 * SUB_ENVS, T])
        check_continuity(b)
        obs, nxt = b["observation"], b["next", "observation"]
        term, trunc = b["next", "terminated"][..., 0], b["next", "truncated"][..., 0]
        assert not bool((term & trunc).any())
        # at an end: ("next", obs) is the true final observation (outside the bounds), and the
        # next frame starts from a reset observation (every component within 0.05)
        final = nxt[term]
        assert len(final) == 0 or bool(((final[:, 0].abs() > X_LIMIT) | (final[:, 2].abs() > THETA_LIMIT)).all())
        ended = term[:, :-1] | trunc[:, :-1]
        assert bool((obs[:, 1:][ended].abs() <= 0.05).all()), "the frame after an end is not a reset"
        done_frames += int((term | trunc).sum())
        # each row is one sub-env: its trajectory ids are row + k * (2 workers x 8 sub-envs)
        ids = b["collector", "traj_ids"]
        assert bool(((ids % (2 * SUB_ENVS)) == torch.arange(2 * SUB_ENVS)[:, None]).all())
    assert done_frames > 0, "episodes ended"
    assert len(events) == done_frames
    assert {e.env for e in events} <= set(range(2 * SUB_ENVS))
    assert all(e.length >= 1 and e.ret == e.length for e in events)  # CartPole: reward 1 per step
    assert len(state["traj_counters"]) == 2 * SUB_ENVS


async def test_envpool_same_seed_same_data():
    """(Without weight updates: which batch a new version reaches first depends on timing.)"""
    first, *_ = await _run(ArgmaxMLP(), update=False)
    second, *_ = await _run(ArgmaxMLP(), update=False)
    assert len(first) == len(second) == 6
    for a, b in zip(first, second):
        for key in ("observation", ("next", "observation"), "action", ("collector", "traj_ids")):
            assert torch.equal(a[key], b[key]), f"{key} differs between two runs with the same seeds"
