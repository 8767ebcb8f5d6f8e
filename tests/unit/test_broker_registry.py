"""The broker's registry without sockets: leases on a fake clock, events, draining, watch queues."""

from __future__ import annotations

import asyncio

import pytest

from pdserve_common.kv_layout import KVLayout
from pdserve_common.membership import EventType, Load, MemberInfo, MemoryRegion, Role, RouterLoad
from pdserve_operator.autoscale.inputs import member_loads
from pdserve_operator.broker.registry import Registry, Subscription, WatchEnded

SVC = "ns/svc"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def decode(worker_id: str = "d0", slots: int = 4) -> MemberInfo:
    layout = KVLayout(num_slots=slots, num_layers=2, max_len=16, kv_heads=1, head_dim=8, dtype="float32")
    return MemberInfo(
        worker_id=worker_id,
        role=Role.DECODE,
        grpc_endpoint="10.0.0.1:7000",
        engine_id="10.0.0.1:7100",
        regions=(MemoryRegion(0x10000, layout.total_bytes),),
        kv_layout=layout,
        revision="r1",
        slots_total=slots,
        slots_free=slots,
    )


def prefill(worker_id: str = "p0") -> MemberInfo:
    return MemberInfo(worker_id=worker_id, role=Role.PREFILL, grpc_endpoint="10.0.0.2:7000")


def drain(sub: Subscription) -> list[tuple[EventType, str | None]]:
    """Everything queued so far, as (type, worker_id)."""
    out = []
    while sub._items:
        event = sub._items.popleft()
        out.append((event.type, event.member.worker_id if event.member else None))
    return out


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> Registry:
    reg = Registry(ttl_s=10.0, resync_grace_s=0.0, queue_size=8, clock=clock)
    reg.start()
    return reg


@pytest.mark.asyncio
async def test_snapshot_then_synced_then_changes(registry: Registry) -> None:
    registry.register(SVC, decode("d1"))
    registry.register(SVC, decode("d0"))
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    assert drain(sub) == [(EventType.ADDED, "d0"), (EventType.ADDED, "d1"), (EventType.SYNCED, None)]
    registry.register(SVC, prefill())
    assert drain(sub) == [(EventType.ADDED, "p0")]


@pytest.mark.asyncio
async def test_role_filter(registry: Registry) -> None:
    sub = registry.subscribe(SVC, [Role.DECODE], asyncio.get_running_loop())
    registry.register(SVC, prefill())
    registry.register(SVC, decode())
    assert drain(sub) == [(EventType.SYNCED, None), (EventType.ADDED, "d0")]
    assert [m.worker_id for m in registry.members(SVC, [Role.PREFILL])] == ["p0"]


@pytest.mark.asyncio
async def test_every_load_received_is_stamped_with_the_brokers_time_and_only_a_change_is_published(
    registry: Registry, clock: FakeClock
) -> None:
    """The autoscaler divides a router's counter increase by these stamps (autoscale/inputs.py):
    a keepalive with the same counters is a newer reading (a rate of 0), not nothing."""
    lease = registry.register(SVC, MemberInfo(worker_id="r0", role=Role.ROUTER))
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    drain(sub)
    load = Load(router=RouterLoad(requests_total=5))
    clock.now += 1.5
    assert registry.keepalive(SVC, lease.lease_id, load)
    assert registry.members(SVC)[0].load_at == 1001.5 and drain(sub) == [(EventType.UPDATED, "r0")]
    clock.now += 0.5
    assert registry.keepalive(SVC, lease.lease_id, load)  # the same counters: stamped, not published
    assert registry.members(SVC)[0].load_at == 1002.0 and drain(sub) == []
    clock.now += 1.0
    assert registry.keepalive(SVC, lease.lease_id)  # no load sent: the stamp stays the last load's
    assert registry.members(SVC)[0].load_at == 1002.0
    report = member_loads(registry.members(SVC))[1]["r0"]
    assert report.at == 1002.0 and report.requests == 5


@pytest.mark.asyncio
async def test_keepalive_renews_and_expiry_removes(registry: Registry, clock: FakeClock) -> None:
    lease = registry.register(SVC, decode())
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    drain(sub)
    clock.now += 9.0
    assert registry.keepalive(SVC, lease.lease_id)
    clock.now += 9.0  # 18 s after registering, 9 s after the renewal
    assert registry.expire() == []
    assert drain(sub) == []
    clock.now += 1.0
    assert [m.worker_id for m in registry.expire()] == ["d0"]
    assert drain(sub) == [(EventType.REMOVED, "d0")]
    assert not registry.keepalive(SVC, lease.lease_id), "an expired lease must not come back"
    assert registry.members(SVC) == []


@pytest.mark.asyncio
async def test_load_change_is_an_update_and_same_load_is_silent(registry: Registry) -> None:
    lease = registry.register(SVC, decode())
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    drain(sub)
    registry.keepalive(SVC, lease.lease_id, Load(slots_used=1, slots_free=3, active_requests=1))
    registry.keepalive(SVC, lease.lease_id, Load(slots_used=1, slots_free=3, active_requests=1))
    assert drain(sub) == [(EventType.UPDATED, "d0")]
    assert registry.members(SVC)[0].load.active_requests == 1


@pytest.mark.asyncio
async def test_draining_by_lease_or_worker_id(registry: Registry) -> None:
    lease = registry.register(SVC, decode())
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    drain(sub)
    assert registry.set_draining(SVC, lease_id=lease.lease_id)
    assert registry.set_draining(SVC, lease_id=lease.lease_id)  # idempotent: no second event
    assert registry.members(SVC)[0].draining
    assert registry.set_draining(SVC, worker_id="d0", draining=False)
    assert not registry.set_draining(SVC, worker_id="nobody")
    assert drain(sub) == [(EventType.DRAINING, "d0"), (EventType.UPDATED, "d0")]
    with pytest.raises(ValueError, match="exactly one"):
        registry.set_draining(SVC, lease_id="x", worker_id="d0")


