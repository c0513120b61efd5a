"""Memory for the batches the collector copies out of shared memory, reused once nothing refers
to it any more.

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


__all__ = ["ChunkPool"]
