"""Slot leases: generations, expiry, quarantine. Time is a fake clock the tests move."""

from __future__ import annotations

import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve_common.kv_layout import KVLayout
from pdserve_worker.kv.reservations import LeaseClock
from pdserve_worker.kv.slots import Grant, NoFreeSlot, SlotState, SlotTable

LAYOUT = KVLayout(num_slots=3, num_layers=2, max_len=8, kv_heads=1, head_dim=4, dtype="float32")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table(quarantine_s: float = 5.0, on_expire=None, **kw) -> tuple[SlotTable, Clock]:
    clock = Clock()
    return SlotTable(
        LAYOUT,
        engine_id="10.0.0.1:7000",
        base_addr=0x10000,
        quarantine_s=quarantine_s,
        clock=LeaseClock(clock, on_expire),
        **kw,
    ), clock


def test_grant_carries_what_a_prefill_needs() -> None:
    slots, _ = table()
    g = slots.reserve("req-a", ttl_s=2.0)
    assert (g.slot, g.request_id, g.engine_id, g.base_addr, g.layout) == (0, "req-a", "10.0.0.1:7000", 0x10000, LAYOUT)
    assert g.slot_addr == 0x10000
    assert slots.reserve("req-b", 2.0).slot_addr == 0x10000 + LAYOUT.bytes_per_slot
    assert g.describe() == f"10.0.0.1:7000 slot=0 generation={g.generation} request=req-a"


def test_generations_are_unique_even_for_the_same_slot() -> None:
    slots, _ = table(quarantine_s=0)
    seen = set()
    for i in range(10):
        g = slots.reserve(f"r{i}", 1.0)
        assert g.slot == 0
        assert g.generation not in seen
        seen.add(g.generation)
        assert slots.commit(g.slot, g.generation)
        assert slots.release(g.slot, g.generation)


def test_expired_lease_quarantines_and_is_not_regranted_until_quarantine_passes() -> None:
    expired: list[Grant] = []
    slots, clock = table(quarantine_s=5.0, on_expire=expired.append)
    a = slots.reserve("a", ttl_s=1.0)
    b = slots.reserve("b", ttl_s=10.0)
    clock.now += 1.5
    assert not slots.is_reserved(a.slot, a.generation)  # stale even before a sweep
    assert [g.request_id for g in slots.expire()] == ["a"]
    assert [g.request_id for g in expired] == ["a"]
    assert slots.state(a.slot) is SlotState.QUARANTINED
    c = slots.reserve("c", 1.0)
    assert c.slot not in (a.slot, b.slot)  # the quarantined slot is skipped
    with pytest.raises(NoFreeSlot, match="1 quarantined"):
        slots.reserve("d", 1.0)
    clock.now += 5.0
    assert slots.state(a.slot) is SlotState.FREE
    d = slots.reserve("d", 1.0)
    assert d.slot == a.slot and d.generation > a.generation


def test_stale_generation_cannot_commit_or_release() -> None:
    slots, clock = table(quarantine_s=0.5)
    old = slots.reserve("old", ttl_s=1.0)
    clock.now += 2
    slots.expire()
    clock.now += 1
    new = slots.reserve("new", ttl_s=1.0)
    assert new.slot == old.slot
    assert not slots.commit(old.slot, old.generation)
    assert not slots.release(old.slot, old.generation)  # a no-op: the new lease is untouched
    assert slots.is_reserved(new.slot, new.generation)
    assert not slots.is_reserved(old.slot, old.generation)
    assert not slots.release(99, 1)


def test_release_before_commit_quarantines_after_commit_frees() -> None:
    slots, clock = table(quarantine_s=3.0)
    a = slots.reserve("a", 5.0)
    assert slots.release(a.slot, a.generation)
    assert slots.state(a.slot) is SlotState.QUARANTINED  # a write may still be in flight
    b = slots.reserve("b", 5.0)
    assert slots.commit(b.slot, b.generation)
    clock.now += 100  # a commitment never expires
    assert slots.expire() == []
    assert slots.is_current(b.slot, b.generation)
    assert slots.release(b.slot, b.generation)
    assert slots.state(b.slot) is SlotState.FREE
    assert slots.usage().quarantined == 0  # a's quarantine (3 s) is long over


