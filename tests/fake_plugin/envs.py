"""The fake plugin's env."""

from aiocollect.testing import CountingEnv


class PluginEnv(CountingEnv):
    """A :class:`~aiocollect.testing.CountingEnv` that lives in a plugin package."""
