"""Choosing a decode and a prefill: most free slots (own in-flight counted), same revision, active only."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdserve_common.kv_layout import KVLayout
from pdserve_common.membership import Load, Member, MemberInfo, MemoryRegion, Role
from pdserve_worker.router.placement import rank_decodes, rank_prefills

REV = "r1"


def decode(worker_id: str, total: int = 8, used: int = 0, *, revision: str = REV, draining: bool = False) -> Member:
    layout = KVLayout(num_slots=total, num_layers=2, max_len=16, kv_heads=1, head_dim=8, dtype="float32")
    info = MemberInfo(
        worker_id=worker_id,
        role=Role.DECODE,
        grpc_endpoint="h:1",
        engine_id="h:2",
        regions=(MemoryRegion(0x1000, layout.total_bytes),),
        kv_layout=layout,
        revision=revision,
        slots_total=total,
        slots_free=total,
    )
    return Member(info, draining=draining, load=Load(slots_used=used, slots_free=total - used))


def prefill(worker_id: str, *, revision: str = REV, draining: bool = False, queued: int = 0) -> Member:
    return Member(
        MemberInfo(worker_id=worker_id, role=Role.PREFILL, grpc_endpoint="h:3", revision=revision),
        draining=draining,
        load=Load(active_requests=queued),
    )


def test_most_free_slots_first():
    ranked = rank_decodes([decode("a", used=6), decode("b", used=1), decode("c", total=4, used=0)], {}, REV)
    assert [m.worker_id for m in ranked] == ["b", "c", "a"]


def test_own_requests_in_flight_count_before_the_next_keepalive():
    # b reported idle, but this router already sent it 5 requests since: a is the better pick.
    ranked = rank_decodes([decode("a", used=2), decode("b", used=0)], {"b": 5}, REV)
    assert [m.worker_id for m in ranked] == ["a", "b"]


def test_only_active_members_of_our_revision_of_a_usable_shape():
    members = [decode("old", revision="r0"), decode("leaving", draining=True), decode("ok"), prefill("p")]
    assert [m.worker_id for m in rank_decodes(members, {}, REV)] == ["ok"]
    assert rank_decodes([decode("old", revision="r0")], {}, REV) == []


def test_prefill_with_the_shortest_queue_of_ours():
    members = [prefill("p0"), prefill("p1"), prefill("p2", draining=True), prefill("p3", revision="r0"), decode("d")]
    assert [m.worker_id for m in rank_prefills(members, {"p0": 2, "p1": 1}, REV)] == ["p1", "p0"]
    # p1 reports a queue of 4 (other routers' requests): p0 with 2 of ours is shorter.
    members = [prefill("p0"), prefill("p1", queued=4)]
    assert [m.worker_id for m in rank_prefills(members, {"p0": 2}, REV)] == ["p0", "p1"]


@given(st.lists(st.tuples(st.integers(1, 16), st.integers(0, 16), st.integers(0, 16)), min_size=1, max_size=6))
def test_the_first_choice_has_the_most_estimated_free_slots(specs):
    members, inflight = [], {}
    for i, (total, used, mine) in enumerate(specs):
        members.append(decode(f"d{i}", total=total, used=min(used, total)))
        inflight[f"d{i}"] = mine
    best = rank_decodes(members, inflight, REV)[0]

    def free(m: Member) -> int:
        return m.info.slots_total - max(m.load.slots_used, inflight[m.worker_id])

    assert free(best) == max(free(m) for m in members)
