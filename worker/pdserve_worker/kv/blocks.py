"""Which request owns which KV blocks of a decode: reservations of block lists (pure logic).

A decode's KV pool is split into fixed-size blocks of `block_tokens` tokens (kv/block_layout.py).
A request is granted a *reservation*: the list of blocks that holds its prompt plus every token
it may generate (`prompt + max_tokens`, capped at the model's length). The whole need is taken
at admission rather than a first share grown while decoding: a request that was admitted can
then never run out of KV mid-stream, so there is no preemption, no recompute and no 429 after
the first token — the only refusal is at the door, where the router can retry another decode.
What it costs is the tokens a request reserves but does not reach (it stops early); compared
with a `max_len` slot per request that is still most of the gain (`300 + 64` tokens instead of
2,048).

The semantics are those of the slot table (kv/slots.py), one reservation standing where a slot
stood:
- A reservation is named by its `generation`, unique over the allocator's life (clock-based
  start with random low bits, as slots'); every later message (ready notify, commit, release)
  names a generation, and one that is not live is ignored.
- It carries a capability `nonce` = HMAC(key, generation), handed out only in the grant.
- A lease (TTL) runs until the KV is committed. A lease that runs out, or a release before
  commit, *quarantines* the reservation: its writable blocks are held, granted to nobody, for
  `quarantine_s`, so a late write of an abandoned push lands in blocks nobody reads. A
  committed reservation's release frees its blocks at once.
- `release_grant(push_settled=...)`: a router gives back a grant it will not use; free at once
  when no write can still arrive, else quarantined.
- `leases` hooks are told of every grant (with its writable blocks) and of every end of the
  write lease, under the allocator's lock (transfer/leases.py makes exactly those bytes
  writable).

Blocks are refcounted. A reservation may *share* leading blocks of a committed reservation
(the same prompt prefix already decoded here): those are read-only to it (not in its writable
list, never leased for writing), so one writer per block holds. A block is free exactly when
no live or quarantined reservation holds it; every path that ends a reservation (commit-then-
release, release, release_grant, expiry, quarantine end) goes through `_drop`, the one place a
reservation's references are given back, exactly once.

`max_reservations` caps concurrent requests (what `slots` means now); capacity is tokens.

All methods are thread-safe; time comes from an injected clock, so tests drive it directly.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from pdserve_worker.kv.slots import NONCE_BYTES, first_generation
from pdserve_worker.logs import kv

log = logging.getLogger("pdserve.kv.blocks")


class ReservationState(str, Enum):
    RESERVED = "reserved"  # granted, waiting for its KV
    COMMITTED = "committed"  # KV arrived, decoding
    QUARANTINED = "quarantined"  # abandoned; its blocks are held until `deadline`


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks (or the reservation cap is reached) for a request."""


class BlockLeaseHooks(Protocol):
    """What an allocator tells about write leases (transfer.leases.BlockWriteLeases)."""

    def granted(self, generation: int, blocks: tuple[int, ...]) -> None: ...

    def ended(self, generation: int) -> None: ...


def block_nonce(key: bytes, generation: int) -> str:
    """The capability of reservation `generation` under `key`, as hex."""
    mac = hmac.new(key, f"pdserve-blocks|{generation}".encode(), hashlib.sha256).digest()
    return mac[:NONCE_BYTES].hex()


