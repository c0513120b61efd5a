"""A user's program: envs whose observation or action space is a Dict or Tuple of one leaf (what
pixel-only wrappers produce), collected with the local backend, a worker process and a vector env.
Each batch must hold the leaf under the key the multi-key path gives it, with the data of a plain
gymnasium loop stepped with the batch's actions."""

from __future__ import annotations

import asyncio
import sys

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from aiocollect import Collector

FRAME = spaces.Box(0, 255, (6, 6, 3), np.uint8)


def wrap(space, value):
    if isinstance(space, spaces.Dict):
        ((name, sub),) = space.spaces.items()
        return {name: wrap(sub, value)}
    if isinstance(space, spaces.Tuple):
        return (wrap(space.spaces[0], value),)
    return value


def unwrap(value):
    while isinstance(value, (dict, tuple)):
        (value,) = value.values() if isinstance(value, dict) else value
    return value


class PixelEnv(gym.Env):
    """Frames made from a seeded base, the step and the last action; reward: the action's sum."""

    def __init__(self, observation_space, action_space):
        self.observation_space, self.action_space = observation_space, action_space

    def _obs(self, code):
        start = self.base + 7 * self.t + int(round(code * 10))
        frame = ((start + np.arange(108)) % 256).astype(np.uint8).reshape(FRAME.shape)
        return wrap(self.observation_space, frame)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.base, self.t = int(self.np_random.integers(256)), 0
        return self._obs(0.0), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        code = float(np.sum(unwrap(action)))
        self.t += 1
        return self._obs(code), code, self.t >= 3, False, {}


CASES = [
    # (observation space, its key, action space, its key)
    (spaces.Dict({"pixels": FRAME}), ("pixels",), spaces.Discrete(3), ("action",)),
    (spaces.Dict({"observation": FRAME}), ("observation",), spaces.Dict({"move": spaces.Discrete(3)}), ("action", "move")),
    (spaces.Tuple((FRAME,)), ("observation", "0"), spaces.Tuple((spaces.Box(-1, 1, (2,), np.float32),)), ("action", "0")),
    (spaces.Dict({"a": spaces.Dict({"b": FRAME})}), ("a", "b"), spaces.Discrete(3), ("action",)),
    (spaces.Tuple((spaces.Dict({"x": FRAME}),)), ("observation", "0", "x"), spaces.Dict({"move": spaces.Discrete(3)}), ("action", "move")),
]


def check(batch, obs_space, obs_key, act_space, act_key, seed, what):
    keys = {k if isinstance(k, tuple) else (k,) for k in batch.keys(True, True)}
    for key in (obs_key, ("next", *obs_key), act_key):
        if key not in keys:
            raise SystemExit(f"{what}: the batch has no key {key} (it has {sorted(keys)})")
    E, T = batch.batch_size
    if tuple(batch[obs_key].shape) != (E, T, 6, 6, 3) or str(batch[obs_key].dtype) != "torch.uint8":
        raise SystemExit(f"{what}: {obs_key} is {batch[obs_key].dtype} {tuple(batch[obs_key].shape)}")
    for k in range(E):
        env = PixelEnv(obs_space, act_space)
        obs, _ = env.reset(seed=seed + k)
        for t in range(T):
            if not np.array_equal(batch[obs_key][k, t].numpy(), unwrap(obs)):
                raise SystemExit(f"{what}: env {k}'s observation at step {t} is not the plain loop's")
            obs, reward, term, trunc, _ = env.step(wrap(act_space, batch[act_key][k, t].numpy()))
            if not np.array_equal(batch["next", *obs_key][k, t].numpy(), unwrap(obs)):
                raise SystemExit(f"{what}: env {k}'s next observation at step {t} is not the plain loop's")
            if batch["next", "reward"][k, t, 0].item() != np.float32(reward):
                raise SystemExit(f"{what}: env {k}'s reward at step {t} is not the plain loop's")
            if term or trunc:
                obs, _ = env.reset()


async def main() -> None:
    runs = 0
    for obs_space, obs_key, act_space, act_key in CASES:
        for num_workers, vector in ((0, False), (1, False), (1, True)):
            if vector:
                def make(o=obs_space, a=act_space):
                    return gym.vector.SyncVectorEnv([lambda: PixelEnv(o, a)] * 2)

                kwargs = dict(envs_per_worker=1)
            else:
                make = PixelEnv
                kwargs = dict(create_env_kwargs={"observation_space": obs_space, "action_space": act_space}, envs_per_worker=2)
            what = f"{obs_space} / {act_space}, num_workers={num_workers}{', vector env' if vector else ''}"
            async with Collector(make, frames_per_batch=12, total_frames=24, num_workers=num_workers, seed=3, **kwargs) as c:
                async for batch in c:
                    batch = batch.clone()
                    break
            check(batch, obs_space, obs_key, act_space, act_key, 3, what)
            runs += 1
    print(f"ok: {runs} runs of one-leaf Dict/Tuple observation and action spaces gave the plain loop's data")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except SystemExit:
        raise
    except Exception as exc:  # the reason, on the last line
        print(f"failed: {type(exc).__name__}: {str(exc).splitlines()[0]}", file=sys.stderr)
        sys.exit(1)
