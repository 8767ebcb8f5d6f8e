"""POSIX shared-memory segments: the host engine's allocator and a peer's view of them.

Hand-written over `mmap` of a file in /dev/shm rather than `multiprocessing.shared_memory`:
in Python 3.11 every process that *attaches* a SharedMemory registers it with its resource
tracker, which unlinks the segment when that process exits (fixed only in 3.13 with
`track=False`), so a decode pool would vanish when the first prefill exits.

Names carry the owner's pid and a random token, so a name that opens on a peer is the same
memory, never a namesake on another host: that is how a client finds out it shares /dev/shm
with the server (same host, same pod) and may take the zero-copy path.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import socket
from functools import lru_cache

SHM_DIR = "/dev/shm"
NAME_PREFIX = "pdserve-hixl-"


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

    def __init__(self, name: str, size: int, mapping: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap = mapping
        # from_buffer pins the mapping (mmap refuses to close while exported): the address
        # stays valid exactly as long as this object is open.
        self._view: ctypes.Array[ctypes.c_char] | None = (ctypes.c_char * size).from_buffer(mapping)
        self.addr = ctypes.addressof(self._view)

    @classmethod
    def create(cls, size: int, populate: bool = True) -> "ShmSegment":
        """A new zero-filled segment. `populate` faults every page in now (like device memory,
        it is then resident), so the first transfer into it does not pay for page faults."""
        if size <= 0:
            raise ValueError(f"shared-memory size must be positive, got {size}")
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mapping = _map(fd, size, populate)
        except BaseException:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        os.close(fd)
        return cls(name, size, mapping, owner=True)

    @classmethod
    def attach(cls, name: str, size: int, populate: bool = True) -> "ShmSegment":
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
        self._view = None
        self._mmap.close()
        if self.owner:
            self.unlink()

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


def _map(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
