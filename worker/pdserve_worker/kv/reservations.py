"""The lease state machine a decode's KV reservations share, whatever holds their bytes.

A reservation handle (what the wire calls a slot) goes FREE → RESERVED (granted, its lease
running, waiting for its KV) → COMMITTED (the KV arrived, decoding) → FREE, or from RESERVED to
QUARANTINED (its lease ran out, or it was given back while a write could still land) and back
to FREE once `quarantine_s` passed. Every later message names (slot, generation); one about a
generation that is not live is ignored. kv/slots.py (one max-length slot per handle) and
kv/blocks.py (block lists, refcounted) are this machine plus what they hold: `_free_resources`
and `_quarantine_resources` are the only places they differ on the way out, so every path
that ends a reservation (commit-then-release, release, release_grant, expiry, quarantine's
end) runs the same code for both pools.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

from pdserve_common.kv_layout import KVLayout
from pdserve_common.logs import kv

log = logging.getLogger(__name__)


NONCE_BYTES = 16


def reservation_nonce(key: bytes, slot: int, generation: int) -> str:
    """The capability of reservation (slot, generation) under `key`, as hex."""
    mac = hmac.new(key, f"pdserve-reservation|{slot}|{generation}".encode(), hashlib.sha256).digest()
    return mac[:NONCE_BYTES].hex()


def nonce_matches(key: bytes, slot: int, generation: int, nonce: str) -> bool:
    """Constant-time check of a notify's nonce against (slot, generation)."""
    expected = reservation_nonce(key, slot, generation)
    return hmac.compare_digest(expected.encode(), nonce.encode("utf-8", "replace"))


def first_generation() -> int:
    """Milliseconds since the epoch in the high bits (grows across restarts), 20 random bits
    below: a restarted decode does not hand out the generations of its previous life."""
    return (int(time.time() * 1000) << 20) | secrets.randbits(20)


class SlotState(str, Enum):
    FREE = "free"
    RESERVED = "reserved"  # granted, waiting for its KV
    COMMITTED = "committed"  # KV arrived, decoding
    QUARANTINED = "quarantined"  # abandoned; not granted again before its deadline


@dataclass(frozen=True)
class SlotUsage:
    free: int
    reserved: int
    committed: int
    quarantined: int


@dataclass
class Reservation:
    """One handle's current reservation (lock held to read or write it)."""

    state: SlotState = SlotState.FREE
    generation: int = 0
    request_id: str = ""
    deadline: float = 0.0  # lease end while RESERVED, quarantine end while QUARANTINED
    nonce: str = ""  # the capability of the current generation


@dataclass(frozen=True)
class LeaseClock:
    """A table's time: what time it is (seconds, monotonic) and whom it tells of each lease
    that ran out (called with that reservation's grant, after the table's lock is released)."""

    now: Callable[[], float] = time.monotonic
    on_expire: Callable[[Any], None] | None = None


SYSTEM_CLOCK = LeaseClock()  # time.monotonic, nobody told


H = TypeVar("H", bound=Reservation)
G = TypeVar("G")


