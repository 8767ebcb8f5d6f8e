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

import logging
from dataclasses import dataclass, field
from typing import Protocol

from pdserve_common.kv_layout import KVLayout
from pdserve_common.logs import kv
from pdserve_worker.kv.reservations import (
    NONCE_BYTES,
    SYSTEM_CLOCK,
    LeaseClock,
    Reservation,
    ReservationTable,
    SlotState,
    SlotUsage,
    first_generation,
    nonce_matches,
    reservation_nonce,
)

__all__ = [
    "NONCE_BYTES",
    "Grant",
    "LeaseHooks",
    "NoFreeSlot",
    "SlotState",
    "SlotTable",
    "SlotUsage",
    "first_generation",
    "nonce_matches",
    "reservation_nonce",
]

log = logging.getLogger(__name__)


class NoFreeSlot(RuntimeError):
    """Every slot is reserved, committed or quarantined."""


class LeaseHooks(Protocol):
    """What a slot table tells about its reservations (transfer.leases.SlotWriteLeases)."""

    def granted(self, slot: int, generation: int) -> None: ...

    def ended(self, slot: int, generation: int) -> None: ...


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


class SlotTable(ReservationTable[Reservation, Grant]):
    """One max-length slot per reservation; the lease life is kv/reservations.py's."""

    kind = "slot"

    def __init__(
        self,
        layout: KVLayout,
        *,
        engine_id: str = "",
        base_addr: int = 0,
        quarantine_s: float = 30.0,
        clock: LeaseClock = SYSTEM_CLOCK,
        capability_key: bytes | None = None,
        leases: LeaseHooks | None = None,
    ) -> None:
        super().__init__(
            layout,
            [Reservation() for _ in range(layout.num_slots)],
            engine_id=engine_id,
            base_addr=base_addr,
            quarantine_s=quarantine_s,
            clock=clock,
            capability_key=capability_key,
        )
        self._leases = leases

    def reserve(self, request_id: str, ttl_s: float) -> Grant:
        """Grant the lowest free slot for `ttl_s` seconds. Raises NoFreeSlot."""
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        self.expire()  # leases run out between sweeps too: settle them before choosing
        with self._lock:
            now = self._clock()
            for index, s in enumerate(self._handles):
                if s.state is SlotState.QUARANTINED and s.deadline <= now:
                    self._free(s)
                if s.state is SlotState.FREE:
                    generation = self._next_generation()
                    if self._leases is not None:
                        self._leases.granted(index, generation)  # may raise: then nothing changed
                    grant = self._grant(index, self._claim(index, generation, request_id, ttl_s, now))
                    break
            else:
                usage = self._usage()
                raise NoFreeSlot(
                    f"no free KV slot for request {request_id!r}: {usage.reserved} reserved, "
                    f"{usage.committed} committed, {usage.quarantined} quarantined of {len(self._handles)}"
                )
        log.debug(kv(event="slot_reserved", request=request_id, slot=grant.slot, generation=grant.generation))
        return grant

    def usage(self) -> SlotUsage:
        with self._lock:
            return self._usage()

    # ---- hooks and internals (lock held) -------------------------------------------------------
    def _usage(self) -> SlotUsage:
        return self._slot_usage()

    def _end_write_lease(self, index: int, h: Reservation) -> None:
        self._revoke(None if self._leases is None else self._leases.ended, index, h.generation)

    def _grant(self, index: int, h: Reservation) -> Grant:
        return Grant(h.request_id, index, h.generation, self.engine_id, self.base_addr, self.layout, h.nonce)

    def _log_fields(self, grant: Grant) -> dict[str, object]:
        return {"request": grant.request_id, "slot": grant.slot, "generation": grant.generation}
