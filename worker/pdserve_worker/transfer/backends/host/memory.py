"""The host engine's local memory: its shared-memory allocations, the registered regions, and
cached byte views of them.

`malloc_mem` memory is a POSIX shared-memory segment (shm.py) whose name a peer on this host
is told at connect, so it can map it (the zero-copy path). A registration inside such a
segment records the segment's name and offset; any other registered memory reaches a peer
only over TCP. Calls take the engine's lock, shared with the engine's other tables.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from pdserve_common.logs import kv
from pdserve_worker.transfer import hixl_api as api
from pdserve_worker.transfer.backends.host.regions import Region, RegionTable
from pdserve_worker.transfer.backends.host.shm import ShmSegment

log = logging.getLogger(__name__)


class MemoryTable:
    """Segments by address, registrations by handle, and a view per registered region."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self.regions = RegionTable()
        self._segments: dict[int, ShmSegment] = {}  # malloc_mem's allocations by address
        self._views: dict[Region, memoryview] = {}

    def malloc(self, size: int, mem_type: int) -> tuple[int, int]:
        if mem_type != api.MemType.MEM_HOST:
            return api.UNSUPPORTED, 0
        if not isinstance(size, int) or size <= 0:
            return api.PARAM_INVALID, 0
        try:
            seg = ShmSegment.create(size)
        except OSError as exc:
            log.error(kv(event="malloc_failed", size=size, error=exc))
            return api.RESOURCE_EXHAUSTED, 0
        with self._lock:
            self._segments[seg.addr] = seg
        return api.SUCCESS, seg.addr

    def free(self, addr: int) -> int:
        with self._lock:
            seg = self._segments.pop(addr, None)
            if seg is None:
                return api.PARAM_INVALID
            for region in self.regions.snapshot(include_local_only=True):
                if region.shm_name == seg.name:
                    handle = self.regions.handle_of(region)
                    if handle is not None:
                        self.regions.remove(handle)
                    self._views.pop(region, None)
        seg.close()
        return api.SUCCESS

    def register(self, mem_desc: Any, mem_type: int) -> tuple[int, int]:
        addr, length = int(mem_desc.addr), int(mem_desc.len)
        if addr <= 0 or length <= 0 or int(mem_type) not in (api.MEM_DEVICE, api.MEM_HOST):
            return api.PARAM_INVALID, 0
        shm_name, shm_offset, shm_size = "", 0, 0
        with self._lock:
            for seg in self._segments.values():
                if seg.addr <= addr and addr + length <= seg.addr + seg.size:
                    shm_name, shm_offset, shm_size = seg.name, addr - seg.addr, seg.size
                    break
            region = Region(
                addr=addr,
                length=length,
                mem_type=int(mem_type),
                shm_name=shm_name,
                shm_offset=shm_offset,
                shm_size=shm_size,
                local_only=bool(getattr(mem_desc, "local_only", False)),
            )
            handle = self.regions.add(region)
        return api.SUCCESS, handle

    def deregister(self, handle: int) -> int:
        if not handle:
            return api.PARAM_INVALID
        region = self.regions.remove(int(handle))  # unknown or repeated: SUCCESS, like HIXL
        if region is not None:
            self._views.pop(region, None)
        return api.SUCCESS

    def view_of(self, region: Region) -> memoryview:
        """A cached byte view of a local registered region (dropped when it is deregistered)."""
        view = self._views.get(region)
        if view is None:
            view = memoryview((ctypes.c_char * region.length).from_address(region.addr)).cast("B")
            self._views[region] = view
        return view

    def clear(self) -> None:
        """At finalize (lock held): drop the views, free the segments, forget the regions."""
        self._views.clear()
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        self.regions = RegionTable()
