"""What the lifecycle tests share: recording every phase move a test makes (each one checked
against its table as it is made) and reading the moves as one path."""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable, Mapping

import pytest


def record_moves(
    monkeypatch: pytest.MonkeyPatch, owner: type, table: Mapping[Any, frozenset], public_state: Callable[[Any], Any],
) -> list[tuple[Any, Any]]:
    """Every phase move of every ``owner`` made during the test, as (from, to). Each move is
    checked as it is made: the table allows it, and the phase entered reports its public state
    (``public_state(obj)``, e.g. what ``collector.state`` reads)."""
    seen: list[tuple[Any, Any]] = []
    original = owner.move_to  # type: ignore[attr-defined]

    @functools.wraps(original)
    def move_to(self: Any, phase: Any) -> None:
        before = self.phase
        original(self, phase)
        assert phase in table[before], f"{before.name} -> {phase.name} was made, and is not in the table"
        assert self.phase is phase and public_state(self) is phase.public
        seen.append((before, phase))

    monkeypatch.setattr(owner, "move_to", move_to)
    return seen


def path(moves: list[tuple[enum.Enum, enum.Enum]]) -> list[enum.Enum]:
    """The phases the moves went through, in order (they must chain: each starts where the
    last ended)."""
    for (_, to), (frm, _) in zip(moves, moves[1:]):
        assert to is frm, f"the moves do not chain: {moves}"
    return [moves[0][0], *(to for _, to in moves)]
