"""A stand-in for a gymnasium plugin package such as ``ale_py``: importing it registers its env ids,
with string entry points into the package (as ale_py registers ``"ale_py.env:AtariEnv"``).

The tests import it in their own process only; a worker imports it when gymnasium loads the entry
point, which registers the ids once more there."""

import gymnasium

gymnasium.register(
    "FakePlugin/Counting-v0",
    entry_point="fake_plugin.envs:PluginEnv",
    kwargs={"episode_length": 4},
    max_episode_steps=100,
)
