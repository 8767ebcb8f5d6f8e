"""The admission queue on its own: order (priority classes, then start-time fair queueing over
tokens across tenants, FIFO within one), how a blocked queue finds capacity (one probe at a
time, woken by releases, held probes and a timer), deadlines, the bounds and rate limits with
their Retry-After, and that every way out leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from pdserve_worker.api.admission import (
    AdmissionConfig,
    AdmissionQueue,
    DrainRate,
    Reason,
    Rejected,
    State,
    TokenBucket,
)
from pdserve_worker.api.keys import Tenant, TenantLimits

pytestmark = pytest.mark.asyncio

A = Tenant("a", TenantLimits())
B = Tenant("b", TenantLimits())
C = Tenant("c", TenantLimits())


class Recorder:
    def __init__(self) -> None:
        self.rejected: list[str] = []
        self.waits: list[tuple[str, float]] = []
        self.tokens: list[tuple[str, int, int]] = []

    def observe_admission_rejected(self, reason: str) -> None:
        self.rejected.append(reason)

    def observe_admission_wait(self, priority: str, seconds: float) -> None:
        self.waits.append((priority, seconds))

    def observe_tenant_tokens(self, tenant: str, prompt: int, completion: int) -> None:
        self.tokens.append((tenant, prompt, completion))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def block(queue: AdmissionQueue):
    """Make the queue blocked: one request holds the only slot, a second found none."""
    holder = queue.enter(A, "normal", 1, 1)
    queue.held(holder)
    loser = queue.enter(A, "normal", 1, 1)
    queue.no_capacity(loser)
    queue.release(loser)
    return holder


def serve_order(queue: AdmissionQueue, holder, count: int) -> list:
    """Release the holder, then admit `count` probes one by one as the slot frees again."""
    order = []
    queue.release(holder, 1)
    for _ in range(count):
        probe = queue._probe
        assert probe is not None and probe.state is State.TRYING
        order.append(probe)
        queue.held(probe)  # held: the queue probes for more...
        nxt = queue._probe
        if nxt is not None:
            queue.no_capacity(nxt)  # ...and finds none: back to its place
        queue.release(probe, 1)  # the request ends, the slot frees
    return order


async def test_open_queue_dispatches_at_once_and_release_is_clean():
    rec = Recorder()
    q = AdmissionQueue(observer=rec)
    t = q.enter(A, "normal", 10, 5)
    assert t.state is State.TRYING and q.waiting() == 0
    await q.wait_turn(t)
    q.held(t)
    assert q.running == 1
    q.release(t, 3)
    assert q.running == 0 and t.state is State.DONE
    assert rec.tokens == [("a", 10, 3)] and rec.waits[0][0] == "normal"
    q.release(t, 3)  # a second release changes nothing
    assert q.running == 0 and rec.tokens == [("a", 10, 3)]


async def test_no_capacity_blocks_and_a_release_probes_in_priority_order():
    q = AdmissionQueue()
    holder = block(q)
    low = q.enter(A, "low", 1, 1)
    normal = q.enter(B, "normal", 1, 1)
    high = q.enter(C, "high", 1, 1)
    assert {low.state, normal.state, high.state} == {State.WAITING}
    assert q.snapshot()["waiting"] == {"high": 1, "normal": 1, "low": 1}
    assert [t.priority_name for t in serve_order(q, holder, 3)] == ["high", "normal", "low"]
    assert q.waiting() == 0 and q.snapshot()["blocked"] is False


async def test_priority_is_capped_by_the_tenants_ceiling():
    q = AdmissionQueue()
    batch = Tenant("batch", TenantLimits(max_priority="low"))
    t = q.enter(batch, "high", 1, 1)
    assert t.priority_name == "low"
    q.release(t)


async def test_fair_over_tokens_not_requests():
    """a sends requests 10x larger than b's: within one class b gets about 10 turns per a's one."""
    q = AdmissionQueue()
    holder = block(q)
    big = [q.enter(A, "normal", 500, 500) for _ in range(5)]
    small = [q.enter(B, "normal", 50, 50) for _ in range(30)]
    order = serve_order(q, holder, 22)
    served_a = sum(1 for t in order if t in big)
    served_b = sum(1 for t in order if t in small)
    assert served_b >= 9 * served_a and 1 <= served_a <= 3, (served_a, served_b)
    for t in big + small:
        q.release(t)
    assert q.waiting() == 0


async def test_weight_shares_tokens_and_fifo_within_a_tenant():
    q = AdmissionQueue()
    heavy = Tenant("heavy", TenantLimits(weight=3))
    holder = block(q)
    hs = [q.enter(heavy, "normal", 10, 10) for _ in range(12)]
    ls = [q.enter(B, "normal", 10, 10) for _ in range(12)]
    order = serve_order(q, holder, 8)
    assert sum(1 for t in order if t in hs) == 6
    served_h = [t for t in order if t in hs]
    assert served_h == hs[: len(served_h)]  # FIFO within the tenant
    for t in hs + ls:
        q.release(t)


async def test_an_idle_tenant_earns_no_credit():
    """a was served alone for a while; b, arriving after its long idle, alternates with a
    instead of getting a run of turns for the service it did not use."""
    q = AdmissionQueue()
    for _ in range(10):  # open queue: served at once, its virtual time runs ahead
        t = q.enter(A, "normal", 10, 10)
        q.held(t)
        q.release(t, 10)
    h = block(q)
    as_ = [q.enter(A, "normal", 10, 10) for _ in range(4)]
    bs = [q.enter(B, "normal", 10, 10) for _ in range(4)]
    order = serve_order(q, h, 4)
    assert sum(1 for t in order if t in bs) == 2, [t.tenant_name for t in order]
    for t in as_ + bs:
        q.release(t)


async def test_max_concurrent_waits_without_blocking_others():
    q = AdmissionQueue()
    capped = Tenant("capped", TenantLimits(max_concurrent=1))
    first = q.enter(capped, "high", 1, 1)
    q.held(first)
    second = q.enter(capped, "high", 1, 1)
    other = q.enter(B, "low", 1, 1)
    assert second.state is State.WAITING and other.state is State.TRYING
    q.release(first, 1)
    assert second.state is State.TRYING
    q.release(second)
    q.release(other)


async def test_a_tenants_grammars_wait_at_its_cap_while_other_tenants_go():
    """#58 A5: a grammar's mask costs every step of the decode batch, the other tenants' rows
    too, so a tenant holds at most maxConcurrentGrammars of them (default 2); the rest wait in
    its queue (FIFO: its own plain request behind them too), never another tenant's request,
    and each release lets the next one go. The count follows every way out, no_capacity too."""
    q = AdmissionQueue()
    assert TenantLimits().max_concurrent_grammars == 2
    grammars = [q.enter(A, "normal", 1, 1, grammar=True) for _ in range(4)]
    plain_a = q.enter(A, "normal", 1, 1)
    other = [q.enter(B, "normal", 1, 1, grammar=True), q.enter(B, "normal", 1, 1)]
    assert [t.state for t in grammars] == [State.TRYING, State.TRYING, State.WAITING, State.WAITING]
    assert plain_a.state is State.WAITING and all(t.state is State.TRYING for t in other)
    assert q.snapshot()["grammars_running"] == 3
    q.held(grammars[0])
    q.no_capacity(grammars[1])  # back to waiting: its grammar count goes with it ...
    assert grammars[1].state is State.WAITING and q.snapshot()["grammars_running"] == 2
    q.release(grammars[0], 1)  # ... and a release lets one more of a's go (the queue probes one)
    assert sum(t.state is State.TRYING for t in grammars) == 1
    for t in (*grammars, plain_a, *other):
        q.release(t)
    assert q.snapshot()["grammars_running"] == 0 and q.running == 0


async def test_grammar_cap_is_per_tenant_and_may_be_lifted():
    q = AdmissionQueue()
    wide = Tenant("wide", TenantLimits(max_concurrent_grammars=None))
    one = Tenant("one", TenantLimits.model_validate({"maxConcurrentGrammars": 1}))
    assert all(q.enter(wide, "normal", 1, 1, grammar=True).state is State.TRYING for _ in range(5))
    first, second = (q.enter(one, "normal", 1, 1, grammar=True) for _ in range(2))
    assert first.state is State.TRYING and second.state is State.WAITING
    assert TenantLimits(max_concurrent_grammars=3).per_replica(2).max_concurrent_grammars == 2
    assert TenantLimits().per_replica(3).max_concurrent_grammars == 2  # the default is each router's


async def test_a_tenant_over_its_share_of_the_slots_goes_after_one_under_it():
    """#29: maxConcurrent's default is the tenant's weighted share of what runs here. a grabbed
    3 of 4 slots while b was quiet; b now waits with a costlier request, which SFQ alone would
    put after a's cheap ones: the slot a frees goes to b. Work-conserving: with b served, a's
    next request is not held back."""
    q = AdmissionQueue()
    a_held = [q.enter(A, "normal", 1, 1) for _ in range(3)]
    b_held = q.enter(B, "normal", 1000, 1000)
    for t in (*a_held, b_held):
        q.held(t)
    probe = q.enter(A, "normal", 1, 1)
    q.no_capacity(probe)  # the 5th request finds no slot: the queue is blocked
    q.release(probe)
    a_next = q.enter(A, "normal", 1, 1)
    b_next = q.enter(B, "normal", 1000, 1000)
    assert a_next.state is State.WAITING and b_next.state is State.WAITING
    q.release(a_held[0], 1)  # a slot frees: a holds 2 of 3 (share 2), b 1
    assert q._probe is b_next and b_next.state is State.TRYING
    q.held(b_next)
    q.release(b_held, 1)  # b is served; a's waiting request is next
    assert q._probe is a_next
    for t in (*a_held[1:], b_next, a_next):
        q.release(t)


async def test_timer_probes_a_blocked_queue_without_any_release():
    q = AdmissionQueue(AdmissionConfig(retry_min_s=0.01, retry_max_s=0.02))
    block(q)  # the holder never releases: slots came free elsewhere (another router)
    t = q.enter(B, "normal", 1, 1)
    assert t.state is State.WAITING
    await asyncio.wait_for(q.wait_turn(t), 1.0)
    assert t.state is State.TRYING and q._probe is t
    q.no_capacity(t)  # still none: the timer backs off and tries again
    await asyncio.wait_for(q.wait_turn(t), 1.0)
    q.held(t)
    q.release(t, 1)


async def test_deadline_while_waiting_is_rejected_and_leaves_the_queue():
    rec = Recorder()
    q = AdmissionQueue(AdmissionConfig(deadline_s=5.0, retry_min_s=5, retry_max_s=5), observer=rec)
    block(q)
    t = q.enter(B, "normal", 1, 1, deadline_s=0.05)
    with pytest.raises(Rejected) as caught:
        await q.wait_turn(t)
    assert caught.value.reason is Reason.DEADLINE and "deadline" in str(caught.value)
    assert q.waiting() == 0 and t.state is State.DONE and rec.rejected == ["deadline"]
    q.release(t)  # the router's release afterwards is harmless
    assert q.waiting() == 0


async def test_a_header_cannot_lengthen_the_deadline():
    q = AdmissionQueue(AdmissionConfig(deadline_s=0.05, retry_min_s=5, retry_max_s=5))
    block(q)
    t = q.enter(B, "normal", 1, 1, deadline_s=3600)
    with pytest.raises(Rejected):
        await asyncio.wait_for(q.wait_turn(t), 2.0)


async def test_cancelled_waiters_leave_at_once():
    q = AdmissionQueue(AdmissionConfig(retry_min_s=5, retry_max_s=5))
    holder = block(q)
    tickets = [q.enter(B, "normal", 1, 1) for _ in range(100)]

    async def client(t):
        try:
            await q.wait_turn(t)
        finally:
            q.release(t)

    tasks = [asyncio.create_task(client(t)) for t in tickets]
    await asyncio.sleep(0.01)
    assert q.waiting() == 100
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert q.waiting() == 0 and all(t.state is State.DONE for t in tickets)
    q.release(holder, 1)
    assert q.running == 0 and q._probe is None and q._timer is None


async def test_a_probe_cancelled_while_reserving_does_not_wedge_the_queue():
    q = AdmissionQueue()
    holder = block(q)
    a = q.enter(B, "normal", 1, 1)
    b = q.enter(C, "normal", 1, 1)
    q.release(holder, 1)
    assert q._probe is a
    q.release(a)  # the client left during its Reserve
    assert q._probe is None
    await asyncio.wait_for(q.wait_turn(b), 1.0)  # the timer probes the next one
    assert b.state is State.TRYING
    q.release(b)


async def test_queue_bounds_answer_with_retry_after_from_the_drain_rate():
    clock = Clock()
    rec = Recorder()
    q = AdmissionQueue(AdmissionConfig(capacity=4, max_queued_per_tenant=3, deadline_s=3600), rec, clock)
    for _ in range(10):  # measured: 2 admissions per second
        t = q.enter(C, "normal", 1, 1)
        q.held(t)
        q.release(t, 1)
        clock.now += 0.5
    holder = block(q)
    waiting = [q.enter(A, "normal", 1, 1) for _ in range(3)]
    with pytest.raises(Rejected) as own:
        q.enter(A, "normal", 1, 1)
    assert own.value.reason is Reason.TENANT_QUEUE_FULL
    waiting.append(q.enter(B, "normal", 1, 1))
    with pytest.raises(Rejected) as full:
        q.enter(C, "normal", 1, 1)
    assert full.value.reason is Reason.QUEUE_FULL
    rate = q.drain.per_second(clock.now)
    assert rate == pytest.approx(12 / 5.5, rel=0.01)  # 12 admissions over the 5.5 s since the first
    assert full.value.retry_after_s == pytest.approx(4 / rate)
    assert rec.rejected == ["tenant_queue_full", "queue_full"]
    for t in waiting + [holder]:
        q.release(t)


async def test_the_probe_still_counts_against_the_capacity():
    """A blocked queue's probe is a waiting request trying a slot: a request arriving during its
    try is refused, or the probe's return would put the queue past its capacity (a test of the
    API saw the third request of a capacity-1 queue queued, not refused, on a loaded machine)."""
    q = AdmissionQueue(AdmissionConfig(capacity=1, retry_min_s=0.01, retry_max_s=0.02))
    holder = block(q)
    waiter = q.enter(B, "normal", 1, 1)
    await asyncio.wait_for(q.wait_turn(waiter), 1.0)  # the timer made it the probe
    assert waiter.state is State.TRYING and q._probe is waiter and q.waiting() == 0
    with pytest.raises(Rejected) as full:
        q.enter(C, "normal", 1, 1)
    assert full.value.reason is Reason.QUEUE_FULL
    q.no_capacity(waiter)  # back to its place: one waiting, the capacity
    assert q.waiting() == 1 and q._probe is None
    for t in (waiter, holder):
        q.release(t)


async def test_a_deadline_the_drain_rate_cannot_meet_is_refused_at_once():
    clock = Clock()
    q = AdmissionQueue(AdmissionConfig(deadline_s=3600), clock=clock)
    for _ in range(5):  # 1 admission per second
        t = q.enter(C, "normal", 1, 1)
        q.held(t)
        q.release(t, 1)
        clock.now += 1.0
    holder = block(q)
    ahead = [q.enter(A, "high", 1, 1) for _ in range(10)]
    with pytest.raises(Rejected) as caught:
        q.enter(B, "normal", 1, 1, deadline_s=2.0)
    assert caught.value.reason is Reason.DEADLINE and caught.value.retry_after_s > 2.0
    ok = q.enter(B, "normal", 1, 1, deadline_s=60.0)  # a deadline that can be met waits
    assert ok.state is State.WAITING
    for t in ahead + [ok, holder]:
        q.release(t)


async def test_requests_per_minute_and_refund_of_requests_never_admitted():
    clock = Clock()
    q = AdmissionQueue(clock=clock)
    limited = Tenant("limited", TenantLimits(requests_per_minute=2))
    first = q.enter(limited, "normal", 1, 1)
    second = q.enter(limited, "normal", 1, 1)
    with pytest.raises(Rejected) as caught:
        q.enter(limited, "normal", 1, 1)
    assert caught.value.reason is Reason.REQUESTS_PER_MINUTE
    assert caught.value.retry_after_s == pytest.approx(30.0)  # one request refills in 60/2 s
    q.held(first)
    q.release(first, 1)  # served: stays counted
    q.release(second)  # never admitted (client left): refunded
    third = q.enter(limited, "normal", 1, 1)
    with pytest.raises(Rejected):
        q.enter(limited, "normal", 1, 1)
    clock.now += 30.0
    q.release(third)
    q.release(q.enter(limited, "normal", 1, 1))


async def test_tokens_per_minute_counts_prompt_and_generated_tokens():
    clock = Clock()
    q = AdmissionQueue(clock=clock)
    limited = Tenant("limited", TenantLimits(tokens_per_minute=600))  # 10 tokens/s
    t = q.enter(limited, "normal", 100, 1000)  # reserves 1,100 of a full bucket of 600
    q.held(t)
    q.release(t, 600)  # 700 used: the 400 not generated come back, 100 in debt
    with pytest.raises(Rejected) as caught:
        q.enter(limited, "normal", 50, 10)
    assert caught.value.reason is Reason.TOKENS_PER_MINUTE
    assert caught.value.retry_after_s == pytest.approx(16.0)  # (50 + 10 - (-100)) / 10 per s
    clock.now += 16.0
    q.release(q.enter(limited, "normal", 50, 10))  # never admitted: all 60 refunded
    with pytest.raises(Rejected, match="more than tenant 'limited'"):
        q.enter(limited, "normal", 601, 1)


async def test_a_burst_reserves_max_tokens_at_admission_and_gets_back_what_it_did_not_use():
    """#29: a tenant limited to 2,000 tokens/min sent 16 requests of max_tokens 300 at once and
    all were admitted (the prompt alone was charged). Now each reserves prompt + max_tokens."""
    clock = Clock()
    q = AdmissionQueue(clock=clock)
    limited = Tenant("limited", TenantLimits(tokens_per_minute=2000))
    admitted, refused = [], 0
    for _ in range(16):
        try:
            admitted.append(q.enter(limited, "normal", 50, 300))
        except Rejected as exc:
            assert exc.reason is Reason.TOKENS_PER_MINUTE
            refused += 1
    assert len(admitted) == 5 and refused == 11  # 5 x 350 = 1,750 of 2,000
    assert sum(t.cost for t in admitted) <= 2000
    for ticket in admitted:  # each stops after 10 tokens: 290 of its reservation come back
        q.held(ticket)
        q.release(ticket, 10)
    more = [q.enter(limited, "normal", 50, 300) for _ in range(4)]  # 250 + 5 x 290 = 1,700 free
    with pytest.raises(Rejected):  # 300 left
        q.enter(limited, "normal", 50, 300)
    for ticket in more:
        q.release(ticket)  # never admitted: the whole reservation is refunded
    assert len([q.enter(limited, "normal", 50, 300) for _ in range(4)]) == 4


async def test_replicas_split_the_limits():
    q = AdmissionQueue(AdmissionConfig(replicas=3))
    limited = Tenant("limited", TenantLimits(requests_per_minute=6))
    q.release(q.enter(limited, "normal", 1, 1))
    t = q.enter(limited, "normal", 1, 1)
    q.held(t)
    q.release(t, 1)
    t = q.enter(limited, "normal", 1, 1)  # the first was refunded: this is the second counted
    q.held(t)
    q.release(t, 1)
    with pytest.raises(Rejected):  # 6 per minute over 3 routers: 2 here
        q.enter(limited, "normal", 1, 1)


async def test_token_bucket_and_drain_rate_units():
    bucket = TokenBucket(60, now=0.0)
    assert bucket.wait_s(60, 0.0) == 0.0
    bucket.take(90, 0.0)
    assert bucket.wait_s(1, 0.0) == pytest.approx(31.0)
    assert bucket.wait_s(61, 100.0) == float("inf")
    bucket.give(1000, 200.0)
    assert bucket.level == 60.0
    rate = DrainRate(window_s=10.0)
    assert rate.per_second(0.0) is None
    for t in (0.0, 1.0, 2.0, 3.0):
        rate.record(t)
    assert rate.per_second(4.0) == pytest.approx(1.0)
    assert rate.per_second(8.0) == pytest.approx(0.5)  # no admissions since 3.0: the rate falls
    assert rate.per_second(100.0) is None
