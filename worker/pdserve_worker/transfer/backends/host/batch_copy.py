"""One batch of shared-memory copies between a local region and one mapped peer segment.

A tensor-parallel prefill rank pushing into a decode pool that holds more KV heads than it
writes a slice of every token's row: thousands of equal, short runs per request (2 × layers ×
tokens per prompt). Copied one by one, each run costs a Python-level slice assignment (more
than moving its 256 bytes); here equal runs are one numpy fancy-index copy over
"window" views of both buffers (row i of a window view is bytes i..i+length), so the bytes
move in a C loop. Runs of different lengths, or few of them, take the plain loop, and long
ones `ctypes.memmove`, which releases the GIL.

Every offset was range-checked by the engine against the two regions before a BatchCopy is
made (engine.py `_resolve_within`); numpy's own index check is a second fence.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from pdserve_worker.transfer.backends.host.shm import ShmSegment

MEMMOVE_MIN_BYTES = 256 << 10  # from here on a copy releases the GIL (ctypes.memmove)
VECTOR_MIN_RUNS = 16  # below this, numpy's per-call cost exceeds the loop's


@dataclass(slots=True)
class BatchCopy:
    """Runs i: `lengths[i]` bytes between `local` at `local_offs[i]` and `segment` at `peer_offs[i]`."""

    local: memoryview  # the local registered region's bytes
    local_addr: int  # its address (for memmove)
    segment: ShmSegment
    local_offs: list[int]
    peer_offs: list[int]
    lengths: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)

    def run(self, write: bool) -> None:
        """Copy every run: local → peer when `write`, else peer → local."""
        lengths = self.lengths
        first = lengths[0]
        if len(lengths) >= VECTOR_MIN_RUNS and first < MEMMOVE_MIN_BYTES and lengths.count(first) == len(lengths):
            self._vector(first, write)
            return
        for loff, poff, n in zip(self.local_offs, self.peer_offs, lengths):
            copy_run(self.local, self.local_addr, loff, self.segment, poff, n, write)

    def _vector(self, length: int, write: bool) -> None:
        local = _windows(np.frombuffer(self.local, dtype=np.uint8), length)
        peer = _windows(np.frombuffer(self.segment.bytes, dtype=np.uint8), length)
        loffs = np.array(self.local_offs, dtype=np.intp)
        poffs = np.array(self.peer_offs, dtype=np.intp)
        if write:
            peer[poffs] = local[loffs]
        else:
            local[loffs] = peer[poffs]


def copy_run(
    local: memoryview, local_addr: int, loff: int, segment: ShmSegment, poff: int, n: int, write: bool
) -> None:
    """One run between `local` (at address `local_addr`) and the peer's mapped `segment`: a
    memoryview slice assignment when short (a third of a ctypes call's overhead, which dominates
    below a few hundred KB), `ctypes.memmove` when long (it releases the GIL, so other Python
    threads run while the bytes move)."""
    if n >= MEMMOVE_MIN_BYTES:
        here, there = local_addr + loff, segment.addr + poff
        ctypes.memmove(there, here, n) if write else ctypes.memmove(here, there, n)
    elif write:
        segment.bytes[poff : poff + n] = local[loff : loff + n]
    else:
        local[loff : loff + n] = segment.bytes[poff : poff + n]


def _windows(buf: np.ndarray, length: int) -> np.ndarray:
    """`[len(buf) - length + 1, length]`: row i is buf[i : i + length] (a view, no copy)."""
    return as_strided(buf, shape=(buf.size - length + 1, length), strides=(1, 1), writeable=True)
