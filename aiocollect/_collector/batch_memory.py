"""Memory for delivered batches, reused once nothing refers to it any more: the workers' slots
lent to the consumer (:class:`Loans`), or, when no slot can be lent, memory the batch is copied
into (:class:`ChunkPool`).

A batch is lent, not copied, when its slot can be spared: its tensors are views on the slot in
shared memory, and the slot goes back to the workers only once the consumer has dropped the batch
and everything derived from it without a copy (each lent slot has an array of its own that every
view refers to; its reference count says when none is left). So a lent batch behaves as a copy
(it stays valid, and yours to modify, for as long as you keep it), and a consumer that drops its
batches, as a training loop does, gets every batch without the copy: 200 KB per Atari frame.
A consumer that keeps batches keeps their slots; once ``capacity`` slots per worker are out,
batches are copied again, so the workers never wait for the consumer's memory.

A fresh allocation for every batch costs more than the copy itself: the kernel faults in and
zeroes every page (a 100 MB Atari batch: about 75 ms of page faults for a 15 ms copy). A batch's
tensors are views on one chunk of this pool; when the consumer drops them (and everything derived
from them without a copy), the chunk's reference count falls back to the pool's own references
and the next batch is copied into it, into pages that are already mapped. A batch that is still
referenced is never reused: correctness never depends on what the consumer does.
"""

from __future__ import annotations

import sys

import numpy as np

# references to a free chunk while take() looks at it: the pool's list, the loop variable and
# getrefcount's argument
_FREE_REFS = 3
# references to a returned loan's slot array while returned() looks at it: the loan's own and
# getrefcount's argument
_RETURNED_REFS = 2

Parts = list  # [(worker handle, slot)]: the slots a batch is a view on


class _Loan:
    __slots__ = ("array", "parts")

    def __init__(self, array: np.ndarray, parts: Parts) -> None:
        self.array = array
        self.parts = parts


class Loans:
    """The slots lent to the consumer as batches, at most ``capacity`` per worker at a time."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.out: list[_Loan] = []
        self.lent = 0  # batches lent so far

    def can_lend(self, parts: Parts) -> bool:
        for w, _ in parts:
            if sum(1 for loan in self.out for v, _ in loan.parts if v is w) >= self.capacity:
                return False
        return True

    def lend(self, array: np.ndarray, parts: Parts) -> None:
        """``array``: the slot's own array (:meth:`SlotLayout.slot_array`) that every view of the
        lent batch refers to, and nothing else."""
        self.out.append(_Loan(array, parts))
        self.lent += 1

    def returned(self) -> list[Parts]:
        """The parts of every loan nothing refers to any more (forgotten here: hand them back)."""
        back = [loan for loan in self.out if sys.getrefcount(loan.array) == _RETURNED_REFS]
        if back:
            self.out = [loan for loan in self.out if loan not in back]
        return [loan.parts for loan in back]

    def clear(self) -> None:
        """The workers are gone: nothing is handed back any more."""
        self.out = []


class ChunkPool:
    """At most ``keep`` chunks of one size are kept for reuse; beyond that, batches get memory of
    their own (freed with them, as any tensor's)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.chunks: list[np.ndarray] = []
        self.reused = 0  # takes served by a kept chunk (for the tests and the stats)

    def take(self, nbytes: int) -> np.ndarray:
        for chunk in self.chunks:
            if sys.getrefcount(chunk) == _FREE_REFS and chunk.nbytes == nbytes:
                self.reused += 1
                return chunk
        chunk = np.empty(nbytes, np.uint8)
        if len(self.chunks) >= self.keep:
            # a chunk of another size (the batch layout changed) or still in use: forget one of
            # another size first, else keep this one out of the pool
            for i, old in enumerate(self.chunks):
                if old.nbytes != nbytes:
                    del self.chunks[i]
                    break
            else:
                return chunk
        self.chunks.append(chunk)
        return chunk

    def clear(self) -> None:
        self.chunks.clear()


__all__ = ["ChunkPool", "Loans"]