def blocks_for(num_tokens: int, block_tokens: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one may be partly used)."""
    if num_tokens < 0 or block_tokens <= 0:
        raise ValueError(f"blocks_for({num_tokens}, {block_tokens}): need tokens >= 0 and block_tokens > 0")
    return -(-num_tokens // block_tokens)


@dataclass(frozen=True)
class BlockGrant:
    """A reservation as a prefill needs it: which blocks, which of them it writes, which lease."""

    request_id: str
    generation: int
    blocks: tuple[int, ...]  # in token order: blocks[i] holds tokens [i*B, (i+1)*B)
    shared: int  # leading blocks shared read-only with another reservation (already hold KV)
    num_tokens: int  # tokens reserved (prompt + max new)
    expires_at: float
    nonce: str = field(default="", repr=False)

    @property
    def writable(self) -> tuple[int, ...]:
        return self.blocks[self.shared:]


@dataclass(frozen=True)
class BlockUsage:
    total_blocks: int
    free_blocks: int
    reserved_blocks: int  # held by reservations still waiting for their KV
    committed_blocks: int  # held by decoding requests (shared blocks counted once)
    quarantined_blocks: int
    reservations: int  # live (reserved + committed)
    block_tokens: int

    @property
    def tokens_total(self) -> int:
        return self.total_blocks * self.block_tokens

    @property
    def tokens_used(self) -> int:
        return (self.total_blocks - self.free_blocks) * self.block_tokens


@dataclass
class _Reservation:
    request_id: str
    generation: int
    blocks: tuple[int, ...]
    shared: int
    num_tokens: int
    prompt_tokens: int
    state: ReservationState
    deadline: float  # lease end while RESERVED, quarantine end while QUARANTINED
    nonce: str
    held: tuple[int, ...] = ()  # the blocks whose references this reservation still holds


class BlockAllocator:
    def __init__(
        self,
        num_blocks: int,
        block_tokens: int,
        *,
        max_reservations: int | None = None,
        quarantine_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_expire: Callable[[BlockGrant], None] | None = None,
        capability_key: bytes | None = None,
        leases: BlockLeaseHooks | None = None,
    ) -> None:
        if num_blocks <= 0 or block_tokens <= 0:
            raise ValueError(f"num_blocks and block_tokens must be positive, got {num_blocks}, {block_tokens}")
        if quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {quarantine_s}")
        if max_reservations is not None and max_reservations <= 0:
            raise ValueError(f"max_reservations must be positive, got {max_reservations}")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.max_reservations = max_reservations
        self.quarantine_s = quarantine_s
        self._clock = clock
        self._on_expire = on_expire
        self._key = capability_key or secrets.token_bytes(32)
        self._leases = leases
        self._refs = [0] * num_blocks
        # Lowest block first: a fresh pool hands out runs of consecutive blocks, which a push
        # moves as one descriptor per layer (kv/block_layout.py).
        self._free: list[int] = list(range(num_blocks))
        self._by_gen: dict[int, _Reservation] = {}  # every reservation that holds blocks
        self._generations = itertools.count(first_generation())
        self._lock = threading.Lock()

    # ---- reservations ------------------------------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int, ttl_s: float, *, prompt_tokens: int | None = None,
                share_from: int | None = None, shared_blocks: int = 0) -> BlockGrant:
        """Grant blocks for `num_tokens` tokens for `ttl_s` seconds. Raises NoFreeBlocks.

        `prompt_tokens` (default `num_tokens`): how many of them the prefill writes; only whole
        blocks of a reservation's prompt may later be shared.
        `share_from`/`shared_blocks`: take the first `shared_blocks` blocks of the committed
        reservation `share_from` read-only instead of fresh ones (their KV is already here, and
        its decode never writes them: they hold only prompt tokens)."""
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
        if num_tokens <= 0:
            raise ValueError(f"a reservation needs at least one token, got {num_tokens}")
        prompt = num_tokens if prompt_tokens is None else prompt_tokens
        if not 0 < prompt <= num_tokens:
            raise ValueError(f"prompt_tokens must be in 1..{num_tokens}, got {prompt_tokens}")
        need = blocks_for(num_tokens, self.block_tokens)
        if need > self.num_blocks:
            raise NoFreeBlocks(f"request {request_id!r} needs {need} blocks ({num_tokens} tokens), "
                               f"more than this pool's {self.num_blocks}")
        if not 0 <= shared_blocks <= need:
            raise ValueError(f"shared_blocks must be in 0..{need}, got {shared_blocks}")
        self.expire()
        with self._lock:
            now = self._clock()
            self._sweep(now)
            shared: tuple[int, ...] = ()
            if shared_blocks:
                source = self._by_gen.get(share_from) if share_from is not None else None
                if source is None or source.state is not ReservationState.COMMITTED:
                    raise ValueError(f"share_from {share_from} is not a committed reservation")
                whole = min(source.prompt_tokens, prompt) // self.block_tokens
                if shared_blocks > whole:
                    raise ValueError(f"cannot share {shared_blocks} blocks: {whole} whole prompt blocks in common")
                shared = source.blocks[:shared_blocks]
            live = sum(1 for r in self._by_gen.values() if r.state is not ReservationState.QUARANTINED)
            if self.max_reservations is not None and live >= self.max_reservations:
                raise NoFreeBlocks(f"no KV reservation for request {request_id!r}: {live} requests live, "
                                   f"the cap is {self.max_reservations}")
            fresh = need - len(shared)
            if fresh > len(self._free):
                usage = self._usage(now)
                raise NoFreeBlocks(
                    f"no KV blocks for request {request_id!r}: needs {fresh} blocks ({num_tokens} tokens), "
                    f"{usage.free_blocks} free, {usage.reserved_blocks} reserved, {usage.committed_blocks} committed, "
                    f"{usage.quarantined_blocks} quarantined of {self.num_blocks}")
            generation = next(self._generations)
            taken = tuple(heapq.heappop(self._free) for _ in range(fresh))
            if self._leases is not None and taken:
                try:
                    self._leases.granted(generation, taken)
                except BaseException:
                    for b in taken:
                        heapq.heappush(self._free, b)
                    raise
            blocks = shared + taken
            for b in blocks:
                self._refs[b] += 1
            res = _Reservation(request_id, generation, blocks, len(shared), num_tokens, prompt, ReservationState.RESERVED,
                               now + ttl_s, block_nonce(self._key, generation), held=blocks)
            self._by_gen[generation] = res
            grant = self._grant(res)
        log.debug(kv(event="blocks_reserved", request=request_id, generation=generation, blocks=len(blocks),
                     shared=len(shared), tokens=num_tokens))
        return grant

    def renew(self, generation: int, ttl_s: float) -> bool:
        with self._lock:
            res = self._live(generation)
            if res is None or res.state is not ReservationState.RESERVED:
                return False
            res.deadline = max(res.deadline, self._clock() + ttl_s)
            return True

    def commit(self, generation: int) -> bool:
        """The KV arrived and decode takes it: the lease stops expiring. False if stale."""
        with self._lock:
            res = self._live(generation)
            if res is None or res.state is not ReservationState.RESERVED:
                log.info(kv(event="blocks_commit_stale", generation=generation))
                return False
            res.state = ReservationState.COMMITTED
            res.deadline = 0.0
            self._end_lease(res)
            return True

    def release(self, generation: int) -> bool:
        """Give the blocks back: before commit quarantined, after commit free. Stale: False."""
        with self._lock:
            res = self._by_gen.get(generation)
            if res is None or res.state is ReservationState.QUARANTINED:
                log.info(kv(event="blocks_release_stale", generation=generation))
                return False
            if res.state is ReservationState.RESERVED:
                self._quarantine(res)
            else:
                self._drop(res)
            return True

    def release_grant(self, generation: int, *, push_settled: bool) -> bool:
        """A router gives back a grant it will not use (see kv/slots.py's `release_grant`)."""
        with self._lock:
            res = self._by_gen.get(generation)
            if res is None:
                return False
            if res.state is ReservationState.RESERVED:
                if push_settled:
                    self._end_lease(res)
                    self._drop(res)
                else:
                    self._quarantine(res)
                return True
            if res.state is ReservationState.QUARANTINED and push_settled:
                self._drop(res)
                return True
            return False

    def expire(self) -> list[BlockGrant]:
        """Quarantine every reservation whose lease has run out; returns their grants."""
        expired: list[BlockGrant] = []
        with self._lock:
            now = self._clock()
            for res in list(self._by_gen.values()):
                if res.state is ReservationState.RESERVED and res.deadline <= now:
                    expired.append(self._grant(res))
                    self._quarantine(res)
        for grant in expired:
            log.warning(kv(event="blocks_lease_expired", request=grant.request_id, generation=grant.generation,
                           blocks=len(grant.blocks)))
            if self._on_expire is not None:
                self._on_expire(grant)
        return expired

    # ---- queries -------------------------------------------------------------------------------
    def is_current(self, generation: int) -> bool:
        with self._lock:
            return self._live(generation) is not None

    def is_reserved(self, generation: int) -> bool:
        with self._lock:
            res = self._live(generation)
            return res is not None and res.state is ReservationState.RESERVED

    def verify(self, generation: int, nonce: str) -> bool:
        expected = block_nonce(self._key, generation)
        return hmac.compare_digest(expected.encode(), nonce.encode("utf-8", "replace"))

    def grant_of(self, generation: int) -> BlockGrant | None:
        """The live reservation `generation` (reserved or committed), or None."""
        with self._lock:
            res = self._live(generation)
            return None if res is None else self._grant(res)

    def refcount(self, block: int) -> int:
        with self._lock:
            return self._refs[block]

    def usage(self) -> BlockUsage:
        with self._lock:
            now = self._clock()
            self._sweep(now)
            return self._usage(now)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a reservation of `num_tokens` would be granted now (no side effect)."""
        with self._lock:
            now = self._clock()
            self._sweep(now)
            live = sum(1 for r in self._by_gen.values() if r.state is not ReservationState.QUARANTINED)
            if self.max_reservations is not None and live >= self.max_reservations:
                return False
            return blocks_for(num_tokens, self.block_tokens) <= len(self._free)

    # ---- internals (lock held) -------------------------------------------------------------------
    def _live(self, generation: int) -> _Reservation | None:
        res = self._by_gen.get(generation)
        if res is None:
            return None
        if res.state is ReservationState.COMMITTED:
            return res
        if res.state is ReservationState.RESERVED and res.deadline > self._clock():
            return res
        return None

    def _sweep(self, now: float) -> None:
        """Quarantines that have run their time end: their blocks are free again."""
        for res in [r for r in self._by_gen.values()
                    if r.state is ReservationState.QUARANTINED and r.deadline <= now]:
            self._drop(res)

    def _quarantine(self, res: _Reservation) -> None:
        """Writable blocks held until the deadline; shared ones (never written by this
        reservation's push) are given back at once."""
        self._end_lease(res)
        res.state = ReservationState.QUARANTINED
        res.deadline = self._clock() + self.quarantine_s
        shared, writable = res.held[:res.shared], res.held[res.shared:]
        self._unref(shared)
        res.held = writable
        if not writable or self.quarantine_s == 0:
            self._drop(res)

    def _drop(self, res: _Reservation) -> None:
        """The one place a reservation gives back its block references (exactly once)."""
        if self._by_gen.pop(res.generation, None) is None:
            raise AssertionError(f"reservation {res.generation} dropped twice")
        self._unref(res.held)
        res.held = ()

    def _unref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise AssertionError(f"block {b} released with refcount {self._refs[b]}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)

    def _end_lease(self, res: _Reservation) -> None:
        if self._leases is not None and res.blocks[res.shared:]:
            try:
                self._leases.ended(res.generation)
            except Exception as exc:  # a revoke that failed must not wedge the allocator
                log.error(kv(event="lease_end_failed", generation=res.generation, error=repr(exc)))

    def _usage(self, now: float) -> BlockUsage:
        counts = {state: set() for state in ReservationState}
        for res in self._by_gen.values():
            counts[res.state].update(res.held)
        committed = counts[ReservationState.COMMITTED]
        reserved = counts[ReservationState.RESERVED] - committed
        quarantined = counts[ReservationState.QUARANTINED]
        live = sum(1 for r in self._by_gen.values() if r.state is not ReservationState.QUARANTINED)
        return BlockUsage(self.num_blocks, len(self._free), len(reserved), len(committed), len(quarantined), live,
                          self.block_tokens)

    @staticmethod
    def _grant(res: _Reservation) -> BlockGrant:
        return BlockGrant(res.request_id, res.generation, res.blocks, res.shared, res.num_tokens,
                          res.deadline, res.nonce)
