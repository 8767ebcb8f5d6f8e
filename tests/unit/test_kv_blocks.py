"""Block reservations: leases, generations, quarantine and refcounts, as slots had them.

The state machine drives the allocator with every operation in any order against a fake
clock and checks, after each step, the acceptance invariants of issue #16: no block in two
live reservations (unless shared read-only), refcounts never negative and equal to the
holders, free + held = the pool, and a lease expiry frees exactly its blocks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.kv.blocks import BlockTable, NoFreeBlocks, blocks_for
from pdserve_worker.kv.reservations import LeaseClock
from pdserve_worker.kv.slots import Grant as BlockGrant
from pdserve_worker.kv.slots import SlotState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingLeases:
    def __init__(self) -> None:
        self.live: dict[int, tuple[int, ...]] = {}

    def granted(self, slot: int, generation: int, blocks: tuple[int, ...]) -> None:
        assert generation not in self.live
        self.live[generation] = blocks

    def ended(self, slot: int, generation: int) -> None:
        assert generation in self.live, f"lease {generation} ended twice or never granted"
        del self.live[generation]


def layout(num_blocks: int = 8, block_tokens: int = 4, max_reservations: int = 8) -> KVLayout:
    return KVLayout(
        num_slots=max_reservations,
        num_layers=2,
        max_len=64,
        kv_heads=1,
        head_dim=4,
        dtype="float32",
        block_tokens=block_tokens,
        num_blocks=num_blocks,
    )


def allocator(
    num_blocks: int = 8, block_tokens: int = 4, max_reservations: int = 8, on_expire=None, **kw
) -> tuple[BlockTable, Clock]:
    clock = Clock()
    table = BlockTable(
        layout(num_blocks, block_tokens, max_reservations),
        engine_id="10.0.0.1:7000",
        base_addr=0x10000,
        clock=LeaseClock(clock, on_expire),
        **kw,
    )
    return table, clock


def test_blocks_for_rounds_up() -> None:
    assert [blocks_for(n, 16) for n in (1, 15, 16, 17, 32, 364)] == [1, 1, 1, 2, 2, 23]
    with pytest.raises(ValueError):
        blocks_for(3, 0)


def test_a_reservation_takes_whole_blocks_for_its_tokens_lowest_first() -> None:
    alloc, _ = allocator()
    a = alloc.reserve("a", 5, num_tokens=9)  # 3 blocks of 4
    b = alloc.reserve("b", 5, num_tokens=4)
    assert a.blocks == (0, 1, 2) and b.blocks == (3,)
    assert (a.slot, b.slot) == (0, 1) and (a.engine_id, a.base_addr, a.layout) == ("10.0.0.1:7000", 0x10000, layout())
    assert a.writable == a.blocks and a.shared == 0
    usage = alloc.usage()
    assert (usage.free_blocks, usage.reserved_blocks, usage.tokens_used, usage.tokens_total) == (4, 4, 16, 32)


def test_capacity_is_tokens_and_the_refusal_says_why() -> None:
    alloc, _ = allocator(num_blocks=8, block_tokens=4)
    alloc.reserve("a", 5, num_tokens=20)  # 5 blocks
    assert alloc.can_admit(12) and not alloc.can_admit(13)
    with pytest.raises(NoFreeBlocks, match=r"needs 4 blocks \(13 tokens\), 3 free; 5 blocks reserved"):
        alloc.reserve("b", 5, num_tokens=13)
    with pytest.raises(NoFreeBlocks, match="more than this pool's 8"):
        alloc.reserve("huge", 5, num_tokens=33)


def test_max_reservations_caps_concurrent_requests() -> None:
    alloc, _ = allocator(max_reservations=2)
    alloc.reserve("a", 5, num_tokens=1)
    alloc.reserve("b", 5, num_tokens=1)
    with pytest.raises(NoFreeBlocks, match="all 2 reservations in use"):
        alloc.reserve("c", 5, num_tokens=1)


def test_expiry_quarantines_exactly_its_blocks_until_the_quarantine_passes() -> None:
    expired: list[BlockGrant] = []
    alloc, clock = allocator(quarantine_s=5.0, on_expire=expired.append)
    a = alloc.reserve("a", 1.0, num_tokens=8)
    b = alloc.reserve("b", 10.0, num_tokens=8)
    clock.now += 1.5
    assert not alloc.is_reserved(a.slot, a.generation)  # stale before any sweep
    assert [g.generation for g in alloc.expire()] == [a.generation]
    assert [g.request_id for g in expired] == ["a"]
    usage = alloc.usage()
    assert (usage.quarantined_blocks, usage.reserved_blocks, usage.free_blocks) == (2, 2, 4)
    c = alloc.reserve("c", 1.0, num_tokens=16)
    assert not set(c.blocks) & set(a.blocks + b.blocks)
    with pytest.raises(NoFreeBlocks, match="2 quarantined"):
        alloc.reserve("d", 1.0, num_tokens=1)
    assert not alloc.commit(a.slot, a.generation) and not alloc.release(a.slot, a.generation)  # stale
    clock.now += 5.0
    assert alloc.state(a.slot) is SlotState.FREE
    d = alloc.reserve("d", 1.0, num_tokens=8)
    assert d.blocks == a.blocks and d.slot == a.slot and d.generation > a.generation


def test_commit_then_release_frees_at_once_and_stale_generations_do_nothing() -> None:
    alloc, _ = allocator(quarantine_s=100)
    a = alloc.reserve("a", 5, num_tokens=8)
    assert alloc.commit(a.slot, a.generation)
    assert not alloc.commit(a.slot, a.generation)
    assert alloc.release(a.slot, a.generation)
    assert alloc.usage().free_blocks == 8
    assert not alloc.release(a.slot, a.generation)


def test_release_before_commit_quarantines_release_grant_settled_frees() -> None:
    alloc, _ = allocator(quarantine_s=100)
    a = alloc.reserve("a", 5, num_tokens=8)
    assert alloc.release(a.slot, a.generation)
    assert alloc.usage().quarantined_blocks == 2
    assert alloc.release_grant(a.slot, a.generation, push_settled=True)  # the prefill says its push is over
    assert alloc.usage().free_blocks == 8
    b = alloc.reserve("b", 5, num_tokens=8)
    assert alloc.release_grant(b.slot, b.generation, push_settled=False)
    assert alloc.usage().quarantined_blocks == 2
    c = alloc.reserve("c", 5, num_tokens=4)
    assert alloc.release_grant(c.slot, c.generation, push_settled=True)
    assert alloc.usage().quarantined_blocks == 2 and alloc.usage().free_blocks == 6


def test_nonce_is_the_reservations_capability() -> None:
    alloc, _ = allocator(capability_key=b"k" * 32)
    a = alloc.reserve("a", 5, num_tokens=4)
    assert alloc.verify(a.slot, a.generation, a.nonce)
    assert not alloc.verify(a.slot, a.generation + 1, a.nonce)
    assert not alloc.verify(a.slot, a.generation, "00" * 16)
    other, _ = allocator(capability_key=b"x" * 32)
    assert not other.verify(a.slot, a.generation, a.nonce)


def test_write_leases_cover_only_writable_blocks_and_end_once() -> None:
    leases = RecordingLeases()
    alloc, _ = allocator(leases=leases)
    a = alloc.reserve("a", 5, num_tokens=12, prompt_tokens=9)
    assert leases.live == {a.generation: (0, 1, 2)}
    alloc.commit(a.slot, a.generation)
    assert leases.live == {}
    b = alloc.reserve("b", 5, num_tokens=12, prompt_tokens=10, share_from=(a.slot, a.generation), shared_blocks=2)
    assert b.blocks[:2] == (0, 1) and b.shared == 2 and b.writable == (3,)
    assert leases.live == {b.generation: (3,)}
    assert alloc.refcount(0) == 2 and alloc.refcount(2) == 1
    alloc.release(a.slot, a.generation)  # a ends; the shared blocks live on in b
    assert alloc.refcount(0) == 1 and alloc.refcount(2) == 0
    alloc.release(b.slot, b.generation)  # before commit: only its writable block is quarantined
    assert leases.live == {}
    assert alloc.refcount(0) == 0 and alloc.refcount(3) == 1


def test_sharing_only_whole_committed_prompt_blocks() -> None:
    alloc, _ = allocator()
    a = alloc.reserve("a", 5, num_tokens=12, prompt_tokens=6)  # one whole prompt block
    with pytest.raises(ValueError, match="not a committed"):
        alloc.reserve("b", 5, num_tokens=8, share_from=(a.slot, a.generation), shared_blocks=1)
    alloc.commit(a.slot, a.generation)
    with pytest.raises(ValueError, match="1 whole prompt blocks"):
        alloc.reserve("b", 5, num_tokens=8, share_from=(a.slot, a.generation), shared_blocks=2)
    assert (
        alloc.reserve("b", 5, num_tokens=8, share_from=(a.slot, a.generation), shared_blocks=1).blocks[0] == a.blocks[0]
    )


def test_a_copy_shares_what_is_still_there_and_must_have_the_same_prompt() -> None:
    """shared_blocks=None (n copies of a prompt, issue #31): every whole prompt block in common
    once the source is committed and told its prompt; none before, and none after it ended.
    The sharing copy's prompt must start with the shared tokens (note_prompt)."""
    alloc, _ = allocator(num_blocks=16)
    prompt = list(range(100, 110))  # 10 tokens: 2 whole blocks of 4
    a = alloc.reserve("a", 5, num_tokens=14, prompt_tokens=10)
    src = (a.slot, a.generation)
    early = alloc.reserve("early", 5, num_tokens=14, prompt_tokens=10, share_from=src, shared_blocks=None)
    assert early.shared == 0  # a's KV has not landed: nothing to share, and no error
    assert alloc.note_prompt(a.slot, a.generation, prompt) is None
    alloc.commit(*src)
    b = alloc.reserve("b", 5, num_tokens=14, prompt_tokens=10, share_from=src, shared_blocks=None)
    assert b.shared == 2 and b.blocks[:2] == a.blocks[:2] and alloc.refcount(a.blocks[0]) == 2
    wrong = [*prompt[:5], 7, *prompt[6:]]
    problem = alloc.note_prompt(b.slot, b.generation, wrong)
    assert problem is not None and "position 5" in problem and "2 shared KV blocks" in problem
    assert alloc.note_prompt(b.slot, b.generation, [*prompt[:8], 1, 2]) is None  # the tail is its own
    short = alloc.reserve("short", 5, num_tokens=9, prompt_tokens=5, share_from=src, shared_blocks=None)
    assert short.shared == 1  # one whole block in common with a 5-token prompt
    alloc.release(*src)
    after = alloc.reserve("after", 5, num_tokens=14, prompt_tokens=10, share_from=src, shared_blocks=None)
    assert after.shared == 0
    assert alloc.refcount(a.blocks[0]) == 2  # b and short still hold the shared block


def test_an_ended_copy_keeps_its_prompt_blocks_for_the_later_copies_and_lets_them_go() -> None:
    """keep_for: the first copy may end before the others reserve (a short answer); its whole
    prompt blocks then wait for them, one share each, and go back after the last, after
    KEEP_S, or as soon as a reservation needs them."""
    from pdserve_worker.kv.blocks import KEEP_S

    alloc, clock = allocator(num_blocks=8)
    prompt = list(range(10))  # 2 whole blocks of 4

    def first(keep: int) -> BlockGrant:
        g = alloc.reserve("first", 5, num_tokens=12, prompt_tokens=10, keep_for=keep)
        assert alloc.note_prompt(g.slot, g.generation, prompt) is None
        alloc.commit(g.slot, g.generation)
        alloc.release(g.slot, g.generation)  # it answered and ended
        return g

    def copy(src: BlockGrant, tokens: int = 12) -> BlockGrant:
        return alloc.reserve(
            "copy", 5, num_tokens=tokens, prompt_tokens=10, share_from=(src.slot, src.generation), shared_blocks=None
        )

    a = first(keep=2)
    assert alloc.usage().kept_blocks == 2 and alloc.usage().free_blocks == 6
    b, c = copy(a), copy(a)
    assert b.shared == c.shared == 2 and b.blocks[:2] == c.blocks[:2] == a.blocks[:2]
    assert alloc.usage().kept_blocks == 0 and alloc.refcount(a.blocks[0]) == 2  # let go after the last copy
    third = copy(a)
    assert third.shared == 0  # a third copy was not expected
    for g in (b, c, third):
        alloc.release_grant(g.slot, g.generation, push_settled=True)
    assert alloc.usage().free_blocks == 8

    d = first(keep=1)
    clock.now += KEEP_S + 0.1
    assert alloc.usage().kept_blocks == 0 and copy(d).shared == 0  # its copy came too late

    alloc2, _ = allocator(num_blocks=4)
    g = alloc2.reserve("first", 5, num_tokens=12, prompt_tokens=10, keep_for=1)
    alloc2.note_prompt(g.slot, g.generation, prompt)
    alloc2.commit(g.slot, g.generation)
    alloc2.release(g.slot, g.generation)
    assert alloc2.usage().kept_blocks == 2 and alloc2.can_admit(16)
    other = alloc2.reserve("other", 5, num_tokens=16)  # needs all 4 blocks: the kept ones go
    assert len(other.blocks) == 4 and alloc2.usage().kept_blocks == 0


def test_a_refused_lease_grants_nothing() -> None:
    class Refusing(RecordingLeases):
        def granted(self, slot, generation, blocks):
            raise RuntimeError("engine refused")

    alloc, _ = allocator(leases=Refusing())
    with pytest.raises(RuntimeError):
        alloc.reserve("a", 5, num_tokens=8)
    assert alloc.usage().free_blocks == 8 and alloc.usage().slots.free == 8
    with pytest.raises(ValueError, match="paged layout"):
        BlockTable(KVLayout(num_slots=2, num_layers=1, max_len=8, kv_heads=1, head_dim=4))


class AllocatorMachine(RuleBasedStateMachine):
    """Any sequence of operations keeps the block accounting exact."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.leases = RecordingLeases()
        self.alloc = BlockTable(layout(12, 4, 6), quarantine_s=3.0, clock=LeaseClock(self.clock), leases=self.leases)
        self.grants: list[BlockGrant] = []
        self.prompts: dict[int, int] = {}

    def pick(self, i: int) -> BlockGrant:
        return self.grants[i % len(self.grants)]

    @rule(
        tokens=st.integers(1, 30),
        ttl=st.floats(0.5, 5),
        prompt_frac=st.floats(0.1, 1.0),
        share=st.integers(0, 4),
        source=st.integers(0, 50),
        keep=st.integers(0, 2),
    )
    def reserve(self, tokens, ttl, prompt_frac, share, source, keep):
        prompt = max(1, int(tokens * prompt_frac))
        committed = [
            g
            for g in self.grants
            if self.alloc.grant_of(g.slot, g.generation) is not None
            and not self.alloc.is_reserved(g.slot, g.generation)
        ]
        kw = {}
        if share == 4 and self.grants:  # a later copy: any earlier reservation, live, kept or gone
            src = self.pick(source)
            kw = {"share_from": (src.slot, src.generation), "shared_blocks": None}
        elif committed and share:
            src = committed[source % len(committed)]
            kw = {"share_from": (src.slot, src.generation), "shared_blocks": min(share, prompt // 4)}
        try:
            grant = self.alloc.reserve(
                f"r{len(self.grants)}", ttl, num_tokens=tokens, prompt_tokens=prompt, keep_for=keep, **kw
            )
        except NoFreeBlocks:
            return
        except ValueError as exc:
            assert "whole prompt blocks" in str(exc)
            return
        assert len(grant.blocks) == blocks_for(tokens, 4)
        if kw:
            assert grant.blocks[: grant.shared] == src.blocks[: grant.shared]
        self.grants.append(grant)
        self.prompts[grant.generation] = prompt

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 100))
    def commit(self, i):
        g = self.pick(i)
        # Every prompt is a prefix of one sequence, so any copy may share with any other.
        assert self.alloc.note_prompt(g.slot, g.generation, list(range(self.prompts[g.generation]))) is None
        self.alloc.commit(g.slot, g.generation)

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        g = self.pick(i)
        self.alloc.release(g.slot, g.generation)

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 100), settled=st.booleans())
    def release_grant(self, i, settled):
        g = self.pick(i)
        self.alloc.release_grant(g.slot, g.generation, push_settled=settled)

    @rule(dt=st.floats(0, 4))
    def tick_and_expire(self, dt):
        self.clock.now += dt
        before = [self.alloc.refcount(b) for b in range(12)]
        expired = self.alloc.expire()
        # An expiry gives back exactly the expired reservations' shared references (their own
        # blocks stay quarantined) and nothing else.
        for b in range(12):
            shared_refs = sum(1 for g in expired for x in g.blocks[: g.shared] if x == b)
            assert self.alloc.refcount(b) == before[b] - shared_refs
        for g in expired:
            assert self.alloc.state(g.slot) is SlotState.QUARANTINED
            assert all(self.alloc.refcount(b) >= 1 for b in g.writable)

    @invariant()
    def accounting_is_exact(self):
        alloc = self.alloc
        # usage() first: it sweeps (lets go of kept blocks whose wait ran out, lazily, as every
        # call that needs the room does), so what follows reads the state it reports on.
        usage = alloc.usage()
        refs = [0] * 12
        writers: dict[int, int] = {}
        for h in alloc._handles:
            for b in h.held:
                refs[b] += 1
        kept = [b for k in alloc._kept.values() for b in k.blocks]
        for b in kept:
            refs[b] += 1
            if h.state in (SlotState.RESERVED, SlotState.COMMITTED):
                for b in h.blocks[h.shared :]:
                    assert b not in writers, f"block {b} writable in two live reservations"
                    writers[b] = h.generation
                for b in h.blocks:
                    assert alloc.refcount(b) >= 1, "a live reservation's block is free"
        for b in range(12):
            count = alloc.refcount(b)
            assert count >= 0
            assert count == refs[b], f"block {b}: refcount {count}, held by {refs[b]}"
        assert len(set(alloc._free_blocks)) == len(alloc._free_blocks), "a block is twice in the free list"
        assert set(alloc._free_blocks) == {b for b in range(12) if refs[b] == 0}
        held = {b for h in alloc._handles for b in h.held}
        kept_only = set(kept) - held
        assert usage.kept_blocks == len(kept_only)
        assert usage.free_blocks + len(held | kept_only) == 12
        assert usage.tokens_used == len(held) * 4  # kept blocks are given up for any reservation: not used
        assert all(k.copies > 0 for k in alloc._kept.values()), "a kept entry outlived its last copy"
        assert set(self.leases.live) == {
            h.generation for h in alloc._handles if h.state is SlotState.RESERVED and h.blocks[h.shared :]
        }


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
