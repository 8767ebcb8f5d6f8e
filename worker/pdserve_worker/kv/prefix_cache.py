"""A prefill's cache of prompt-prefix KV blocks: chained block hashes, longest-prefix reuse, LRU (pure logic).

Block i of a prompt (blocks of `block_tokens`) is named h_i = SHA-256(h_{i-1} || its tokens),
h_{-1} from a salt of model revision, KV dtype and block size narrowed by the request's scope
(`scoped_salt`: tenant and `cache_salt`). Two prompts share a name exactly when they share the
tokens up to it, the model and the scope, so a hit is the KV this prefill would compute and one
tenant never finds another's blocks. Only whole blocks are named. A cryptographic hash because
whoever sends prompts chooses its input (a collision would hand one user's KV to another).
At most `num_blocks` blocks, each free, pinned (refcount > 0) or idle in LRU order; only idle
blocks are evicted, so when every block is pinned a prefill caches less. One prefill's protocol:
  lease = cache.acquire(hashes, limit)        # pins the longest cached prefix: lease.hits
  fills = cache.reserve_fills(lease, hashes)  # blocks for those not cached yet
  cache.publish(lease)                        # fills become findable, only once their KV is in
  cache.release(lease)                        # exactly once; unpublished fills go back free
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve_worker.kv.block_events import BlockEventLog

HASH_BYTES = 32


def cache_salt(revision: str, dtype: str, block_tokens: int) -> bytes:
    """The root of every hash chain: KV of another model, dtype or block size never matches."""
    return hashlib.sha256(f"pdserve-prefix|{revision}|{dtype}|{block_tokens}".encode()).digest()


def scoped_salt(salt: bytes, scope: str) -> bytes:
    """The root of the chains of one scope: prompts of different scopes share no block name.

    The scope is hashed behind a separator rather than appended to the token bytes so that no
    choice of scope string can produce another scope's root (SHA-256 is collision resistant)."""
    return hashlib.sha256(salt + b"|scope|" + scope.encode("utf-8")).digest()


def block_hashes(tokens: Sequence[int], block_tokens: int, salt: bytes) -> list[bytes]:
    """Chained hashes of the whole blocks of `tokens` (a partial last block is not named)."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    out: list[bytes] = []
    parent = salt
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        block = tokens[start : start + block_tokens]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_tokens}q", *block)).digest()
        out.append(parent)
    return out


@dataclass
class PrefixLease:
    """One prefill's hold on cache blocks: the hits it reads, the fills it writes."""

    hits: list[int] = field(default_factory=list)  # blocks of hashes[0..len(hits))
    fills: list[tuple[int, int]] = field(default_factory=list)  # (hash index, block) to be written
    fill_hashes: list[bytes] = field(default_factory=list)
    published: bool = False
    released: bool = False

    @property
    def hit_blocks(self) -> int:
        return len(self.hits)


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: int
    query_blocks: int
    hit_blocks: int
    cached_blocks: int  # blocks findable by hash now
    pinned_blocks: int
    capacity_blocks: int
    block_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        """Share of whole prompt blocks that were found cached."""
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


class PrefixCache:
    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks <= 0 or block_tokens <= 0:
            raise ValueError(f"num_blocks and block_tokens must be positive, got {num_blocks}, {block_tokens}")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs = [0] * num_blocks
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unpinned; least recently used first
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives the lowest
        self._lock = threading.Lock()
        self._queries = self._query_blocks = self._hit_blocks = self._evictions = 0
        # Told of every block made findable and every one evicted (kv/block_events.py), if set.
        self.events: BlockEventLog | None = None

    def match(self, hashes: Sequence[bytes]) -> int:
        """Leading hashes cached now (no side effect)."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._by_hash:
                    break
                n += 1
            return n

    def acquire(self, hashes: Sequence[bytes], limit: int | None = None) -> PrefixLease:
        """Pin the longest cached prefix of `hashes`, at most `limit` blocks (a prefill must
        compute at least one token to sample from: pass (prompt_len - 1) // block_tokens)."""
        cap = len(hashes) if limit is None else max(0, min(limit, len(hashes)))
        lease = PrefixLease()
        with self._lock:
            for h in hashes[:cap]:
                block = self._by_hash.get(h)
                if block is None:
                    break
                self._pin(block)
                lease.hits.append(block)
            self._queries += 1
            self._query_blocks += cap
            self._hit_blocks += len(lease.hits)
        return lease

    def reserve_fills(self, lease: PrefixLease, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """Blocks for the hashes after the hits that are not cached: free ones first, then the
        least recently used idle ones (evicted). Stops at the first that cannot be had (every
        block pinned), so what is cached stays a prefix. Returns (hash index, block) to fill."""
        self._check_open(lease)
        with self._lock:
            for index in range(len(lease.hits), len(hashes)):
                h = hashes[index]
                if h in self._by_hash:  # cached meanwhile (past the hit limit): nothing to fill
                    continue
                block = self._take()
                if block is None:
                    break
                self._refs[block] = 1
                lease.fills.append((index, block))
                lease.fill_hashes.append(h)
            return list(lease.fills)

    def publish(self, lease: PrefixLease) -> None:
        """The fills' KV is written: make them findable. A hash another prefill published
        meanwhile keeps its block; this lease's duplicate goes back free on release."""
        self._check_open(lease)
        with self._lock:
            stored = []
            for (_, block), h in zip(lease.fills, lease.fill_hashes, strict=True):
                if h not in self._by_hash:
                    self._by_hash[h] = block
                    self._hash_of[block] = h
                    stored.append(h)
            lease.published = True
            if self.events is not None and stored:
                self.events.record(True, False, stored)

    def release(self, lease: PrefixLease) -> None:
        """Unpin everything the lease holds. Exactly once: a second call is an error."""
        self._check_open(lease)
        with self._lock:
            lease.released = True
            # Tail first: it becomes the least recently used, so eviction takes a chain from
            # its end and the prefix that many prompts share stays findable longest (vLLM frees
            # a request's blocks in reverse order for the same reason).
            for block in reversed(lease.hits + [b for _, b in lease.fills]):
                self._unpin(block)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            pinned = sum(1 for r in self._refs if r > 0)
            return PrefixCacheStats(
                self._queries,
                self._query_blocks,
                self._hit_blocks,
                len(self._by_hash),
                pinned,
                self.num_blocks,
                self.block_tokens,
                self._evictions,
            )

    def refcount(self, block: int) -> int:
        with self._lock:
            return self._refs[block]

    def held(self) -> list[bytes]:
        """Every hash findable now (a snapshot for kv/block_events.py)."""
        with self._lock:
            return list(self._by_hash)

    def lookup(self, h: bytes) -> int | None:
        with self._lock:
            return self._by_hash.get(h)

    # ---- internals (lock held) ---------------------------------------------------------------------
    @staticmethod
    def _check_open(lease: PrefixLease) -> None:
        if lease.released:
            raise RuntimeError("prefix lease already released")

    def _pin(self, block: int) -> None:
        if self._refs[block] == 0:
            self._idle.pop(block, None)
        self._refs[block] += 1

    def _unpin(self, block: int) -> None:
        if self._refs[block] <= 0:
            raise AssertionError(f"prefix block {block} unpinned with refcount {self._refs[block]}")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._idle[block] = None  # most recently used: last to go
            else:
                self._free.append(block)

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._idle:
            return None
        block, _ = self._idle.popitem(last=False)
        h = self._hash_of.pop(block)
        del self._by_hash[h]
        self._evictions += 1
        if self.events is not None:
            self.events.record(False, False, [h])
        return block
