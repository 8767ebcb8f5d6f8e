"""Which request owns which KV blocks of a decode: reservations of block lists (pure logic).

A decode's pool is cut into blocks of `block_tokens` tokens (pdserve_common/kv_layout.py). A
request gets at admission the blocks of its whole need (`prompt + max_tokens`), so it never
runs out of KV mid-stream: the only refusal is at the door (NoFreeBlocks). `max_reservations`
caps concurrent requests (what `slots` means here: the handle a request decodes in).
The lease life is the slot table's (kv/reservations.py): (slot, generation) names a
reservation, its capability `nonce`, the lease until commit, quarantine of writable blocks
when a lease runs out or is released before commit, `release_grant(push_settled=...)`, and
`leases` hooks told of every grant (with its writable blocks) and every end, under the lock.
Blocks are refcounted: a reservation may share leading blocks of a committed one (same prompt
prefix), read-only to it; `_free_resources` is the one place references are given back. With
`keep_for`, a prompt's whole blocks are kept (`_Kept`) for its later copies until they came,
`KEEP_S` passed, or a reservation needs them: keeping never refuses a request. Thread-safe.
"""

from __future__ import annotations

import collections
import heapq
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve_common.kv_layout import KVLayout
from pdserve_common.logs import kv
from pdserve_worker.kv.decode_prefix import CachedPrompt, DecodePrefixCache
from pdserve_worker.kv.reservations import SYSTEM_CLOCK, LeaseClock, Reservation, ReservationTable
from pdserve_worker.kv.slots import Grant, NoFreeSlot, SlotState, SlotUsage

log = logging.getLogger(__name__)


class NoFreeBlocks(NoFreeSlot):
    """Not enough free blocks, or every reservation handle is taken, for a request."""


class BlockLeaseHooks(Protocol):
    """What a block table tells about write leases (transfer.leases.BlockWriteLeases)."""

    def granted(self, slot: int, generation: int, blocks: tuple[int, ...]) -> None: ...

    def ended(self, slot: int, generation: int) -> None: ...