class ReservationTable(Generic[H, G]):
    """Leases, generations and quarantine over `handles`; subclasses say what a handle holds.

    Hooks (called with the lock held): `_grant(index, h)` makes the wire grant;
    `_free_resources(h)` gives back what a reservation holds as it becomes free (exactly once);
    `_quarantine_resources(index, h)` what it keeps or gives back as it is quarantined;
    `_end_write_lease(index, h)` revokes its write lease (transfer/leases.py).
    """

    kind = "reservation"  # for log events: slot_..., blocks_...

    def __init__(
        self,
        layout: KVLayout,
        handles: list[H],
        *,
        engine_id: str,
        base_addr: int,
        quarantine_s: float,
        clock: LeaseClock,
        capability_key: bytes | None,
    ) -> None:
        if quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {quarantine_s}")
        self.layout = layout
        self.engine_id = engine_id
        self.base_addr = base_addr
        self.quarantine_s = quarantine_s
        self._clock = clock.now
        self._on_expire = clock.on_expire
        self._key = capability_key or secrets.token_bytes(32)
        self._handles = handles
        self._generations = itertools.count(first_generation())
        self._lock = threading.Lock()

    # ---- the lease life ------------------------------------------------------------------------
    def renew(self, slot: int, generation: int, ttl_s: float) -> bool:
        """Extend a reservation's lease (e.g. a long prompt still pushing). False if stale."""
        with self._lock:
            h = self._live(slot, generation)
            if h is None or h.state is not SlotState.RESERVED:
                return False
            h.deadline = max(h.deadline, self._clock() + ttl_s)
            return True

    def commit(self, slot: int, generation: int) -> bool:
        """The KV arrived and decode takes it: the lease stops expiring. False if stale."""
        with self._lock:
            h = self._live(slot, generation)
            if h is None or h.state is not SlotState.RESERVED:
                current = self._handle(slot)
                log.info(kv(event=f"{self.kind}_commit_stale", slot=slot, generation=generation, **_describe(current)))
                return False
            h.state = SlotState.COMMITTED
            h.deadline = 0.0
            self._end_write_lease(slot, h)  # the KV is in: nothing more to write
            return True

    def release(self, slot: int, generation: int) -> bool:
        """Give the reservation back. Before commit it is quarantined (a write may be in
        flight); after commit it is free at once. A stale generation is a no-op (logged): False."""
        with self._lock:
            h = self._handle(slot)
            if h is None or h.state not in (SlotState.RESERVED, SlotState.COMMITTED) or h.generation != generation:
                log.info(kv(event=f"{self.kind}_release_stale", slot=slot, generation=generation, **_describe(h)))
                return False
            if h.state is SlotState.RESERVED:
                self._quarantine(slot, h)
            else:
                self._free(h)
            return True

    def release_grant(self, slot: int, generation: int, *, push_settled: bool) -> bool:
        """A router gives back a grant it will not use (worker.proto's Release).

        Reserved: free at once if `push_settled` (no write into it can still arrive), else
        quarantined. Quarantined for this very generation (its Generate was cancelled, or its
        lease ran out) and `push_settled`: free at once. Committed: left alone, the request's
        stream frees it. Anything else is stale: False."""
        with self._lock:
            h = self._handle(slot)
            if h is None or h.generation != generation:
                return False
            if h.state is SlotState.RESERVED:
                if push_settled:
                    self._end_write_lease(slot, h)  # not writable any more, like a quarantine
                    self._free(h)
                else:
                    self._quarantine(slot, h)
                return True
            if h.state is SlotState.QUARANTINED and push_settled:  # its write lease ended with the quarantine
                self._free(h)
                return True
            return False

    def expire(self) -> list[G]:
        """Quarantine every reservation whose lease has run out; returns their grants."""
        expired: list[G] = []
        with self._lock:
            now = self._clock()
            for index, h in enumerate(self._handles):
                if h.state is SlotState.RESERVED and h.deadline <= now:
                    expired.append(self._grant(index, h))
                    self._quarantine(index, h)
        for grant in expired:
            log.warning(kv(event=f"{self.kind}_lease_expired", **self._log_fields(grant)))
            if self._on_expire is not None:
                self._on_expire(grant)
        return expired

    # ---- queries -------------------------------------------------------------------------------
    def is_current(self, slot: int, generation: int) -> bool:
        """Whether (slot, generation) is a live reservation or commitment (not stale).
        A reservation whose lease has run out is stale even before `expire` swept it."""
        with self._lock:
            return self._live(slot, generation) is not None

    def is_reserved(self, slot: int, generation: int) -> bool:
        """Whether (slot, generation) still waits for its KV: the only time a ready message counts."""
        with self._lock:
            h = self._live(slot, generation)
            return h is not None and h.state is SlotState.RESERVED

    def grant_of(self, slot: int, generation: int) -> G | None:
        """The live reservation (slot, generation), reserved or committed, or None."""
        with self._lock:
            h = self._live(slot, generation)
            return None if h is None else self._grant(slot, h)

    def verify(self, slot: int, generation: int, nonce: str) -> bool:
        """Whether `nonce` is the capability of reservation (slot, generation) (live or not:
        `is_reserved` says whether it still waits). The current reservation's nonce is kept,
        so the common case is one constant-time compare rather than an HMAC."""
        with self._lock:
            h = self._handle(slot)
            expected = h.nonce if h is not None and h.generation == generation and h.nonce else None
        if expected is None:
            return nonce_matches(self._key, slot, generation, nonce)
        return hmac.compare_digest(expected.encode(), nonce.encode("utf-8", "replace"))

    def state(self, slot: int) -> SlotState:
        with self._lock:
            h = self._handles[slot]
            if h.state is SlotState.QUARANTINED and h.deadline <= self._clock():
                return SlotState.FREE
            return h.state

    # ---- internals (lock held) -----------------------------------------------------------------
    def _next_generation(self) -> int:
        return next(self._generations)

    def _claim(self, index: int, generation: int, request_id: str, ttl_s: float, now: float) -> H:
        """Free handle `index` becomes reservation `generation`, leased until now + ttl_s; the
        caller fills in what it holds."""
        h = self._handles[index]
        if h.state is not SlotState.FREE:
            raise AssertionError(f"{self.kind} {index} claimed while {h.state.value}")
        h.state, h.generation, h.request_id, h.deadline = SlotState.RESERVED, generation, request_id, now + ttl_s
        h.nonce = reservation_nonce(self._key, index, generation)
        return h

    def _handle(self, slot: int) -> H | None:
        return self._handles[slot] if 0 <= slot < len(self._handles) else None

    def _live(self, slot: int, generation: int) -> H | None:
        h = self._handle(slot)
        if h is None or h.generation != generation:
            return None
        if h.state is SlotState.COMMITTED or (h.state is SlotState.RESERVED and h.deadline > self._clock()):
            return h
        return None

    def _slot_usage(self) -> SlotUsage:
        """Handles per state, a quarantine past its deadline counted free."""
        now = self._clock()
        c = {state: 0 for state in SlotState}
        for h in self._handles:
            c[SlotState.FREE if h.state is SlotState.QUARANTINED and h.deadline <= now else h.state] += 1
        return SlotUsage(c[SlotState.FREE], c[SlotState.RESERVED], c[SlotState.COMMITTED], c[SlotState.QUARANTINED])

    def _quarantine(self, index: int, h: H) -> None:
        self._end_write_lease(index, h)
        h.state = SlotState.QUARANTINED
        h.deadline = self._clock() + self.quarantine_s
        h.request_id = ""
        self._quarantine_resources(index, h)

    def _free(self, h: H) -> None:
        """The one way a reservation ends: what it holds goes back, exactly once."""
        if h.state is SlotState.FREE:
            raise AssertionError(f"{self.kind} {h.generation} freed twice")
        self._free_resources(h)
        h.state, h.request_id, h.deadline = SlotState.FREE, "", 0.0

    def _revoke(self, revoke: Callable[[int, int], None] | None, index: int, generation: int) -> None:
        if revoke is None:
            return
        try:
            revoke(index, generation)
        except Exception as exc:  # a revoke that failed must not wedge the table
            log.error(kv(event="lease_end_failed", slot=index, generation=generation, error=repr(exc)))

    # ---- hooks ---------------------------------------------------------------------------------
    def _grant(self, index: int, h: H) -> G:
        raise NotImplementedError

    def _free_resources(self, h: H) -> None:
        """What the reservation holds goes back (lock held; called once per reservation)."""

    def _quarantine_resources(self, index: int, h: H) -> None:
        """What a quarantined reservation gives back at once (lock held)."""

    def _end_write_lease(self, index: int, h: H) -> None:
        raise NotImplementedError

    def _log_fields(self, grant: G) -> dict[str, object]:
        raise NotImplementedError


def _describe(h: Reservation | None) -> dict[str, object]:
    if h is None:
        return {"current": "no such slot"}
    return {"current_state": h.state.value, "current_generation": h.generation}
