"""Registered memory regions and the range check every transfer goes through (pure logic).

HIXL rejects an op whose local or remote range is not wholly inside one registered segment
with PARAM_INVALID (HIXL.md 1.4, 1.7). Both sides of the host engine use this table: the
client for its own memory and for the snapshot of the server's regions it fetched at connect,
the server again before it writes a byte it received.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Region:
    """One registered range. `shm_*` say where it lives when the host engine allocated it."""

    addr: int
    length: int
    mem_type: int
    shm_name: str = ""  # empty: not shareable, reached only through the owner's server
    shm_offset: int = 0  # offset of `addr` inside that segment
    shm_size: int = 0  # the whole segment's size: a peer maps all of it once
    local_only: bool = False
    end: int = field(init=False, compare=False, repr=False)  # addr + length, precomputed: hot path

    def __post_init__(self) -> None:
        object.__setattr__(self, "end", self.addr + self.length)

    def contains(self, addr: int, length: int) -> bool:
        return length >= 0 and self.addr <= addr and addr + length <= self.end

    def to_wire(self) -> dict[str, object]:
        data = asdict(self)
        del data["end"]
        return data

    @classmethod
    def from_wire(cls, data: dict[str, object]) -> Region:
        return cls(**{k: v for k, v in data.items() if k != "end"})  # type: ignore[arg-type]


class RegionTable:
    """Regions sorted by start address, looked up with bisect; overlapping regions are allowed.

    Thread-safe: the server's handler threads look up while the owner registers.
    """

    def __init__(self, regions: list[Region] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_handle: dict[int, Region] = {}
        self._sorted: list[tuple[int, int, Region]] = []  # (addr, handle, region)
        self._live: set[Region] = set()
        self._last: Region | None = None  # most recent hit; cleared on any removal
        self._next_handle = 1
        for region in regions or []:
            self.add(region)

    def add(self, region: Region) -> int:
        """Returns the region's handle; registering the same (addr, len) again returns the same one."""
        with self._lock:
            for handle, existing in self._by_handle.items():
                if existing.addr == region.addr and existing.length == region.length:
                    return handle
            handle = self._next_handle
            self._next_handle += 1
            self._by_handle[handle] = region
            self._live.add(region)
            bisect.insort(self._sorted, (region.addr, handle, region))
            return handle

    def remove(self, handle: int) -> Region | None:
        with self._lock:
            region = self._by_handle.pop(handle, None)
            if region is not None:
                self._last = None
                self._sorted.remove((region.addr, handle, region))
                self._live.discard(region)
            return region

    def find(self, addr: int, length: int) -> Region | None:
        """The region holding [addr, addr+length) whole, or None."""
        last = self._last  # the hot path: a push's runs all fall in one pool
        if last is not None and last.addr <= addr and addr + length <= last.end and length >= 0:
            return last
        with self._lock:
            i = bisect.bisect_right(self._sorted, (addr, float("inf")))
            # Candidates start at or before addr; with few overlaps the nearest one holds it.
            for j in range(i - 1, -1, -1):
                region = self._sorted[j][2]
                if region.contains(addr, length):
                    self._last = region
                    return region
            return None

    def handle_of(self, region: Region) -> int | None:
        with self._lock:
            for handle, existing in self._by_handle.items():
                if existing == region:
                    return handle
            return None

    def __contains__(self, region: object) -> bool:
        """Whether exactly this region is still registered (the server's second check)."""
        with self._lock:
            return region in self._live

    def snapshot(self, include_local_only: bool = False) -> list[Region]:
        with self._lock:
            return [r for _, _, r in self._sorted if include_local_only or not r.local_only]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_handle)
