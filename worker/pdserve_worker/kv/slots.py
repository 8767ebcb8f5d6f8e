"""Which request owns which decode slot: leases, generations and quarantine (pure logic).

A slot is granted to one request at a time with a lease (TTL). The grant carries a
generation number, unique over the table's life, and everything that refers to a slot later
(a ready notification, a commit, a release) names (slot, generation): a message about an older
generation is about a request that is gone and is ignored.

A lease that runs out, or a release before the KV was committed, means a prefill may still be
writing into the slot: its transfer was abandoned, not stopped. The slot is then
*quarantined*: free again, but not granted to anyone until `quarantine_s` has passed, so a
late write lands in a slot nobody reads, and a late ready notification names a dead
generation. Choose `quarantine_s` above the prefill's transfer timeout. A committed slot (its
KV arrived and decode took it) is released straight to free.

All methods are thread-safe; time comes from an injected clock, so tests drive it directly.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from pdserve_worker.kv.layout import KVLayout
from pdserve_worker.logs import kv

log = logging.getLogger("pdserve.kv.slots")


class SlotState(str, Enum):
    FREE = "free"
    RESERVED = "reserved"  # granted, waiting for its KV
    COMMITTED = "committed"  # KV arrived, decoding
    QUARANTINED = "quarantined"  # abandoned; not granted again before `quarantine_until`


class NoFreeSlot(RuntimeError):
    """Every slot is reserved, committed or quarantined."""


@dataclass(frozen=True)
class Grant:
    """What a prefill needs to push into a slot: where (engine, base, layout) and which lease."""

    request_id: str
    slot: int
    generation: int
    expires_at: float
    engine_id: str
    base_addr: int
    layout: KVLayout

    @property
    def slot_addr(self) -> int:
        """The slot's first byte in the decode process's address space."""
        return self.base_addr + self.layout.slot_span(self.slot)[0]

    def to_dict(self) -> dict[str, object]:
        return {
            "request_id": self.request_id,
            "slot": self.slot,
            "generation": self.generation,
            "engine_id": self.engine_id,
            "base_addr": self.base_addr,
            "layout": self.layout.to_dict(),
        }


@dataclass(frozen=True)
class SlotUsage:
    free: int
    reserved: int
    committed: int
    quarantined: int


@dataclass
class _Slot:
    state: SlotState = SlotState.FREE
    generation: int = 0
    request_id: str = ""
    deadline: float = 0.0  # lease end while RESERVED, quarantine end while QUARANTINED


class SlotTable:
    def __init__(
        self,
        layout: KVLayout,
        *,
        engine_id: str = "",
        base_addr: int = 0,
        quarantine_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_expire: Callable[[Grant], None] | None = None,
    ) -> None:
        if quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {quarantine_s}")
        self.layout = layout
        self.engine_id = engine_id
        self.base_addr = base_addr
        self.quarantine_s = quarantine_s
        self._clock = clock
        self._on_expire = on_expire
        self._slots = [_Slot() for _ in range(layout.num_slots)]
        self._generations = itertools.count(1)
        self._lock = threading.Lock()

    # ---- leases ------------------------------------------------------------------------------------
    def reserve(self, request_id: str, ttl_s: float) -> Grant:
        """Grant the lowest free slot for `ttl_s` seconds. Raises NoFreeSlot."""
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.expire()  # leases run out between sweeps too: settle them before choosing
        with self._lock:
            now = self._clock()
            for index, s in enumerate(self._slots):
                if s.state is SlotState.QUARANTINED and s.deadline <= now:
                    s.state = SlotState.FREE
                if s.state is SlotState.FREE:
                    s.state = SlotState.RESERVED
                    s.generation = next(self._generations)
                    s.request_id = request_id
                    s.deadline = now + ttl_s
                    grant = self._grant(index, s)
                    break
            else:
                usage = self._usage()
                raise NoFreeSlot(
                    f"no free KV slot for request {request_id!r}: {usage.reserved} reserved, "
                    f"{usage.committed} committed, {usage.quarantined} quarantined of {len(self._slots)}"
                )
        log.debug(kv(event="slot_reserved", request=request_id, slot=grant.slot, generation=grant.generation))
        return grant

    def renew(self, slot: int, generation: int, ttl_s: float) -> bool:
        """Extend a reservation's lease (e.g. a long prompt still pushing). False if stale."""
        with self._lock:
            s = self._slots[slot]
            if s.state is not SlotState.RESERVED or s.generation != generation:
                return False
            s.deadline = max(s.deadline, self._clock() + ttl_s)
            return True

    def commit(self, slot: int, generation: int) -> bool:
        """The slot's KV arrived and decode takes it: the lease stops expiring. False if stale."""
        with self._lock:
            s = self._slots[slot]
            if s.state is not SlotState.RESERVED or s.generation != generation:
                log.info(kv(event="slot_commit_stale", slot=slot, generation=generation, **self._describe(s)))
                return False
            s.state = SlotState.COMMITTED
            s.deadline = 0.0
            return True

    def release(self, slot: int, generation: int) -> bool:
        """Give the slot back. Before commit it is quarantined (a write may be in flight);
        after commit it is free at once. A stale generation is a no-op (logged): False."""
        with self._lock:
            s = self._slots[slot] if 0 <= slot < len(self._slots) else None
            if s is None or s.state not in (SlotState.RESERVED, SlotState.COMMITTED) or s.generation != generation:
                log.info(
                    kv(event="slot_release_stale", slot=slot, generation=generation, **self._describe(s))
                )
                return False
            if s.state is SlotState.RESERVED:
                self._quarantine(s)
            else:
                s.state = SlotState.FREE
                s.request_id = ""
            return True

    def expire(self) -> list[Grant]:
        """Quarantine every reservation whose lease has run out; returns their grants."""
        expired: list[Grant] = []
        with self._lock:
            now = self._clock()
            for index, s in enumerate(self._slots):
                if s.state is SlotState.RESERVED and s.deadline <= now:
                    expired.append(self._grant(index, s))
                    self._quarantine(s)
        for grant in expired:
            log.warning(
                kv(event="slot_lease_expired", request=grant.request_id, slot=grant.slot, generation=grant.generation)
            )
            if self._on_expire is not None:
                self._on_expire(grant)
        return expired

    # ---- queries -----------------------------------------------------------------------------------
    def is_current(self, slot: int, generation: int) -> bool:
        """Whether (slot, generation) is a live reservation or commitment (not stale)."""
        with self._lock:
            if not 0 <= slot < len(self._slots):
                return False
            s = self._slots[slot]
            return s.generation == generation and s.state in (SlotState.RESERVED, SlotState.COMMITTED)

    def is_reserved(self, slot: int, generation: int) -> bool:
        """Whether (slot, generation) still waits for its KV: the only time a ready message counts."""
        with self._lock:
            if not 0 <= slot < len(self._slots):
                return False
            s = self._slots[slot]
            return s.generation == generation and s.state is SlotState.RESERVED

    def state(self, slot: int) -> SlotState:
        with self._lock:
            s = self._slots[slot]
            if s.state is SlotState.QUARANTINED and s.deadline <= self._clock():
                return SlotState.FREE
            return s.state

    def usage(self) -> SlotUsage:
        with self._lock:
            return self._usage()

    # ---- internals (lock held) ----------------------------------------------------------------------
    def _usage(self) -> SlotUsage:
        now = self._clock()
        counts = {state: 0 for state in SlotState}
        for s in self._slots:
            state = SlotState.FREE if s.state is SlotState.QUARANTINED and s.deadline <= now else s.state
            counts[state] += 1
        return SlotUsage(
            counts[SlotState.FREE], counts[SlotState.RESERVED], counts[SlotState.COMMITTED], counts[SlotState.QUARANTINED]
        )

    def _quarantine(self, s: _Slot) -> None:
        s.state = SlotState.QUARANTINED
        s.deadline = self._clock() + self.quarantine_s
        s.request_id = ""

    def _grant(self, index: int, s: _Slot) -> Grant:
        return Grant(s.request_id, index, s.generation, s.deadline, self.engine_id, self.base_addr, self.layout)

    @staticmethod
    def _describe(s: _Slot | None) -> dict[str, object]:
        if s is None:
            return {"current": "no such slot"}
        return {"current_state": s.state.value, "current_generation": s.generation}