def blocks_for(num_tokens: int, block_tokens: int) -> int:
    """Blocks that hold `num_tokens` tokens (the last one may be partly used)."""
    if num_tokens < 0 or block_tokens <= 0:
        raise ValueError(f"blocks_for({num_tokens}, {block_tokens}): need tokens >= 0 and block_tokens > 0")
    return -(-num_tokens // block_tokens)


@dataclass(frozen=True)
class BlockUsage:
    """Reservation handles as slots counted them, and the pool in blocks and tokens."""

    slots: SlotUsage
    total_blocks: int
    free_blocks: int
    reserved_blocks: int  # held by reservations still waiting for their KV
    committed_blocks: int  # held by decoding requests (shared blocks counted once)
    quarantined_blocks: int
    block_tokens: int
    kept_blocks: int = 0  # held only for later copies of a prompt or the prefix cache (given up for any reservation)

    @property
    def tokens_total(self) -> int:
        return self.total_blocks * self.block_tokens

    # The slot table's view, so callers that count reservations (the router's Status, tests of
    # the release paths) read a block pool and a slot pool alike.
    @property
    def free(self) -> int:
        return self.slots.free

    @property
    def reserved(self) -> int:
        return self.slots.reserved

    @property
    def committed(self) -> int:
        return self.slots.committed

    @property
    def quarantined(self) -> int:
        return self.slots.quarantined

    @property
    def tokens_used(self) -> int:
        """Tokens of the blocks reservations hold (kept blocks are given up for any)."""
        return (self.total_blocks - self.free_blocks - self.kept_blocks) * self.block_tokens


KEEP_S = 10.0  # how long an ended copy's prompt blocks wait for the later copies of its prompt


@dataclass
class _Kept:
    """The whole prompt blocks of an ended reservation, held for later copies of its prompt."""

    blocks: tuple[int, ...]
    prompt_tokens: int
    prompt_ids: tuple[int, ...]
    copies: int  # later copies still expected
    deadline: float


@dataclass
class _Handle(Reservation):
    blocks: tuple[int, ...] = ()
    shared: int = 0
    num_tokens: int = 0
    prompt_tokens: int = 0
    held: tuple[int, ...] = ()  # the blocks whose references this reservation still holds
    # Its prompt's token ids once Generate named them (`note_prompt`); until then, for a
    # reservation sharing blocks, the tokens those blocks hold (what its prompt must start with).
    prompt_ids: tuple[int, ...] = ()
    keep_for: int = 0  # later copies of its prompt that will share its prompt blocks
    cached: CachedPrompt | None = None  # reserved with its prompt and scope: kept in the prefix cache after
    kv_ids: tuple[int, ...] = ()  # the tokens whose KV its blocks hold when it ends (`note_kv`)
    kv_names: tuple[bytes, ...] = ()  # whole blocks' names in its scope: its prompt's, then kv_ids'


def _checked(
    layout: KVLayout,
    request_id: str,
    ttl_s: float,
    num_tokens: int,
    prompt_tokens: int | None,
    shared_blocks: int | None,
) -> tuple[int, int]:
    """The request's prompt tokens and blocks needed in a pool of `layout`, or why it can never be granted."""
    if ttl_s <= 0:
        raise ValueError(f"lease ttl must be > 0 seconds, got {ttl_s}")
    if num_tokens <= 0:
        raise ValueError(f"a reservation needs at least one token, got {num_tokens}")
    prompt = num_tokens if prompt_tokens is None else prompt_tokens
    if not 0 < prompt <= num_tokens:
        raise ValueError(f"prompt_tokens must be in 1..{num_tokens}, got {prompt_tokens}")
    need = blocks_for(num_tokens, layout.block_tokens)
    if need > layout.num_blocks:
        raise NoFreeBlocks(
            f"request {request_id!r} needs {need} KV blocks ({num_tokens} tokens), "
            f"more than this pool's {layout.num_blocks}"
        )
    if shared_blocks is not None and not 0 <= shared_blocks <= need:
        raise ValueError(f"shared_blocks must be in 0..{need}, got {shared_blocks}")
    return prompt, need


class BlockTable(ReservationTable[_Handle, Grant]):
    kind = "blocks"

    def __init__(
        self,
        layout: KVLayout,
        *,
        engine_id: str = "",
        base_addr: int = 0,
        quarantine_s: float = 30.0,
        clock: LeaseClock = SYSTEM_CLOCK,
        capability_key: bytes | None = None,
        leases: BlockLeaseHooks | None = None,
    ) -> None:
        if not layout.paged:
            raise ValueError(f"a BlockTable needs a paged layout (block_tokens > 0), got {layout}")
        super().__init__(
            layout,
            [_Handle() for _ in range(layout.num_slots)],  # max_reservations
            engine_id=engine_id,
            base_addr=base_addr,
            quarantine_s=quarantine_s,
            clock=clock,
            capability_key=capability_key,
        )
        self.num_blocks = layout.num_blocks
        self.block_tokens = layout.block_tokens
        self._leases = leases
        self._refs = [0] * self.num_blocks
        # Lowest block first: a fresh pool hands out runs of consecutive blocks, which a push
        # moves as one descriptor per layer (pdserve_common/kv_layout.py).
        self._free_blocks: list[int] = list(range(self.num_blocks))
        self._kept: dict[int, _Kept] = {}  # by the generation of the reservation that ended
        # Ended requests' blocks, for later prompts (kv/decode_prefix.py): set by the pool's
        # owner, blocks of this pool's size.
        self.prefix: DecodePrefixCache | None = None

    @property
    def max_reservations(self) -> int:
        return len(self._handles)

    # ---- reservations ------------------------------------------------------------------------
    def reserve(
        self,
        request_id: str,
        ttl_s: float,
        *,
        num_tokens: int,
        prompt_tokens: int | None = None,
        share_from: tuple[int, int] | CachedPrompt | None = None,
        shared_blocks: int | None = 0,
        keep_for: int = 0,
    ) -> Grant:
        """Grant a handle and blocks for `num_tokens` tokens for `ttl_s` seconds. Raises NoFreeBlocks.

        `prompt_tokens` (default `num_tokens`): how many of them the prefill writes; only whole
        blocks of a reservation's prompt may later be shared.
        `share_from`/`shared_blocks`: take the first `shared_blocks` blocks of the committed
        reservation (slot, generation) read-only instead of fresh ones (their KV is already
        here, and its decode never writes them: they hold only prompt tokens). `shared_blocks`
        None: every whole prompt block the two have in common, or none when `share_from` is no
        longer committed, nor kept, or has not been told its prompt (`note_prompt`): n copies of
        a prompt share what is still there. `keep_for`: later copies that will share this one's
        prompt blocks (kept for them if it ends first; see the module's docstring).
        `share_from` a CachedPrompt: the blocks of its longest prefix the prefix cache holds in
        its scope, read-only; this one's are kept there when it ends (kv/decode_prefix.py)."""
        prompt, need = _checked(self.layout, request_id, ttl_s, num_tokens, prompt_tokens, shared_blocks)
        copy = share_from if isinstance(share_from, tuple) else None
        cached = share_from if isinstance(share_from, CachedPrompt) and self.prefix is not None else None
        # Hashed once, outside the lock: matched now, and the names of what it keeps when it ends.
        names = tuple(self.prefix.hashes(cached.token_ids[:prompt], cached.scope)) if cached and self.prefix else ()
        self.expire()
        with self._lock:
            now = self._clock()
            self._sweep(now)
            findable = names[: (prompt - 1) // self.block_tokens]  # (its last position is computed)
            shared, expected = self._shared_prefix(share_from, shared_blocks, prompt, findable)
            index = next((i for i, h in enumerate(self._handles) if h.state is SlotState.FREE), None)
            fresh = need - len(shared)
            if index is None or fresh > len(self._free_blocks) + self._freeable(copy, shared):
                raise no_room(self, request_id, index, fresh, num_tokens)  # (nothing kept let go for it)
            self._make_room(fresh, copy, shared)
            generation = self._next_generation()
            blocks = shared + self._take(index, generation, fresh)
            for b in blocks:
                self._refs[b] += 1
            if shared and copy is not None:
                self._copy_came(copy)
            h = self._claim(index, generation, request_id, ttl_s, now)
            h.blocks, h.shared, h.num_tokens, h.prompt_tokens, h.held = blocks, len(shared), num_tokens, prompt, blocks
            h.prompt_ids, h.keep_for = expected, keep_for
            h.cached, h.kv_ids, h.kv_names = cached, (), names
            grant = self._grant(index, h)
        fields = {"blocks": len(blocks), "shared": len(shared), "tokens": num_tokens}
        log.debug(kv(event="blocks_reserved", request=request_id, slot=index, generation=generation, **fields))
        return grant

    # ---- queries -------------------------------------------------------------------------------

    def _shared_prefix(
        self,
        share_from: tuple[int, int] | CachedPrompt | None,
        shared_blocks: int | None,
        prompt: int,
        names: tuple[bytes, ...],
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The first `shared_blocks` blocks of a committed reservation, and the prompt tokens they
        hold as far as it was told them, or the prefix cache's blocks of a CachedPrompt's `names`
        (lock held); see `reserve` for None."""
        if isinstance(share_from, CachedPrompt):
            hit = self.prefix.match(names) if self.prefix is not None else None
            return (hit.blocks, hit.token_ids) if hit is not None else ((), ())
        if share_from is None or shared_blocks == 0:
            return (), ()
        live = self._live(*share_from)
        source = live if live is not None and live.state is SlotState.COMMITTED else self._kept.get(share_from[1])
        whole = 0 if source is None else min(source.prompt_tokens, prompt) // self.block_tokens
        if shared_blocks is None:
            shared_blocks = whole if source is not None and source.prompt_ids else 0
        elif source is None or source is not live:
            raise ValueError(f"share_from {share_from} is not a committed reservation")
        elif shared_blocks > whole:
            raise ValueError(f"cannot share {shared_blocks} blocks: {whole} whole prompt blocks in common")
        if source is None or shared_blocks == 0:
            return (), ()
        return source.blocks[:shared_blocks], source.prompt_ids[: shared_blocks * self.block_tokens]

    def _copy_came(self, source: tuple[int, int]) -> None:
        """A later copy shared the prompt blocks of `source`: one fewer to keep them for."""
        live, kept = self._live(*source), self._kept.get(source[1])
        if live is not None:
            live.keep_for = max(0, live.keep_for - 1)
        elif kept is not None:
            kept.copies -= 1
            self._let_go(lambda generation, k: generation == source[1] and k.copies <= 0)

    def _let_go(self, which: Callable[[int, _Kept], bool]) -> None:
        """The one release path of kept blocks: the entries `which` names give their references back."""
        for generation, kept in list(self._kept.items()):
            if which(generation, kept):
                del self._kept[generation]
                self._unref(kept.blocks)
                log.debug(kv(event="kept_blocks_let_go", generation=generation, blocks=len(kept.blocks)))

    def _take(self, index: int, generation: int, fresh: int) -> tuple[int, ...]:
        """`fresh` free blocks, lowest first, made writable for this grant (lock held); back on
        the free list if the leases refuse them."""
        taken = tuple(heapq.heappop(self._free_blocks) for _ in range(fresh))
        if self._leases is not None and taken:
            try:
                self._leases.granted(index, generation, taken)
            except BaseException:
                for b in taken:
                    heapq.heappush(self._free_blocks, b)
                raise
        return taken

    def note_prompt(self, slot: int, generation: int, token_ids: Sequence[int]) -> str | None:
        """Tell (slot, generation) its prompt (Generate names it), for a later copy to share its
        blocks. A reservation that shares blocks must start with the tokens they hold: the
        problem, naming the first difference, if it does not (nothing is recorded then)."""
        with self._lock:
            h = self._live(slot, generation)
            if h is None:
                return None  # (not live: the caller's renew refuses it)
            expected, given = h.prompt_ids, tuple(token_ids[: len(h.prompt_ids)])
            if given != expected:
                at = next((i for i, (a, b) in enumerate(zip(given, expected, strict=False)) if a != b), len(given))
                return (
                    f"prompt_token_ids differ at position {at} from the {len(expected)} tokens held by its "
                    f"{h.shared} shared KV blocks (another copy's prompt, or the prefix cache's)"
                )
            if h.cached is not None and tuple(token_ids) != h.cached.token_ids:  # (its names are that prompt's)
                return f"prompt_token_ids differ from the {len(h.cached.token_ids)} tokens its Reserve named"
            h.prompt_ids = tuple(token_ids)
            return None

    def note_kv(self, slot: int, generation: int, token_ids: Sequence[int]) -> None:
        """The tokens whose KV (slot, generation)'s blocks hold as it ends: the prefix cache
        keeps those blocks (nothing without one, or once it is not live)."""
        with self._lock:
            h = self._live(slot, generation)
            cached, known = (None, ()) if h is None else (h.cached, h.kv_names)
        if cached is None or self.prefix is None:
            return
        # `token_ids` start with the Reserve's prompt (note_prompt): only what follows is hashed.
        names = self.prefix.extend(known, token_ids, cached.scope)
        with self._lock:
            h = self._live(slot, generation)
            if h is not None and h.cached is cached:
                h.kv_ids, h.kv_names = tuple(token_ids), names

    def _make_room(self, fresh: int, copy: tuple[int, int] | None, shared: tuple[int, ...]) -> None:
        """Kept blocks never stand in a reservation's way: let go of copies' (but `copy`'s), then
        evict the prefix cache's least recently used until `fresh` blocks are free (lock held)."""
        if fresh > len(self._free_blocks):
            self._let_go(lambda gen, kept: copy is None or gen != copy[1])
        if fresh > len(self._free_blocks) and self.prefix is not None:  # (`_freeable` counted these)
            room, keep = fresh - len(self._free_blocks), set(shared)
            self._unref(self.prefix.evict(room, lambda b: self._refs[b] == 1 and b not in keep))

    def blocks_of(self, slot: int) -> tuple[int, ...]:
        """The block table of the reservation in handle `slot` (what decode attends through)."""
        with self._lock:
            return self._handles[slot].blocks

    def refcount(self, block: int) -> int:
        with self._lock:
            return self._refs[block]

    def usage(self) -> BlockUsage:
        with self._lock:
            self._sweep(self._clock())
            return block_usage(self)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a reservation of `num_tokens` would be granted now (no side effect but sweeping)."""
        with self._lock:
            self._sweep(self._clock())
            if not any(h.state is SlotState.FREE for h in self._handles):
                return False
            return blocks_for(num_tokens, self.block_tokens) <= len(self._free_blocks) + self._freeable(None, ())

    def _freeable(self, copy: tuple[int, int] | None, shared: tuple[int, ...]) -> int:
        """Blocks that letting go of the kept copies' (but `copy`'s) and the prefix cache's (but
        `shared`) would free: those they alone hold (lock held)."""
        holders = collections.Counter(
            b for g, kept in self._kept.items() if not copy or g != copy[1] for b in kept.blocks
        )
        holders.update(b for b in (self.prefix.blocks() if self.prefix is not None else ()) if b not in shared)
        return sum(1 for b, n in holders.items() if self._refs[b] == n)

    # ---- hooks and internals (lock held) ---------------------------------------------------------
    def _sweep(self, now: float) -> None:
        """Quarantines that have run their time end: their blocks and handle are free again; so
        do kept prompt blocks whose later copies did not come in time."""
        for h in self._handles:
            if h.state is SlotState.QUARANTINED and h.deadline <= now:
                self._free(h)
        self._let_go(lambda generation, kept: kept.deadline <= now)

    def _quarantine_resources(self, index: int, h: _Handle) -> None:
        """Writable blocks (and the handle) held until the deadline; shared ones, never written
        by this reservation's push, are given back at once."""
        self._unref(h.held[: h.shared])
        h.held = h.held[h.shared :]
        if self.quarantine_s == 0:
            self._free(h)

    def _free_resources(self, h: _Handle) -> None:
        """The one place a reservation gives back its block references (exactly once); those
        of its whole prompt blocks go to a `_Kept` entry instead while later copies are expected."""
        whole = h.prompt_tokens // self.block_tokens
        if h.state is SlotState.COMMITTED and h.keep_for > 0 and h.prompt_ids and whole:
            self._kept[h.generation] = _Kept(
                h.held[:whole], h.prompt_tokens, h.prompt_ids, h.keep_for, self._clock() + KEEP_S
            )
            self._unref(h.held[whole:])
        elif h.state is SlotState.COMMITTED and self.prefix is not None and h.cached is not None and h.kv_ids:
            kept = min(len(h.kv_ids) // self.block_tokens, len(h.held))
            self._unref(self.prefix.keep(h.kv_names, h.kv_ids, h.held[:kept]) + list(h.held[kept:]))
        else:
            self._unref(h.held)
        h.held, h.blocks, h.shared, h.prompt_ids, h.keep_for, h.kv_ids, h.kv_names, h.cached = (
            (),
            (),
            0,
            (),
            0,
            (),
            (),
            None,
        )

    def _unref(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise AssertionError(f"block {b} released with refcount {self._refs[b]}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free_blocks, b)

    def _end_write_lease(self, index: int, h: _Handle) -> None:
        if h.blocks[h.shared :]:  # a reservation that shares all its blocks was never leased
            self._revoke(None if self._leases is None else self._leases.ended, index, h.generation)

    def _log_fields(self, grant: Grant) -> dict[str, object]:
        return {
            "request": grant.request_id,
            "slot": grant.slot,
            "generation": grant.generation,
            "blocks": len(grant.blocks),
        }

    def _grant(self, index: int, h: _Handle) -> Grant:
        return Grant(
            h.request_id, index, h.generation, self.engine_id, self.base_addr, self.layout, h.nonce, h.blocks, h.shared
        )


def no_room(t: BlockTable, request_id: str, index: int | None, fresh: int, num_tokens: int) -> NoFreeBlocks:
    """Why `request_id` gets no reservation of `t` (lock held)."""
    usage = block_usage(t)
    what = (
        f"all {t.max_reservations} reservations in use"
        if index is None
        else f"needs {fresh} blocks ({num_tokens} tokens), {usage.free_blocks} free"
    )
    return NoFreeBlocks(
        f"no KV room for request {request_id!r}: {what}; {usage.reserved_blocks} blocks reserved, "
        f"{usage.committed_blocks} committed, {usage.quarantined_blocks} quarantined of {t.num_blocks}"
    )


def block_usage(t: BlockTable) -> BlockUsage:
    """`t`'s reservations and pool, as BlockUsage counts them (lock held)."""
    blocks: dict[SlotState, set[int]] = {state: set() for state in SlotState}
    for h in t._handles:
        blocks[h.state].update(h.held)
    committed = blocks[SlotState.COMMITTED]
    return BlockUsage(
        t._slot_usage(),
        t.num_blocks,
        len(t._free_blocks),
        len(blocks[SlotState.RESERVED] - committed),
        len(committed),
        len(blocks[SlotState.QUARANTINED]),
        t.block_tokens,
        t._freeable(None, ()),  # (blocks only kept entries hold)
    )
