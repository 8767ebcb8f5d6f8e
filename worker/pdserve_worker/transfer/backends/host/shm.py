"""POSIX shared-memory segments: the host engine's allocator and a peer's view of them.

Hand-written over `mmap` of a file in /dev/shm rather than `multiprocessing.shared_memory`:
in Python 3.11 a process that attaches a SharedMemory unlinks it when it exits (its resource
tracker; `track=False` is 3.13), so a decode pool would vanish with the first prefill.
Names carry the owner's pid and a random token: a name that opens on a peer is the same
memory, which is how a client learns it shares /dev/shm with the server (the zero-copy path).
The owner holds a shared `flock` on each segment while it lives; creating a segment first
unlinks every pdserve segment nobody holds a lock on (flock is on the file, so it works across
PID namespaces: a live owner in another container is never taken for a dead one).
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import socket
import time
from functools import lru_cache

from pdserve_common.logs import kv

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "pdserve-hixl-"
ORPHAN_MIN_AGE_S = 10.0


@lru_cache(maxsize=1)
def host_identity() -> str:
    """hostname plus kernel boot id: equal only for processes of one running host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


class ShmSegment:
    """One mapping of a /dev/shm file; `addr` is its raw address in this process."""

    def __init__(self, name: str, size: int, mapping: mmap.mmap, owner: bool, lock_fd: int = -1) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._lock_fd = lock_fd  # the owner's open file, holding the liveness flock
        self._mmap = mapping
        # from_buffer pins the mapping (mmap refuses to close while exported): the address
        # stays valid exactly as long as this object is open.
        self._view: ctypes.Array[ctypes.c_char] | None = (ctypes.c_char * size).from_buffer(mapping)
        self.addr = ctypes.addressof(self._view)
        self.bytes = memoryview(self._view).cast("B")  # for copies cheaper than a ctypes call

    @classmethod
    def create(cls, size: int, populate: bool = True) -> ShmSegment:
        """A new zero-filled segment. `populate` faults every page in now (like device memory,
        it is then resident), so the first transfer into it does not pay for page faults."""
        if size <= 0:
            raise ValueError(f"shared-memory size must be positive, got {size}")
        reap_orphans()
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, size)
            mapping = _map(fd, size, populate)
        except BaseException:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        return cls(name, size, mapping, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, size: int, populate: bool = True) -> ShmSegment:
        """Map a peer's segment. Raises OSError when it is not visible here (another host or
        pod) and ValueError when the file there is not the size the peer announced."""
        if not name.startswith(NAME_PREFIX) or "/" in name:
            raise ValueError(f"not a pdserve shared-memory name: {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"shared memory {name} has {actual} bytes, peer announced {size}")
            mapping = _map(fd, size, populate)
        finally:
            os.close(fd)
        return cls(name, size, mapping, owner=False)

    @property
    def closed(self) -> bool:
        return self._view is None

    def close(self) -> None:
        """Unmap (the owner also unlinks). Callers make sure no copy into it is running."""
        if self._view is None:
            return
        self.bytes.release()
        self._view = None
        self._mmap.close()
        if self.owner:
            self.unlink()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


def reap_orphans() -> list[str]:
    """Unlink pdserve segments whose owner is gone (nobody holds their flock). Returns names."""
    reaped: list[str] = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)]
    except OSError:
        return reaped
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            if time.time() - os.fstat(fd).st_ctime < ORPHAN_MIN_AGE_S:
                continue  # maybe created a moment ago, its owner not yet holding the lock
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live owner holds it
        finally:
            os.close(fd)  # also drops the lock we may have taken
        try:
            os.unlink(path)
            reaped.append(name)
        except FileNotFoundError:
            pass
    if reaped:
        log.warning(kv(event="shm_orphans_reaped", count=len(reaped), names=",".join(reaped)))
    return reaped


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
