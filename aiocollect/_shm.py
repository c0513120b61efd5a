"""Shared memory for batch slots: an anonymous memfd (Linux), so that nothing is left in /dev/shm
after a crash; elsewhere an already-unlinked temporary file. Freed when the last mapping and file
descriptor are gone."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile


def allocate(nbytes: int, name: str) -> tuple[int, mmap.mmap]:
    """A file descriptor for a zero-filled segment of ``nbytes`` and the caller's mapping of it."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
            fd = os.dup(f.fileno())
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def discard(mapping: mmap.mmap, offset: int, length: int) -> None:
    """Free the memory of ``length`` bytes at ``offset`` (page-aligned) of a segment nothing will
    read again, though the segment stays mapped (best effort: where the kernel cannot, the memory
    is freed with the segment)."""
    if length > 0:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            mapping.madvise(mmap.MADV_REMOVE, offset, length)
