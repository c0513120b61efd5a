"""Registers an env class defined in this ``__main__`` module (as a user's script or notebook does),
collects 2 batches from 2 workers through ``Collector("MyEnv-v0")``, through
``lambda: gym.make("MyEnv-v0")`` and through an id whose entry point is the string
``"__main__:MyEnv"``, runs one evaluation, and collects from a plugin's id (``fake_plugin``, on
PYTHONPATH). Prints the observations as JSON, one line (used by tests/test_registry.py).

No ``if __name__ == "__main__"`` guard: the workers never import this script.
"""

import asyncio
import json

import gymnasium as gym
import numpy as np
from gymnasium import spaces

import fake_plugin  # noqa: F401 - registers "FakePlugin/Counting-v0"
from aiocollect import Collector, Evaluator


class MyEnv(gym.Env):
    """Observation ``[seed * 100 + k]`` at step ``k`` of an episode of ``length`` steps."""

    metadata = {"render_modes": []}

    def __init__(self, length=3):
        self.length = length
        self.observation_space = spaces.Box(-np.inf, np.inf, (1,), np.float32)
        self.action_space = spaces.Discrete(2)
        self.start, self.k = 0, 0

    def _obs(self):
        return np.array([self.start * 100 + self.k], dtype=np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.start = seed
        self.k = 0
        return self._obs(), {}

    def step(self, action):
        self.k += 1
        return self._obs(), 1.0, self.k >= self.length, False, {}


gym.register("MyEnv-v0", entry_point=MyEnv, kwargs={"length": 3})
gym.register("MyEnvByName-v0", entry_point="__main__:MyEnv", kwargs={"length": 3})


async def collect(env_fn):
    frames = []
    async with Collector(env_fn, frames_per_batch=8, total_frames=16, num_workers=2, seed=0) as collector:
        async for batch in collector:
            frames.append(batch["observation"][..., 0].tolist())
    return frames


async def main():
    out = {
        "id": await collect("MyEnv-v0"),
        "factory": await collect(lambda: gym.make("MyEnv-v0")),
        "main_string_entry_point": await collect("MyEnvByName-v0"),
        "plugin": await collect("FakePlugin/Counting-v0"),
    }
    async with Evaluator("MyEnv-v0", num_trajectories=2, seed=0) as evaluator:
        out["evaluation_length_mean"] = (await evaluator.evaluate())["episode_length_mean"]
    print(json.dumps(out), flush=True)


asyncio.run(main())
