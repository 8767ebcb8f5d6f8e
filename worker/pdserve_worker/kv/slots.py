"""Which request owns which decode slot: leases, generations and quarantine (pure logic).

A slot is granted to one request at a time with a lease (TTL). The grant carries a
generation number, unique over the table's life, and everything that refers to a slot later
(a ready notification, a commit, a release) names (slot, generation): a message about an older
generation is about a request that is gone and is ignored.

Generations are not a secret and must not need to be: they start at a clock-based value with
random low bits (unique across restarts, so a layer-sharded group's followers, which only let
generations grow, keep working after the leader restarts) and count up. What a ready notify
must also carry is the grant's `nonce`, a capability: HMAC(key, slot, generation), 128 bits,
unguessable without the key. The decode hands it out only in its Reserve answer; the router
passes it to the prefill; `verify` checks it. A MAC rather than a stored random value so that
every member of a sharded group (which share the service-derived key, link_auth.py) can check
a notify for a reservation it was never told about; without a key the table makes a random one.

`leases` (optional) is told of every grant and of every end of one, under the table's lock:
the decode's engine uses it to make exactly the reserved slots writable (transfer/leases.py).

A lease that runs out, or a release before the KV was committed, means a prefill may still be
writing into the slot: its transfer was abandoned, not stopped. The slot is then
*quarantined*: free again, but not granted to anyone until `quarantine_s` has passed, so a
late write lands in a slot nobody reads, and a late ready notification names a dead
generation. Choose `quarantine_s` above the prefill's transfer timeout. A committed slot (its
KV arrived and decode took it) is released straight to free.

A router that gives a grant back (`release_grant`) says whether a write can still arrive: if
no push was ever started for it, or the prefill confirmed its push is over (`push_settled`),
the slot is free at once, even out of the quarantine its cancelled Generate put it in; else it
is quarantined. Only a push that may still be running costs a quarantine.

All methods are thread-safe; time comes from an injected clock, so tests drive it directly.
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
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from pdserve_common.kv_layout import KVLayout
from pdserve_common.logs import kv

log = logging.getLogger("pdserve.kv.slots")


class SlotState(str, Enum):
    FREE = "free"
    RESERVED = "reserved"  # granted, waiting for its KV
    COMMITTED = "committed"  # KV arrived, decoding
    QUARANTINED = "quarantined"  # abandoned; not granted again before `quarantine_until`


class NoFreeSlot(RuntimeError):
    """Every slot is reserved, committed or quarantined."""


class LeaseHooks(Protocol):
    """What a slot table tells about its reservations (transfer.leases.SlotWriteLeases)."""

    def granted(self, slot: int, generation: int) -> None: ...

    def ended(self, slot: int, generation: int) -> None: ...


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


@dataclass(frozen=True)
class Grant:
    """A slot reserved for one request: where its bytes are (engine, pool base, layout), which
    reservation (slot, generation) and its capability. The one grant type: the decode's table
    makes it, the wire carries it (worker.proto's Grant, `rpc.convert`), the prefill pushes
    into it (`transfer.push.KVPusher` targets)."""

    request_id: str
    slot: int
    generation: int
    engine_id: str
    base_addr: int
    layout: KVLayout
    nonce: str = field(default="", repr=False)  # the capability a ready notify must carry (hex)
    # A paged pool's reservation (kv/blocks.py): its blocks in token order, of which the first
    # `shared` are another reservation's (read-only here: the push skips them). Empty for a slot.
    blocks: tuple[int, ...] = ()
    shared: int = 0

    @property
    def writable(self) -> tuple[int, ...]:
        """The blocks a push writes (a paged reservation's own)."""
        return self.blocks[self.shared :]

    @property
    def slot_addr(self) -> int:
        """The slot's first byte in the decode process's address space."""
        return self.base_addr + self.layout.slot_span(self.slot)[0]

    def describe(self) -> str:
        """For logs and errors (the nonce is a secret of the request and is left out)."""
        return f"{self.engine_id} slot={self.slot} generation={self.generation} request={self.request_id}"


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
    nonce: str = ""  # the capability of the current generation


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
        capability_key: bytes | None = None,
        leases: LeaseHooks | None = None,
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
        self._generations = itertools.count(first_generation())
        self._key = capability_key or secrets.token_bytes(32)
        self._leases = leases
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
                    generation = next(self._generations)
                    if self._leases is not None:
                        self._leases.granted(index, generation)  # may raise: then nothing changed
                    s.state = SlotState.RESERVED
                    s.generation = generation
                    s.nonce = reservation_nonce(self._key, index, generation)
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
            s = self._live(slot, generation)
            if s is None or s.state is not SlotState.RESERVED:
                return False
            s.deadline = max(s.deadline, self._clock() + ttl_s)
            return True

    def commit(self, slot: int, generation: int) -> bool:
        """The slot's KV arrived and decode takes it: the lease stops expiring. False if stale."""
        with self._lock:
            s = self._live(slot, generation)
            if s is None or s.state is not SlotState.RESERVED:
                current = self._slots[slot] if 0 <= slot < len(self._slots) else None
                log.info(kv(event="slot_commit_stale", slot=slot, generation=generation, **self._describe(current)))
                return False
            s.state = SlotState.COMMITTED
            s.deadline = 0.0
            self._end_lease(slot, generation)  # the KV is in: nothing more to write
            return True

    def release(self, slot: int, generation: int) -> bool:
        """Give the slot back. Before commit it is quarantined (a write may be in flight);
        after commit it is free at once. A stale generation is a no-op (logged): False."""
        with self._lock:
            s = self._slots[slot] if 0 <= slot < len(self._slots) else None
            if s is None or s.state not in (SlotState.RESERVED, SlotState.COMMITTED) or s.generation != generation:
                log.info(kv(event="slot_release_stale", slot=slot, generation=generation, **self._describe(s)))
                return False
            if s.state is SlotState.RESERVED:
                self._quarantine(slot, s)
            else:
                s.state = SlotState.FREE
                s.request_id = ""
            return True

    def release_grant(self, slot: int, generation: int, *, push_settled: bool) -> bool:
        """A router gives back a grant it will not use (worker.proto's Release).

        Reserved: free at once if `push_settled` (no write into it can still arrive), else
        quarantined. Quarantined for this very generation (its Generate was cancelled, or its
        lease ran out) and `push_settled`: free at once. Committed: left alone, the request's
        stream frees it. Anything else is stale: False."""
        with self._lock:
            s = self._slots[slot] if 0 <= slot < len(self._slots) else None
            if s is None or s.generation != generation:
                return False
            if s.state is SlotState.RESERVED:
                if push_settled:
                    self._end_lease(slot, s.generation)  # not writable any more, like a quarantine
                    self._free(s)
                else:
                    self._quarantine(slot, s)
                return True
            if s.state is SlotState.QUARANTINED and push_settled:  # its write lease ended with the quarantine
                self._free(s)
                return True
            return False

    def expire(self) -> list[Grant]:
        """Quarantine every reservation whose lease has run out; returns their grants."""
        expired: list[Grant] = []
        with self._lock:
            now = self._clock()
            for index, s in enumerate(self._slots):
                if s.state is SlotState.RESERVED and s.deadline <= now:
                    expired.append(self._grant(index, s))
                    self._quarantine(index, s)
        for grant in expired:
            log.warning(
                kv(event="slot_lease_expired", request=grant.request_id, slot=grant.slot, generation=grant.generation)
            )
            if self._on_expire is not None:
                self._on_expire(grant)
        return expired

    # ---- queries -----------------------------------------------------------------------------------
    def is_current(self, slot: int, generation: int) -> bool:
        """Whether (slot, generation) is a live reservation or commitment (not stale).
        A reservation whose lease has run out is stale even before `expire` swept it."""
        with self._lock:
            s = self._live(slot, generation)
            return s is not None

    def verify(self, slot: int, generation: int, nonce: str) -> bool:
        """Whether `nonce` is the capability of reservation (slot, generation) (live or not:
        `is_reserved` says whether it still waits). The current reservation's nonce is kept,
        so the common case is one constant-time compare rather than an HMAC."""
        with self._lock:
            s = self._slots[slot] if 0 <= slot < len(self._slots) else None
            expected = s.nonce if s is not None and s.generation == generation and s.nonce else None
        if expected is None:
            return nonce_matches(self._key, slot, generation, nonce)
        return hmac.compare_digest(expected.encode(), nonce.encode("utf-8", "replace"))

    def is_reserved(self, slot: int, generation: int) -> bool:
        """Whether (slot, generation) still waits for its KV: the only time a ready message counts."""
        with self._lock:
            s = self._live(slot, generation)
            return s is not None and s.state is SlotState.RESERVED

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
    def _live(self, slot: int, generation: int) -> _Slot | None:
        if not 0 <= slot < len(self._slots):
            return None
        s = self._slots[slot]
        if s.generation != generation:
            return None
        if s.state is SlotState.COMMITTED or (s.state is SlotState.RESERVED and s.deadline > self._clock()):
            return s
        return None

    def _usage(self) -> SlotUsage:
        now = self._clock()
        counts = {state: 0 for state in SlotState}
        for s in self._slots:
            state = SlotState.FREE if s.state is SlotState.QUARANTINED and s.deadline <= now else s.state
            counts[state] += 1
        return SlotUsage(
            counts[SlotState.FREE],
            counts[SlotState.RESERVED],
            counts[SlotState.COMMITTED],
            counts[SlotState.QUARANTINED],
        )

    @staticmethod
    def _free(s: _Slot) -> None:
        s.state = SlotState.FREE
        s.request_id = ""
        s.deadline = 0.0

    def _quarantine(self, index: int, s: _Slot) -> None:
        self._end_lease(index, s.generation)
        s.state = SlotState.QUARANTINED
        s.deadline = self._clock() + self.quarantine_s
        s.request_id = ""

    def _end_lease(self, index: int, generation: int) -> None:
        if self._leases is not None:
            try:
                self._leases.ended(index, generation)
            except Exception as exc:  # a revoke that failed must not wedge the table
                log.error(kv(event="lease_end_failed", slot=index, generation=generation, error=repr(exc)))

    def _grant(self, index: int, s: _Slot) -> Grant:
        return Grant(
            s.request_id,
            index,
            s.generation,
            self.engine_id,
            self.base_addr,
            self.layout,
            s.nonce or reservation_nonce(self._key, index, s.generation),
        )

    @staticmethod
    def _describe(s: _Slot | None) -> dict[str, object]:
        if s is None:
            return {"current": "no such slot"}
        return {"current_state": s.state.value, "current_generation": s.generation}