def test_renew_extends_only_a_live_reservation() -> None:
    slots, clock = table()
    a = slots.reserve("a", 1.0)
    clock.now += 0.9
    assert slots.renew(a.slot, a.generation, 1.0)
    clock.now += 0.9
    assert slots.is_reserved(a.slot, a.generation)
    clock.now += 0.2
    assert not slots.renew(a.slot, a.generation, 1.0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="ttl"):
        table()[0].reserve("a", 0)
    with pytest.raises(ValueError, match="quarantine_s"):
        SlotTable(LAYOUT, quarantine_s=-1)


def test_concurrent_reservations_never_share_a_slot() -> None:
    slots = SlotTable(KVLayout(num_slots=64, num_layers=1, max_len=1, kv_heads=1, head_dim=1, dtype="float32"))
    grants: list[Grant] = []
    lock = threading.Lock()

    def grab(n: int) -> None:
        for i in range(n):
            g = slots.reserve(f"{threading.get_ident()}-{i}", 60)
            with lock:
                grants.append(g)

    threads = [threading.Thread(target=grab, args=(16,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(g.slot for g in grants) == list(range(64))
    with pytest.raises(NoFreeSlot):
        slots.reserve("one-too-many", 60)


class SlotMachine(RuleBasedStateMachine):
    """Random reserve/commit/release/expire/time steps: no slot is ever held by two live
    requests, and a stale (slot, generation) never becomes current again."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.slots = SlotTable(LAYOUT, quarantine_s=2.0, clock=LeaseClock(self.clock))
        self.grants: list[Grant] = []
        self.dead: set[tuple[int, int]] = set()

    @rule(ttl=st.floats(0.1, 5.0))
    def reserve(self, ttl: float) -> None:
        try:
            g = self.slots.reserve(f"r{len(self.grants)}", ttl)
        except NoFreeSlot:
            return
        assert (g.slot, g.generation) not in self.dead
        self.grants.append(g)

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 1000))
    def commit(self, i: int) -> None:
        g = self.grants[i % len(self.grants)]
        self.slots.commit(g.slot, g.generation)

    @precondition(lambda self: self.grants)
    @rule(i=st.integers(0, 1000))
    def release(self, i: int) -> None:
        g = self.grants[i % len(self.grants)]
        if self.slots.release(g.slot, g.generation):
            self.dead.add((g.slot, g.generation))

    @rule(dt=st.floats(0.0, 3.0))
    def tick(self, dt: float) -> None:
        self.clock.now += dt

    @rule()
    def expire(self) -> None:
        for g in self.slots.expire():
            self.dead.add((g.slot, g.generation))

    @invariant()
    def one_live_request_per_slot(self) -> None:
        live = [g for g in self.grants if self.slots.is_current(g.slot, g.generation)]
        assert len({g.slot for g in live}) == len(live)
        assert not any((g.slot, g.generation) in self.dead for g in live)


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---- capabilities and write leases ------------------------------------------------------------------
class Hooks:
    """Records what the table tells its lease hooks; `fail` makes the next grant refuse."""

    def __init__(self) -> None:
        self.live: set[tuple[int, int]] = set()
        self.fail = False

    def granted(self, slot: int, generation: int) -> None:
        if self.fail:
            raise RuntimeError("engine refused")
        self.live.add((slot, generation))

    def ended(self, slot: int, generation: int) -> None:
        self.live.discard((slot, generation))


def test_a_grants_nonce_verifies_only_its_own_reservation() -> None:
    from pdserve_worker.kv.slots import nonce_matches, reservation_nonce

    key = b"k" * 32
    slots, _ = table(capability_key=key)
    a, b = slots.reserve("a", 5), slots.reserve("b", 5)
    assert len(bytes.fromhex(a.nonce)) == 16 and a.nonce != b.nonce
    assert a.nonce == reservation_nonce(key, a.slot, a.generation)  # a group member can check it with the key
    assert slots.verify(a.slot, a.generation, a.nonce) and nonce_matches(key, a.slot, a.generation, a.nonce)
    assert not slots.verify(b.slot, b.generation, a.nonce)
    assert not slots.verify(a.slot, a.generation + 1, a.nonce)
    assert not slots.verify(a.slot, a.generation, "00" * 16) and not slots.verify(a.slot, a.generation, "")
    other, _ = table()  # its own random key: the same (slot, generation) has another nonce
    assert not other.verify(a.slot, a.generation, a.nonce)
    assert a.nonce not in repr(a) and a.nonce not in a.describe()


def test_generations_are_not_small_counters_and_grow_across_restarts() -> None:
    first, _ = table()
    g1 = first.reserve("a", 5).generation
    second, _ = table()  # a restarted decode
    g2 = second.reserve("a", 5).generation
    assert g1 > 1 << 40 and g2 > 1 << 40 and g1 != g2
    assert second.reserve("b", 5).generation == g2 + 1


def test_lease_hooks_follow_every_reservation_from_grant_to_end() -> None:
    hooks = Hooks()
    slots, clock = table(leases=hooks)
    a, b, c = (slots.reserve(r, 5) for r in "abc")
    assert hooks.live == {(g.slot, g.generation) for g in (a, b, c)}
    assert slots.commit(a.slot, a.generation)  # KV arrived: nothing more to write
    assert slots.release(b.slot, b.generation)  # abandoned: quarantined, and not writable
    clock.now += 10
    slots.expire()  # c's lease lapsed
    assert hooks.live == set()
    hooks.fail = True
    with pytest.raises(RuntimeError, match="engine refused"):
        slots.reserve("d", 5)
    assert slots.usage().reserved == 0  # a refused lease grants nothing


def test_a_grant_given_back_settled_is_free_at_once_else_quarantined() -> None:
    slots, _ = table(quarantine_s=30.0)
    a = slots.reserve("a", 10.0)
    assert slots.release_grant(a.slot, a.generation, push_settled=True)
    assert slots.usage().free == LAYOUT.num_slots  # no push can write into it: no quarantine
    b = slots.reserve("b", 10.0)
    assert slots.release_grant(b.slot, b.generation, push_settled=False)
    assert slots.usage().quarantined == 1  # a push may still land: nobody gets it meanwhile
    assert not slots.release_grant(b.slot, b.generation + 1, push_settled=True)  # another generation: stale
    assert slots.usage().quarantined == 1


def test_a_grant_given_back_ends_its_write_lease_either_way() -> None:
    hooks = Hooks()
    slots, _ = table(leases=hooks)
    a, b = slots.reserve("a", 5), slots.reserve("b", 5)
    assert slots.release_grant(a.slot, a.generation, push_settled=True)
    assert slots.release_grant(b.slot, b.generation, push_settled=False)
    assert hooks.live == set()  # neither slot is writable by a peer any more


def test_a_settled_give_back_lifts_the_quarantine_of_its_own_generation_only() -> None:
    slots, _ = table(quarantine_s=30.0)
    a = slots.reserve("a", 10.0)
    assert slots.release(a.slot, a.generation)  # the cancelled Generate quarantines it first
    assert slots.state(a.slot) is SlotState.QUARANTINED
    assert slots.release_grant(a.slot, a.generation, push_settled=True)  # then the prefill said it is over
    assert slots.state(a.slot) is SlotState.FREE
    c = slots.reserve("c", 10.0)
    assert slots.commit(c.slot, c.generation)
    assert not slots.release_grant(c.slot, c.generation, push_settled=True)  # a committed slot is its stream's
    assert slots.state(c.slot) is SlotState.COMMITTED
