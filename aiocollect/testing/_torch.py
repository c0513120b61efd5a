"""The torch part of :mod:`aiocollect.testing`: :class:`FaultyPolicy`, loaded on first use (so
that importing ``aiocollect.testing``, which worker processes do, never imports torch).

A module of its own, so that the class pickles by reference (``aiocollect.testing._torch``) and
travels to worker processes like any policy class of a user's package.
"""

from __future__ import annotations

from typing import Literal

import torch

from ._failures import InjectedFailure

__all__ = ["FaultyPolicy"]

FAULTS = ("raise", "wrong_shape", "nan")


class FaultyPolicy(torch.nn.Module):
    """A policy module that fails on purpose on its N-th call.

    It maps observations ``[E, *obs]`` (its only input, so the collector passes it the
    observation tensor) to actions of shape ``[E, *action_shape]`` and dtype ``dtype``, all equal
    to ``action``: with the defaults, action ``0`` of a ``Discrete`` space. On the ``at_call``-th
    call (1-based) it injects its fault, then goes back to normal:

    - ``"raise"``: raises :class:`~aiocollect.testing.InjectedFailure`;
    - ``"wrong_shape"``: returns actions with an extra last dimension of size 3
      (``[E, *action_shape, 3]``);
    - ``"nan"``: returns actions that are all NaN (``dtype`` must be a float dtype, for a ``Box``
      action space: ``ValueError`` at construction otherwise).

    Calls are counted by each copy in its own process (:attr:`calls`): a copy sent to a worker
    starts from the count it had when it was sent. The collector and the evaluator call a worker's
    copy once at start-up to check its outputs: ``at_call=1`` fails there, ``at_call=2`` at the
    first step.

    It has one parameter (``bias``, unused), so that it has weights to synchronise like any
    policy. Pickles by reference (class ``aiocollect.testing._torch.FaultyPolicy``).

    Examples:
        >>> policy = FaultyPolicy("raise", at_call=3)
        >>> policy(torch.zeros(2, 4)).shape
        torch.Size([2])
    """

    def __init__(
        self,
        fault: Literal["raise", "wrong_shape", "nan"] = "raise",
        at_call: int = 1,
        *,
        action: float = 0,
        action_shape: tuple[int, ...] = (),
        dtype: torch.dtype = torch.int64,
    ) -> None:
        super().__init__()
        if fault not in FAULTS:
            raise ValueError(f"fault={fault!r} must be one of {FAULTS}")
        if isinstance(at_call, bool) or not isinstance(at_call, int) or at_call < 1:
            raise ValueError(f"at_call={at_call!r} must be an int >= 1 (1: the first call)")
        if fault == "nan" and not dtype.is_floating_point:
            raise ValueError(f"fault='nan' needs a float dtype (a Box action space), got dtype={dtype}")
        self.fault = fault
        self.at_call = at_call
        self.action = action
        self.action_shape = tuple(action_shape)
        self.dtype = dtype
        self.calls = 0
        """Calls so far in this process (including one that failed)."""
        self.bias = torch.nn.Parameter(torch.zeros(()))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        """Actions for the ``E = observation.shape[0]`` envs; the fault on call ``at_call``."""
        self.calls += 1
        shape: tuple[int, ...] = (observation.shape[0],) + self.action_shape
        if self.calls == self.at_call:
            if self.fault == "raise":
                raise InjectedFailure(f"FaultyPolicy: injected failure at call {self.calls}")
            if self.fault == "wrong_shape":
                shape = shape + (3,)
            else:
                return torch.full(shape, float("nan"), dtype=self.dtype)
        return torch.full(shape, self.action, dtype=self.dtype)

    def extra_repr(self) -> str:
        return f"fault={self.fault!r}, at_call={self.at_call}, calls={self.calls}"
