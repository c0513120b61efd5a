"""Shared memory for batch slots: an anonymous memfd (Linux), so that nothing is left in /dev/shm
after a crash; elsewhere an already-unlinked temporary file. Freed when the last mapping and file
descriptor are gone. :func:`available` says how much of it this process can fill now."""

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


#: What a run keeps free for the rest of the program (the interpreter, torch, the envs, the
#: policy, the user's own data) when it checks that its batches fit: this share of the memory
#: that can be filled, and at least :data:`HEADROOM_MIN` bytes.
HEADROOM_SHARE = 0.10
HEADROOM_MIN = 256 * 2**20


def headroom(nbytes: int) -> int:
    """Bytes of ``nbytes`` (memory that can be filled) left for the rest of the program."""
    return max(int(nbytes * HEADROOM_SHARE), HEADROOM_MIN)


def available() -> tuple[int, str] | None:
    """Bytes of shared memory this process can fill now, and what says so (for messages);
    ``None`` where it cannot be known.

    A memfd's pages are anonymous shared memory, charged to RAM and swap and to the process's
    memory cgroup: the size of /dev/shm does not limit them. So on Linux this is the smaller of
    ``MemAvailable + SwapFree`` (/proc/meminfo) and the memory cgroup's limit less its usage (its
    inactive file cache, which the kernel reclaims, counted as free). Elsewhere a segment is an
    unlinked file in /dev/shm or the temporary directory, limited by that file system's free space."""
    if not hasattr(os, "memfd_create"):  # pragma: no cover - non-Linux
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        try:
            st = os.statvfs(folder)
        except (OSError, AttributeError):
            return None
        return st.f_bavail * st.f_frsize, f"the free space of {folder}"
    found: list[tuple[int, str]] = []
    meminfo = _meminfo()
    if "MemAvailable" in meminfo:
        free = meminfo["MemAvailable"] + meminfo.get("SwapFree", 0)
        found.append((free, "MemAvailable + SwapFree in /proc/meminfo"))
    cgroup = _cgroup_free()
    if cgroup is not None:
        found.append(cgroup)
    return min(found) if found else None


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
    except (OSError, ValueError, IndexError):
        return {}


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # (cgroup v2 writes "max" for no limit)


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_free() -> tuple[int, str] | None:
    """The tightest memory cgroup limit over this process's cgroup and its parents, less usage
    (v2: ``memory.max``, ``memory.current``; v1: ``memory.limit_in_bytes``, ``usage_in_bytes``)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for parts in lines:
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            root, files = "/sys/fs/cgroup", ("memory.max", "memory.current", "memory.stat", "inactive_file")
        elif "memory" in controllers.split(","):
            root = "/sys/fs/cgroup/memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.stat", "total_inactive_file")
        else:
            continue
        # the cgroup's own folder, and each parent up to the mount's root (in a container the
        # path may not exist below the mount: its root is then the container's cgroup)
        folders, path = [], path.rstrip("/")
        while True:
            folders.append(os.path.join(root, path.lstrip("/")) if path else root)
            if not path:
                break
            path = path.rpartition("/")[0]
        for folder in folders:
            limit = _read_int(os.path.join(folder, files[0]))
            usage = _read_int(os.path.join(folder, files[1]))
            if limit is None or usage is None or limit >= 2**60:  # no limit (v1 writes a huge number)
                continue
            free = max(limit - usage + _stat(os.path.join(folder, files[2]), files[3]), 0)
            if best is None or free < best[0]:
                best = (free, f"the limit of the memory cgroup {folder} less its usage")
    return best
