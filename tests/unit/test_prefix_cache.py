"""Prefix cache: chained hashes, longest-prefix reuse, LRU under a bound, pinned blocks kept."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve_worker.kv.prefix_cache import PrefixCache, PrefixLease, block_hashes, cache_salt

SALT = cache_salt("rev1", "float32", 4)


def test_hashes_are_chained_over_whole_blocks_and_salted() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, SALT)
    assert len(a) == 2  # the partial tail is not named
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4, SALT)
    assert a[0] == b[0] and a[1] != b[1]
    # the same block after a different prefix has a different name
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, SALT)
    assert c[1] != a[1]
    # another model revision, dtype or block size never matches
    for salt in (cache_salt("rev2", "float32", 4), cache_salt("rev1", "bfloat16", 4), cache_salt("rev1", "float32", 8)):
        assert block_hashes([1, 2, 3, 4], 4, salt)[0] != a[0]
    # token ids are hashed as 64-bit values: no two blocks alias by byte concatenation
    assert block_hashes([1, 256, 0, 0], 4, SALT) != block_hashes([256, 1, 0, 0], 4, SALT)


def fill(cache: PrefixCache, hashes: list[bytes], limit: int | None = None) -> PrefixLease:
    lease = cache.acquire(hashes, limit)
    cache.reserve_fills(lease, hashes)
    cache.publish(lease)
    return lease


def test_longest_prefix_reuse_and_limit() -> None:
    cache = PrefixCache(8, 4)
    h = block_hashes(list(range(16)), 4, SALT)
    cache.release(fill(cache, h[:3]))
    assert cache.match(h) == 3
    lease = cache.acquire(h, limit=2)  # a prompt of exactly these tokens must compute its last one
    assert lease.hit_blocks == 2
    fills = cache.reserve_fills(lease, h)
    assert [i for i, _ in fills] == [3]  # block 2 is cached already: only 3 is filled
    cache.release(lease)  # never published: the fill is not findable
    assert cache.match(h) == 3
    stats = cache.stats()
    assert (stats.queries, stats.query_blocks, stats.hit_blocks) == (2, 5, 2)


def test_eviction_is_lru_tail_first_and_never_takes_a_pinned_block() -> None:
    cache = PrefixCache(4, 4)
    a = block_hashes(list(range(8)), 4, SALT)
    b = block_hashes(list(range(100, 108)), 4, SALT)
    cache.release(fill(cache, a))
    pinned = cache.acquire(a)  # a in use
    lease = fill(cache, b)
    assert cache.match(b) == 2
    c = block_hashes(list(range(200, 208)), 4, SALT)
    lease_c = cache.acquire(c)
    fills = cache.reserve_fills(lease_c, c)
    assert fills == []  # every block pinned: nothing cached, nothing evicted
    cache.release(lease)
    fills = cache.reserve_fills(lease_c, c)
    assert len(fills) == 2 and cache.match(a) == 2  # b's blocks evicted, a's (pinned) kept
    cache.publish(lease_c)
    cache.release(lease_c)
    cache.release(pinned)
    d = block_hashes(list(range(300, 304)), 4, SALT)
    cache.release(fill(cache, d))
    # one block had to go: the least recently used is a chain's tail, so a's and c's heads remain
    assert cache.match(a) >= 1 and cache.match(c) >= 1
    assert cache.stats().evictions == 3


def test_release_twice_is_an_error() -> None:
    cache = PrefixCache(2, 4)
    lease = cache.acquire([])
    cache.release(lease)
    with pytest.raises(RuntimeError, match="already released"):
        cache.release(lease)


class PrefixMachine(RuleBasedStateMachine):
    """Any interleaving of prefills keeps: refcount = pins, no pinned block evicted or reassigned,
    every findable hash names a block whose recorded hash it is, total blocks bounded."""

    N = 6

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(self.N, 2)
        self.open: list[tuple[PrefixLease, list[bytes], dict[int, bytes]]] = []
        self.content: dict[int, bytes] = {}  # block -> the hash whose KV it holds (published)

    @rule(prompt=st.lists(st.integers(0, 3), min_size=0, max_size=10), publish=st.booleans())
    def start(self, prompt, publish):
        hashes = block_hashes(prompt, 2, SALT)
        lease = self.cache.acquire(hashes, limit=max(0, (len(prompt) - 1) // 2))
        for i, block in enumerate(lease.hits):
            assert self.content[block] == hashes[i], "a hit returned a block holding other KV"
        fills = self.cache.reserve_fills(lease, hashes)
        pinned_elsewhere = {b for other, _, _ in self.open for b in other.hits + [x for _, x in other.fills]}
        assert not {b for _, b in fills} & pinned_elsewhere, "a pinned block was handed out again"
        assert not {b for _, b in fills} & set(lease.hits)
        written = {}
        for index, block in fills:
            self.content.pop(block, None)
            written[block] = hashes[index]
        if publish:
            self.cache.publish(lease)
            for block, h in written.items():
                if self.cache.lookup(h) == block:
                    self.content[block] = h
        self.open.append((lease, hashes, written))

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 20))
    def finish(self, i):
        lease, _, _ = self.open.pop(i % len(self.open))
        self.cache.release(lease)

    @invariant()
    def consistent(self):
        pins = [0] * self.N
        for lease, _, _ in self.open:
            for b in lease.hits + [x for _, x in lease.fills]:
                pins[b] += 1
        for b in range(self.N):
            assert self.cache.refcount(b) == pins[b] >= 0
        stats = self.cache.stats()
        assert stats.cached_blocks <= self.N
        for b, h in list(self.content.items()):
            found = self.cache.lookup(h)
            assert found in (None, b)
            if found is None:
                del self.content[b]


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