@pytest.mark.asyncio
async def test_reregistering_replaces_the_lease(registry: Registry) -> None:
    old = registry.register(SVC, decode())
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    drain(sub)
    new = registry.register(SVC, decode(), draining=True)
    assert drain(sub) == [(EventType.DRAINING, "d0")]
    assert not registry.keepalive(SVC, old.lease_id)
    assert not registry.deregister(SVC, old.lease_id), "a stale lease must not remove the new registration"
    assert [m.worker_id for m in registry.members(SVC)] == ["d0"]
    assert registry.deregister(SVC, new.lease_id)
    assert drain(sub) == [(EventType.REMOVED, "d0")]


@pytest.mark.asyncio
async def test_synced_waits_for_the_grace_after_start(clock: FakeClock) -> None:
    registry = Registry(ttl_s=5.0, clock=clock)  # grace defaults to one TTL
    registry.start()
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    lease = registry.register(SVC, decode())
    registry.expire()
    assert drain(sub) == [(EventType.ADDED, "d0")]
    clock.now += 4.0
    registry.expire()
    assert drain(sub) == []
    registry.keepalive(SVC, lease.lease_id)
    clock.now += 1.0
    registry.expire()
    assert drain(sub) == [(EventType.SYNCED, None)]


@pytest.mark.asyncio
async def test_slow_watcher_is_cut_off_without_blocking_others(registry: Registry) -> None:
    loop = asyncio.get_running_loop()
    slow = registry.subscribe(SVC, (), loop)
    fast = registry.subscribe(SVC, (), loop)
    received: list[str] = []

    async def consume() -> None:
        while True:
            event = await fast.next()
            if event.member is not None:
                received.append(event.member.worker_id)

    consumer = loop.create_task(consume())
    for i in range(20):  # queue_size is 8: the slow watcher overflows, registration goes on
        registry.register(SVC, prefill(f"p{i:02d}"))
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    consumer.cancel()
    assert received == [f"p{i:02d}" for i in range(20)]
    with pytest.raises(WatchEnded) as ended:
        await slow.next()
    assert ended.value.reason == "overflow"
    assert len(registry.members(SVC)) == 20


@pytest.mark.asyncio
async def test_next_wakes_on_an_event_from_another_thread(registry: Registry) -> None:
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    assert (await sub.next()).type is EventType.SYNCED
    waiter = asyncio.ensure_future(sub.next())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await asyncio.to_thread(registry.register, SVC, decode())
    event = await asyncio.wait_for(waiter, 2)
    assert (event.type, event.member.worker_id) == (EventType.ADDED, "d0")


@pytest.mark.asyncio
async def test_remove_service_ends_its_watches_and_counts(registry: Registry) -> None:
    registry.register(SVC, decode())
    registry.register(SVC, prefill())
    registry.register("ns/other", prefill())
    assert registry.registered_counts(SVC) == {Role.PREFILL: 1, Role.DECODE: 1, Role.ROUTER: 0}
    sub = registry.subscribe(SVC, (), asyncio.get_running_loop())
    drain(sub)
    assert registry.remove_service(SVC) == 2
    with pytest.raises(WatchEnded) as ended:
        await sub.next()
    assert ended.value.reason == "service_removed"
    assert registry.registered_counts(SVC) == {Role.PREFILL: 0, Role.DECODE: 0, Role.ROUTER: 0}
    assert registry.registered_counts("ns/other")[Role.PREFILL] == 1


def test_invalid_member_is_refused(registry: Registry) -> None:
    bad = MemberInfo(worker_id="d9", role=Role.DECODE, grpc_endpoint="10.0.0.1:7000", engine_id="10.0.0.1:7100")
    with pytest.raises(ValueError, match="kv_layout"):
        registry.register(SVC, bad)
    assert registry.members(SVC) == []


def test_a_service_cannot_register_more_than_max_members(clock: FakeClock) -> None:
    from pdserve_operator.broker.registry import TooManyMembers

    reg = Registry(ttl_s=10.0, clock=clock, wall_clock=clock, max_members=2)
    first = reg.register("ns/a", prefill("p0"))
    reg.register("ns/a", prefill("p1"))
    with pytest.raises(TooManyMembers):
        reg.register("ns/a", prefill("p2"))
    reg.register("ns/a", prefill("p1"))  # a member already there registers again
    reg.register("ns/b", prefill("p2"))  # the cap is per service
    assert reg.deregister("ns/a", first.lease_id)
    reg.register("ns/a", prefill("p2"))  # room again once one left


def test_kv_tokens_in_use_sums_the_decodes_last_reports(clock: FakeClock) -> None:
    reg = Registry(ttl_s=10.0, clock=clock)
    a = reg.register(SVC, decode("d0"))
    b = reg.register(SVC, decode("d1"))
    reg.register(SVC, prefill())
    assert reg.kv_tokens_in_use(SVC) == 0
    reg.keepalive(SVC, a.lease_id, Load(slots_used=2, slots_free=2, kv_tokens_used=736, kv_tokens_total=4096))
    reg.keepalive(SVC, b.lease_id, Load(slots_used=1, slots_free=3, kv_tokens_used=368, kv_tokens_total=4096))
    assert reg.kv_tokens_in_use(SVC) == 1104
    assert reg.kv_tokens_in_use("ns/other") == 0
