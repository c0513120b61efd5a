"""The exception that the envs and the policy of :mod:`aiocollect.testing` raise on purpose (its
own module, so that the torch part imports it without importing the package)."""

from __future__ import annotations


class InjectedFailure(RuntimeError):
    """Raised on purpose by the envs of this module (``fail_at_step``, ``fail_on_reset``) and by
    :class:`FaultyPolicy`.

    Tests catch it to check that an env's exception reaches the consumer (wrapped in
    :class:`aiocollect.WorkerError` when it comes from a worker).
    """


InjectedFailure.__module__ = "aiocollect.testing"
