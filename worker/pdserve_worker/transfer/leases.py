"""Which registered bytes a remote peer may write right now: the leases of live reservations.

A decode's pool is registered whole (HIXL: register before connect), but only reserved slots
are due to receive KV. With the host engine's `pdserve.RemoteWrite=leased` a remote WRITE lands
only where every range lies in a lease (else PARAM_INVALID, counted as `writes_refused`).
Leases do not bound peers inside the service: any may write into any slot reserved now, and a
WRITE is checked when it starts, so its payload may land after the lease ended (quarantine
keeps such a slot from reuse where the grant ended without a commit).
- `LeaseTable`: the engine's side (pure, thread-safe): ranges by id, and the check.
- `SlotWriteLeases`: a slot table's hooks (`granted`/`ended`) leasing a reservation's slot in
  the engine until commit, release or expiry; a no-op on an engine without lease calls (real
  HIXL: the NetworkPolicy and the capability check bound a peer there).
- `BlockWriteLeases`: the same for a block table (kv/blocks.py): one engine lease per (layer,
  K|V, run of consecutive blocks) of a reservation's own blocks (`block_spans`).
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Sequence

from pdserve_common.kv_layout import KVLayout, block_spans
from pdserve_common.logs import kv
from pdserve_worker.transfer.base import TransferBackend

log = logging.getLogger(__name__)


class LeaseTable:
    """Leased byte ranges by id. A paged pool leases one range per (layer, K|V, block run) of
    each reservation (thousands), so the check is a bisect over the ranges sorted by start:
    live leases never overlap (one writer per byte: the tables grant disjoint slots and blocks),
    so the only candidate for an address is the range that starts last at or before it. The
    last hit is tried first (a slot push's runs all fall in one lease)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: dict[int, tuple[int, int]] = {}  # id -> (start, end)
        self._sorted: list[tuple[int, int]] = []  # the live (start, end), by start
        self._next = 1
        self._last: tuple[int, int] | None = None

    def grant(self, addr: int, length: int) -> int:
        if addr < 0 or length <= 0:
            raise ValueError(f"lease of {length} bytes at {addr:#x}: need a positive length")
        span = (addr, addr + length)
        with self._lock:
            i = bisect.bisect_left(self._sorted, span)
            before = self._sorted[i - 1] if i else None
            after = self._sorted[i] if i < len(self._sorted) else None
            if (before is not None and before[1] > addr) or (after is not None and after[0] < span[1]):
                raise ValueError(f"lease of {length} bytes at {addr:#x} overlaps a live lease")
            lease_id = self._next
            self._next += 1
            self._ranges[lease_id] = span
            self._sorted.insert(i, span)
            return lease_id

    def revoke(self, lease_id: int) -> bool:
        with self._lock:
            gone = self._ranges.pop(lease_id, None)
            if gone is None:
                return False
            i = bisect.bisect_left(self._sorted, gone)
            del self._sorted[i]
            if gone == self._last:
                self._last = None
            return True

    def covers(self, addr: int, length: int) -> bool:
        """Whether [addr, addr+length) lies wholly inside one live lease."""
        end = addr + length
        with self._lock:
            last = self._last
            if last is not None and last[0] <= addr and end <= last[1]:
                return True
            i = bisect.bisect_right(self._sorted, (addr, float("inf"))) - 1
            if i >= 0 and self._sorted[i][1] >= end:
                self._last = self._sorted[i]
                return True
            return False

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranges)


class SlotWriteLeases:
    """A `SlotTable`'s lease hooks over an engine's `lease_write`/`revoke_write`.

    The table calls these under its own lock, so a grant's lease exists before the grant is
    returned (and so before any prefill can learn of it), and an ended reservation cannot be
    leased again by a late call. Raises RuntimeError when the engine refuses a lease: the
    reservation is then not granted."""

    def __init__(self, backend: TransferBackend, base_addr: int, layout: KVLayout) -> None:
        self._engine = backend.host  # real HIXL has no write leases
        self._api = backend.api
        self._base = base_addr
        self._layout = layout
        self.enabled = self._engine is not None
        self._leases: dict[tuple[int, int], int] = {}  # (slot, generation) -> engine lease id

    def granted(self, slot: int, generation: int) -> None:
        if self._engine is None:
            return
        offset, length = self._layout.slot_span(slot)
        status, lease_id = self._engine.lease_write(self._base + offset, length)
        if status != self._api.SUCCESS:
            raise RuntimeError(f"engine refused a write lease for slot {slot} ({length} bytes): status {status}")
        self._leases[(slot, generation)] = lease_id

    def ended(self, slot: int, generation: int) -> None:
        lease_id = self._leases.pop((slot, generation), None)
        if lease_id is not None and self._engine is not None:
            status = self._engine.revoke_write(lease_id)
            if status != self._api.SUCCESS:
                log.warning(kv(event="lease_revoke_failed", slot=slot, generation=generation, status=status))

    def __len__(self) -> int:
        return len(self._leases)


class BlockWriteLeases:
    """A `BlockTable`'s lease hooks: a reservation's own (writable) blocks become writable for
    peers when granted and stop being so when its KV arrived, it was released, or it expired.
    Called under the table's lock, like `SlotWriteLeases`. A refused lease revokes what this
    grant got so far and raises: the reservation is then not granted."""

    def __init__(self, backend: TransferBackend, base_addr: int, layout: KVLayout) -> None:
        self._engine = backend.host  # real HIXL has no write leases
        self._api = backend.api
        self._base = base_addr
        self._blocks = layout.blocks
        self.enabled = self._engine is not None
        self._leases: dict[tuple[int, int], list[int]] = {}  # (slot, generation) -> engine lease ids

    def granted(self, slot: int, generation: int, blocks: Sequence[int]) -> None:
        if self._engine is None:
            return
        ids: list[int] = []
        for offset, length in block_spans(self._blocks, blocks):
            status, lease_id = self._engine.lease_write(self._base + offset, length)
            if status != self._api.SUCCESS:
                for got in ids:
                    self._engine.revoke_write(got)
                raise RuntimeError(
                    f"engine refused a write lease for slot {slot}'s blocks ({length} bytes at "
                    f"offset {offset}): status {status}"
                )
            ids.append(lease_id)
        self._leases[(slot, generation)] = ids

    def ended(self, slot: int, generation: int) -> None:
        ids = self._leases.pop((slot, generation), None)
        if ids and self._engine is not None:
            for lease_id in ids:
                status = self._engine.revoke_write(lease_id)
                if status != self._api.SUCCESS:
                    log.warning(kv(event="lease_revoke_failed", slot=slot, generation=generation, status=status))

    def __len__(self) -> int:
        return len(self._leases)
