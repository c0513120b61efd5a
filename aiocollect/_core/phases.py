"""Checked lifecycles: a phase enum, a table of the moves it may make, and :class:`Lifecycle`,
the one place where the phase changes.

A lifecycle's phases are an :class:`enum.Enum` whose members each report the public state
users see (``phase.public``) and say what they mean (``phase.meaning``); several phases may
report one public state (closing, and closed, both read ``closed``). Its table maps every
phase to the phases it may move to. :meth:`Lifecycle.move_to` refuses any other move with
:class:`_PhaseError`: an ``AssertionError``, because only a bug of aiocollect makes one, never
its user.

Imported by worker processes: standard library only.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Generic, Mapping, TypeVar

P = TypeVar("P", bound=enum.Enum)


class PhaseEnum(enum.Enum):
    """The base of a lifecycle's phases: each member is written ``NAME = public_state, meaning``
    and reports both (``phase.public``, ``phase.meaning``)."""

    def __init__(self, public_state: Any, meaning: str) -> None:
        self.public = public_state
        self.meaning = meaning


class _PhaseError(AssertionError):
    """A lifecycle was asked to make a move between phases that its table does not allow: a bug
    of aiocollect, never of its user."""


def checked_table(phases: type[P], table: Mapping[P, frozenset[P]]) -> dict[P, frozenset[P]]:
    """``table`` as a dict, once it is checked: it lists the moves of every phase of ``phases``
    (none for a last phase), and only to phases of ``phases``. Raises :class:`_PhaseError`
    otherwise (at import, where the table is written)."""
    missing = [p.name for p in phases if p not in table]
    strangers = [repr(p) for p, nexts in table.items() for q in (p, *nexts) if not isinstance(q, phases)]
    if missing or strangers:
        raise _PhaseError(f"the {phases.__name__} table lacks the moves of {missing} or names {strangers}")
    return dict(table)


class Lifecycle(Generic[P]):
    """One object's phase, moved only along its table (see the module docstring).

    ``who`` names the object in :class:`_PhaseError`'s message ("an evaluator's run"). A move
    may be made from any thread: :attr:`moving` (a re-entrant lock) is held while it is made,
    and a caller that must check the phase and move in one step holds it around both."""

    __slots__ = ("_phase", "_table", "_who", "moving")

    def __init__(self, first: P, table: Mapping[P, frozenset[P]], who: str) -> None:
        self._phase = first
        self._table = table
        self._who = who
        self.moving = threading.RLock()

    @property
    def phase(self) -> P:
        """The current phase (read-only: :meth:`move_to` changes it)."""
        return self._phase

    def allows(self, phase: P) -> bool:
        """``phase`` is one the table lets the current phase move to."""
        return phase in self._table[self._phase]

    def move_to(self, phase: P) -> None:
        """Enter ``phase``; :class:`_PhaseError` for a move the table does not allow."""
        with self.moving:
            if phase not in self._table[self._phase]:
                raise _PhaseError(f"{self._who} cannot go from {self._phase.name} to {phase.name}")
            self._phase = phase

    def __repr__(self) -> str:
        return f"<Lifecycle of {self._who}: {self._phase.name}>"


__all__ = ["Lifecycle", "PhaseEnum", "_PhaseError", "checked_table"]
