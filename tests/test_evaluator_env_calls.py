"""Reaching into the Evaluator's envs (call, get_attr, set_attr, map_fn, getattr_env): one result
per env in env order; a change applies between evaluations, in the order the calls and the
evaluations were made (an evaluation runs with the settings it started with); set_attr (and
persist=True calls) are applied again by a worker that replaces a SIGKILLed one; an env's error
arrives as its own type with the worker's traceback, and the worker goes on; synchronous code
blocks."""

from __future__ import annotations

import os
import signal

import anyio
import gymnasium as gym
import pytest

from aiocollect import ConfigError, Evaluator, EvaluatorClosedError, WorkerError
from aiocollect.events import EvaluationCompleted, WorkerRestarted

pytestmark = [pytest.mark.timeout(90), pytest.mark.loops("asyncio", "uvloop", "trio")]


class RewardScale(gym.Wrapper):
    """CartPole (reward 1 per step) whose rewards are multiplied by ``scale``: an episode's return
    divided by its length says under which setting it was run."""

    def __init__(self) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.scale = 1.0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward * self.scale, terminated, truncated, info

    def raise_scale(self, by: float) -> float:
        self.scale += by
        return self.scale


def scale_of(metrics: dict) -> float:
    return round(metrics["return_mean"] / metrics["episode_length_mean"], 6)


async def test_a_curriculum_set_between_evaluations_holds_for_the_evaluations_after_it():
    """Evaluations triggered before set_attr run with the old scale, those after with the new one,
    whatever the order in which they finish being awaited; get_attr reads one value per env."""
    completed: list[EvaluationCompleted] = []
    async with Evaluator(RewardScale, num_trajectories=2, num_envs=2, seed=0, busy_policy="queue") as ev:
        ev.on(EvaluationCompleted, completed.append)
        assert scale_of(await ev.evaluate(step=0)) == 1.0
        ev.trigger(step=1)
        assert await ev.set_attr("scale", 3.0) is None  # (waits behind the evaluation of step 1)
        ev.trigger(step=2)
        assert await ev.get_attr("scale") == [3.0, 3.0]
        await ev.wait()
        assert [(e.step, scale_of(e.metrics)) for e in completed] == [(0, 1.0), (1, 1.0), (2, 3.0)]
        await ev.set_attr("scale", [2.0, 5.0])  # (one value per env)
        assert await ev.get_attr("scale", indices=[1, 0]) == [5.0, 2.0]
        assert await ev.call("raise_scale", 1.0, indices=[0]) == [3.0]
        assert await ev.map_fn(lambda env, k: env.get_wrapper_attr("scale") * k, 2) == [6.0, 10.0]
        assert await ev.getattr_env("_max_episode_steps") == 500


async def test_kept_calls_are_applied_again_by_a_worker_that_replaces_a_killed_one():
    """set_attr and a persist=True call are applied to the new worker's envs before its first
    evaluation; a call that was not persisted is gone with the old envs."""
    async with Evaluator(RewardScale, num_trajectories=2, num_envs=2, seed=0, on_worker_failure="restart") as ev:
        await ev.set_attr("scale", 4.0)
        assert await ev.call("raise_scale", 1.0, persist=True) == [5.0, 5.0]  # kept
        assert await ev.call("raise_scale", 10.0) == [15.0, 15.0]  # not kept
        pid = ev.worker_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(30):
            await ev.wait_for(WorkerRestarted)
        assert ev.worker_pid != pid
        assert await ev.get_attr("scale") == [5.0, 5.0]
        assert scale_of(await ev.evaluate()) == 5.0


async def test_an_env_error_arrives_as_its_type_with_the_worker_traceback_and_the_worker_goes_on():
    def boom(env):
        raise KeyError("no such level")

    async with Evaluator(RewardScale, num_trajectories=2, num_envs=2, seed=0) as ev:
        with pytest.raises(KeyError, match="no such level") as info:
            await ev.map_fn(boom, indices=[1])
        assert isinstance(info.value, WorkerError) and "boom" in info.value.worker_traceback
        with pytest.raises(AttributeError, match="nope"):
            await ev.call("nope")
        assert (await ev.evaluate())["num_trajectories"] == 2  # the worker goes on
        with pytest.raises(ConfigError, match="indices"):
            await ev.get_attr("scale", indices=[2])
        with pytest.raises(ConfigError, match="2 values for 1 env rows"):
            await ev.set_attr("scale", [1.0, 2.0], indices=[0])
        with pytest.raises(ConfigError, match=r"call\('set_level', \*args, workers=\[i\]\)"):
            ev.map_fn("env.set_level")  # (TorchRL's map_fn takes a method's name)
    with pytest.raises(EvaluatorClosedError):
        await ev.get_attr("scale")


@pytest.mark.loops("asyncio")
def test_synchronous_code_blocks():
    ev = Evaluator(RewardScale, num_trajectories=1, seed=0)
    try:
        assert ev.set_attr("scale", 2.0) is None
        assert ev.get_attr("scale") == [2.0]
        assert scale_of(ev.evaluate()) == 2.0
    finally:
        ev.shutdown()
