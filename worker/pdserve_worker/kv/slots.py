"""Which request owns which decode slot: leases, generations and quarantine (pure logic).

A slot is granted to one request at a time with a lease (TTL); the grant's generation is
unique over the table's life (clock-based start, random low bits, counting up), and every later
message (ready notify, commit, release) names (slot, generation): one about an older generation
is ignored. A ready notify must also carry the grant's `nonce`, HMAC(key, slot, generation):
a MAC, so every member of a sharded group (same service-derived key) can check it; without a
key the table makes a random one. `leases` hooks are told of every grant and every end, under
the lock (transfer/leases.py makes exactly the reserved slots writable).
A lease that runs out, or a release before commit, quarantines the slot for `quarantine_s`
(choose it above the prefill's transfer timeout): a late write lands where nobody reads. A
committed slot is released straight to free. `release_grant(push_settled=...)` frees at once
when no write can still arrive, else quarantines. Thread-safe; time comes from the injected
`LeaseClock` (kv/reservations.py), so tests drive it.
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
